#!/usr/bin/env bash
# The environment of every process on this node: writes ~/xmodal.env and loads it from ~/.bashrc. The
# cluster launcher's commands source ~/.bashrc, so `ray start`, and every job, Train worker and trial
# it starts, inherit it. The first setup command of cluster.yaml and cluster.onprem.yaml; every
# `ray up` runs it again and the file is rewritten from the arguments alone (never from the variables
# an earlier ~/xmodal.env left in this shell).
#
#   bash ~/xmodal/scripts/cluster/node_env.sh --storage-path=URI --mlflow-artifacts=URI [options]
#
#   --storage-path=URI       XMODAL_STORAGE_PATH: checkpoints, Ray Train and Tune state. s3://..., or a
#                            folder every node mounts at the same path (NFS)
#   --mlflow-artifacts=URI   where the head's MLflow server keeps artifacts: s3://..., or a folder on the head
#   --stores=URI             XMODAL_STORES: where the feature stores are. s3://...: read there by URI
#                            (the AWS_* variables below reach them); a folder on each node: copied to
#                            ~/stores by setup_node.sh; empty (the default): none
#   --mlflow-backend=URI     another MLflow database than the head's own PostgreSQL (the default, which
#                            start_postgres.sh runs), e.g. sqlite:///$HOME/mlflow/mlflow.db
#   --postgres-data=DIR      the head's PostgreSQL data folder (default ~/mlflow/postgres; for a root
#                            login /var/lib/xmodal/postgres, as the postgres user cannot enter /root)
#   --postgres-port=N        its port on the head's loopback (default 5433)
#   --mlflow-port=N          the MLflow server's port on the head (default 5000)
#   --head-ip=IP             the head's IPv4 address. Default: RAY_HEAD_IP, which the launcher gives the
#                            workers' commands; on the head, head_ip of a local provider's config, else
#                            the head's first address (`hostname -I`). Whichever is used is checked
#                            first (scripts/check_cluster.py): a malformed one is an error, nothing written
#   --venv=DIR               an existing environment with the project's dependencies (prepared machines,
#                            no internet): used instead of building ~/xmodal/.venv, and the synced
#                            tree's platform/ goes on PYTHONPATH so that its code is the one that runs
#   --export=NAME=VALUE      one more variable (repeatable), e.g. AWS_ENDPOINT_URL for an S3-compatible
#                            store, AWS_DEFAULT_REGION, or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY
#                            where no instance profile gives credentials: checkpoints and stores on S3
#                            are read and written with them by every job, worker and Ray Data task
set -euo pipefail

usage() { sed -n '8,/^set -euo pipefail$/{/^#/p}' "$0" | cut -c3- >&2; exit 2; }  # the options above

storage= artifacts= stores= backend= port=5000 head_ip= venv= pg_data= pg_port=5433
extra=()
for arg in "$@"; do
    case "$arg" in
        --storage-path=*) storage=${arg#*=} ;;
        --mlflow-artifacts=*) artifacts=${arg#*=} ;;
        --stores=*) stores=${arg#*=} ;;
        --mlflow-backend=*) backend=${arg#*=} ;;
        --mlflow-port=*) port=${arg#*=} ;;
        --postgres-data=*) pg_data=${arg#*=} ;;
        --postgres-port=*) pg_port=${arg#*=} ;;
        --head-ip=*) head_ip=${arg#*=} ;;
        --venv=*) venv=${arg#*=} ;;
        --export=*=*) extra+=("${arg#--export=}") ;;
        *) echo "node_env.sh: unknown argument ${arg@Q}" >&2; usage ;;
    esac
done
if [ -z "$storage" ] || [ -z "$artifacts" ]; then
    echo "node_env.sh: --storage-path and --mlflow-artifacts are required" >&2
    usage
fi
# The head's address is checked before anything is written: a malformed one (300.1.1.1, or head_ip:
# 192.168.1.300 in the config) is one error, never a silent fallback to this machine's first address.
# On the head, the launcher has synced its copy of the config (JSON) before the setup commands run.
check=$(cd "$(dirname "$0")/.." && pwd)/check_cluster.py
bootstrap=$HOME/ray_bootstrap_config.yaml
if [ -n "$head_ip" ]; then
    python3 "$check" --option="node_env.sh --head-ip" --address="$head_ip" >/dev/null || exit 2
