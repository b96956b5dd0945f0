"""Hosts of a one-machine cluster rehearsal (platform/xmodal_rehearsal/): real namespaces, a real bridge and
real sockets, so root only. Every test removes what it made, even when it fails, and first removes what
a crashed earlier run left."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

import xmodal_rehearsal as rehearsal
from xmodal_rehearsal import Hosts, RehearsalError, machine
from xmodal_rehearsal.hosts import _kept
from xmodal_testing import held

REASON = rehearsal.unavailable_reason()
needs_hosts = pytest.mark.skipif(REASON is not None, reason=f"host rehearsal unavailable: {REASON}")

# Not the command line's prefix: a test never removes a rehearsal someone is running by hand.
PREFIX = "xmt"
PYTHON = sys.executable
REPO = Path(__file__).resolve().parents[1]
# TEST-NET-2 (RFC 5737): documentation only, never routed; the hosts have no route to it anyway.
OUTSIDE = "198.51.100.1"


def nothing_left() -> None:
    """No namespace, link, process or folder of the prefix on the machine, seen with the system's tools."""
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not [line for line in netns.splitlines() if line.startswith(f"{PREFIX}-")], netns
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    assert not [line for line in links.splitlines() if f" {PREFIX}v-" in line or f" {PREFIX}br0" in line], links
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    assert f"/run/{PREFIX}-rehearsal" not in ps, ps
    assert rehearsal.leftovers(PREFIX) == []
    assert not Path(f"/run/{PREFIX}-rehearsal").exists()


def netns_pids() -> list[int]:
    pids = []
    for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith(f"{PREFIX}-"):
            out = subprocess.run(["ip", "netns", "pids", line.split()[0]], capture_output=True, text=True)
            pids += [int(p) for p in out.stdout.split()]
    return pids


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def hosts():
    rehearsal.teardown_leftovers(PREFIX)
    made = Hosts(2, PREFIX)
    try:
        yield made.create()
    finally:
        made.teardown()


def py(hosts: Hosts, host: str, code: str, **kwargs) -> str:
    return hosts.run(host, [PYTHON, "-c", textwrap.dedent(code)], timeout=60, **kwargs).stdout.strip()


