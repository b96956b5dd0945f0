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
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.231.0"  # the hosts' /24; host i (from 0) has SUBNET.(i + 1)
BRIDGE_ADDRESS = f"{SUBNET}.254"
DEFAULT_PREFIX = "xm"
MAX_HOSTS = 50  # keeps every name within the kernel's 15 characters with a 4-character prefix
_COMMANDS = {"ip": "iproute2", "unshare": "util-linux", "nsenter": "util-linux", "mount": "util-linux",
             "sh": "a POSIX shell", "sleep": "coreutils", "stat": "coreutils"}
_SSH_COMMANDS = {"ssh-keygen": "openssh-client", "ssh": "openssh-client"}
SSH_PORT = 22
_SSHD_DIR = "/run/rehearsal-sshd"  # inside each host (its own /run): the server's config, key, log
_NAMESPACES = ("net", "pid", "mnt", "uts", "ipc")
_HOLDER_MARK = "XMODAL_REHEARSAL_HOLDER"  # in each holder's environment (value: the prefix), to find it by
_STARTUP_TIMEOUT_S = 15.0
_KILL_TIMEOUT_S = 10.0

# Run by each holder inside its fresh namespaces ($1: the hosts file, $2: the host name, $3: a folder for
# the kept paths' mounts in between, then the kept paths). The mounts are private to the host (unshare
# makes the new mount namespace's propagation private), so nothing here shows on the machine. /tmp, /run
# and /dev/shm start empty, but for the kept paths under /tmp (a checkout there and its virtual
# environment): each is bound aside before the host's /tmp covers the machine's, then moved to its own
# path in it, so that it reads and writes the machine's folder. /root is an overlay: the machine's /root
# read through (interpreters often live there, e.g. pyenv's), with the host's writes (~/.ray, caches)
# kept in the host's /run. IPv6 goes off before any link comes up, so no host sends router solicitations
# or multicast reports anywhere. Then the shell stays as PID 1: each `wait` reaps every child that exits
# meanwhile, the adopted orphans too (a `sleep` as PID 1 would reap none).
_HOLDER_SCRIPT = """set -e
for f in /proc/sys/net/ipv6/conf/all/disable_ipv6 /proc/sys/net/ipv6/conf/default/disable_ipv6; do
    if [ -e "$f" ]; then echo 1 > "$f"; fi
done
mount --bind "$1" /etc/hosts
name=$2 aside=$3
shift 3
i=0
for kept in "$@"; do
    mkdir -p "$aside/$i"
    mount --rbind "$kept" "$aside/$i"
    i=$((i + 1))
done
mount -t tmpfs -o mode=1777 tmpfs /tmp
i=0
for kept in "$@"; do
    mkdir -p "$kept"
    mount --move "$aside/$i" "$kept"
    i=$((i + 1))
done
mount -t tmpfs -o mode=0755 tmpfs /run
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mkdir -p /run/.rehearsal-root/upper /run/.rehearsal-root/work
chmod "$(stat -c %a /root)" /run/.rehearsal-root/upper
mount -t overlay overlay -o lowerdir=/root,upperdir=/run/.rehearsal-root/upper,workdir=/run/.rehearsal-root/work /root
echo "$name" > /proc/sys/kernel/hostname
echo ready
set +e
while :; do sleep 3600 & wait; done
"""


class RehearsalError(RuntimeError):
    """The rehearsal cannot run here, or a step of making or removing hosts failed; the message names
    what is missing or which command failed, with its error output."""


@dataclass(frozen=True)
class Host:
    name: str  # also its hostname
    address: str
    netns: str
    veth: str  # the machine's end of the host's link; the host's end is its eth0
    holder: int  # pid (on the machine) of the process holding the host's namespaces


def host_names(n: int) -> list[str]:
    if not 1 <= n <= MAX_HOSTS:
        raise RehearsalError(f"hosts: {n}; expected 1 to {MAX_HOSTS}")
    return ["head"] + [f"worker{i}" for i in range(1, n)]


# Mounted empty in every host. A path a host must see under /tmp is bound in (`Hosts.keep`); one under
# /run or /dev/shm cannot be (/run holds the binds on their way in), and is refused at `create`.
_PRIVATE_MOUNTS = ("/tmp", "/run", "/dev/shm")


