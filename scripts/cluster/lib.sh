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

# The head's own PostgreSQL for MLflow (start_postgres.sh starts it; stop_cluster.sh stops it). Its
# programs: those of the major version that initialised the data folder (PG_VERSION), else the newest
# of Debian's /usr/lib/postgresql/*/bin, else the initdb on PATH. Sets XM_PG_BIN; says what is
# missing and returns 1 when there are none.
xm_pg_bin() {
    local data=$1 version="" d
    XM_PG_BIN=
    if [ -f "$data/PG_VERSION" ]; then
        version=$(cat "$data/PG_VERSION")
        for d in "/usr/lib/postgresql/$version/bin" "$(dirname "$(readlink -f "$(command -v pg_ctl || echo /nonexistent)")")"; do
            if [ -x "$d/pg_ctl" ] && [ "$("$d/pg_ctl" --version | grep -oE '[0-9]+' | head -n 1)" = "$version" ]; then
                XM_PG_BIN=$d
                return 0
            fi
        done
        echo "$(basename "$0"): $data was initialised by PostgreSQL $version, whose programs are not on" \
             "$(hostname) (looked in /usr/lib/postgresql/$version/bin and for pg_ctl on PATH): install" \
             "PostgreSQL $version, or upgrade the data folder (pg_upgrade)" >&2
        return 1
    fi
    for d in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r) \
             "$(dirname "$(readlink -f "$(command -v initdb || echo /nonexistent)")")"; do
        if [ -x "$d/initdb" ] && [ -x "$d/pg_ctl" ] && [ -x "$d/postgres" ]; then
            XM_PG_BIN=$d
            return 0
        fi
    done
    echo "$(basename "$0"): no PostgreSQL server programs (initdb, pg_ctl, postgres) on $(hostname):" \
         "looked in /usr/lib/postgresql/*/bin and on PATH; install them (the head's setup command" \
         "\`start_postgres.sh --install\` does it with apt: package postgresql)" >&2
    return 1
}

# Runs a command as the owner of the PostgreSQL data folder: this login, or, for root (PostgreSQL
# refuses to run as root), the system user postgres.
xm_pg_as_owner() {
    if [ "$(id -u)" = 0 ]; then
        # From /: the postgres user may not enter root's working directory.
        (cd / && runuser -u postgres -- "$@")
    else
        "$@"
    fi
}

# Stops the head's PostgreSQL if it runs (a fast shutdown: open sessions end, every committed run is
# on disk); its data folder stays. Nothing to do without XMODAL_POSTGRES_DATA (another backend).
xm_stop_postgres() {
    local data=${XMODAL_POSTGRES_DATA:-}
    [ -n "$data" ] && [ -f "$data/PG_VERSION" ] || return 0
    xm_pg_bin "$data" || return 1
    if xm_pg_as_owner "$XM_PG_BIN/pg_ctl" -D "$data" status >/dev/null 2>&1; then
        xm_pg_as_owner "$XM_PG_BIN/pg_ctl" -D "$data" stop -m fast -w -t 60 >/dev/null
    fi
}
