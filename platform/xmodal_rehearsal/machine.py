"""What a rehearsal needs of the machine and leaves on it: whether it can run here (Linux, root, the
commands, the namespaces), the names of everything it makes (each carries the rehearsal's prefix), and
finding and removing what a rehearsal left, this process's or a crashed one's. Standard library only.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

SUBNET = "10.231.0"  # the hosts' /24; host i (from 0) has SUBNET.(i + 1)
BRIDGE_ADDRESS = f"{SUBNET}.254"
DEFAULT_PREFIX = "xm"
MAX_HOSTS = 50  # keeps every name within the kernel's 15 characters with a 4-character prefix
_COMMANDS = {"ip": "iproute2", "unshare": "util-linux", "nsenter": "util-linux", "mount": "util-linux",
             "sh": "a POSIX shell", "sleep": "coreutils", "stat": "coreutils"}
_SSH_COMMANDS = {"ssh-keygen": "openssh-client", "ssh": "openssh-client"}
_NAMESPACES = ("net", "pid", "mnt", "uts", "ipc")
HOLDER_MARK = "XMODAL_REHEARSAL_HOLDER"  # in each holder's environment (value: the prefix), to find it by
_KILL_TIMEOUT_S = 10.0


class RehearsalError(RuntimeError):
    """The rehearsal cannot run here, or a step of making or removing hosts failed; the message names
    what is missing or which command failed, with its error output."""


def host_names(n: int) -> list[str]:
    if not 1 <= n <= MAX_HOSTS:
        raise RehearsalError(f"hosts: {n}; expected 1 to {MAX_HOSTS}")
    return ["head"] + [f"worker{i}" for i in range(1, n)]


def check_prefix(prefix: str) -> str:
    if not re.fullmatch(r"[a-z][a-z0-9]{0,3}", prefix):
        raise RehearsalError(f"prefix {prefix!r}: expected 1 to 4 lowercase letters or digits, starting "
                             "with a letter (every name made must fit the kernel's 15 characters)")
    return prefix


def netns_name(prefix: str, host: str) -> str:
    return f"{prefix}-{host}"


def veth_name(prefix: str, host: str) -> str:
    return f"{prefix}v-{host}"


def bridge_name(prefix: str) -> str:
    return f"{prefix}br0"


def state_dir(prefix: str) -> Path:
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


def sh(argv: Sequence[str], what: str) -> str:
    out = subprocess.run(list(argv), capture_output=True, text=True)
    if out.returncode != 0:
        raise RehearsalError(f"{what}: `{' '.join(argv)}` failed (exit {out.returncode}): "
                             f"{(out.stderr or out.stdout).strip()}")
    return out.stdout


def write_sysctl(path: str, value: str) -> None:
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
    return sorted(n for n in names if n == bridge_name(prefix) or n.startswith(f"{prefix}v-"))


def _netns_pids(netns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split() if p.isdigit()]


def is_holder(pid: int) -> bool:
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


def holder_of(netns: str) -> int | None:
    return next((pid for pid in _netns_pids(netns) if is_holder(pid)), None)


def _marked_processes(prefix: str) -> list[int]:
    """Holders (and their `unshare` parents) by the mark in their environment: found even when their
    network namespace's name is gone (deleted by hand while they still ran)."""
    mark = f"{HOLDER_MARK}={prefix}".encode()
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
    prefix = check_prefix(prefix)
    found = [f"network namespace {ns}" for ns in _netns_list(prefix)]
    found += [f"link {link}" for link in _links(prefix)]
    found += [f"process {pid} in {ns}" for ns in _netns_list(prefix) for pid in _netns_pids(ns)]
    found += [f"holder process {pid}" for pid in _marked_processes(prefix)
              if not any(f"process {pid} in" in f for f in found)]
    if state_dir(prefix).exists():
        found.append(f"folder {state_dir(prefix)}")
    return found


def _kill_netns_processes(netns: str) -> None:
    """The holder first: its PID namespace dying kills every process in the host. Then any other process
    in the network namespace (an nsenter parent, or something joined with `ip netns exec`)."""
    deadline = time.monotonic() + _KILL_TIMEOUT_S
    while True:
        pids = _netns_pids(netns)
        if not pids:
            return
        _kill([pid for pid in pids if is_holder(pid)] or pids)
        if time.monotonic() > deadline:
            raise RehearsalError(f"processes {pids} in network namespace {netns} survived SIGKILL for "
                                 f"{_KILL_TIMEOUT_S:.0f} s")
        time.sleep(0.05)


def teardown_leftovers(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Remove everything a rehearsal with this prefix left (a crashed run's, or a live one's): kill every
    process in its hosts, delete the links, bridge and namespaces and its folder. Returns what it removed;
    safe to call when nothing is there."""
    prefix = check_prefix(prefix)
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
        _kill(sorted(orphans, key=lambda pid: not is_holder(pid)))
        removed += [f"holder process {pid}" for pid in orphans]
    # The machine's ends of the veth pairs (deleting one end deletes the pair), then the bridge.
    for link in sorted(_links(prefix), key=lambda name: name == bridge_name(prefix)):
        sh(["ip", "link", "del", link], f"deleting link {link}")
        removed.append(f"link {link}")
    for ns in namespaces:
        sh(["ip", "netns", "del", ns], f"deleting network namespace {ns}")
        removed.append(f"network namespace {ns}")
    if state_dir(prefix).exists():
        shutil.rmtree(state_dir(prefix))
        removed.append(f"folder {state_dir(prefix)}")
    return removed

