#!/usr/bin/env bash
# The MLflow server for the whole cluster, on the head, (re)started with Ray: the head's second start
# command in cluster.yaml and cluster.onprem.yaml. Returns once the server answers.
#
# Nodes reach it at $MLFLOW_TRACKING_URI (the head's address); an SSH tunnel (`ray attach CONFIG -p
# 5000`) reaches its loopback binding. Runs go to $XMODAL_MLFLOW_BACKEND; artifacts go through the
# server to $XMODAL_MLFLOW_ARTIFACTS, so only the head needs access to them. With the head's own
# PostgreSQL (start_postgres.sh, run before this), the server reads the database's password from
# ~/mlflow/pgpass (PGPASSFILE), which that script keeps. Gunicorn binds both
# addresses; its long timeout lets large model uploads through. MLflow's GenAI job runners are not
# used here: off.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$here/lib.sh"
xm_load_env

mkdir -p "$HOME/mlflow"
xm_stop_mlflow  # the previous server, unless the head rebooted since
if [ -n "${XMODAL_POSTGRES_DATA:-}" ]; then
    export PGPASSFILE=$HOME/mlflow/pgpass
    if [ ! -s "$PGPASSFILE" ]; then
        echo "start_mlflow.sh: no $PGPASSFILE on $(hostname): the head's PostgreSQL has not been started" \
             "(run scripts/cluster/start_postgres.sh first; the head's start commands do)" >&2
        exit 1
    fi
fi
MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false nohup mlflow server \
    --backend-store-uri "$XMODAL_MLFLOW_BACKEND" --artifacts-destination "$XMODAL_MLFLOW_ARTIFACTS" \
    --host "$XMODAL_HEAD_IP" --port "$XMODAL_MLFLOW_PORT" --workers 4 \
    --gunicorn-opts "--bind 127.0.0.1:$XMODAL_MLFLOW_PORT --timeout 900" \
    > "$HOME/mlflow/server.log" 2>&1 < /dev/null &
pid=$!
echo "$pid" > "$HOME/mlflow/server.pid"
for _ in $(seq 120); do
    curl -sf "http://127.0.0.1:$XMODAL_MLFLOW_PORT/health" >/dev/null && exit 0
    if ! kill -0 "$pid" 2>/dev/null; then  # it exited: its log says why (a database it cannot open, say)
        echo "start_mlflow.sh: the MLflow server ($XMODAL_MLFLOW_BACKEND) exited at start:" >&2
        tail -n 40 "$HOME/mlflow/server.log" >&2
        exit 1
    fi
    sleep 2
done
echo "start_mlflow.sh: the MLflow server did not answer on 127.0.0.1:$XMODAL_MLFLOW_PORT within 240 s:" >&2
tail -n 40 "$HOME/mlflow/server.log" >&2
exit 1
