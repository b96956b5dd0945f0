#!/usr/bin/env bash
# Stops Ray on every node of a cluster on your own machines (cluster.onprem.yaml), and the head's MLflow
# server and PostgreSQL (whose data stays). Run it on the head, before `ray down`:
#
#   ray exec cluster.onprem.yaml 'bash ~/xmodal/scripts/cluster/stop_cluster.sh'
#   ray down -y cluster.onprem.yaml
#
# Needed because `ray down` runs `ray stop` on the head only: the local provider then just marks the
# workers terminated in a state file, and their Ray processes live on. (Cloud providers switch the
# machines off instead.)
#
# The head first: its autoscaler restarts a worker whose Ray it sees stop. Then, in parallel, every
# worker in worker_ips of the head's copy of the config (~/ray_bootstrap_config.yaml), over SSH with
# the key the launcher copied to the head, as the launcher does (host keys not checked). With the head
# gone, a worker's raylet may not finish within `ray stop`'s grace period; `ray stop` then kills it.
# On each machine a second `ray stop` must find nothing left. Exits non-zero naming each machine where
# Ray may still run.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$here/lib.sh"
xm_load_env

config=$HOME/ray_bootstrap_config.yaml
if [ ! -f "$config" ]; then
    echo "stop_cluster.sh: no $config on $(hostname): run this on the head of a cluster \`ray up\` started" >&2
    exit 1
fi
# The SSH user, the key and the workers' addresses, one per line (the launcher writes the file as JSON).
mapfile -t lines < <(python3 - "$config" <<'PY'
import json
import os
import sys

cfg = json.load(open(sys.argv[1]))
print(cfg["auth"]["ssh_user"])
print(os.path.expanduser(cfg["auth"].get("ssh_private_key", "")))
for ip in cfg["provider"].get("worker_ips") or []:
    print(ip)
PY
)
if [ "${#lines[@]}" -lt 2 ]; then
    echo "stop_cluster.sh: could not read auth.ssh_user and provider.worker_ips from $config" >&2
    exit 1
fi
user=${lines[0]} key=${lines[1]} workers=("${lines[@]:2}")

# `ray stop` stops what it finds (killing what outlives its grace period) and exits 0 either way: the
# second one tells whether anything is left.
gone='ray stop && ray stop 2>&1 | grep -q "Did not find any active Ray processes"'
if ! eval "$gone"; then
    echo "stop_cluster.sh: Ray processes are still running on the head ($(hostname)) after \`ray stop\`" >&2
    exit 1
fi
xm_stop_mlflow
# The head's PostgreSQL stops too; its data folder, and every run in it, stays for the next `ray up`.
if ! xm_stop_postgres; then
    echo "stop_cluster.sh: stopping PostgreSQL ($XMODAL_POSTGRES_DATA) on the head ($(hostname)) failed" >&2
    exit 1
fi

ssh_opts=(-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o IdentitiesOnly=yes
          -o BatchMode=yes -o ConnectTimeout=10)
if [ -n "$key" ]; then
    ssh_opts+=(-i "$key")
fi
logs=$(mktemp -d)
pids=()
for ip in "${workers[@]}"; do
    ssh "${ssh_opts[@]}" "$user@$ip" ". ~/xmodal.env && $gone" > "$logs/$ip" 2>&1 < /dev/null &
    pids+=($!)
done
failed=()
for i in "${!workers[@]}"; do
    ip=${workers[$i]}
    if wait "${pids[$i]}"; then
        echo "$ip: no Ray process left"
    else
        failed+=("$ip")
        echo "stop_cluster.sh: stopping Ray on $ip failed:" >&2
        tail -n 20 "$logs/$ip" >&2
    fi
done
rm -rf "$logs"
if [ "${#failed[@]}" -gt 0 ]; then
    echo "stop_cluster.sh: Ray may still run on ${failed[*]}" >&2
    exit 1
fi
