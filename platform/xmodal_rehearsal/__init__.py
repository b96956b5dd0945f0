"""Several "hosts" on one Linux machine, to rehearse a multi-host Ray cluster without a cloud. Needs root.

Each host is a network namespace with an address of its own on a private bridge, plus PID, mount, UTS
and IPC namespaces with a private /tmp, /run and /dev/shm (empty at first: Ray's session folders and
`ray stop` stay per host; but for the folders kept, `Hosts(keep=...)`, by default this checkout and the
running Python's environment when they are under /tmp, bound in at the same path), a /root whose writes stay in the host (it reads the machine's /root through,
where interpreters may be installed) and a hostname of its own. Its /etc/hosts maps every host name to
that host's bridge address: Ray and gloo look their own host name up, and a name that resolves to
127.0.0.1 makes the other hosts dial their own loopback.

    with Hosts(3) as hosts:                     # head, worker1, worker2 at 10.231.0.1, .2, .3
        hosts.run("worker1", ["getent", "hosts", "head"])
        node = hosts.popen("head", ["ray", "start", "--head", "--block", ...])

Nothing inside a host can reach any other network: the hosts have no default route (a connection to any
address outside loopback and 10.231.0.0/24 fails at once with "network unreachable", before a packet is
sent), no NAT and no forwarding are set up, and IPv6 is off on every interface made here. The bridge
holds 10.231.0.254 so that the machine itself can reach the hosts.

With `sshd=True`, every host also runs an SSH server on its bridge address only (port 22; not on its
loopback), as a machine reached by the Ray cluster launcher would. One key pair made for the rehearsal
logs in as root on every host: root inside any host has it as ~/.ssh/id_ed25519 and the hosts' keys
in ~/.ssh/known_hosts, and the machine has both under /run/PREFIX-rehearsal/ssh/ (`Hosts.ssh_key`,
`Hosts.known_hosts`, `Hosts.ssh_argv`). Needs `sshd` (openssh-server) and `ssh-keygen`.

A host is kept alive by one holder process (PID 1 of the host's PID namespace, a shell); killing it
kills everything started in the host. Like a machine's init, it reaps the orphans it adopts (Ray's
daemons, once `ray start` has returned): left as zombies, `ray stop` would wait them out as if alive.
Every namespace, link and folder is named with `prefix` (default "xm"), so that `teardown_leftovers`
finds what a crashed run left, and `Hosts.attach` finds hosts made by another process (the command
line's `up`, then `run`).

Standard library only, and no Ray: the caller decides what runs in the hosts.

`machine`: whether the rehearsal can run here, the names it gives what it makes, and finding and removing
leftovers. `hosts`: the `Hosts` themselves. What callers use of either is re-exported here.
"""

from xmodal_rehearsal.hosts import Host, Hosts, default_keep
from xmodal_rehearsal.machine import (
    BRIDGE_ADDRESS,
    DEFAULT_PREFIX,
    MAX_HOSTS,
    SUBNET,
    RehearsalError,
    check_can_run,
    host_names,
    leftovers,
    missing,
    sshd_path,
    teardown_leftovers,
    unavailable_reason,
)

__all__ = [
    "BRIDGE_ADDRESS", "DEFAULT_PREFIX", "MAX_HOSTS", "SUBNET", "Host", "Hosts", "RehearsalError", "check_can_run",
    "default_keep", "host_names", "leftovers", "missing", "sshd_path", "teardown_leftovers", "unavailable_reason",
]
