# Sourced by the node scripts next to it (setup, start, stop); defines functions only.

# Loads ~/xmodal.env (written by node_env.sh) into this script's shell. ~/.bashrc loads it too, but a
# PATH set further down ~/.bashrc (pyenv, conda) or a shell that reads no ~/.bashrc would find another
# `ray` or `python` than the project's.
xm_load_env() {
    if [ ! -f "$HOME/xmodal.env" ]; then
        echo "$(basename "$0"): no ~/xmodal.env on $(hostname): the node environment is missing" \
             "(the first setup command, scripts/cluster/node_env.sh, has not run here)" >&2
        exit 1
    fi
    # shellcheck disable=SC1091
    . "$HOME/xmodal.env"
}

# Ray holds many files open per node (sockets, object store, logs). Raises this shell's soft limit to
# 65536, or to the hard limit where that is lower: a plain `ulimit -n 65536` fails there, and only
# root may raise a hard limit. A soft limit already higher is kept.
xm_raise_open_files() {
    local want=65536 hard soft
    hard=$(ulimit -Hn)
    soft=$(ulimit -Sn)
    if [ "$hard" != unlimited ] && [ "$hard" -lt "$want" ]; then
        want=$hard
    fi
    if [ "$soft" != unlimited ] && [ "$soft" -lt "$want" ]; then
        ulimit -Sn "$want"
    fi
}

# Stops the MLflow server that start_mlflow.sh started on this node (its pid in ~/mlflow/server.pid),
# and waits up to 60 s for it to exit. A pid file left from before a reboot names some other process
# or none: then nothing is stopped.
xm_stop_mlflow() {
    local old
    old=$(cat "$HOME/mlflow/server.pid" 2>/dev/null || true)
    if [ -n "$old" ] && ps -o args= -p "$old" | grep -q "mlflow server"; then
        kill "$old"
        for _ in $(seq 60); do
            kill -0 "$old" 2>/dev/null || break
            sleep 1
        done
    fi
    rm -f "$HOME/mlflow/server.pid"
}
