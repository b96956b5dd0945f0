"""Check a cluster config before `ray up` (xmodal/runner/cluster_check.py): addresses, key files, file mounts,
the scripts its commands run. Run it from the repository root, where `ray up` runs.

    python3 scripts/check_cluster.py cluster.onprem.yaml      # before `ray up cluster.onprem.yaml`

Prints one line and exits 0 when the config is fine; otherwise one `error:` line naming the file and
every key and value at fault, exit code 2. node_env.sh runs the two node forms on each node:

    python3 scripts/check_cluster.py --on-node --print-head-ip ~/ray_bootstrap_config.yaml
    python3 scripts/check_cluster.py --option='node_env.sh --head-ip' --address=10.0.0.5

docs/cluster.md, "Before the first `ray up`".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Standard library only (and PyYAML where installed): with the repository's platform/ on the path this runs
# under any python3, a node's too, before its environment exists.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

from xmodal.runner.cluster_check import ClusterConfigError, check, check_address, head_address  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", help="the cluster config (YAML; JSON on a node)")
    parser.add_argument("--on-node", action="store_true",
                        help="the launcher's copy on the head (~/ray_bootstrap_config.yaml): addresses only")
    parser.add_argument("--print-head-ip", action="store_true",
                        help="print the local provider's head address (a host name resolved here)")
    parser.add_argument("--address", metavar="VALUE",
                        help="check one head address (an IPv4 address) and print it; its source named by --option")
    parser.add_argument("--option", default="address", help="what gave --address, named in the error")
    args = parser.parse_args(argv)
    try:
        if args.address is not None:
            print(check_address(args.address, args.option, ip_only=True))
            return 0
        if not args.config:
            parser.error("give a cluster config, or --address=VALUE")
        cfg = check(args.config, on_node=args.on_node)
        if args.print_head_ip:
            print(head_address(cfg, args.config) or "")
        else:
            provider = cfg.get("provider") or {}
            where = (f"head {provider.get('head_ip')}, {len(provider.get('worker_ips') or [])} worker(s)"
                     if provider.get("type") == "local" else f"provider {provider.get('type')}")
            v1 = "RAY_UP_enable_autoscaler_v2=0 " if provider.get("type") == "local" else ""
            print(f"{args.config}: ok ({where}); start it with `{v1}ray up -y {args.config}`")
        return 0
    except ClusterConfigError as e:
        where = (" (the launcher's copy of your cluster config: fix the config, then `ray up` again)"
                 if args.on_node else "")
        print(f"error: {e}{where}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
