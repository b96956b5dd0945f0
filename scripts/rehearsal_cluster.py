"""Hosts on this machine to rehearse a multi-host Ray cluster (platform/xmodal_rehearsal/). Run it as root.

    sudo python3 scripts/rehearsal_cluster.py up --hosts 3     # head, worker1, worker2 at 10.231.0.1, .2, .3
    sudo python3 scripts/rehearsal_cluster.py up --sshd        # and an SSH server in each (root, key login)
    sudo python3 scripts/rehearsal_cluster.py run head -- hostname
    sudo python3 scripts/rehearsal_cluster.py run worker1      # a shell inside worker1
    sudo python3 scripts/rehearsal_cluster.py down             # everything, also what a crashed run left

The hosts outlive `up`: they stay until `down`. docs/cluster.md, "Rehearsing a cluster on one machine".
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

# The package is standard library only: with the repository's platform/ on the path this runs under any
# python3 (sudo's often lacks the project's virtual environment).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

from xmodal_rehearsal import (  # noqa: E402
    BRIDGE_ADDRESS,
    DEFAULT_PREFIX,
    Hosts,
    RehearsalError,
    teardown_leftovers,
)

SCRIPT = "scripts/rehearsal_cluster.py"


def up(args: argparse.Namespace) -> int:
    hosts = Hosts(args.hosts, args.prefix, sshd=args.sshd).create()
    print(f"{len(hosts.names)} hosts on bridge {hosts.bridge} ({BRIDGE_ADDRESS} is this machine):")
    for name, host in hosts.hosts.items():
        print(f"  {name:<10} {host.address:<12} network namespace {host.netns}, holder pid {host.holder}")
    first = hosts.names[0]
    print("\nEnter one (a shell), or run a command in it:")
    print(f"  sudo python3 {SCRIPT} run {first}")
    print(f"  sudo python3 {SCRIPT} run {first} -- hostname")
    print(f"  sudo {' '.join(hosts.enter_argv(first))} bash")
    if hosts.sshd:
        print(f"\nSSH servers on each host's address, port 22; root logs in with {hosts.ssh_key} (inside a host:")
        print("~/.ssh/id_ed25519, with every host's key in ~/.ssh/known_hosts):")
        print(f"  sudo {' '.join(hosts.ssh_argv(hosts.names[-1]))} hostname")
    print(f"\nRemove them all: sudo python3 {SCRIPT} down")
    return 0


def run(args: argparse.Namespace) -> int:
    hosts = Hosts.attach(args.prefix)
    command = args.command or [shutil.which("bash") and "bash" or "sh"]
    argv = [*hosts.enter_argv(args.host), *command]
    # Replaced by nsenter: the terminal, signals and the exit status are the command's own.
    os.execvpe(argv[0], argv, hosts.environment(args.host))
    return 0  # not reached


def down(args: argparse.Namespace) -> int:
    removed = teardown_leftovers(args.prefix)
    print("\n".join(f"removed {what}" for what in removed) if removed
          else f"nothing to remove (no rehearsal with prefix {args.prefix!r})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix", default=DEFAULT_PREFIX,
                        help="names every namespace, link and folder made (default %(default)s)")
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("up", help="make the hosts and print their addresses")
    p.add_argument("--hosts", type=int, default=3, help="how many (head, worker1, ...; default %(default)s)")
    p.add_argument("--sshd", action="store_true",
                   help="an SSH server in each host, on its address only; root logs in with a key made for the hosts")
    p.set_defaults(func=up)
    p = sub.add_parser("run", help="run a command (default: a shell) inside a host: run HOST -- CMD...")
    p.add_argument("host")
    p.add_argument("command", nargs=argparse.REMAINDER)
    p.set_defaults(func=run)
    p = sub.add_parser("down", help="remove every host, link and process, also those of a crashed run")
    p.set_defaults(func=down)
    args = parser.parse_args(argv)
    if args.action == "run" and args.command[:1] == ["--"]:
        args.command = args.command[1:]
    try:
        return args.func(args)
    except RehearsalError as e:
        print(f"rehearsal_cluster: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
