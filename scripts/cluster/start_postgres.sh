#!/usr/bin/env bash
# The head's PostgreSQL, the database of the cluster's MLflow server: the head's start command before
# start_mlflow.sh in cluster.yaml and cluster.onprem.yaml. Idempotent; every `ray up` runs it again.
#
#   bash ~/xmodal/scripts/cluster/start_postgres.sh            # initialise if absent, start if stopped
#   bash ~/xmodal/scripts/cluster/start_postgres.sh --install  # the head's setup: install PostgreSQL
#
# The data folder is $XMODAL_POSTGRES_DATA (node_env.sh --postgres-data; default ~/mlflow/postgres, or
# /var/lib/xmodal/postgres for a root login, whose home the postgres user cannot enter). Made once with
# initdb, by this login or, for root, by the system user postgres (PostgreSQL refuses to run as root);
# kept across `ray down` and `ray up`: stop_cluster.sh only stops the server. It listens on 127.0.0.1
# at $XMODAL_POSTGRES_PORT (default 5433: a PostgreSQL from apt runs its own cluster on 5432) and on a
# Unix socket in the data folder, which only its owner can enter. The database and role `mlflow`:
# created if missing; the role's password is kept in ~/mlflow/pgpass (libpq's password file, made
# once, mode 600), set again at every start, and read by the MLflow server (start_mlflow.sh), so the
# URI in XMODAL_MLFLOW_BACKEND names none. With another --mlflow-backend given to node_env.sh there
# is nothing to start here.
#
# --install: installs PostgreSQL with apt (package postgresql) where its programs are missing, as root
# or with sudo; elsewhere, says what to install.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$here/lib.sh"
xm_load_env

install=0
for arg in "$@"; do
    case "$arg" in
        --install) install=1 ;;
        *) echo "start_postgres.sh: unknown argument ${arg@Q}; expected --install or nothing" >&2; exit 2 ;;
    esac
done
data=${XMODAL_POSTGRES_DATA:-}
port=${XMODAL_POSTGRES_PORT:-5433}
if [ -z "$data" ]; then
    echo "start_postgres.sh: nothing to start: the MLflow database is $XMODAL_MLFLOW_BACKEND (node_env.sh --mlflow-backend)"
    exit 0
fi

if [ "$install" = 1 ]; then
    if xm_pg_bin "$data" 2>/dev/null; then
        exit 0
    fi
    if ! command -v apt-get >/dev/null; then
        xm_pg_bin "$data" || true
        echo "start_postgres.sh: no apt-get on $(hostname): install PostgreSQL's server with this system's" \
             "package manager" >&2
        exit 1
    fi
    root=(sudo)
    [ "$(id -u)" = 0 ] && root=()  # a root login (own machines) may have no sudo
    "${root[@]}" apt-get -o DPkg::Lock::Timeout=600 update -qq
    "${root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq postgresql
    xm_pg_bin "$data"
    exit 0
fi

if [ "$(id -u)" = 0 ] && ! id postgres >/dev/null 2>&1; then
    echo "start_postgres.sh: PostgreSQL refuses to run as root, and $(hostname) has no user postgres to run it" \
         "as: install the package postgresql (start_postgres.sh --install), which makes that user" >&2
    exit 1
fi
if [ -e "$data" ] && [ ! -d "$data" ]; then
    echo "start_postgres.sh: XMODAL_POSTGRES_DATA=$data is not a folder on $(hostname)" >&2
    exit 1