def default_keep() -> list[Path]:
    """What a command run in a host needs of this process's files: the checkout this module is in, and
    the Python environment running it (its prefix, base prefix and interpreter)."""
    return [Path(__file__).resolve().parents[2], Path(sys.prefix), Path(sys.base_prefix),
            Path(sys.executable).resolve().parent]


def _kept(paths: Sequence[str | Path]) -> list[Path]:
    """Of `paths`, those a host would not see (under its own /tmp, /run or /dev/shm), resolved, without
    those inside another one. Paths elsewhere the host sees as the machine's already."""
    found = []
    for path in paths:
        p = Path(path).resolve()
        root = next((Path(r) for r in _PRIVATE_MOUNTS if p == Path(r) or Path(r) in p.parents), None)
        if root is not None:
            found.append((p, root))
    kept: list[Path] = []
    for p, root in sorted(found, key=lambda f: len(f[0].parts)):
        if any(k == p or k in p.parents for k in kept):
            continue
        if root != Path("/tmp") or p == root:
            raise RehearsalError(f"{p} is under {root}, which every host mounts empty of its own: a command run "
                                 f"in a host would not find it; move it (a checkout, a virtual environment) "
                                 f"elsewhere, or under /tmp, whose folders the hosts are given")
        if not p.is_dir():
            raise RehearsalError(f"{p}: not a folder; expected a folder to show in every host")
        kept.append(p)
    return kept


def _check_prefix(prefix: str) -> str:
    if not re.fullmatch(r"[a-z][a-z0-9]{0,3}", prefix):
        raise RehearsalError(f"prefix {prefix!r}: expected 1 to 4 lowercase letters or digits, starting "
                             "with a letter (every name made must fit the kernel's 15 characters)")
    return prefix


def _netns_name(prefix: str, host: str) -> str:
    return f"{prefix}-{host}"


def _veth_name(prefix: str, host: str) -> str:
    return f"{prefix}v-{host}"


def _bridge_name(prefix: str) -> str:
    return f"{prefix}br0"


def _state_dir(prefix: str) -> Path:
    return Path("/run") / f"{prefix}-rehearsal"


def sshd_path() -> str | None:
    """The SSH server's program, by absolute path (sshd re-executes itself by it): on PATH or in the
    sbin folders, which a non-root PATH often lacks."""
    found = shutil.which("sshd")
    if found is None:
        found = next((p for p in ("/usr/sbin/sshd", "/usr/local/sbin/sshd", "/sbin/sshd") if os.access(p, os.X_OK)),
                     None)
    return os.path.abspath(found) if found else None


def missing(sshd: bool = False) -> list[str]:
    """What this machine lacks for the rehearsal (with an SSH server per host if `sshd`), one line
    each; empty when it can run."""
    found = []
    if not sys.platform.startswith("linux"):
        return [f"Linux (this is {sys.platform}): hosts are Linux namespaces"]
    if os.geteuid() != 0:
        found.append("root (it makes network namespaces, a bridge and mounts; run it with sudo)")
    commands = {**_COMMANDS, **(_SSH_COMMANDS if sshd else {})}
    absent = [f"{command} ({package})" for command, package in commands.items() if shutil.which(command) is None]
    if sshd and sshd_path() is None:
        absent.append("sshd (openssh-server; scripts/setup.sh installs it when run as root)")
    if absent:
        found.append(f"the command{'s' if len(absent) > 1 else ''} {', '.join(absent)} on PATH")
    lacking = [ns for ns in _NAMESPACES if not os.path.exists(f"/proc/self/ns/{ns}")]
    if lacking:
        found.append(f"kernel support for {', '.join(lacking)} namespaces (no /proc/self/ns/{lacking[0]})")
    return found


