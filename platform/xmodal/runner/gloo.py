"""Which network interface gloo (torch.distributed on CPU) uses on a Train worker: the one that holds the
node IP Ray reports, set as GLOO_SOCKET_IFNAME in every worker before its process group starts.

Without it gloo takes the address its own host name resolves to; where that is 127.0.0.1 (a common
/etc/hosts), a worker on another host dials its own loopback and the group times out ("Unable to
resolve hostname to a (local) address"). A GLOO_SOCKET_IFNAME already in the worker's environment wins.
"""

from __future__ import annotations

import os
import socket

from ray.train.torch import TorchConfig
from ray.train.torch.config import _TorchBackend

GLOO_IFNAME = "GLOO_SOCKET_IFNAME"


def interface_of(address: str) -> str | None:
    """The name of the interface holding the IPv4 or IPv6 `address`, None if no interface here has it."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family in (socket.AF_INET, socket.AF_INET6) and a.address.split("%")[0] == address
               for a in addrs):
            return name
    return None


def choose_interface(node_ip: str | None = None) -> str | None:
    """Set GLOO_SOCKET_IFNAME in this process to the interface of `node_ip` (default: this Ray node's IP)
    unless it is set already; returns the interface gloo will use (None: gloo's own choice)."""
    if os.environ.get(GLOO_IFNAME):
        return os.environ[GLOO_IFNAME]
    if node_ip is None:
        import ray

        node_ip = ray.util.get_node_ip_address()
    name = interface_of(node_ip)
    if name is not None:
        os.environ[GLOO_IFNAME] = name
    return name


class _Backend(_TorchBackend):
    def on_start(self, worker_group, backend_config):
        worker_group.execute(choose_interface)  # before the process group: gloo reads it at init
        super().on_start(worker_group, backend_config)


class NodeInterfaceTorchConfig(TorchConfig):
    """Ray Train's TorchConfig, with GLOO_SOCKET_IFNAME chosen in each worker (`choose_interface`)."""

    @property
    def backend_cls(self):
        return _Backend
