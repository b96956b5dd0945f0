#!/usr/bin/env bash
# Installs the project on this node and fetches the feature stores: the second setup command of
# cluster.yaml and cluster.onprem.yaml, after node_env.sh. Idempotent; every `ray up` runs it again.
#
#   bash ~/xmodal/scripts/cluster/setup_node.sh [--no-synthetic-store]
#
# 1. The project: scripts/setup.sh builds ~/xmodal/.venv (the head starts Ray from it, so a job's
#    `python` is this one). With --venv given to node_env.sh, that environment is used as it is and
#    nothing is installed.
# 2. Feature stores. On S3 (XMODAL_STORES=s3://...) they stay there and nothing is copied: jobs name
#    a store by its URI (--store s3://.../stores/lxmert) and Ray Data's tasks read its row groups from
#    S3 on whichever node they run, with the node's AWS_* environment (node_env.sh). A folder of stores
#    on each machine (own machines) is copied to ~/stores, so that every store has the same path on
#    every node. The embedded synthetic store is built as ~/stores/synthetic_lxmert for a first run
#    (--no-synthetic-store: not built): it is derived data, which lives on a local disk.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$here/lib.sh"
xm_load_env

synthetic=1
for arg in "$@"; do
    case "$arg" in
        --no-synthetic-store) synthetic=0 ;;
        *) echo "setup_node.sh: unknown argument ${arg@Q}; expected --no-synthetic-store" >&2; exit 2 ;;
    esac
done

cd "$HOME/xmodal"
if [ -z "${XMODAL_VENV:-}" ]; then
    # python3-venv is missing from some Ubuntu images; apt waits for the boot-time upgrades' lock.
    # (Elsewhere `python3 -m venv` in scripts/setup.sh says what is missing.)
    if command -v dpkg >/dev/null && command -v apt-get >/dev/null && ! dpkg -s python3-venv >/dev/null 2>&1; then
        root=(sudo)
        [ "$(id -u)" = 0 ] && root=()  # a root login (own machines) may have no sudo
        "${root[@]}" apt-get -o DPkg::Lock::Timeout=600 update -qq
        "${root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq python3-venv
    fi
    bash "$HOME/xmodal/scripts/setup.sh"
elif ! python -c "import ray, torch, mlflow, psycopg2" 2>/dev/null; then
    echo "setup_node.sh: the environment $XMODAL_VENV (node_env.sh --venv) on $(hostname) lacks ray, torch," \
         "mlflow or psycopg2: install the project's dependencies into it (pip install -e '.[cluster,test]')" >&2
    exit 1
fi

mkdir -p "$HOME/stores"
case "${XMODAL_STORES:-}" in
    "" | *://*) ;;  # none, or on S3 (any URI): read where they are
    *)
        if [ ! -d "$XMODAL_STORES" ]; then
            echo "setup_node.sh: XMODAL_STORES=$XMODAL_STORES is not a folder on $(hostname)" >&2
            exit 1
        fi
        rsync -a "$XMODAL_STORES"/ "$HOME/stores"/
        ;;
esac
if [ "$synthetic" = 1 ] && [ ! -f "$HOME/stores/synthetic_lxmert/manifest.json" ]; then
    python "$HOME/xmodal/jobs/ingest.py" synthetic "$HOME/stores/synthetic_lxmert"
fi
