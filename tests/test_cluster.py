"""cluster.yaml, cluster.onprem.yaml and running on a multi-node Ray cluster.

Offline: both configs validate against the installed Ray's autoscaler schema, the commands they run
(and the node scripts under scripts/cluster/ that those call) name files, entry points and flags that
exist, nothing listens on a public interface, the node environment their setup writes is what the
jobs read, and the on-premises config runs the same scripts as the AWS one. The node scripts' start
and stop steps run here against stand-ins for `ray` and `ssh` (tests/test_ray_up.py runs
cluster.onprem.yaml for real, with `ray up` on rehearsal hosts). The rehearsal: the cluster on this
machine, two Ray nodes with token authentication, the head's MLflow server started by cluster.yaml's
own command with its artifacts in S3 (the nodes have no S3 credentials), shared storage both nodes see,
and a sweep of pretraining trials submitted with `ray job submit --working-dir`, each trial's two Train
workers one per node; then the server restarted, its artifacts still served. (A pretraining run's workers on
separate hosts, and the hosts that fail under it: tests/test_cross_host.py.)
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from xmodal import tracking
from xmodal_testing import (
    PYTHON,
    RAY,
    REPO,
    S3_BUCKET,
    RayHead,
    free_port,
    kill_tree,
    s3_environment,
    wait_job,
)

CLUSTER_YAML = REPO / "cluster.yaml"
ONPREM_YAML = REPO / "cluster.onprem.yaml"
CLUSTER_DOC = REPO / "docs" / "cluster.md"  # how to run on the cluster, for a user
VENV_BIN = Path(PYTHON).parent  # the environment scripts/setup.sh builds, as it does on every node
COMMAND_KEYS = ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands",
                "head_start_ray_commands", "worker_start_ray_commands")


@pytest.fixture(scope="module")
def cfg() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


# A node script a command runs; the scripts source lib.sh next to them.
SCRIPT_REF = re.compile(r"~/xmodal/(scripts/cluster/[\w.-]+\.sh)")


def with_scripts(cmds: list[str]) -> list[str]:
    """The commands, then the text of every node script they run (and of lib.sh, which those source)."""
    out, seen = list(cmds), set()
    queue = [ref for c in cmds for ref in SCRIPT_REF.findall(c)]
    while queue:
        path = queue.pop(0)
        if path in seen:
            continue
        seen.add(path)
        assert (REPO / path).exists(), f"the cluster config runs {path}, which the repository does not have"
        text = (REPO / path).read_text()
        out.append(text)
        queue += SCRIPT_REF.findall(text) + (["scripts/cluster/lib.sh"] if '/lib.sh"' in text else [])
    return out


def all_commands(cfg: dict) -> list[str]:
    cmds = [c for key in COMMAND_KEYS for c in cfg.get(key) or []]
    for node_type in (cfg.get("available_node_types") or {}).values():
        cmds += [c for key in ("initialization_commands", "worker_setup_commands") for c in node_type.get(key) or []]
    return with_scripts(cmds)


def command_with(cfg: dict, key: str, needle: str) -> str:
    found = [c for c in cfg[key] if needle in c]
    assert len(found) == 1, f"cluster.yaml: expected one {key} entry with {needle!r}, found {len(found)}"
    return found[0]


def invocations(cmds: list[str], program: str, sub: str) -> list[list[str]]:
    """Each `program sub ...` in the commands, as argument lists (shell quoting applied, up to the first
    shell operator or redirection)."""
    out = []
    for cmd in cmds:
        flat = cmd.replace("\\\n", " ")
        for line in flat.splitlines():
            for m in re.finditer(rf"(?:^|[\s;&|(]){re.escape(program)}\s+{sub}\b", line):
                rest = line[m.end():]
                tokens = []
                for tok in shlex.split(rest, comments=True):
                    if tok in (";", "&&", "||", "|", "&", ">", "<", "2>&1") or tok.startswith((">", "<", "2>")):
                        break
                    tokens.append(tok)
                out.append(tokens)
    return out


def flags_of(args: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in args if a.startswith("--") and " " not in a]


def option_value(args: list[str], flag: str) -> str:
    for i, a in enumerate(args):
        if a == flag:
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    raise AssertionError(f"{flag} not given in {args}")


# ---------------------------------------------------------------- the config, offline


def test_validates_against_the_installed_ray_schema(cfg):
    import jsonschema
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(copy.deepcopy(cfg)))

    # The check has teeth: the schema refuses fractional GPU counts and unknown keys.
    gpu_type = next(n for n, t in cfg["available_node_types"].items() if t["resources"].get("GPU"))
    fractional = copy.deepcopy(cfg)
    fractional["available_node_types"][gpu_type]["resources"]["GPU"] = 0.5
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(fractional))
    unknown = copy.deepcopy(cfg)
    unknown["available_node_types"][gpu_type]["min_worker"] = 1
    with pytest.raises(jsonschema.ValidationError):
        validate_config(prepare_config(unknown))


def test_node_types_cpu_head_and_gpu_workers_that_scale_to_zero(cfg):
    types = cfg["available_node_types"]
    head = types[cfg["head_node_type"]]
    assert not head["resources"].get("GPU"), "the head is a CPU node"
    workers = {name: t for name, t in types.items() if name != cfg["head_node_type"]}
    gpus = {name: t["resources"].get("GPU", 0) for name, t in workers.items()}
    assert max(gpus.values()) == 8, f"a node type with 8 GPUs for pretraining: {gpus}"
    assert any(0 < g < 8 for g in gpus.values()), f"a smaller GPU node type for sweeps: {gpus}"
    for name, t in workers.items():
        assert t.get("min_workers", 0) == 0, f"{name}: GPU nodes only while jobs ask for them"
        assert 0 < t["max_workers"] <= cfg["max_workers"], name
        # CPU and GPU given explicitly, so the autoscaler plans with what the instance really has
        assert t["resources"].get("CPU", 0) >= 1 and t["resources"]["GPU"] >= 1, name
    assert sum(t["max_workers"] for t in workers.values()) <= cfg["max_workers"]
    assert 1 <= cfg["idle_timeout_minutes"] <= 60
    assert cfg["provider"]["type"] == "aws" and cfg["provider"]["region"]


def test_commands_name_files_entry_points_and_flags_that_exist(cfg):
    # The working tree is mounted at ~/xmodal from where `ray up` runs: the repository root.
    mounts = cfg["file_mounts"]
    assert (REPO / mounts["~/xmodal"]).resolve() == REPO
    cmds = all_commands(cfg)
    text = "\n".join(cmds)

    # Paths in the synced tree: ~/xmodal/X or $HOME/xmodal/X, and repo-relative paths after `cd ~/xmodal`,
    # in the config's commands and the node scripts they run.
    # .venv/... is what scripts/setup.sh builds on each node, as it built .venv here.
    named = set(re.findall(r"(?:~|\$HOME)/xmodal/([\w./-]+)", text))
    for cmd in cmds:
        for part in re.split(r"cd ~/xmodal\s*&&", cmd)[1:]:
            named |= set(re.findall(r"(?<![\w/~])((?:scripts|jobs|search_spaces|platform)/[\w./-]+)", part))
    assert any(p.startswith("scripts/") for p in named) and any(p.startswith("jobs/") for p in named), named
    for path in sorted(named):
        assert (REPO / path).exists(), f"cluster.yaml runs {path}, which the repository does not have"

    # Entry points the commands call come from the project's environment (PATH puts .venv/bin first).
    for program in ("ray", "mlflow", "python"):
        assert re.search(rf"(?:^|[\s;&|(]){program}\s", text), program
        assert (VENV_BIN / program).exists(), f"{program} is not installed by scripts/setup.sh"

    # Every flag given to `ray start`, `mlflow server` and gunicorn exists in the installed versions.
    import gunicorn.config
    from mlflow.cli import server as mlflow_server
    from ray.scripts.scripts import start as ray_start

    known = {"ray start": {o for p in ray_start.params for o in p.opts},
             "mlflow server": {o for p in mlflow_server.params for o in p.opts}}
    gunicorn_flags = {o for s in gunicorn.config.KNOWN_SETTINGS for o in s.cli or []}
    for program, sub in (("ray", "start"), ("mlflow", "server")):
        calls = invocations(cmds, program, sub)
        assert calls, f"cluster.yaml never runs `{program} {sub}`"
        for args in calls:
            unknown = set(flags_of(args)) - known[f"{program} {sub}"]
            assert not unknown, f"`{program} {sub}` has no {sorted(unknown)}"
    for args in invocations(cmds, "mlflow", "server"):
        if "--gunicorn-opts" in args:
            unknown = set(flags_of(shlex.split(option_value(args, "--gunicorn-opts")))) - gunicorn_flags
            assert not unknown, f"gunicorn has no {sorted(unknown)}"

    # Stores, runs, local MLflow data and virtual environments never travel with the sync.
    excluded = set(cfg["rsync_exclude"])
    for must in ("/data/", "/runs/", "/mlflow.db", ".venv"):
        assert must in excluded, f"rsync_exclude lacks {must}"


def test_nothing_listens_on_a_public_interface_and_every_node_uses_the_token(cfg):
    cmds = all_commands(cfg)
    text = "\n".join(cmds)
    assert "0.0.0.0" not in text and "::/0" not in text
    heads = [a for a in invocations(cfg["head_start_ray_commands"], "ray", "start") if "--head" in a]
    assert len(heads) == 1
    assert option_value(heads[0], "--dashboard-host") == "127.0.0.1"
    (mlflow,) = invocations(with_scripts(cfg["head_start_ray_commands"]), "mlflow", "server")
    # MLflow: the head's private address (what the nodes use) and the loopback (the SSH tunnel's end).
    assert option_value(mlflow, "--host") == "$XMODAL_HEAD_IP"
    binds = [option_value(shlex.split(option_value(mlflow, "--gunicorn-opts")), "--bind")]
    assert all(b.split(":")[0] == "127.0.0.1" for b in binds), binds
    # Ray's security group: intra-cluster traffic and SSH only; no node type brings groups of its own.
    assert not cfg["provider"].get("security_group", {}).get("IpPermissions")
    for name, t in cfg["available_node_types"].items():
        assert "SecurityGroupIds" not in t["node_config"] and "NetworkInterfaces" not in t["node_config"], name
    # Token authentication: the token file reaches every node, and every node's environment turns it on
    # (setup_commands run on all nodes; the environment's RAY_AUTH_MODE: test_node_environment_written_by_setup).
    assert cfg["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert any("scripts/cluster/node_env.sh" in c for c in cfg["setup_commands"])


def run_env_setup(cfg: dict, home: Path, *args: str, **env: str) -> dict[str, str]:
    """Run cluster.yaml's environment setup command in a stand-in HOME (its ~/xmodal: this repository,
    unless there already), `args` appended, and return what a login shell on that node sees after
    sourcing ~/.bashrc (which is what Ray's commands do)."""
    script = command_with(cfg, "setup_commands", "node_env.sh")
    if not (home / "xmodal").exists():
        (home / "xmodal").symlink_to(REPO)
    base = {"HOME": str(home), "PATH": os.environ["PATH"], **env}
    subprocess.run(["bash", "-c", " ".join([script, *map(shlex.quote, args)])], env=base, check=True, timeout=60)
    out = subprocess.run(["bash", "-c", "source ~/.bashrc >/dev/null 2>&1; env -0"], env={**base, "PS1": "$ "},
                         check=True, timeout=60, capture_output=True, text=True).stdout
    return dict(line.split("=", 1) for line in out.split("\0") if "=" in line)


def test_node_environment_written_by_setup(cfg, tmp_path):
    # A worker: the autoscaler passes the head's address as RAY_HEAD_IP.
    (tmp_path / "w").mkdir()
    worker = run_env_setup(cfg, tmp_path / "w", RAY_HEAD_IP="10.1.2.3")
    assert worker["XMODAL_STORAGE_PATH"].startswith("s3://")
    assert worker["XMODAL_MLFLOW_ARTIFACTS"].startswith("s3://")
    assert worker["MLFLOW_TRACKING_URI"] == f"http://10.1.2.3:{worker['XMODAL_MLFLOW_PORT']}"
    assert worker["RAY_AUTH_MODE"] == "token"
    assert worker["PATH"].split(":")[0] == str(tmp_path / "w" / "xmodal" / ".venv" / "bin")
    # Idempotent: `ray up` reruns setup; ~/.bashrc loads the environment first and last, once each.
    run_env_setup(cfg, tmp_path / "w", RAY_HEAD_IP="10.1.2.3")
    lines = (tmp_path / "w" / ".bashrc").read_text().splitlines()
    assert [line for line in lines if "xmodal.env" in line] == [lines[0], lines[-1]] and lines[0] == lines[-1]
    # A PATH that ~/.bashrc sets between the two (pyenv, conda) does not hide the project's environment.
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / ".bashrc").write_text('export PATH="/opt/conda/bin:$PATH"\n')
    conda = run_env_setup(cfg, tmp_path / "c", RAY_HEAD_IP="10.1.2.3")
    assert conda["PATH"].split(":")[0] == str(tmp_path / "c" / "xmodal" / ".venv" / "bin")
    # Another environment (machines without internet): its bin first, the synced tree's code on PYTHONPATH.
    venv = Path(PYTHON).parent.parent
    other = run_env_setup(cfg, tmp_path / "w", f"--venv={venv}", RAY_HEAD_IP="10.1.2.3")
    assert other["PATH"].split(":")[0] == str(venv / "bin")
    assert other["PYTHONPATH"] == str(tmp_path / "w" / "xmodal" / "platform")
    # The head: no RAY_HEAD_IP, its own first address.
    (tmp_path / "h").mkdir()
    head = run_env_setup(cfg, tmp_path / "h")
    own = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()[0]
    assert head["XMODAL_HEAD_IP"] == own and head["MLFLOW_TRACKING_URI"].startswith(f"http://{own}:")