def test_what_is_missing_is_named(monkeypatch):
    """Runs anywhere: the one error says what the machine lacks (root, commands), before anything is made."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(machine.shutil, "which", lambda cmd: None if cmd in ("nsenter", "ip") else "/bin/" + cmd)
    monkeypatch.setattr(machine.sys, "platform", "linux")
    with pytest.raises(RehearsalError) as err:
        Hosts(2, PREFIX).create()
    assert str(err.value) == ("the rehearsal needs root (it makes network namespaces, a bridge and mounts; run "
                              "it with sudo); the commands ip (iproute2), nsenter (util-linux) on PATH")
    with pytest.raises(RehearsalError, match="removing the rehearsal needs root"):
        rehearsal.teardown_leftovers(PREFIX)
    with pytest.raises(RehearsalError, match="prefix 'xm-long'"):
        Hosts(2, "xm-long")
    with pytest.raises(RehearsalError, match="hosts: 0; expected 1 to 50"):
        Hosts(0, PREFIX)


@needs_hosts
def test_each_host_has_its_own_address_and_name(hosts):
    for name, address in (("head", "10.231.0.1"), ("worker1", "10.231.0.2")):
        assert hosts.run(name, ["hostname"]).stdout.strip() == name
        addrs = hosts.run(name, ["ip", "-4", "-o", "addr", "show"]).stdout
        found = sorted(line.split()[3] for line in addrs.splitlines())
        assert found == sorted(["127.0.0.1/8", f"{address}/24"]), addrs
        # Its own PID namespace: the holder is PID 1 and the machine's processes are not seen.
        ps = hosts.run(name, ["ps", "-eo", "pid,args"]).stdout
        assert ps.splitlines()[1].split()[:3] == ["1", "sh", "-c"], ps
        assert str(os.getpid()) not in ps.split()


@needs_hosts
def test_host_names_resolve_to_bridge_addresses(hosts):
    for name in hosts.names:
        seen = json.loads(py(hosts, name, """
            import json, socket
            print(json.dumps({n: socket.gethostbyname(n) for n in ("head", "worker1", socket.gethostname())}))
        """))
        assert seen == {"head": "10.231.0.1", "worker1": "10.231.0.2", name: hosts.addresses[name]}
        assert hosts.run(name, ["getent", "hosts", "worker1"]).stdout.split() == ["10.231.0.2", "worker1"]


@needs_hosts
def test_one_host_reaches_another_over_tcp(hosts):
    server = hosts.popen("worker1", [PYTHON, "-c", textwrap.dedent("""
        import socket
        s = socket.create_server(("10.231.0.2", 7001))
        conn, peer = s.accept()
        conn.sendall(f"{socket.gethostname()} saw {peer[0]}".encode())
        conn.close()
    """)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        reply = py(hosts, "head", """
            import socket, time
            for _ in range(100):  # until the server listens
                try:
                    c = socket.create_connection(("worker1", 7001), timeout=5)
                    break
                except ConnectionRefusedError:
                    time.sleep(0.05)
            print(c.recv(100).decode())
        """)
        assert reply == "worker1 saw 10.231.0.1"
        assert server.wait(timeout=10) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


@needs_hosts
def test_tmp_run_shm_and_home_are_private_to_each_host(hosts):
    for folder in ("/tmp", "/run", "/dev/shm", "/root"):
        marker = f"{folder}/{PREFIX}-marker-{uuid.uuid4().hex}"
        hosts.run("head", ["sh", "-c", f"echo here > {marker}"])
        assert hosts.run("head", ["cat", marker]).stdout == "here\n"
        assert hosts.run("worker1", ["test", "-e", marker], check=False).returncode == 1, marker
        assert not Path(marker).exists(), marker
    # /tmp starts empty (a fresh Ray session folder) but for the folders the hosts keep (this checkout
    # and its environment, when they are under /tmp); /root reads the machine's through.
    kept = sorted({p.relative_to("/tmp").parts[0] for p in hosts.keep})
    assert hosts.run("worker1", ["ls", "-A", "/tmp"]).stdout.split() == kept
    assert hosts.run("worker1", ["stat", "-f", "-c", "%T", "/root"]).stdout.strip() == "overlayfs"
    assert hosts.run("worker1", ["test", "-x", PYTHON], check=False).returncode == 0


def test_a_host_file_holds_the_hosts_lock_and_a_dead_holder_frees_a_lock():
    """Runs anywhere: while this file runs, another pytest run's host file waits (tests/conftest.py: they
    all take 10.231.0.0/24); a lock another process holds times out naming itself, and is free again once
    that process is killed, with nothing to clean up."""
    probe = "from xmodal_testing import held\nwith held({name!r}, {timeout}, poll=0.05):\n    print('held', flush=True)\n"
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests")}
    taken = subprocess.run([PYTHON, "-c", probe.format(name="xmodal-rehearsal-test-hosts", timeout=0.3)],
                           env=env, capture_output=True, text=True)
    assert taken.returncode == 1 and "was still held after 0 s" in taken.stderr, taken.stderr

    name = f"xmodal-test-lock-{uuid.uuid4().hex}"
    holder = subprocess.Popen([PYTHON, "-c", probe.format(name=name, timeout=5) + "    input()\n"], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(TimeoutError, match=rf"the lock '{name}' .* was still held after 0 s"):
            with held(name, 0.2, poll=0.05):
                pass
    finally:
        holder.kill()
        holder.wait()
    with held(name, 5, poll=0.05):
        with pytest.raises(TimeoutError):
            with held(name, 0, poll=0.05):
                pass


def test_the_folders_kept_are_those_a_host_would_not_see(tmp_path):
    """Runs anywhere: what is under the hosts' own /tmp is kept (once, the outermost); what is elsewhere
    they see already; a folder under their own /run or /dev/shm cannot be given to them: refused."""
    outer = Path("/tmp") / f"{PREFIX}-keep-{uuid.uuid4().hex}"
    (outer / ".venv").mkdir(parents=True)
    try:
        assert _kept([outer / ".venv", "/usr", outer]) == [outer]
        assert _kept(["/usr", "/var/tmp"]) == []
    finally:
        shutil.rmtree(outer)
    with pytest.raises(RehearsalError, match=r"/run/xmodal-venv is under /run, which every host mounts empty"):
        _kept(["/run/xmodal-venv"])
    with pytest.raises(RehearsalError, match=r"/tmp is under /tmp"):
        _kept(["/tmp"])
    defaults = rehearsal.default_keep()
    assert REPO in defaults and Path(sys.prefix) in defaults


@needs_hosts
def test_a_checkout_under_tmp_and_its_environment_work_in_every_host(tmp_path):
    """A checkout under the machine's /tmp with its virtual environment in it (a clean clone's `.venv`): its
    interpreter and code run in every host, reading and writing the machine's folder, while the rest
    of the host's /tmp stays its own. By default: the rehearsal is made by that checkout's own Python."""
    rehearsal.teardown_leftovers(PREFIX)
    checkout = Path(tempfile.mkdtemp(prefix=f"{PREFIX}-checkout-", dir="/tmp"))
    try:
        # The package alone (no xmodal beside it): it runs on the standard library.
        shutil.copytree(REPO / "platform" / "xmodal_rehearsal", checkout / "platform" / "xmodal_rehearsal",
                        ignore=shutil.ignore_patterns("__pycache__"))
        subprocess.run([PYTHON, "-m", "venv", "--without-pip", str(checkout / ".venv")], check=True, timeout=120)
        made = subprocess.run([str(checkout / ".venv" / "bin" / "python"), "-c", textwrap.dedent(f"""
            import json, sys
            from xmodal_rehearsal import Hosts
            hosts = Hosts(2, {PREFIX!r}).create()
            try:
                seen = {{name: hosts.run(name, [sys.executable, "-c", "import sys, xmodal_rehearsal.hosts as r; "
                                                "open(r.__file__ + '.' + sys.argv[1], 'w'); print(sys.prefix)",
                                                name], env={{"PYTHONPATH": sys.path[1]}}).stdout.strip()
                        for name in hosts.names}}
                tmp = hosts.run("worker1", ["ls", "-A", "/tmp"]).stdout.split()
                print(json.dumps({{"keep": [str(p) for p in hosts.keep], "seen": seen, "tmp": tmp}}))
            finally:
                hosts.teardown()
        """)], env={**os.environ, "PYTHONPATH": str(checkout / "platform")}, capture_output=True, text=True,
            timeout=120)
        assert made.returncode == 0, made.stderr
        out = json.loads(made.stdout)
        assert out["keep"] == [str(checkout)]
        assert out["seen"] == {"head": str(checkout / ".venv"), "worker1": str(checkout / ".venv")}
        assert out["tmp"] == [checkout.name]
        # What the hosts wrote there is in the machine's folder.
        assert sorted(p.name for p in (checkout / "platform" / "xmodal_rehearsal").glob("hosts.py.*")) == \
            ["hosts.py.head", "hosts.py.worker1"]
    finally:
        shutil.rmtree(checkout, ignore_errors=True)
        rehearsal.teardown_leftovers(PREFIX)
    nothing_left()


@needs_hosts
def test_a_host_reaches_nothing_outside(hosts):
    for name in hosts.names:
        routes = hosts.run(name, ["ip", "-4", "route", "show"]).stdout.splitlines()
        assert [r.split()[:3] for r in routes] == [["10.231.0.0/24", "dev", "eth0"]], routes
        assert hosts.run(name, ["ip", "-6", "route", "show"]).stdout.strip() == ""
    # Refused by the kernel at once (no route): nothing is sent, there is nothing to time out.
    err = json.loads(py(hosts, "head", f"""
        import json, socket, time
        t = time.monotonic()
        try:
            socket.create_connection(("{OUTSIDE}", 80), timeout=3)
            print(json.dumps([0, time.monotonic() - t]))
        except OSError as e:
            print(json.dumps([e.errno, time.monotonic() - t]))
    """))
    assert err[0] == errno.ENETUNREACH, f"expected 'network unreachable', got {errno.errorcode.get(err[0])}"
    assert err[1] < 1.0


@needs_hosts
def test_the_holder_reaps_orphans_as_an_init_does(hosts):
    # A daemon's parent exits (as `ray start` does): the host's PID 1 adopts it, and reaps it once it
    # exits, instead of leaving a zombie that `ray stop` would wait out as if alive.
    hosts.run("worker1", ["sh", "-c", "sleep 0.3 > /dev/null 2>&1 &"])
    deadline = time.monotonic() + 10
    while True:
        ps = hosts.run("worker1", ["ps", "-eo", "pid=,ppid=,stat=,args="]).stdout
        if not [line for line in ps.splitlines() if "sleep 0.3" in line or line.split()[2].startswith("Z")]:
            break
        assert time.monotonic() < deadline, ps
        time.sleep(0.2)


SSHD_REASON = rehearsal.unavailable_reason(sshd=True)


@pytest.mark.skipif(SSHD_REASON is not None, reason=f"host rehearsal with sshd unavailable: {SSHD_REASON}")
def test_sshd_lets_root_log_into_every_host_on_its_bridge_address_only():
    rehearsal.teardown_leftovers(PREFIX)
    made = Hosts(2, PREFIX, sshd=True)
    try:
        made.create()
        # From the machine, host key checked against the rehearsal's known_hosts.
        out = subprocess.run([*made.ssh_argv("worker1"), "hostname"], capture_output=True, text=True, timeout=60)
        assert (out.returncode, out.stdout.strip()) == (0, "worker1"), out.stderr
        # From the head, as the cluster launcher's head does: its ~/.ssh has the key and the hosts' keys.
        for target in ("worker1", "10.231.0.2"):
            out = made.run("head", ["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", target,
                                    "hostname"], timeout=60)
            assert out.stdout.strip() == "worker1", out.stderr
        for name, address in made.addresses.items():
            listening = made.run(name, ["ss", "-ltnH"]).stdout.split("\n")
            assert [line.split()[3] for line in listening if line.strip()] == [f"{address}:22"], listening
        refused = py(made, "worker1", """
            import socket
            try:
                socket.create_connection(("127.0.0.1", 22), timeout=3)
                print("connected")
            except ConnectionRefusedError:
                print("refused")
        """)
        assert refused == "refused"
        # No password logins, and the key is needed: without it the server turns root away.
        out = subprocess.run(["ssh", "-o", "BatchMode=yes", "-o", f"UserKnownHostsFile={made.known_hosts}",
                              "-o", "IdentitiesOnly=yes", "-o", "IdentityFile=/dev/null", "root@10.231.0.2", "true"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 255 and "Permission denied (publickey)" in out.stderr, out.stderr
    finally:
        made.teardown()
    nothing_left()


@needs_hosts
def test_teardown_removes_every_process_namespace_and_link():
    rehearsal.teardown_leftovers(PREFIX)
    made = Hosts(3, PREFIX)
    try:
        made.create()
        sleeper = made.popen("worker2", ["sleep", "300"])
        made.run("head", ["sh", "-c", "sleep 300 > /dev/null 2>&1 &"])
        pids = netns_pids()
        assert len(pids) >= 7  # a holder and its unshare parent per host, and the two sleeps
    finally:
        made.teardown()
    nothing_left()
    assert not [pid for pid in pids if alive(pid)]
    assert sleeper.poll() is not None
    assert made.teardown() == []  # again: nothing to do


@needs_hosts
def test_a_failed_create_leaves_nothing(monkeypatch):
    rehearsal.teardown_leftovers(PREFIX)
    real = Hosts._create_host

    def second_fails(self, name, address, hosts_file):
        if name == "worker1":
            raise RehearsalError("the second host fails")
        return real(self, name, address, hosts_file)

    monkeypatch.setattr(Hosts, "_create_host", second_fails)
    with pytest.raises(RehearsalError, match="the second host fails"):
        Hosts(3, PREFIX).create()
    nothing_left()


@needs_hosts
def test_a_crashed_run_is_found_and_removed():
    """The hosts outlive the process that made them (the command line's `up`): `attach` runs commands in
    them, a second create is refused with what is there, and `teardown_leftovers` removes it all."""
    rehearsal.teardown_leftovers(PREFIX)
    maker = subprocess.Popen([PYTHON, "-c", textwrap.dedent(f"""
        import time
        from xmodal_rehearsal import Hosts
        Hosts(2, {PREFIX!r}).create()
        print("up", flush=True)
        time.sleep(300)
    """)], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO / "platform")})
    try:
        assert maker.stdout.readline().strip() == "up"
        maker.send_signal(signal.SIGKILL)  # no teardown
        maker.wait()
        found = Hosts.attach(PREFIX)
        assert found.run("worker1", ["hostname"]).stdout.strip() == "worker1"
        with pytest.raises(RehearsalError, match=f"prefix '{PREFIX}' is already there .*network namespace {PREFIX}-head"):
            Hosts(2, PREFIX).create()
        removed = rehearsal.teardown_leftovers(PREFIX)
        assert f"network namespace {PREFIX}-worker1" in removed and f"link {PREFIX}br0" in removed
    finally:
        if maker.poll() is None:
            maker.kill()
            maker.wait()
        rehearsal.teardown_leftovers(PREFIX)
    nothing_left()


@needs_hosts
def test_the_command_line_makes_enters_and_removes_hosts():
    rehearsal.teardown_leftovers(PREFIX)
    script = [PYTHON, str(REPO / "scripts" / "rehearsal_cluster.py"), "--prefix", PREFIX]
    try:
        up = subprocess.run([*script, "up", "--hosts", "2"], capture_output=True, text=True, timeout=60)
        assert up.returncode == 0, up.stderr
        assert "head       10.231.0.1" in up.stdout and "worker1    10.231.0.2" in up.stdout
        assert "run head -- hostname" in up.stdout
        inside = subprocess.run([*script, "run", "worker1", "--", "sh", "-c", "hostname; exit 3"],
                                capture_output=True, text=True, timeout=60)
        assert (inside.returncode, inside.stdout) == (3, "worker1\n")
        again = subprocess.run([*script, "up"], capture_output=True, text=True, timeout=60)
        assert again.returncode == 2 and "is already there" in again.stderr and "Traceback" not in again.stderr
        down = subprocess.run([*script, "down"], capture_output=True, text=True, timeout=60)
        assert down.returncode == 0 and f"removed network namespace {PREFIX}-head" in down.stdout
    finally:
        rehearsal.teardown_leftovers(PREFIX)
    nothing_left()
