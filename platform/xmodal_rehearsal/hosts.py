"""The hosts: `Hosts` makes them (a holder process per host in fresh namespaces, a link to the bridge,
optionally an SSH server), runs commands inside them and removes them; `attach` finds hosts another
process made.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from xmodal_rehearsal.machine import (
    BRIDGE_ADDRESS,
    DEFAULT_PREFIX,
    HOLDER_MARK,
    SUBNET,
    RehearsalError,
    bridge_name,
    check_can_run,
    check_prefix,
    holder_of,
    host_names,
    is_holder,
    leftovers,
    netns_name,
    sh,
    sshd_path,
    state_dir,
    teardown_leftovers,
    veth_name,
    write_sysctl,
)

SSH_PORT = 22
_SSHD_DIR = "/run/rehearsal-sshd"  # inside each host (its own /run): the server's config, key, log
_STARTUP_TIMEOUT_S = 15.0

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


@dataclass(frozen=True)
class Host:
    name: str  # also its hostname
    address: str
    netns: str
    veth: str  # the machine's end of the host's link; the host's end is its eth0
    holder: int  # pid (on the machine) of the process holding the host's namespaces


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


class Hosts:
    """`n` hosts, `head`, `worker1`, ...: made by `create()` (or entering `with`), removed by `teardown()`
    (or leaving it). `run` and `popen` start commands inside a host. `sshd`: every host runs an SSH
    server on its bridge address, root logging in with the rehearsal's key (`ssh_argv`)."""

    def __init__(self, n: int, prefix: str = DEFAULT_PREFIX, sshd: bool = False,
                 keep: Sequence[str | Path] | None = None):
        self.prefix = check_prefix(prefix)
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
        return bridge_name(self.prefix)

    @property
    def ssh_key(self) -> Path:
        """The private key that logs in as root on every host (on the machine; inside a host it is
        ~/.ssh/id_ed25519)."""
        return state_dir(self.prefix) / "ssh" / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        """Every host's key, by name and address (on the machine; inside a host, in ~/.ssh/known_hosts)."""
        return state_dir(self.prefix) / "ssh" / "known_hosts"

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
        prefix = check_prefix(prefix)
        state = state_dir(prefix) / "hosts.json"
        if not state.exists():
            raise RehearsalError(f"no rehearsal hosts with prefix {prefix!r} ({state} does not exist): "
                                 "make them first (`up`)")
        saved = json.loads(state.read_text())
        names = saved["hosts"]
        hosts = cls(len(names), prefix, sshd=saved.get("sshd", False))
        for name, address in hosts.addresses.items():
            netns = netns_name(prefix, name)
            holder = holder_of(netns)
            if holder is None:
                raise RehearsalError(f"host {name}: no holder process in network namespace {netns} (a "
                                     "crashed run?); remove the leftovers (`down`) and make the hosts again")
            hosts.hosts[name] = Host(name, address, netns, veth_name(prefix, name), holder)
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
        out = sh(["ip", "-o", "-4", "addr", "show"], "listing the machine's addresses")
        taken = [line.split()[1] + " " + line.split()[3] for line in out.splitlines()
                 if f" {SUBNET}." in line]
        routes = sh(["ip", "-4", "route", "show", "match", f"{SUBNET}.0/24"], "listing routes")
        local = [r for r in routes.splitlines() if not r.startswith("default")]
        if taken or local:
            raise RehearsalError(f"the machine already uses {SUBNET}.0/24 ({'; '.join(taken + local)}): the "
                                 "rehearsal's bridge would take that traffic")

    def _create(self) -> None:
        state = state_dir(self.prefix)
        state.mkdir(mode=0o755, parents=True)
        # Written first: `attach` and `teardown_leftovers` key on the folder, even after a partial create.
        (state / "hosts.json").write_text(json.dumps({"hosts": self.names, "addresses": self.addresses,
                                                      "sshd": self.sshd}))
        hosts_file = state / "hosts"
        hosts_file.write_text("127.0.0.1\tlocalhost\n"
                              + "".join(f"{addr}\t{name}\n" for name, addr in self.addresses.items()))
        bridge = self.bridge
        sh(["ip", "link", "add", bridge, "type", "bridge"], f"making the bridge {bridge}")
        write_sysctl(f"/proc/sys/net/ipv6/conf/{bridge}/disable_ipv6", "1")
        sh(["ip", "addr", "add", f"{BRIDGE_ADDRESS}/24", "dev", bridge], f"addressing the bridge {bridge}")
        sh(["ip", "link", "set", bridge, "up"], f"bringing the bridge {bridge} up")
        for name, address in self.addresses.items():
            self.hosts[name] = self._create_host(name, address, hosts_file)
        if self.sshd:
            self._start_sshds()

    def _create_host(self, name: str, address: str, hosts_file: Path) -> Host:
        netns, veth = netns_name(self.prefix, name), veth_name(self.prefix, name)
        sh(["ip", "netns", "add", netns], f"host {name}: making network namespace {netns} (network "
            "namespaces need CAP_SYS_ADMIN; a container may not grant it)")
        holder = self._start_holder(name, netns, hosts_file)
        # The veth's far end is made directly inside the host, as its eth0.
        sh(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns],
            f"host {name}: making its link {veth}")
        write_sysctl(f"/proc/sys/net/ipv6/conf/{veth}/disable_ipv6", "1")
        sh(["ip", "link", "set", veth, "master", self.bridge, "up"], f"host {name}: joining {veth} to the bridge")
        # Only the address: the kernel adds the /24's route and nothing else, so there is no default route.
        sh(["ip", "-n", netns, "addr", "add", f"{address}/24", "dev", "eth0"], f"host {name}: addressing eth0")
        sh(["ip", "-n", netns, "link", "set", "eth0", "up"], f"host {name}: bringing eth0 up")
        sh(["ip", "-n", netns, "link", "set", "lo", "up"], f"host {name}: bringing lo up")
        return Host(name, address, netns, veth, holder)

    def _start_holder(self, name: str, netns: str, hosts_file: Path) -> int:
        log = state_dir(self.prefix) / f"{name}.holder.log"
        with open(log, "w") as err:
            # Its own session: a Ctrl-C in the terminal that ran `up` does not reach the hosts.
            proc = subprocess.Popen(
                ["ip", "netns", "exec", netns, "unshare", "--pid", "--mount", "--uts", "--ipc", "--fork",
                 "--mount-proc", "sh", "-c", _HOLDER_SCRIPT, "holder", str(hosts_file), name,
                 str(state_dir(self.prefix) / f"{name}.kept"), *map(str, self.keep)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, start_new_session=True,
                env={**os.environ, HOLDER_MARK: self.prefix})
        self._holders.append(proc)
        ready, _, _ = select.select([proc.stdout], [], [], _STARTUP_TIMEOUT_S)
        line = proc.stdout.readline() if ready else b""
        proc.stdout.close()
        if line.strip() != b"ready":
            problem = log.read_text().strip() or (f"not ready after {_STARTUP_TIMEOUT_S:.0f} s" if not ready
                                                  else f"exited {proc.poll()}")
            raise RehearsalError(f"host {name}: its holder (unshare --pid --mount --uts --ipc in {netns}) "
                                 f"failed: {problem}")
        holder = holder_of(netns)
        if holder is None:
            raise RehearsalError(f"host {name}: its holder said ready but no PID 1 is in {netns}")
        return holder

    # --- SSH servers -----------------------------------------------------------------------------------

    def _start_sshds(self) -> None:
        """One key pair for root on every host, one host key per host, then one sshd per host, each
        listening on its bridge address only. Returns once every server accepts connections."""
        keys = self.ssh_key.parent
        keys.mkdir(mode=0o700)
        sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{self.prefix}-rehearsal root",
             "-f", str(self.ssh_key)], "making the rehearsal's SSH key pair")
        for name in self.names:
            sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{self.prefix}-rehearsal {name}",
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
        log = state_dir(self.prefix) / f"{name}.sshd.log"
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
                log = state_dir(self.prefix) / f"{name}.sshd.log"
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
        if not is_holder(host.holder):
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