fi
case "$data" in
    /*) ;;
    *) echo "start_postgres.sh: XMODAL_POSTGRES_DATA=$data: expected an absolute path" >&2; exit 1 ;;
esac
xm_pg_bin "$data" || exit 1
pg_ctl=$XM_PG_BIN/pg_ctl
log=$data/server.log  # the server's log, in the one folder its owner can surely write
mkdir -p "$HOME/mlflow"

if [ ! -f "$data/PG_VERSION" ]; then
    if [ -d "$data" ] && [ -n "$(ls -A "$data")" ]; then
        echo "start_postgres.sh: XMODAL_POSTGRES_DATA=$data on $(hostname) holds files but no PostgreSQL" \
             "database (no PG_VERSION): empty it, or name another folder (node_env.sh --postgres-data)" >&2
        exit 1
    fi
    # Made beside its final place and renamed at the end: an initdb that fails leaves no half-made
    # folder for the next run to mistake for a database.
    parent=$(dirname "$data")
    mkdir -p "$parent"
    new="$parent/.$(basename "$data").new"
    rm -rf "$new"
    mkdir -m 700 "$new"
    if [ "$(id -u)" = 0 ]; then
        chown postgres "$new"
    fi
    if ! xm_pg_as_owner "$XM_PG_BIN/initdb" -D "$new" --auth-local=peer --auth-host=scram-sha-256 \
            --encoding=UTF8 --locale=C > "$HOME/mlflow/initdb.log" 2>&1; then
        echo "start_postgres.sh: initdb of $data on $(hostname) failed:" >&2
        tail -n 20 "$HOME/mlflow/initdb.log" >&2
        rm -rf "$new"
        exit 1
    fi
    rmdir "$data" 2>/dev/null || true
    mv "$new" "$data"
fi

# Running already (an earlier `ray up`): kept, unless on another port than the one asked for now.
if xm_pg_as_owner "$pg_ctl" -D "$data" status >/dev/null 2>&1; then
    if [ "$(sed -n 4p "$data/postmaster.pid")" != "$port" ]; then
        xm_pg_as_owner "$pg_ctl" -D "$data" stop -m fast -w -t 60 >/dev/null
    fi
fi
if ! xm_pg_as_owner "$pg_ctl" -D "$data" status >/dev/null 2>&1; then
    if ! xm_pg_as_owner "$pg_ctl" -D "$data" -l "$log" -w -t 120 start \
            -o "-c listen_addresses=127.0.0.1 -p $port -k $data" >/dev/null; then
        echo "start_postgres.sh: PostgreSQL (data $data, 127.0.0.1:$port) did not start on $(hostname):" >&2
        tail -n 20 "$log" >&2
        exit 1
    fi
fi

# The role and the database, over the Unix socket as the superuser (the data folder's owner).
pgpass=$HOME/mlflow/pgpass
if [ ! -s "$pgpass" ]; then
    (umask 077; printf '127.0.0.1:%s:mlflow:mlflow:%s\n' "$port" \
        "$(od -An -N24 -tx1 /dev/urandom | tr -d ' \n')" > "$pgpass.new")
    mv "$pgpass.new" "$pgpass"
fi
password=$(cut -d: -f5 "$pgpass" | head -n 1)
if ! [[ "$password" =~ ^[0-9a-f]+$ ]]; then
    echo "start_postgres.sh: $pgpass on $(hostname) is not the one this script writes (expected" \
         "127.0.0.1:PORT:mlflow:mlflow:HEX): delete it, and the next start makes a new password" >&2
    exit 1
fi
# The port in the password file follows the server's.
(umask 077; printf '127.0.0.1:%s:mlflow:mlflow:%s\n' "$port" "$password" > "$pgpass.new")
mv "$pgpass.new" "$pgpass"
psql=(xm_pg_as_owner "$XM_PG_BIN/psql" -h "$data" -p "$port" -d postgres -v ON_ERROR_STOP=1 -qAt)
# The password (hex digits) goes in on stdin, not on a command line that `ps` shows.
if ! out=$("${psql[@]}" 2>&1 <<SQL
SELECT 'CREATE ROLE mlflow LOGIN' WHERE NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'mlflow')
\gexec
ALTER ROLE mlflow LOGIN PASSWORD '$password';
SELECT 'CREATE DATABASE mlflow OWNER mlflow' WHERE NOT EXISTS (SELECT 1 FROM pg_database WHERE datname = 'mlflow')
\gexec
SQL
); then
    echo "start_postgres.sh: making the role and database mlflow in PostgreSQL ($data) on $(hostname) failed:" >&2
    echo "$out" >&2
    exit 1
fi
echo "start_postgres.sh: PostgreSQL on 127.0.0.1:$port, data in $data"
