"""What a run on several nodes needs of each node, checked at start-up so that a node that lacks it fails with
its name and the reason, instead of every node waiting in the first collective until the process-group timeout.

- :func:`check_gloo_interface` (before the process group exists): gloo, which carries every CPU-tensor
  collective (object broadcasts, the checkpoint's coordination, the weight broadcast's headers), binds to the
  address this node's hostname resolves to, or to ``GLOO_SOCKET_IFNAME``'s interface when it is set
  (PyTorch's ``ProcessGroupGloo``; with a hostname it cannot use it falls back to the loopback address with a
  warning). A hostname that resolves to a loopback address (the ``127.0.1.1 <hostname>`` line many images
  ship in ``/etc/hosts``) makes the other nodes connect to themselves: the run hangs at start-up.
- :func:`check_shared_paths` (a collective, once the group exists): the run dir, the model and the data files
  must be on a filesystem every node sees (global rank 0 writes the run dir and the exported model; every rank
  reads the model and data, and writes its checkpoint shards under the run dir).
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
from pathlib import Path
from typing import Mapping

import torch.distributed as dist

__all__ = ["check_gloo_interface", "check_shared_paths", "NodeSetupError"]

_MARKER = ".rlfunc_shared_fs_check"


class NodeSetupError(RuntimeError):
    """A node of a multi-node run lacks what the run needs of it (the message names the node and the fix)."""


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    return int(value) if value not in (None, "") else None


def check_gloo_interface(env: Mapping[str, str] | None = None, hostname: str | None = None) -> None:
    """Refuse a multi-node torchrun (``WORLD_SIZE`` > ``LOCAL_WORLD_SIZE``) whose gloo would bind to an address other
    nodes cannot reach: ``GLOO_SOCKET_IFNAME`` naming an interface this node lacks or the loopback, or, without it, a
    hostname that does not resolve or resolves to a loopback address. ``env`` / ``hostname``: this process's
    by default."""
    env = os.environ if env is None else env
    world, local = _env_int(env, "WORLD_SIZE"), _env_int(env, "LOCAL_WORLD_SIZE")
    if world is None or local is None or world <= local:
        return  # one node: every rank reaches the others over the loopback
    hostname = socket.gethostname() if hostname is None else hostname
    where = f"node {hostname} (rank {env.get('RANK', '?')} of a {world}-rank run over several nodes)"
    fix = (
        "set GLOO_SOCKET_IFNAME to the interface the nodes reach each other on (`ip -brief addr`; e.g. eth0 or "
        "ib0) on every node, or map the hostname to that interface's address in /etc/hosts"
    )
    names = env.get("GLOO_SOCKET_IFNAME")
    if names:
        present = {name for _, name in socket.if_nameindex()}
        for name in names.split(","):
            if name not in present:
                raise NodeSetupError(
                    f"{where}: GLOO_SOCKET_IFNAME={names} names {name!r}, which this node does not "
                    f"have (it has {sorted(present)}): {fix}"
                )
            if name == "lo" or name.startswith("lo:"):
                raise NodeSetupError(
                    f"{where}: GLOO_SOCKET_IFNAME={names} is the loopback, which other nodes cannot reach: {fix}"
                )
        return
    try:
        addresses = sorted({info[4][0] for info in socket.getaddrinfo(hostname, None)})
    except OSError as e:
        raise NodeSetupError(
            f"{where}: the hostname does not resolve ({e}), so gloo would bind to the loopback "
            f"address, which other nodes cannot reach: {fix}"
        ) from None
    if all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        raise NodeSetupError(
            f"{where}: the hostname resolves to {', '.join(addresses)}, a loopback address, and gloo "
            f"binds to it: the other nodes cannot reach this one and the run would hang: {fix}"
        )


def check_shared_paths(run_dir: Path, paths: Mapping[str, Path], *, group: object = None) -> None:
    """Every rank of ``group`` sees ``run_dir`` (global rank 0's check file in it) and each of ``paths`` (a setting's
    name -> the path it gave) that any rank sees; else a :class:`NodeSetupError` on every rank naming each node, its
    ranks and what it cannot see. A path no rank sees is left to the check that reads it (a missing file is the
    user's typo, not a node's). A collective; call it after rank 0 created ``run_dir``."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    first = dist.get_rank(group) == 0
    marker = Path(run_dir) / _MARKER
    box = [secrets.token_hex(8) if first else None]
    if first:
        marker.write_text(box[0])
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    try:
        sees_run_dir = marker.read_text() == box[0]
    except OSError:
        sees_run_dir = False
    # (setting, what this rank looked for): the paths as this rank was given them
    lacks = [] if sees_run_dir else [("run_dir", f"the run dir {run_dir} (global rank 0 wrote {_MARKER} there)")]
    lacks += [(name, f"{name}={path}") for name, path in paths.items() if not Path(path).exists()]
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (socket.gethostname(), dist.get_rank(), lacks), group=group)
    if first:
        marker.unlink(missing_ok=True)
    nowhere = set.intersection(*({name for name, _ in lacking} for _, _, lacking in everyone))
    by_node: dict[tuple[str, tuple[str, ...]], list[int]] = {}
    for host, rank, lacking in everyone:
        shown = tuple(text for name, text in lacking if name not in nowhere)
        if shown:
            by_node.setdefault((host, shown), []).append(rank)
    if by_node:
        lines = [
            f"node {host} (ranks {', '.join(map(str, ranks))}) does not see {'; '.join(shown)}"
            for (host, shown), ranks in by_node.items()
        ]
        raise NodeSetupError(
            "every node must see the run dir, the model and the data at the same paths (a shared "
            "filesystem: NFS, Lustre, ...), and other nodes do: " + " | ".join(lines)
        )