def unavailable_reason(sshd: bool = False) -> str | None:
    """Why the rehearsal (with an SSH server per host if `sshd`) cannot run here (None when it can),
    after trying to make the namespaces once: a container may lack the capability even as root. Leaves
    nothing behind."""
    lacking = missing(sshd)
    if lacking:
        return "the rehearsal needs " + "; ".join(lacking)
    probe = subprocess.run(["unshare", "--net", "--pid", "--mount", "--uts", "--ipc", "--fork", "true"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return (f"cannot make namespaces here (`unshare --net --pid --mount --uts --ipc` failed: "
                f"{probe.stderr.strip()}); a container may not grant CAP_SYS_ADMIN")
    return None


def check_can_run(sshd: bool = False) -> None:
    reason = unavailable_reason(sshd)
    if reason:
        raise RehearsalError(reason)


def _sh(argv: Sequence[str], what: str) -> str:
    out = subprocess.run(list(argv), capture_output=True, text=True)
    if out.returncode != 0:
        raise RehearsalError(f"{what}: `{' '.join(argv)}` failed (exit {out.returncode}): "
                             f"{(out.stderr or out.stdout).strip()}")
    return out.stdout


def _write_sysctl(path: str, value: str) -> None:
    """Per-interface sysctls of the links made here only; absent (IPv6 not built in) is fine."""
    if os.path.exists(path):
        Path(path).write_text(value)


# --- finding what exists (this run's or a crashed one's) -----------------------------------------------

def _netns_list(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    names = [line.split()[0] for line in out.stdout.splitlines() if line.strip()]
    return sorted(n for n in names if n.startswith(f"{prefix}-"))


def _links(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True)
    names = [line.split(":")[1].strip().split("@")[0] for line in out.stdout.splitlines() if ":" in line]
    return sorted(n for n in names if n == _bridge_name(prefix) or n.startswith(f"{prefix}v-"))


def _netns_pids(netns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split() if p.isdigit()]


def _is_holder(pid: int) -> bool:
    """PID 1 of a PID namespace other than ours: the shell a holder runs as (its `unshare` parent, and
    processes joined with nsenter, have other pids in there)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        if os.readlink(f"/proc/{pid}/ns/pid") == os.readlink("/proc/self/ns/pid"):
            return False
    except OSError:
        return False
    nspid = next((line.split()[1:] for line in status.splitlines() if line.startswith("NSpid:")), [])
    return len(nspid) >= 2 and nspid[-1] == "1"


def _holder_of(netns: str) -> int | None:
    return next((pid for pid in _netns_pids(netns) if _is_holder(pid)), None)


def _marked_processes(prefix: str) -> list[int]:
    """Holders (and their `unshare` parents) by the mark in their environment: found even when their
    network namespace's name is gone (deleted by hand while they still ran)."""
    mark = f"{_HOLDER_MARK}={prefix}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if mark in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return sorted(found)


def _kill(pids: Sequence[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def leftovers(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """What a rehearsal with this prefix has on the machine now: namespaces, links, processes, folder."""
    prefix = _check_prefix(prefix)
    found = [f"network namespace {ns}" for ns in _netns_list(prefix)]
    found += [f"link {link}" for link in _links(prefix)]
    found += [f"process {pid} in {ns}" for ns in _netns_list(prefix) for pid in _netns_pids(ns)]
    found += [f"holder process {pid}" for pid in _marked_processes(prefix)
              if not any(f"process {pid} in" in f for f in found)]
    if _state_dir(prefix).exists():
        found.append(f"folder {_state_dir(prefix)}")
    return found


def _kill_netns_processes(netns: str) -> None:
    """The holder first: its PID namespace dying kills every process in the host. Then any other process
    in the network namespace (an nsenter parent, or something joined with `ip netns exec`)."""
    deadline = time.monotonic() + _KILL_TIMEOUT_S
    while True:
        pids = _netns_pids(netns)
        if not pids:
            return
        _kill([pid for pid in pids if _is_holder(pid)] or pids)
        if time.monotonic() > deadline:
            raise RehearsalError(f"processes {pids} in network namespace {netns} survived SIGKILL for "
                                 f"{_KILL_TIMEOUT_S:.0f} s")
        time.sleep(0.05)


def teardown_leftovers(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Remove everything a rehearsal with this prefix left (a crashed run's, or a live one's): kill every
    process in its hosts, delete the links, bridge and namespaces and its folder. Returns what it removed;
    safe to call when nothing is there."""
    prefix = _check_prefix(prefix)
    lacking = missing()
    if lacking:
        # Without root the namespaces may be there but neither fully seen nor removable.
        raise RehearsalError("removing the rehearsal needs " + "; ".join(lacking))
    removed = []
    namespaces = _netns_list(prefix)
    for ns in namespaces:
        pids = _netns_pids(ns)
        _kill_netns_processes(ns)
        removed += [f"process {pid} in {ns}" for pid in pids]
    orphans = _marked_processes(prefix)
    if orphans:
        # PID 1s first, so their namespaces' other processes die with them.
        _kill(sorted(orphans, key=lambda pid: not _is_holder(pid)))
        removed += [f"holder process {pid}" for pid in orphans]
    # The machine's ends of the veth pairs (deleting one end deletes the pair), then the bridge.
    for link in sorted(_links(prefix), key=lambda name: name == _bridge_name(prefix)):
        _sh(["ip", "link", "del", link], f"deleting link {link}")
        removed.append(f"link {link}")
    for ns in namespaces:
        _sh(["ip", "netns", "del", ns], f"deleting network namespace {ns}")
        removed.append(f"network namespace {ns}")
    if _state_dir(prefix).exists():
        shutil.rmtree(_state_dir(prefix))
        removed.append(f"folder {_state_dir(prefix)}")
    return removed


# --- the hosts --------------------------------------------------------------------------------------------

class Hosts:
    """`n` hosts, `head`, `worker1`, ...: made by `create()` (or entering `with`), removed by `teardown()`
    (or leaving it). `run` and `popen` start commands inside a host. `sshd`: every host runs an SSH
    server on its bridge address, root logging in with the rehearsal's key (`ssh_argv`)."""

    def __init__(self, n: int, prefix: str = DEFAULT_PREFIX, sshd: bool = False,
                 keep: Sequence[str | Path] | None = None):
        self.prefix = _check_prefix(prefix)
        self.names = host_names(n)
        self.sshd = sshd
        # Folders every host sees as the machine's although they are under /tmp (default: this
        # checkout and its Python environment, wherever they are).
        self._keep_asked = default_keep() if keep is None else list(keep)
        self.keep: list[Path] = []
        self.hosts: dict[str, Host] = {}
        self._holders: list[subprocess.Popen] = []
        self._started: list[subprocess.Popen] = []

    @property
    def addresses(self) -> dict[str, str]:
        return {name: f"{SUBNET}.{i + 1}" for i, name in enumerate(self.names)}

    @property
    def bridge(self) -> str:
        return _bridge_name(self.prefix)

    @property
    def ssh_key(self) -> Path:
        """The private key that logs in as root on every host (on the machine; inside a host it is
        ~/.ssh/id_ed25519)."""
        return _state_dir(self.prefix) / "ssh" / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        """Every host's key, by name and address (on the machine; inside a host, in ~/.ssh/known_hosts)."""
        return _state_dir(self.prefix) / "ssh" / "known_hosts"

    def ssh_argv(self, name: str, user: str = "root") -> list[str]:
        """`ssh` from the machine to host `name` (over the bridge, host key checked); append a command."""
        if not self.sshd:
            raise RehearsalError("these hosts run no SSH server: make them with sshd=True (`up --sshd`)")
        address = self.addresses[self._host(name).name]
        return ["ssh", "-i", str(self.ssh_key), "-o", f"UserKnownHostsFile={self.known_hosts}",
                "-o", "StrictHostKeyChecking=yes", "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
                "-o", "ConnectTimeout=10", f"{user}@{address}"]

    @classmethod
    def attach(cls, prefix: str = DEFAULT_PREFIX) -> Hosts:
        """The hosts another process made with this prefix (read from the machine), to run commands in.
        `teardown()` on it removes them too."""
        prefix = _check_prefix(prefix)
        state = _state_dir(prefix) / "hosts.json"
        if not state.exists():
            raise RehearsalError(f"no rehearsal hosts with prefix {prefix!r} ({state} does not exist): "
                                 "make them first (`up`)")
        saved = json.loads(state.read_text())
        names = saved["hosts"]
        hosts = cls(len(names), prefix, sshd=saved.get("sshd", False))
        for name, address in hosts.addresses.items():
            netns = _netns_name(prefix, name)
            holder = _holder_of(netns)
            if holder is None:
                raise RehearsalError(f"host {name}: no holder process in network namespace {netns} (a "
                                     "crashed run?); remove the leftovers (`down`) and make the hosts again")
            hosts.hosts[name] = Host(name, address, netns, _veth_name(prefix, name), holder)
        return hosts

    def create(self) -> Hosts:
        """Make the bridge and every host (and their SSH servers). On any failure, removes whatever it
        made, then raises."""
        check_can_run(self.sshd)
        self.keep = _kept(self._keep_asked)
        there = leftovers(self.prefix)
        if there:
            raise RehearsalError(f"a rehearsal with prefix {self.prefix!r} is already there ({', '.join(there)}); "
                                 "remove it first (`teardown_leftovers`, or the command line's `down`)")
        self._check_subnet_free()
        try:
            self._create()
        except BaseException:
            self.teardown()
            raise
        return self

    def _check_subnet_free(self) -> None:
        """The machine must not already use the hosts' subnet (a VPN, another network): the bridge's route
        would take its traffic."""
        out = _sh(["ip", "-o", "-4", "addr", "show"], "listing the machine's addresses")
        taken = [line.split()[1] + " " + line.split()[3] for line in out.splitlines()
                 if f" {SUBNET}." in line]
        routes = _sh(["ip", "-4", "route", "show", "match", f"{SUBNET}.0/24"], "listing routes")
        local = [r for r in routes.splitlines() if not r.startswith("default")]
        if taken or local:
            raise RehearsalError(f"the machine already uses {SUBNET}.0/24 ({'; '.join(taken + local)}): the "
                                 "rehearsal's bridge would take that traffic")

    def _create(self) -> None:
        state = _state_dir(self.prefix)
        state.mkdir(mode=0o755, parents=True)
        # Written first: `attach` and `teardown_leftovers` key on the folder, even after a partial create.
        (state / "hosts.json").write_text(json.dumps({"hosts": self.names, "addresses": self.addresses,
                                                      "sshd": self.sshd}))
        hosts_file = state / "hosts"
        hosts_file.write_text("127.0.0.1\tlocalhost\n"
                              + "".join(f"{addr}\t{name}\n" for name, addr in self.addresses.items()))
        bridge = self.bridge
        _sh(["ip", "link", "add", bridge, "type", "bridge"], f"making the bridge {bridge}")
        _write_sysctl(f"/proc/sys/net/ipv6/conf/{bridge}/disable_ipv6", "1")
        _sh(["ip", "addr", "add", f"{BRIDGE_ADDRESS}/24", "dev", bridge], f"addressing the bridge {bridge}")
        _sh(["ip", "link", "set", bridge, "up"], f"bringing the bridge {bridge} up")
        for name, address in self.addresses.items():
            self.hosts[name] = self._create_host(name, address, hosts_file)
        if self.sshd:
            self._start_sshds()

    def _create_host(self, name: str, address: str, hosts_file: Path) -> Host:
        netns, veth = _netns_name(self.prefix, name), _veth_name(self.prefix, name)
        _sh(["ip", "netns", "add", netns], f"host {name}: making network namespace {netns} (network "
            "namespaces need CAP_SYS_ADMIN; a container may not grant it)")
        holder = self._start_holder(name, netns, hosts_file)
        # The veth's far end is made directly inside the host, as its eth0.
        _sh(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns],
            f"host {name}: making its link {veth}")
        _write_sysctl(f"/proc/sys/net/ipv6/conf/{veth}/disable_ipv6", "1")
        _sh(["ip", "link", "set", veth, "master", self.bridge, "up"], f"host {name}: joining {veth} to the bridge")
        # Only the address: the kernel adds the /24's route and nothing else, so there is no default route.
        _sh(["ip", "-n", netns, "addr", "add", f"{address}/24", "dev", "eth0"], f"host {name}: addressing eth0")
        _sh(["ip", "-n", netns, "link", "set", "eth0", "up"], f"host {name}: bringing eth0 up")
        _sh(["ip", "-n", netns, "link", "set", "lo", "up"], f"host {name}: bringing lo up")
        return Host(name, address, netns, veth, holder)

    def _start_holder(self, name: str, netns: str, hosts_file: Path) -> int:
        log = _state_dir(self.prefix) / f"{name}.holder.log"
        with open(log, "w") as err:
            # Its own session: a Ctrl-C in the terminal that ran `up` does not reach the hosts.
            proc = subprocess.Popen(
                ["ip", "netns", "exec", netns, "unshare", "--pid", "--mount", "--uts", "--ipc", "--fork",
                 "--mount-proc", "sh", "-c", _HOLDER_SCRIPT, "holder", str(hosts_file), name,
                 str(_state_dir(self.prefix) / f"{name}.kept"), *map(str, self.keep)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, start_new_session=True,
                env={**os.environ, _HOLDER_MARK: self.prefix})
        self._holders.append(proc)
        ready, _, _ = select.select([proc.stdout], [], [], _STARTUP_TIMEOUT_S)
        line = proc.stdout.readline() if ready else b""
        proc.stdout.close()
        if line.strip() != b"ready":
            problem = log.read_text().strip() or (f"not ready after {_STARTUP_TIMEOUT_S:.0f} s" if not ready
                                                  else f"exited {proc.poll()}")
            raise RehearsalError(f"host {name}: its holder (unshare --pid --mount --uts --ipc in {netns}) "
                                 f"failed: {problem}")
        holder = _holder_of(netns)
        if holder is None:
            raise RehearsalError(f"host {name}: its holder said ready but no PID 1 is in {netns}")
        return holder

    # --- SSH servers -----------------------------------------------------------------------------------

    def _start_sshds(self) -> None:
        """One key pair for root on every host, one host key per host, then one sshd per host, each
        listening on its bridge address only. Returns once every server accepts connections."""
        keys = self.ssh_key.parent
        keys.mkdir(mode=0o700)
        _sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{self.prefix}-rehearsal root",
             "-f", str(self.ssh_key)], "making the rehearsal's SSH key pair")
        for name in self.names:
            _sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{self.prefix}-rehearsal {name}",
                 "-f", str(keys / f"{name}_host_key")], f"host {name}: making its SSH host key")
        self.known_hosts.write_text("".join(
            f"{name},{address} {' '.join((keys / f'{name}_host_key.pub').read_text().split()[:2])}\n"
            for name, address in self.addresses.items()))
        sshd = sshd_path()
        servers = {name: self._start_sshd(name, sshd) for name in self.names}
        for name, proc in servers.items():
            self._wait_sshd(name, proc)

    def _start_sshd(self, name: str, sshd: str) -> subprocess.Popen:
        address = self.addresses[name]
        keys = self.ssh_key.parent
        config = "\n".join([
            f"ListenAddress {address}:{SSH_PORT}",
            f"HostKey {_SSHD_DIR}/host_key",
            f"AuthorizedKeysFile {_SSHD_DIR}/authorized_keys",
            f"PidFile {_SSHD_DIR}/sshd.pid",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            # No PAM: nothing of the machine's login configuration runs, and root's key is all it takes.
            "UsePAM no",
            "X11Forwarding no",
            "PrintMotd no",
            # The launcher multiplexes its commands and file syncs over one connection per host.
            "MaxSessions 64",
            "Subsystem sftp internal-sftp",
        ]) + "\n"
        files = {"XM_CONFIG": config,
                 "XM_HOST_KEY": (keys / f"{name}_host_key").read_text(),
                 "XM_AUTHORIZED": self.ssh_key.with_suffix(".pub").read_text(),
                 "XM_CLIENT_KEY": self.ssh_key.read_text(),
                 "XM_CLIENT_PUB": self.ssh_key.with_suffix(".pub").read_text(),
                 "XM_KNOWN_HOSTS": self.known_hosts.read_text()}
        # Written inside the host: its /run and /root are its own, so the files go with it. /run/sshd is
        # the server's privilege separation folder (Debian's sshd refuses to start without it).
        self.run(name, ["sh", "-c", f"""set -e
umask 077
mkdir -p /run/sshd {_SSHD_DIR} /root/.ssh
chmod 755 /run/sshd
printf %s "$XM_CONFIG" > {_SSHD_DIR}/sshd_config
printf %s "$XM_HOST_KEY" > {_SSHD_DIR}/host_key
printf %s "$XM_AUTHORIZED" > {_SSHD_DIR}/authorized_keys
printf %s "$XM_CLIENT_KEY" > /root/.ssh/id_ed25519
printf %s "$XM_CLIENT_PUB" > /root/.ssh/id_ed25519.pub
printf %s "$XM_KNOWN_HOSTS" >> /root/.ssh/known_hosts
"""], env=files, timeout=30)
        self.run(name, [sshd, "-t", "-f", f"{_SSHD_DIR}/sshd_config"], timeout=30)
        log = _state_dir(self.prefix) / f"{name}.sshd.log"
        with open(log, "w") as out:
            # -D: stays in the foreground (dies with the host); -e: its log to the file above.
            return self.popen(name, [sshd, "-D", "-e", "-f", f"{_SSHD_DIR}/sshd_config"], stdout=out,
                              stderr=subprocess.STDOUT)

    def _wait_sshd(self, name: str, proc: subprocess.Popen) -> None:
        address = self.addresses[name]
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while True:
            try:
                socket.create_connection((address, SSH_PORT), timeout=1).close()
                return
            except OSError as e:
                log = _state_dir(self.prefix) / f"{name}.sshd.log"
                if proc.poll() is not None or time.monotonic() > deadline:
                    said = log.read_text().strip() if log.exists() else ""
                    raise RehearsalError(f"host {name}: its sshd does not accept connections on {address}:"
                                         f"{SSH_PORT} ({'exited ' + str(proc.returncode) if proc.poll() is not None else e}): "
                                         f"{said or 'no output'}") from e
                time.sleep(0.05)

    # --- inside a host ---------------------------------------------------------------------------------

    def _host(self, name: str) -> Host:
        host = self.hosts.get(name)
        if host is None:
            raise RehearsalError(f"no host {name!r}; the hosts are {', '.join(self.names)}")
        if not _is_holder(host.holder):
            raise RehearsalError(f"host {name}: its holder {host.holder} is gone; remove the leftovers and "
                                 "make the hosts again")
        return host

    def enter_argv(self, name: str, cwd: str | None = None) -> list[str]:
        """The command prefix that runs a program inside host `name` (all its namespaces)."""
        host = self._host(name)
        argv = ["nsenter", f"--target={host.holder}", "--net", "--pid", "--mount", "--uts", "--ipc"]
        # Entering the mount namespace moves the working directory to the host's /, unless given (a path
        # seen inside the host: its /tmp is not the machine's).
        if cwd is not None:
            argv.append(f"--wdns={cwd}")
        return [*argv, "--"]

    def environment(self, name: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """The caller's environment with `env` on top. TMPDIR goes: the machine's is not the host's."""
        merged = {k: v for k, v in os.environ.items() if k != "TMPDIR"}
        merged["HOSTNAME"] = name
        merged.update(env or {})
        return merged

    def run(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None, check: bool = True,
            timeout: float | None = None, cwd: str | None = None, input: str | None = None,
            ) -> subprocess.CompletedProcess:
        """Run `argv` inside host `name` and wait; output captured as text. `env`: added to this process's
        environment. `check`: raise RehearsalError (with the output) when it exits non-zero."""
        full = [*self.enter_argv(name, cwd), *argv]
        try:
            out = subprocess.run(full, env=self.environment(name, env), capture_output=True, text=True,
                                 timeout=timeout, input=input, stdin=None if input is not None else subprocess.DEVNULL)
        except subprocess.TimeoutExpired as e:
            raise RehearsalError(f"host {name}: `{' '.join(argv)}` still running after {timeout} s; "
                                 f"output so far: {e.stdout!r} {e.stderr!r}") from e
        if check and out.returncode != 0:
            raise RehearsalError(f"host {name}: `{' '.join(argv)}` exited {out.returncode}:\n"
                                 f"{out.stdout}{out.stderr}")
        return out

    def popen(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
              cwd: str | None = None, **kwargs) -> subprocess.Popen:
        """Start `argv` inside host `name` (a long-running process, e.g. `ray start --block`) and return at
        once; `kwargs` go to subprocess.Popen (stdout, stderr, ...). `teardown()` kills it with the host."""
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen([*self.enter_argv(name, cwd), *argv], env=self.environment(name, env),
                                start_new_session=True, **kwargs)
        self._started.append(proc)
        return proc

    # --- removal ---------------------------------------------------------------------------------------

    def teardown(self) -> list[str]:
        """Kill every process in every host, delete the namespaces, links and bridge: everything with this
        prefix, whether this object made it or a crashed run did. Safe to call more than once."""
        removed = teardown_leftovers(self.prefix)
        # Reap what this process started (their hosts are gone, so they have exited or will at once).
        for proc in self._started + self._holders:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        self._started, self._holders = [], []
        self.hosts = {}
        return removed

    def __enter__(self) -> Hosts:
        return self.create()

    def __exit__(self, *exc) -> None:
        self.teardown()
