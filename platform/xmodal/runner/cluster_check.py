"""Checks a Ray cluster launcher config (cluster.yaml, cluster.onprem.yaml, or a copy a user edited) before
`ray up`: what the launcher's own schema check lets through and a cluster then gets silently wrong or
fails on minutes later.

- the local provider's addresses (`provider.head_ip`, `provider.worker_ips`): IPv4 addresses or host
  names, each machine named once (the node scripts build `HOST:PORT` and `http://HOST:PORT` from them,
  which an IPv6 address breaks);
- the SSH key files named under `auth`, and every local source of `file_mounts` (the cluster's token,
  `~/.ray/auth_token`, among them);
- every script a command runs from a mounted folder (`bash ~/xmodal/scripts/cluster/X.sh`), looked up
  where `file_mounts` syncs it from, and every `--head-ip=` a command passes;
- placeholders of the templates left unedited (`EDIT-...`).

On a node (`on_node`: the head's `~/ray_bootstrap_config.yaml`, the launcher's JSON copy) only the
addresses are checked: node_env.sh runs that before it writes anything.

Standard library only (PyYAML where installed, which Ray's command line needs anyway; without it only a
JSON config can be read), so that it runs under a node's bare `python3` before any environment exists:
scripts/check_cluster.py is its command line.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shlex
from pathlib import Path
from typing import Any

from xmodal.base.errors import UserError

COMMAND_KEYS = ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands",
                "head_start_ray_commands", "worker_start_ray_commands")
# An RFC 1123 host name: labels of letters, digits and hyphens, not starting or ending with a hyphen.
_HOSTNAME = re.compile(r"(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}"
                       r"[A-Za-z0-9])?)*\.?")
_SCRIPT = re.compile(r"\.(sh|py)$")
_PLACEHOLDER = re.compile(r"EDIT-[\w-]*")


class ClusterConfigError(UserError):
    """What is wrong with a cluster config: every problem found, each naming the file, key and value."""


def address_problem(value: Any, *, ip_only: bool = False) -> str | None:
    """Why `value` is not a usable machine address (None when it is): an IPv4 address, or (unless
    `ip_only`) a host name. Four dot-separated numbers are always read as an address, never as a name:
    192.168.1.300 is a typo, which a resolver would otherwise turn into a silent fallback."""
    expected = "an IPv4 address" + ("" if ip_only else " or a host name")
    if not isinstance(value, str) or not value.strip():
        return f"expected {expected}"
    try:
        ip = ipaddress.ip_address(value)
    except ValueError:
        ip = None
    if ip is not None:
        if ip.version == 6:
            return (f"an IPv6 address; expected {expected} (the node scripts build HOST:PORT and "
                    "http://HOST:PORT addresses, which an IPv6 address breaks)")
        if ip.is_unspecified or ip.is_multicast:
            return f"not a machine's address; expected {expected}"
        return None
    if re.fullmatch(r"[0-9.]+", value):
        return f"not a valid IPv4 address (four numbers 0-255); expected {expected}"
    if ip_only or not _HOSTNAME.fullmatch(value):
        return f"expected {expected}"
    return None


def check_address(value: Any, where: str, *, ip_only: bool = False) -> str:
    """`value`, or a ClusterConfigError naming `where` (the option or key) and the value."""
    problem = address_problem(value, ip_only=ip_only)
    if problem:
        raise ClusterConfigError(f"{where}: {value!r}: {problem}")
    return value


def load(path: str | Path) -> dict:
    """The config as a mapping: YAML (a key given twice is an error: the launcher would keep the last one
    silently), or JSON where PyYAML is not installed."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ClusterConfigError(f"{path}: cannot be read ({e.strerror}); expected a cluster config "
                                 "(cluster.yaml, cluster.onprem.yaml)") from None
    try:
        import yaml
    except ImportError:
        yaml = None
    if yaml is None:
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ClusterConfigError(f"{path}: not JSON ({e}), and PyYAML, which reads YAML, is not installed: run "
                                     "this with the project's Python (.venv/bin/python) or with Ray's") from None
    else:
        class Loader(yaml.SafeLoader):
            pass

        def mapping(loader, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = loader.construct_object(key_node, deep=deep)
                if key in seen:
                    raise ClusterConfigError(f"{path}: line {key_node.start_mark.line + 1}: key {key!r} given twice "
                                             "(the launcher would keep the last one); expected each key once")
                seen.add(key)
            return loader.construct_mapping(node, deep=deep)

        Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
        try:
            data = yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader subclass
        except yaml.YAMLError as e:
            raise ClusterConfigError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    if not isinstance(data, dict):
        raise ClusterConfigError(f"{path}: holds {type(data).__name__}; expected a cluster config (a mapping)")
    return data


def _local(source: str, base: Path) -> Path:
    """A file mount's source as the launcher reads it: `~` expanded, relative to where `ray up` runs."""
    p = Path(os.path.expanduser(source))
    return p if p.is_absolute() else base / p


def _addresses(cfg: dict, problems: list[str]) -> None:
    provider = cfg.get("provider")
    if not isinstance(provider, dict):
        problems.append(f"provider: {provider!r}: expected a mapping with a type")
        return
    if provider.get("type") != "local":
        return
    named: dict[str, str] = {}

    def one(value: Any, key: str) -> None:
        problem = address_problem(value)
        if problem:
            problems.append(f"{key}: {value!r}: {problem}")
            return
        same = str(ipaddress.ip_address(value)) if re.fullmatch(r"[0-9.]+", value) else value.lower().rstrip(".")
        if same in named:
            problems.append(f"{key}: {value!r}: the same machine as {named[same]}; expected every machine once "
                            "(the launcher would set it up twice, and its Ray would stop the other's)")
        else:
            named[same] = key

    one(provider.get("head_ip"), "provider.head_ip")
    workers = provider.get("worker_ips")
    if workers is None:
        workers = []
    if not isinstance(workers, list):
        problems.append(f"provider.worker_ips: {workers!r}: expected a list of addresses")
        workers = []
    for i, value in enumerate(workers):
        one(value, f"provider.worker_ips[{i}]")
    if "external_head_ip" in provider:
        problem = address_problem(provider["external_head_ip"])
        if problem:
            problems.append(f"provider.external_head_ip: {provider['external_head_ip']!r}: {problem}")


def _files(cfg: dict, base: Path, problems: list[str]) -> dict[str, Path]:
    """Checks the key files and the file mounts' sources; returns the mounts (remote path -> local)."""
    auth = cfg.get("auth") or {}
    if not isinstance(auth, dict):
        problems.append(f"auth: {auth!r}: expected a mapping")
        auth = {}
    for key in ("ssh_private_key", "ssh_public_key"):
        if key in auth:
            value = auth[key]
            path = _local(str(value), base)
            if not isinstance(value, str) or not path.is_file():
                problems.append(f"auth.{key}: {value!r}: no such file ({path}); expected the SSH key that logs "
                                "into every machine")
            elif not os.access(path, os.R_OK):
                problems.append(f"auth.{key}: {value!r}: {path} cannot be read by this user")
    mounts = cfg.get("file_mounts") or {}
    if not isinstance(mounts, dict):
        problems.append(f"file_mounts: {mounts!r}: expected a mapping of remote path: local path")
        return {}
    found = {}
    for remote, source in mounts.items():
        path = _local(str(source), base)
        if not path.exists():
            hint = (" (`ray get-auth-token --generate` makes the cluster's token there)"
                    if str(source).endswith("auth_token") else "")
            problems.append(f"file_mounts[{remote!r}]: {source!r}: no such file or folder ({path}){hint}")
        found[str(remote).rstrip("/")] = path
    return found


def _commands(cfg: dict, mounts: dict[str, Path], problems: list[str]) -> None:
    for key in COMMAND_KEYS:
        commands = cfg.get(key) or []
        if not isinstance(commands, list):
            problems.append(f"{key}: {commands!r}: expected a list of shell commands")
            continue
        for i, command in enumerate(commands):
            where = f"{key}[{i}]"
            if not isinstance(command, str):
                problems.append(f"{where}: {command!r}: expected a shell command (a string)")
                continue
            try:
                tokens = shlex.split(command, comments=True)
            except ValueError as e:
                problems.append(f"{where}: {command!r}: cannot be split as a shell command ({e})")
                continue
            for token in tokens:
                if _PLACEHOLDER.search(token):
                    problems.append(f"{where}: {token!r}: still the template's placeholder; expected your own "
                                    "value (the lines to change say EDIT)")
                if token.startswith("--head-ip="):
                    value = token.split("=", 1)[1]
                    problem = address_problem(value, ip_only=True)
                    if problem:
                        problems.append(f"{where}: --head-ip: {value!r}: {problem}")
                if not _SCRIPT.search(token) or not token.startswith(("~/", "/")):
                    continue
                for remote, local in mounts.items():
                    if token == remote or token.startswith(remote + "/"):
                        path = local / token[len(remote):].lstrip("/")
                        if not path.is_file():
                            problems.append(f"{where}: runs {token}, which file_mounts[{remote!r}] does not hold "
                                            f"(no {path}); expected a script of the synced tree")
                        break


def problems(cfg: dict, base: str | Path = ".", on_node: bool = False) -> list[str]:
    """Every problem of `cfg` (keys and values named; the file is the caller's to add). `base`: where
    `ray up` runs, against which relative file mounts are read."""
    found: list[str] = []
    _addresses(cfg, found)
    if not on_node:
        mounts = _files(cfg, Path(base).resolve(), found)
        _commands(cfg, mounts, found)
    return found


def check(path: str | Path, base: str | Path = ".", on_node: bool = False) -> dict:
    """The config at `path`, or one ClusterConfigError naming the file and every problem."""
    cfg = load(path)
    found = problems(cfg, base, on_node)
    if found:
        if len(found) == 1:
            raise ClusterConfigError(f"{path}: {found[0]}")
        raise ClusterConfigError(f"{path}: {len(found)} problems: "
                                 + " ".join(f"({i}) {p}" for i, p in enumerate(found, 1)))
    return cfg


def head_address(cfg: dict, where: str) -> str | None:
    """The local provider's head as an IPv4 address (a host name resolved here), None for another
    provider; a name that does not resolve is a ClusterConfigError naming `where`."""
    import socket

    provider = cfg.get("provider") or {}
    if provider.get("type") != "local" or not provider.get("head_ip"):
        return None
    value = check_address(provider["head_ip"], f"{where}: provider.head_ip")
    try:
        return socket.gethostbyname(value)
    except OSError as e:
        raise ClusterConfigError(f"{where}: provider.head_ip: {value!r} does not resolve on {socket.gethostname()} "
                                 f"({e}); expected an address or a name this machine resolves") from None