# ---------------------------------------------------------------- cluster.onprem.yaml and the node scripts


@pytest.fixture(scope="module")
def onprem() -> dict:
    return yaml.safe_load(ONPREM_YAML.read_text())


def scripts_run(cmds: list[str]) -> list[list[str]]:
    return [SCRIPT_REF.findall(c) for c in cmds]


def test_onprem_config_validates_and_runs_the_same_node_scripts(cfg, onprem):
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(copy.deepcopy(onprem)))
    provider = onprem["provider"]
    assert provider["type"] == "local" and provider["head_ip"] and provider["worker_ips"]
    assert onprem["auth"]["ssh_user"] and onprem["auth"]["ssh_private_key"]
    # The same scripts, in the same order, for setup and for starting each kind of node; both configs
    # sync the same tree, token and exclusions.
    for key in ("setup_commands", "head_start_ray_commands", "worker_start_ray_commands"):
        assert scripts_run(onprem[key]) == scripts_run(cfg[key]), key
        assert all(refs for refs in scripts_run(onprem[key])), f"{key}: every command runs a node script"
    for key in ("file_mounts", "rsync_exclude", "rsync_filter"):
        assert onprem[key] == cfg[key], key
    # The same `ray start` flags; the head keeps no CPUs or GPUs for Ray (cluster.yaml's head node type
    # says so with its resources instead).
    def starts(c: dict, key: str) -> list[list[str]]:
        return [sorted(flags_of(a)) for a in invocations(c[key], "ray", "start")]

    assert starts(onprem, "worker_start_ray_commands") == starts(cfg, "worker_start_ray_commands")
    (head,) = starts(onprem, "head_start_ray_commands")
    assert head == sorted(starts(cfg, "head_start_ray_commands")[0] + ["--num-cpus", "--num-gpus"])
    assert "--autoscaler-v1" in command_with(onprem, "head_start_ray_commands", "ray start")
    # Only the head's loopback for the dashboard, as on AWS; every command's files and flags exist.
    (head_args,) = [a for a in invocations(onprem["head_start_ray_commands"], "ray", "start") if "--head" in a]
    assert option_value(head_args, "--dashboard-host") == "127.0.0.1"
    assert "0.0.0.0" not in "\n".join(all_commands(onprem))