elif [ -n "${RAY_HEAD_IP:-}" ]; then
    head_ip=$RAY_HEAD_IP
    python3 "$check" --option="RAY_HEAD_IP (given by the launcher)" --address="$head_ip" >/dev/null || exit 2
elif [ -f "$bootstrap" ]; then
    head_ip=$(python3 "$check" --on-node --print-head-ip "$bootstrap") || exit 2
fi
head_ip=${head_ip:-$(hostname -I | awk '{print $1}')}
# The head's own PostgreSQL unless another database is named. The driver is named in the URI: a plain
# postgresql:// makes SQLAlchemy 2 look for psycopg 3, and the project installs psycopg2. No password
# here (this file is on every node): the MLflow server reads it from the head's ~/mlflow/pgpass.
if [ -z "$backend" ]; then
    if [ -z "$pg_data" ]; then
        pg_data=$HOME/mlflow/postgres
        [ "$(id -u)" = 0 ] && pg_data=/var/lib/xmodal/postgres
    fi
    backend=postgresql+psycopg2://mlflow@127.0.0.1:$pg_port/mlflow
elif [ -n "$pg_data" ]; then
    echo "node_env.sh: --postgres-data is the head's own PostgreSQL, which --mlflow-backend=$backend replaces:" \
         "give one of them" >&2
    exit 2
fi
case "$pg_data" in
    ""|/*) ;;
    *) echo "node_env.sh: --postgres-data=$pg_data: expected an absolute path" >&2; exit 2 ;;
esac
if [ -n "$venv" ] && [ ! -x "$venv/bin/python" ]; then
    echo "node_env.sh: --venv=$venv: no $venv/bin/python on $(hostname)" >&2
    exit 1
fi

var() { printf 'export %s=%q\n' "$1" "$2"; }
{
    echo "# Written by scripts/cluster/node_env.sh at every \`ray up\`; edits here do not last."
    var XMODAL_STORAGE_PATH "$storage"
    var XMODAL_MLFLOW_ARTIFACTS "$artifacts"
    var XMODAL_STORES "$stores"
    var XMODAL_MLFLOW_BACKEND "$backend"
    var XMODAL_POSTGRES_DATA "$pg_data"
    var XMODAL_POSTGRES_PORT "$pg_port"
    var XMODAL_HEAD_IP "$head_ip"
    var XMODAL_MLFLOW_PORT "$port"
    var MLFLOW_TRACKING_URI "http://$head_ip:$port"
    var RAY_AUTH_MODE token
    # Ray Train's controller polls its workers every 2 s by default: a run's end and a dead worker
    # are seen later, and each trial's teardown waits on more polls (platform/xmodal/runner/ray_cluster.py)
    var RAY_TRAIN_HEALTH_CHECK_INTERVAL_S 0.5
    if [ -n "$venv" ]; then
        var XMODAL_VENV "$venv"
        var PYTHONPATH "$HOME/xmodal/platform"
        echo "export PATH=$(printf %q "$venv/bin"):\$PATH"
    else
        echo "export PATH=$(printf %q "$HOME/xmodal/.venv/bin"):\$PATH"
    fi
    for kv in "${extra[@]}"; do
        var "${kv%%=*}" "${kv#*=}"
    done
} > "$HOME/xmodal.env.new"
mv "$HOME/xmodal.env.new" "$HOME/xmodal.env"

# Loaded first in ~/.bashrc, because Ubuntu's returns early for non-interactive shells, and again last,
# so that a PATH set in between (pyenv, conda) does not hide the project's `ray` and `python`.
hook='[ -f ~/xmodal.env ] && . ~/xmodal.env  # xmodal: the node environment'
touch "$HOME/.bashrc"
if [ "$(grep -cxF "$hook" "$HOME/.bashrc")" != 2 ] || [ "$(head -n 1 "$HOME/.bashrc")" != "$hook" ] \
        || [ "$(tail -n 1 "$HOME/.bashrc")" != "$hook" ]; then
    # Also replaces the one-line hook that earlier versions wrote first.
    { echo "$hook"; grep -vF "xmodal.env" "$HOME/.bashrc" || true; echo "$hook"; } > "$HOME/.bashrc.new"
    mv "$HOME/.bashrc.new" "$HOME/.bashrc"
fi
