"""scripts/check_cluster.py (xmodal/runner/cluster_check.py), the check a user runs before `ray up`, and the head
address node_env.sh checks before it writes anything: each run as a process, as a user or a node runs it.
A good config passes with one line; each bad one is one `error:` line naming the file, key and value, exit
code 2, no traceback, nothing written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from xmodal_testing import PYTHON, REPO

CHECK = REPO / "scripts" / "check_cluster.py"
NODE_ENV = REPO / "scripts" / "cluster" / "node_env.sh"


def run_check(*args: str, cwd: Path = REPO, home: Path | None = None, python: str = PYTHON) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if home is not None:
        env["HOME"] = str(home)
    return subprocess.run([python, str(CHECK), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def one_error(out: subprocess.CompletedProcess, *named: str) -> str:
    shown = f"rc {out.returncode}\n--- stdout\n{out.stdout}\n--- stderr\n{out.stderr}"
    assert out.returncode == 2, shown
    assert "Traceback" not in out.stderr and out.stdout == "", shown
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), shown
    for piece in named:
        assert piece in lines[0], f"{piece!r} not named\n{shown}"
    return lines[0]


@pytest.fixture
def user(tmp_path) -> Path:
    """A user's HOME with the cluster's token and an SSH key, as the docs have them made."""
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("token")
    (home / ".ssh").mkdir()
    (home / ".ssh" / "id_ed25519").write_text("a key")
    return home


def onprem(tmp_path: Path, **provider) -> Path:
    """cluster.onprem.yaml as shipped (its key ~/.ssh/id_ed25519), `provider` keys replaced."""
    cfg = yaml.safe_load((REPO / "cluster.onprem.yaml").read_text())
    cfg["provider"].update(provider)
    path = tmp_path / "onprem.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def test_the_shipped_onprem_config_passes_from_the_repository_root(tmp_path, user):
    before = sorted(p.name for p in tmp_path.iterdir())
    out = run_check(str(REPO / "cluster.onprem.yaml"), home=user)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok (head 192.168.1.10, 2 worker(s)); start it with "
                                       f"`RAY_UP_enable_autoscaler_v2=0 ray up -y {REPO / 'cluster.onprem.yaml'}`")
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


@pytest.mark.parametrize("provider, named", [
    ({"head_ip": "192.168.1.300"}, ["provider.head_ip", "'192.168.1.300'", "not a valid IPv4 address"]),
    ({"worker_ips": ["192.168.1.11", "10.0.0.1.5"]}, ["provider.worker_ips[1]", "'10.0.0.1.5'"]),
    ({"worker_ips": ["192.168.1.11", "bad_name!"]}, ["provider.worker_ips[1]", "'bad_name!'", "host name"]),
    ({"head_ip": "fe80::1"}, ["provider.head_ip", "IPv6"]),
    ({"worker_ips": ["192.168.1.11", "192.168.1.11"]}, ["provider.worker_ips[1]", "'192.168.1.11'",
                                                        "the same machine as provider.worker_ips[0]"]),
    ({"worker_ips": ["192.168.1.10"]}, ["provider.worker_ips[0]", "the same machine as provider.head_ip"]),
    ({"worker_ips": "192.168.1.11"}, ["provider.worker_ips", "expected a list"]),
])
def test_a_bad_or_repeated_address_is_named(tmp_path, user, provider, named):
    config = onprem(tmp_path, **provider)
    one_error(run_check(str(config), home=user), str(config), *named)


def test_every_problem_is_in_the_one_line(tmp_path, user):
    config = onprem(tmp_path, head_ip="192.168.1.300", worker_ips=["192.168.1.11", "192.168.1.11"])
    (user / ".ssh" / "id_ed25519").unlink()
    line = one_error(run_check(str(config), home=user))
    assert "3 problems: (1) provider.head_ip: '192.168.1.300'" in line, line
    assert "(2) provider.worker_ips[1]: '192.168.1.11'" in line and "(3) auth.ssh_private_key" in line, line


def test_a_missing_key_token_or_start_script_is_named(tmp_path, user):
    config = onprem(tmp_path)
    (user / ".ssh" / "id_ed25519").unlink()
    one_error(run_check(str(config), home=user), str(config), "auth.ssh_private_key", "'~/.ssh/id_ed25519'",
              f"no such file ({user / '.ssh' / 'id_ed25519'})")
    (user / ".ssh" / "id_ed25519").write_text("a key")
    (user / ".ray" / "auth_token").unlink()
    one_error(run_check(str(config), home=user), "file_mounts['~/.ray/auth_token']", "ray get-auth-token --generate")

    # A start command that runs a script the synced tree (file_mounts: ~/xmodal is the directory
    # `ray up` runs in) does not hold.
    (user / ".ray" / "auth_token").write_text("token")
    cfg = yaml.safe_load(config.read_text())
    cfg["worker_start_ray_commands"] = ["bash ~/xmodal/scripts/cluster/start_rays.sh ray start --address=x:6379"]
    config.write_text(yaml.safe_dump(cfg))
    one_error(run_check(str(config), home=user), "worker_start_ray_commands[0]",
              "~/xmodal/scripts/cluster/start_rays.sh", str(REPO / "scripts" / "cluster" / "start_rays.sh"))
    # ... and the same config run from elsewhere: the sync's source `.` holds none of the scripts.
    cfg["worker_start_ray_commands"] = yaml.safe_load((REPO / "cluster.onprem.yaml").read_text())["worker_start_ray_commands"]
    config.write_text(yaml.safe_dump(cfg))
    assert run_check(str(config), home=user).returncode == 0
    one_error(run_check(str(config), home=user, cwd=tmp_path), "setup_commands[0]", "node_env.sh")


def test_the_aws_template_is_refused_until_edited_and_a_bad_head_ip_option_is_named(tmp_path, user):
    one_error(run_check(str(REPO / "cluster.yaml"), home=user), "setup_commands[0]",
              "'--storage-path=s3://EDIT-your-bucket/xmodal/runs'", "placeholder")
    cfg = yaml.safe_load((REPO / "cluster.yaml").read_text())
    cfg["setup_commands"][0] = ("bash ~/xmodal/scripts/cluster/node_env.sh --storage-path=s3://b/runs "
                                "--mlflow-artifacts=s3://b/mlflow --head-ip=300.1.1.1")
    config = tmp_path / "aws.yaml"
    config.write_text(yaml.safe_dump(cfg))
    one_error(run_check(str(config), home=user), "setup_commands[0]", "--head-ip", "'300.1.1.1'")
    cfg["setup_commands"][0] = cfg["setup_commands"][0].replace("300.1.1.1", "10.0.0.5")
    config.write_text(yaml.safe_dump(cfg))
    assert run_check(str(config), home=user).returncode == 0


def test_unreadable_yaml_and_a_key_given_twice_are_named(tmp_path, user):
    config = tmp_path / "c.yaml"
    one_error(run_check(str(config), home=user), str(config), "cannot be read")
    config.write_text("provider:\n  type: local\n  head_ip: 10.0.0.1\n  head_ip: 10.0.0.2\n")
    one_error(run_check(str(config), home=user), str(config), "line 4", "'head_ip' given twice")
    config.write_text("provider: [\n")
    one_error(run_check(str(config), home=user), str(config), "not valid YAML")
    config.write_text("- a list\n")
    one_error(run_check(str(config), home=user), str(config), "expected a cluster config")


# ---------------------------------------------------------------- on a node: node_env.sh


def node_env(home: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    base = {"HOME": str(home), "PATH": os.environ["PATH"], **env}
    return subprocess.run(["bash", str(NODE_ENV), "--storage-path=/shared/runs", "--mlflow-artifacts=/shared/mlflow",
                           *args], env=base, capture_output=True, text=True, timeout=60)


def test_node_env_refuses_a_bad_head_ip_and_writes_nothing(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    one_error(node_env(home, "--head-ip=300.1.1.1"), "node_env.sh --head-ip", "'300.1.1.1'",
              "not a valid IPv4 address")
    one_error(node_env(home, "--head-ip=head.example"), "node_env.sh --head-ip", "expected an IPv4 address")
    one_error(node_env(home, RAY_HEAD_IP="10.0.0"), "RAY_HEAD_IP", "'10.0.0'")
    assert list(home.iterdir()) == []  # no ~/xmodal.env, no ~/.bashrc
    out = node_env(home, "--head-ip=10.0.0.5")
    assert out.returncode == 0, out.stderr
    assert "export MLFLOW_TRACKING_URI=http://10.0.0.5:5000\n" in (home / "xmodal.env").read_text()


def test_node_env_on_the_head_refuses_a_bad_head_ip_in_the_launchers_copy_of_the_config(tmp_path):
    """On the head the address comes from ~/ray_bootstrap_config.yaml (JSON, read by the node's bare
    python3): a malformed head_ip there was a silent fallback to `hostname -I`; now it is one error."""
    home = tmp_path / "home"
    home.mkdir()
    bootstrap = home / "ray_bootstrap_config.yaml"
    bootstrap.write_text(json.dumps({"provider": {"type": "local", "head_ip": "192.168.1.300",
                                                  "worker_ips": ["192.168.1.11"]}}))
    one_error(node_env(home), str(bootstrap), "provider.head_ip", "'192.168.1.300'", "launcher's copy")
    assert sorted(p.name for p in home.iterdir()) == ["ray_bootstrap_config.yaml"]
    bootstrap.write_text(json.dumps({"provider": {"type": "local", "head_ip": "localhost", "worker_ips": []}}))
    out = node_env(home)
    assert out.returncode == 0, out.stderr
    assert "export XMODAL_HEAD_IP=127.0.0.1\n" in (home / "xmodal.env").read_text()


@pytest.mark.skipif(shutil.which("python3") is None, reason="no python3 on PATH")
def test_the_node_form_runs_under_a_python_without_the_project(tmp_path):
    """A node runs it before its environment exists: the standard library reads the launcher's JSON."""
    bootstrap = tmp_path / "bootstrap.json"
    bootstrap.write_text(json.dumps({"provider": {"type": "local", "head_ip": "127.0.0.1", "worker_ips": []}}))
    out = subprocess.run([shutil.which("python3"), "-I", str(CHECK), "--on-node", "--print-head-ip", str(bootstrap)],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert (out.returncode, out.stdout) == (0, "127.0.0.1\n"), out.stderr


def test_a_cluster_jobs_mlflow_address_is_one_the_user_can_open(monkeypatch):
    """A job on a cluster logs to the head's private address (node_env.sh), which a user's computer does
    not reach: the address it prints is followed by the same page through the documented SSH tunnel."""
    from xmodal import tracking

    uri, view = "http://10.231.0.10:5000", "/#/experiments?workflowType=machine_learning"
    monkeypatch.delenv("XMODAL_HEAD_IP", raising=False)
    assert tracking.ui_command(uri) == f"open {uri}{view} in a browser (MLflow server)"
    monkeypatch.setenv("XMODAL_HEAD_IP", "10.231.0.10")
    assert tracking.ui_command(uri) == (f"open {uri}{view} in a browser (MLflow server)\n"
                                        f"  or open    http://127.0.0.1:5000{view} through the SSH tunnel "
                                        "(`ray attach CLUSTER.yaml -p 5000`)")
    assert "\n" not in tracking.ui_command("http://mlflow.example.org:8080")  # a server of its own: as it is