def test_open_files_limit_is_raised_to_what_the_hard_limit_allows():
    lib = REPO / "scripts" / "cluster" / "lib.sh"

    def soft_after(hard: int, soft: int) -> int:
        out = subprocess.run(["bash", "-c", f"set -e; ulimit -Sn {soft}; ulimit -Hn {hard}; . {shlex.quote(str(lib))}; "
                              "xm_raise_open_files; ulimit -Sn"], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        return int(out.stdout)

    hard = subprocess.run(["bash", "-c", "ulimit -Hn"], capture_output=True, text=True).stdout.strip()
    top = 1 << 20 if hard == "unlimited" else int(hard)
    assert soft_after(min(4096, top), 256) == min(4096, top)  # a hard limit under 65536: up to it, no error
    if top >= 65536:
        assert soft_after(top, 256) == 65536
        assert soft_after(top, top) == top  # a higher soft limit is kept


def stand_in_node(tmp_path: Path, programs: dict[str, str]) -> tuple[Path, dict[str, str]]:
    """A HOME whose node environment (written by node_env.sh) puts stand-in programs first on PATH: each
    appends its name and arguments (and, for `ray`, the soft open files limit) to calls.log."""
    home = tmp_path / "home"
    bin_dir = home / "xmodal" / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name, body in programs.items():
        (bin_dir / name).write_text(f'#!/usr/bin/env bash\necho "{name} $* (nofile $(ulimit -Sn))" >> '
                                    f'{shlex.quote(str(home / "calls.log"))}\n{body}\n')
        (bin_dir / name).chmod(0o755)
    env = {"HOME": str(home), "PATH": os.environ["PATH"]}
    subprocess.run(["bash", str(REPO / "scripts" / "cluster" / "node_env.sh"), "--storage-path=/shared/runs",
                    "--mlflow-artifacts=/shared/mlflow", "--head-ip=10.9.8.7"], env=env, check=True, timeout=60)
    return home, env


def test_start_ray_stops_first_and_the_onprem_head_refuses_autoscaler_v2(onprem, tmp_path):
    home, env = stand_in_node(tmp_path, {"ray": "exit 0"})
    head_cmd = command_with(onprem, "head_start_ray_commands", "ray start")
    argv = shlex.split(head_cmd.replace("~/xmodal/", str(REPO) + "/"))
    # What `ray up` runs with autoscaler v2 (its default): refused before anything is stopped.
    refused = subprocess.run(argv, env={**env, "RAY_enable_autoscaler_v2": "1"}, capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode == 2 and "RAY_UP_enable_autoscaler_v2=0 ray up" in refused.stderr, refused.stderr
    assert not (home / "calls.log").exists()
    started = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert started.returncode == 0, started.stderr
    stop, start = (home / "calls.log").read_text().splitlines()
    assert stop.startswith("ray stop ")
    assert start.startswith("ray start --node-ip-address=10.9.8.7 --system-config=") and "--num-cpus=0" in start
    assert " --head " in start
    hard = subprocess.run(["bash", "-c", "ulimit -Hn"], capture_output=True, text=True).stdout.strip()
    assert f"(nofile {65536 if hard == 'unlimited' else min(65536, int(hard))})" in start


def test_start_ray_gives_the_head_the_health_check_settings(cfg, onprem, tmp_path):
    """Both configs' head `ray start` gets scripts/cluster/head_system_config.json as --system-config (the
    GCS hands it to every node); a worker's gets none (Ray refuses one there); a --system-config in the
    command given replaces it. tests/test_cross_host.py runs its cluster with the same file."""
    path = REPO / "scripts" / "cluster" / "head_system_config.json"
    config = json.loads(path.read_text())
    # A node that answers no health check is declared dead after `threshold` checks in a row fail, each
    # after its timeout, with a period between them: at most 15 s with these settings (Ray's: 65 s).
    worst_ms = config["health_check_failure_threshold"] * (config["health_check_timeout_ms"]
                                                           + config["health_check_period_ms"])
    assert set(config) == {"health_check_period_ms", "health_check_timeout_ms", "health_check_failure_threshold"}
    assert worst_ms <= 15_000, config
    home, env = stand_in_node(tmp_path, {"ray": '[ "$1" = start ] && printf "%s\\n" "$@" > "$HOME/start.args"; exit 0'})

    def start_args(command: str) -> list[str]:
        subprocess.run(shlex.split(command.replace("~/xmodal/", str(REPO) + "/")), env=env, check=True,
                       capture_output=True, timeout=60)
        return (home / "start.args").read_text().splitlines()[1:]

    for c in (cfg, onprem):
        head = start_args(command_with(c, "head_start_ray_commands", "ray start"))
        given = [a.split("=", 1)[1] for a in head if a.startswith("--system-config")]
        assert len(given) == 1 and json.loads(given[0]) == config, head
        worker = start_args(command_with(c, "worker_start_ray_commands", "ray start"))
        assert "--address=$RAY_HEAD_IP:6379" in worker and not any(a.startswith("--system-config") for a in worker)
    own = start_args(command_with(cfg, "head_start_ray_commands", "ray start") + """ --system-config='{"a": 1}'""")
    assert [a for a in own if a.startswith("--system-config")] == ['--system-config={"a": 1}'], own


def test_stop_cluster_stops_the_head_then_every_worker_over_ssh(tmp_path):
    home, env = stand_in_node(tmp_path, {"ray": 'echo "Did not find any active Ray processes."', "ssh": "exit 0"})
    # The head's copy of the config, as the launcher writes it (JSON), with the key it copied there.
    (home / "ray_bootstrap_config.yaml").write_text(
        '{"provider": {"type": "local", "head_ip": "10.9.8.7", "worker_ips": ["10.9.8.8", "10.9.8.9"]}, '
        '"auth": {"ssh_user": "xm", "ssh_private_key": "~/ray_bootstrap_key.pem"}}')
    out = subprocess.run(["bash", str(REPO / "scripts" / "cluster" / "stop_cluster.sh")], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    calls = (home / "calls.log").read_text().splitlines()
    # The head (and its autoscaler) first, then a second `ray stop` that must find nothing left.
    assert [c.split(" (")[0] for c in calls[:2]] == ["ray stop", "ray stop"], calls
    ssh = sorted(c for c in calls if c.startswith("ssh "))
    assert len(ssh) == 2 and len(calls) == 4, calls
    for call, ip in zip(ssh, ("10.9.8.8", "10.9.8.9"), strict=True):
        assert f"-i {home}/ray_bootstrap_key.pem" in call and f"xm@{ip} . ~/xmodal.env && ray stop && ray stop" in call
    assert "10.9.8.8: no Ray process left" in out.stdout, out.stdout
    # A worker that cannot be reached is named, and the exit status says so.
    (home / "xmodal" / ".venv" / "bin" / "ssh").write_text('#!/usr/bin/env bash\necho "no route" >&2; exit 255\n')
    out = subprocess.run(["bash", str(REPO / "scripts" / "cluster" / "stop_cluster.sh")], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "Ray may still run on 10.9.8.8 10.9.8.9" in out.stderr, out.stderr
    # Ray left on the head: said, and the workers are not tried.
    (home / "xmodal" / ".venv" / "bin" / "ray").write_text('#!/usr/bin/env bash\necho "Stopped all 3 Ray processes."\n')
    out = subprocess.run(["bash", str(REPO / "scripts" / "cluster" / "stop_cluster.sh")], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "still running on the head" in out.stderr, out.stderr


def scale_out_docs() -> list[str]:
    """docs/cluster.md, the page the README links for running on a cluster."""
    assert CLUSTER_DOC.exists(), "no docs/cluster.md"
    return [CLUSTER_DOC.read_text()]


def job_help(job: str, capsys) -> str:
    """`python jobs/JOB.py --help`, in this process (a fresh interpreter costs seconds)."""
    spec = importlib.util.spec_from_file_location(f"_doc_job_{job}", REPO / "jobs" / f"{job}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit):
        module.main(["--help"])
    return capsys.readouterr().out


def test_scale_out_doc_names_files_and_flags_that_exist(capsys):
    helps: dict[str, str] = {}
    for doc in scale_out_docs():
        for path in sorted(set(re.findall(r"(?<![\w/~.])((?:jobs|search_spaces|scripts)/[\w./-]+\.\w+)", doc))):
            assert (REPO / path).exists(), f"docs/cluster.md names {path}, which the repository lacks"
        assert "cluster.yaml" in doc
        # Flags given to each job in the section's commands exist in that job's command line.
        commands = re.sub(r"\\\n\s*", " ", doc)
        for job in ("pretrain", "sweep"):
            used = set()
            for m in re.finditer(rf"python jobs/{job}\.py([^\n`]*)", commands):
                used |= set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", m.group(1)))
            assert used, f"docs/cluster.md never runs jobs/{job}.py"
            if job not in helps:
                helps[job] = job_help(job, capsys)
            missing = {f for f in used if f not in helps[job]}
            assert not missing, f"jobs/{job}.py has no {sorted(missing)}"


# ---------------------------------------------------------------- the rehearsal: two nodes on this machine


@dataclass
class Rehearsal:
    head: RayHead
    tmp: Path
    shared: Path  # stands in for s3://.../runs: every node sees it
    tracking_uri: str
    store: Path
    node_env: dict[str, str]  # the head's environment, as its start commands see it
    mlflow_start: str  # cluster.yaml's command that (re)starts the head's MLflow server


def submit(head: RayHead, *args: str) -> str:
    """`ray job submit --working-dir <repo> -- python ...` as docs/cluster.md has it: `python` is whatever the
    cluster's PATH finds (the nodes run in the project's environment)."""
    out = subprocess.run([RAY, "job", "submit", f"--address={head.dashboard}", "--no-wait",
                          "--working-dir", str(REPO), "--", "python", *args],
                         env=head.env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    ids = re.findall(r"raysubmit_\w+", out.stdout + out.stderr)
    assert ids, out.stdout + out.stderr
    return ids[0]


def state_api(head: RayHead, what: str, **params) -> list[dict]:
    import requests

    params = {"limit": 10000, "detail": "true", **params}
    r = requests.get(f"{head.dashboard}/api/v0/{what}", params=params, timeout=60,
                     headers={"Authorization": f"Bearer {head.token}"})
    r.raise_for_status()
    return r.json()["data"]["result"]["result"]


def nodes_by_label(head: RayHead) -> dict[str, str]:
    """node id -> the custom resource that marks it (node_a: the head, node_b: the second node)."""
    return {n["node_id"]: next(k for k in n["resources_total"] if k.startswith("node_"))
            for n in state_api(head, "nodes") if n["state"] == "ALIVE"}


def train_workers(head: RayHead, submission_id: str) -> list[dict]:
    job_id = head.client().get_job_info(submission_id).job_id
    return [a for a in state_api(head, "actors", filter_keys="job_id", filter_predicates="=", filter_values=job_id)
            if a["class_name"] == "RayTrainWorker"]


SWEEP_SPACE = """\
job: pretrain
base:
  config:
    preset: tiny
    data: {{store: {store}, eval_batches: 2}}
    train: {{epochs: 1, batch_size: 16, max_steps: 4, eval_every: 2, log_every: 2}}
    # each trial's two workers on two nodes
    scale: {{num_workers: 2, placement_strategy: STRICT_SPREAD}}
    mlflow: {{system_metrics: false}}
metric: eval/loss/mlm
mode: min
num_samples: 1
max_concurrent: 1
seed: 0
scheduler: {{type: fifo}}
parameters:
  optim.lr: {{type: choice, values: [1.0e-2, 1.0e-3]}}
try_first:
  - {{optim.lr: 1.0e-3}}
"""


@pytest.fixture(scope="module")
def rehearsal(cfg, tmp_path_factory, tiny_store, s3):
    tmp = tmp_path_factory.mktemp("cluster")
    # The head's environment, written by cluster.yaml's setup (~/xmodal is the synced tree), with a local
    # stand-in for the storage path's S3 URI and the MLflow artifacts in S3 (the tests' moto server; the
    # endpoint and credentials passed with `--export`, as a cluster config without an instance profile
    # does); 127.0.0.2 plays the head's private address. Then the head's MLflow server, started by
    # cluster.yaml's own command (it waits until the server answers), while the two Ray nodes start.
    home = tmp / "home"
    home.mkdir()
    shared, port = tmp / "shared", free_port()
    exports = [f"--export={k}={v}" for k, v in s3_environment(s3.port).items()]
    # The MLflow server on a SQLite file of the head's, not the configs' default PostgreSQL: that one is
    # tests/test_cluster_postgres.py's and tests/test_ray_up.py's; this rehearsal is of the Ray nodes.
    env = run_env_setup(cfg, home, f"--storage-path={shared}", f"--mlflow-artifacts=s3://{S3_BUCKET}/mlflow",
                        f"--mlflow-port={port}", f"--mlflow-backend=sqlite:///{home}/mlflow/mlflow.db", *exports,
                        RAY_HEAD_IP="127.0.0.2")
    start = command_with(cfg, "head_start_ray_commands", "start_mlflow.sh")
    mlflow_start = subprocess.Popen(["bash", "-c", start], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
    # The second node's own session folder: a short path, as Ray's socket paths live under it.
    node_temp = tempfile.mkdtemp(prefix="xr", dir="/tmp")
    head = None
    try:
        # The jobs log through MLflow's loopback binding: its DNS-rebinding guard admits localhost and
        # private ranges (a real head's 10.x / 172.16-31.x / 192.168.x), not 127.0.0.2.
        tracking_uri = f"http://127.0.0.1:{port}"
        with pytest.MonkeyPatch.context() as mp:
            # What `ray start` inherits on a node: the project's venv first on PATH, storage and MLflow,
            # and no S3 credentials (the trials' artifacts reach S3 through the head's MLflow server only).
            mp.setenv("PATH", env["PATH"])
            mp.setenv("XMODAL_STORAGE_PATH", str(shared))
            mp.setenv("MLFLOW_TRACKING_URI", tracking_uri)
            for name in [k for k in os.environ if k.startswith("AWS_")]:
                mp.delenv(name)
            # Memory counts twice with two nodes on one machine: RayHead sets --memory and
            # --object-store-memory per node.
            head = RayHead(tmp, num_cpus=4, resources='{"node_a": 1}')
            head.add_worker_node(tmp, num_cpus=4, resources='{"node_b": 1}', temp_dir=node_temp)
        out, _ = mlflow_start.communicate(timeout=400)
        assert mlflow_start.returncode == 0, out
        import requests

        for host in ("127.0.0.1", "127.0.0.2"):  # the SSH tunnel's end and the nodes' address
            assert requests.get(f"http://{host}:{port}/health", timeout=30).ok, host
        deadline = time.time() + 120
        while len(nodes_by_label(head)) < 2:
            assert time.time() < deadline, (tmp / "node1.log").read_text()[-3000:]
            time.sleep(2)

        yield Rehearsal(head, tmp, shared, tracking_uri, tiny_store, env, start)
    finally:
        if head is not None:
            head.stop()
        if mlflow_start.poll() is None:
            kill_tree(mlflow_start.pid)
        pid_file = home / "mlflow" / "server.pid"  # the server outlives the command that started it
        if pid_file.exists():
            kill_tree(int(pid_file.read_text()))
        shutil.rmtree(node_temp, ignore_errors=True)


def run_job(r: Rehearsal, *args: str, timeout: float = 480) -> str:
    """Submit a job and wait for it (jobs one at a time: on 2 cores, two at once took longer than both
    in turn); returns its submission id, or fails with its log."""
    job = submit(r.head, *args)
    client = r.head.client()
    status = wait_job(client, job, timeout=timeout)
    assert status == "SUCCEEDED", client.get_job_logs(job)[-5000:]
    return job


@pytest.mark.slow
def test_sweep_runs_its_trials_across_both_nodes(rehearsal, s3):
    r = rehearsal
    if not (REPO / "jobs" / "sweep.py").exists():
        pytest.skip("jobs/sweep.py is not in this tree yet (the sweep layer lands separately)")
    T = pytest.importorskip("xmodal.base.run_tags", reason="xmodal.sweep is not in this tree yet")
    space = r.tmp / "space.yaml"
    space.write_text(SWEEP_SPACE.format(store=r.store))
    job = run_job(r, "jobs/sweep.py", str(space), "--name", "rehearsal-sweep", "--no-report")
    nodes = nodes_by_label(r.head)
    workers = train_workers(r.head, job)
    trials: dict[str, set[str]] = {}
    # A worker group whose start timed out on a loaded machine is started again: its first actors may
    # never have been placed (no node), and its placement group is another one.
    for w in (w for w in workers if w["node_id"] in nodes):
        trials.setdefault(w["placement_group_id"], set()).add(nodes[w["node_id"]])
    assert trials and all(on == {"node_a", "node_b"} for on in trials.values()), trials

    # Tune's state and the trials' checkpoints in the shared storage path; one parent run, a child per trial.
    assert (r.shared / "sweeps" / "rehearsal-sweep").is_dir()
    assert list((r.shared / "sweeps" / "rehearsal-sweep" / "train").glob("*/checkpoint_*"))
    exp_id = tracking.get_experiment_id(r.tracking_uri, "xmodal-sweep-space")
    parent = tracking.find_run(r.tracking_uri, exp_id, "rehearsal-sweep")
    assert parent.status == "FINISHED"
    children = tracking.child_runs(r.tracking_uri, parent.run_id)
    # One trial: what the cluster adds to a sweep (Tune placing a trial's workers on two nodes, its state and
    # checkpoints in the shared storage, its run through the head's server) is all in it; sweeps of several
    # trials, their schedulers and faults are tests/sweep/test_sweep.py's.
    assert len(children) == 1 and all(c.status == "FINISHED" for c in children)
    assert {c.params["optim.lr"] for c in children} == {"0.001"}
    assert all(c.tags[T.KIND] == "trial" for c in children)
    # Each trial logged through the head's MLflow server: its metrics, and its model's files, which the
    # server put in its own artifact root.
    for child in children:
        assert child.params["scale.placement_strategy"] == "STRICT_SPREAD"
        assert "train/loss" in child.metrics and "eval/loss/mlm" in child.metrics
        assert "model/model.pt" in tracking.list_artifacts(r.tracking_uri, child.run_id, "model")
    # ... in its artifact root in S3, written by the server: the nodes have no S3 credentials.
    keys = [o["Key"] for o in s3.client().list_objects_v2(Bucket=S3_BUCKET, Prefix="mlflow/")["Contents"]]
    for child in children:
        assert [k for k in keys if k.endswith(f"{child.run_id}/artifacts/model/model.pt")], keys


@pytest.mark.slow
def test_the_heads_mlflow_server_keeps_artifacts_in_object_storage(rehearsal, s3, monkeypatch):
    """The rehearsal's MLflow server (cluster.yaml's own command, artifacts in S3): a file logged through
    it by a client that has no S3 credentials (only the head needs them) lands in the bucket, comes back
    through the server, and is still served after the server restarts, as are the sweep's models when
    the sweep ran before."""
    r = rehearsal
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)  # the client reaches S3 through the server only
    uri = r.tracking_uri
    exp = tracking.ensure_experiment(uri, "s3-artifacts")
    run_id = tracking.create_run(uri, exp, "s3-artifacts", {}, {})
    (r.tmp / "model.pt").write_bytes(b"weights " * 1000)
    tracking.log_artifact(uri, run_id, r.tmp / "model.pt", "model")
    keys = [o["Key"] for o in s3.client().list_objects_v2(Bucket=S3_BUCKET, Prefix="mlflow/")["Contents"]]
    assert [k for k in keys if k.endswith(f"{run_id}/artifacts/model/model.pt")], keys
    back = tracking.download_artifacts(uri, run_id, "model/model.pt", r.tmp / "back")
    assert back.read_bytes() == b"weights " * 1000
    sweep_models = [k for k in keys if k.endswith("/artifacts/model/model.pt") and run_id not in k]

    out = subprocess.run(["bash", "-c", r.mlflow_start], env=r.node_env, capture_output=True, text=True,
                         timeout=400)  # a restart
    assert out.returncode == 0, out.stdout + out.stderr
    assert tracking.list_artifacts(uri, run_id, "model") == ["model/model.pt"]
    for key in sweep_models:  # .../<run id>/artifacts/model/model.pt
        assert "model/model.pt" in tracking.list_artifacts(uri, key.split("/")[-4], "model"), key
