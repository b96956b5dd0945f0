#!/usr/bin/env bash
# (Re)starts Ray on this node with the `ray start` command given: the head's and the workers' start
# command in cluster.yaml and cluster.onprem.yaml. The `ray start` line stays in the cluster config,
# where the launcher looks for it (it checks the head's for --autoscaling-config).
#
#   bash ~/xmodal/scripts/cluster/start_ray.sh [--autoscaler-v1] ray start ...
#
# Before it: this node's Ray is stopped (`ray stop` stops every Ray node on a machine: never use these
# commands on a computer shared with other Ray users), the environment is loaded, and the open files
# limit raised. On the head (`--head` given), Ray listens on XMODAL_HEAD_IP, the address the workers
# and MLflow clients use, and its GCS gets the health-check settings in head_system_config.json (next
# to this script; a --system-config in the command given replaces them). Ray's defaults (a check every
# 3 s, 10 s to answer, 5 misses) take about 65 s to declare a cut-off or powered-off node dead; these
# (1 s, 3 s, 3 misses) about 12 s, and a node whose Ray died with its machine up (connections refused
# at once) about 3 s. A false alarm needs a node that answers none of three checks in a row, each given
# 3 s: some 11 s without an answer, far beyond the scheduling delays of a loaded machine (the gRPC
# health service answers from its own threads, not the raylet's busy event loop). docs/reliability.md
# says what a run does when a node is declared dead.
#   --autoscaler-v1   refuse to start the head under autoscaler v2 (the launcher's default since Ray
#                     2.50). With the local provider (cluster.onprem.yaml), v2 started only one of two
#                     workers; `RAY_UP_enable_autoscaler_v2=0 ray up` runs v1.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$here/lib.sh"
xm_load_env

v1=0
if [ "${1:-}" = --autoscaler-v1 ]; then
    v1=1
    shift
fi
if [ "${1:-}" != ray ] || [ "${2:-}" != start ]; then
    echo "start_ray.sh: expected [--autoscaler-v1], then the node's Ray start command (ray, start, flags); got: $*" >&2
    exit 2
fi
shift 2
head=0
own_config=0
for arg in "$@"; do
    case "$arg" in
        --head) head=1 ;;
        --system-config|--system-config=*) own_config=1 ;;
    esac
done
if [ "$head" = 1 ] && [ "$v1" = 1 ] && [ "${RAY_enable_autoscaler_v2:-0}" = 1 ]; then
    echo "start_ray.sh: this cluster runs Ray's autoscaler v1: run \`RAY_UP_enable_autoscaler_v2=0 ray up ...\`" \
         "(with v2, the local provider starts only some of the worker_ips)" >&2
    exit 2
fi

ray stop
xm_raise_open_files
if [ "$head" = 1 ]; then
    if [ "$own_config" = 0 ]; then
        set -- --system-config="$(cat "$here/head_system_config.json")" "$@"
    fi
    set -- --node-ip-address="$XMODAL_HEAD_IP" "$@"
fi
ray start "$@"
