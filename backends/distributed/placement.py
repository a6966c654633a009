"""Role placement: which ranks hold which roles, and moving batches between those rank pools.

Two modes (``PlacementConfig.mode``), as verl's colocated default and its ``examples/split_placement``:

- ``colocated`` (default): every role (actor + rollout, critic, reference) lives on every rank, sharded
  over one data-parallel mesh; the phases of a step alternate on the same ranks.
- ``split``: two disjoint pools of ranks. The **actor pool** (the first ``actor_pool`` ranks) holds
  the actor and the rollout engine; the **critic pool** (the remaining ``critic_pool`` ranks) holds the
  critic and the reference. Each pool's models are FSDP-sharded over the pool's own 1-D sub-mesh
  ("dp"), so the pools work at the same time: while the actor pool updates the policy and syncs the
  rollout weights, the critic pool updates the value model.

The pools' meshes are sub-meshes of the world: one ``DeviceMesh`` per pool, built over that pool's
ranks (every rank takes part in creating every pool's group, as ``new_group`` requires). A 2-D
``("role", "dp")`` mesh would give the same groups but only for pools of equal size; a mesh per pool
also allows, say, 1 actor rank and 3 critic ranks (FSDP2's ``fully_shard`` on gloo accepts such a
mesh; checked on 4 ranks).

Batches cross between pools with point-to-point collectives (:func:`redistribute`): the rows of the
source pool, concatenated in rank order, are the global batch; the destination ranks receive
contiguous row ranges of it (near-equal by default), so pools of different sizes work; only the pieces
that change hands are sent. In colocated mode the moves are the identity and nothing is communicated.
"""

from __future__ import annotations

from typing import Any, Literal, Sequence

import attrs
import torch
import torch.distributed as dist
from torch import Tensor

from backends.distributed.setup import DistEnv, device_mesh

__all__ = [
    "PlacementConfig",
    "Placement",
    "PlacementError",
    "pool_ranks",
    "build_placement",
    "colocated_on_pool",
    "redistribute",
    "concat_padded",
    "pad_to",
    "trim_to",
]

#: the pool each role lives in under split placement
ROLE_POOL = {"actor": "actor", "rollout": "actor", "critic": "critic", "reference": "critic"}


class PlacementError(ValueError):
    """A placement that cannot be built on this world (pool sizes, empty pool, unknown role)."""


@attrs.frozen
class PlacementConfig:
    """Where the roles run (see the module docstring)."""

    #: colocated: every role on every rank; split: actor + rollout and critic + reference on their own pools
    mode: Literal["colocated", "split"] = "colocated"
    #: split: ranks of the actor pool (actor + rollout), the first ranks; 0 = the world minus the critic pool (half if
    #: both are 0)
    actor_pool: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    #: split: ranks of the critic pool (critic + reference), the ranks after the actor pool; 0 = the rest
    critic_pool: int = attrs.field(default=0, validator=attrs.validators.ge(0))


def pool_ranks(cfg: PlacementConfig, world_size: int) -> dict[str, tuple[int, ...]]:
    """The global ranks of each pool (``"actor"``, ``"critic"``); a clear error for an impossible layout."""
    if cfg.mode == "colocated":
        if cfg.actor_pool or cfg.critic_pool:
            raise PlacementError(
                f"placement.actor_pool / placement.critic_pool ({cfg.actor_pool}, {cfg.critic_pool}) are for "
                "placement.mode=split; colocated placement puts every role on all ranks"
            )
        everyone = tuple(range(world_size))
        return {"actor": everyone, "critic": everyone}
    if cfg.mode != "split":
        raise PlacementError(f"placement.mode must be 'colocated' or 'split', got {cfg.mode!r}")
    if world_size < 2:
        raise PlacementError(f"placement.mode=split needs at least 2 ranks (one per pool), the world has {world_size}")
    actor = cfg.actor_pool or (world_size - cfg.critic_pool if cfg.critic_pool else world_size // 2)
    critic = cfg.critic_pool or world_size - actor
    if actor < 1 or critic < 1:
        raise PlacementError(
            f"placement.mode=split: empty pool (actor_pool={actor}, critic_pool={critic}) on {world_size} ranks; "
            "each pool needs at least one rank"
        )
    if actor + critic != world_size:
        raise PlacementError(
            f"placement.actor_pool={actor} + placement.critic_pool={critic} = {actor + critic} ranks, but the "
            f"world has {world_size}: the pools must cover every rank exactly once"
        )
    return {"actor": tuple(range(actor)), "critic": tuple(range(actor, world_size))}


@attrs.frozen
class Placement:
    """This rank's view of the layout: the pools' global ranks, and for the pools it belongs to, the
    pool's mesh and a :class:`DistEnv` whose rank / world size / group are those of the pool."""

    mode: str
    world: DistEnv
    pools: dict[str, tuple[int, ...]]
    meshes: dict[str, Any]  # pool -> DeviceMesh, only the pools this rank is in
    envs: dict[str, DistEnv]  # pool -> this rank's DistEnv within it, only the pools this rank is in

    @property
    def split(self) -> bool:
        return self.mode == "split"

    def _pool(self, role: str) -> str:
        if role not in ROLE_POOL:
            raise PlacementError(f"unknown role {role!r}; roles: {', '.join(ROLE_POOL)}")
        return ROLE_POOL[role]

    def has(self, role: str) -> bool:
        """Whether this rank holds ``role``."""
        return self._pool(role) in self.envs

    def env(self, role: str) -> DistEnv:
        """This rank's DistEnv within ``role``'s pool (the world's in colocated mode)."""
        pool = self._pool(role)
        if pool not in self.envs:
            raise PlacementError(f"rank {self.world.rank} is not in the {pool} pool (ranks {self.pools[pool]})")
        return self.envs[pool]

    def mesh(self, role: str) -> Any:
        """The 1-D data-parallel mesh ("dp") to build ``role``'s engine on."""
        self.env(role)  # raises for a rank outside the pool
        return self.meshes[self._pool(role)]

    def leader(self, role: str) -> int:
        """Global rank of the first rank of ``role``'s pool (it logs that pool's metrics)."""
        return self.pools[self._pool(role)][0]

    def move(self, batch: Any, src_role: str, dst_role: str, *, like: Any = None) -> Any:
        """Move ``batch`` from ``src_role``'s pool to ``dst_role``'s pool; a collective of all ranks.

        Returns the batch share of this rank on the destination pool and None elsewhere. ``like``: on
        destination ranks, a batch whose row count and padded widths the result must have (the batch
        this rank sent on the way out, to get the same rows back). Colocated: ``batch`` is returned.
        """
        src, dst = self.pools[self._pool(src_role)], self.pools[self._pool(dst_role)]
        if src == dst:
            return batch
        return redistribute(batch, src, dst, like=like if self.world.rank in dst else None)

    def barrier(self) -> None:
        """Wait until every rank of the layout (the world, or the pool an asynchronous run trains on) gets here."""
        if dist.is_initialized() and self.world.world_size > 1:
            dist.barrier(group=self.world.group)

    def share(self, obj: Any, role: str) -> Any:
        """``role``'s pool leader's ``obj`` (picklable: metrics) on every rank; identity when colocated."""
        if not self.split:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.leader(role))
        return box[0]


def build_placement(cfg: PlacementConfig, env: DistEnv) -> Placement:
    """Check the layout against the world, then build each pool's mesh (a collective of all ranks)."""
    pools = pool_ranks(cfg, env.world_size)
    if cfg.mode == "colocated":
        mesh = device_mesh(env)
        return Placement(
            mode=cfg.mode,
            world=env,
            pools=pools,
            meshes={"actor": mesh, "critic": mesh},
            envs={"actor": env, "critic": env},
        )
    from torch.distributed.device_mesh import DeviceMesh

    meshes, envs = {}, {}
    for name, ranks in pools.items():
        # every rank constructs every pool's mesh: creating a process group is collective over the world
        mesh = DeviceMesh(env.device.type, torch.tensor(ranks), mesh_dim_names=("dp",))
        if env.rank in ranks:
            meshes[name] = mesh
            envs[name] = DistEnv(
                rank=ranks.index(env.rank),
                world_size=len(ranks),
                local_rank=env.local_rank,
                device=env.device,
                backend=env.backend,
                group=mesh.get_group(),
            )
    return Placement(mode=cfg.mode, world=env, pools=pools, meshes=meshes, envs=envs)


def colocated_on_pool(env: DistEnv, mesh: Any) -> Placement:
    """Every role on one pool of ranks (``env``: this rank's DistEnv within the pool, ``mesh``: the pool's 1-D mesh):
    the trainer pool of an asynchronous run, whose rollout has ranks of its own. Nothing moves between roles."""
    ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    return Placement(
        mode="colocated",
        world=env,
        pools={"actor": ranks, "critic": ranks},
        meshes={"actor": mesh, "critic": mesh},
        envs={"actor": env, "critic": env},
    )


# ------------------------------------------------------------------------------------ batch transfer

#: how a batch field's named axis is padded when rows of different widths meet: prompts are
#: left-padded, responses right-padded (see rlfunc.batch.RolloutBatch)
_PAD_LEFT = {"p": True, "t": False}


def _fields(batch: Any) -> list[tuple[str, tuple[str, ...]]]:
    if not attrs.has(type(batch)):
        raise TypeError(f"redistribute needs an attrs batch pytree (e.g. RolloutBatch), got {type(batch).__name__}")
    return [(f.name, tuple((f.metadata.get("shape") or "").split())) for f in attrs.fields(type(batch))]


def _describe(batch: Any) -> dict[str, Any]:
    """Row count, class and, per field, (shape, dtype, device type) or None: what a receiver allocates."""
    fields = {}
    rows = None
    for name, dims in _fields(batch):
        value = getattr(batch, name)
        if value is None:
            fields[name] = None
            continue
        if not isinstance(value, Tensor) or not dims or dims[0] != "b":
            raise TypeError(f"redistribute: field {name!r} must be a tensor with a leading row axis 'b'")
        rows = value.shape[0] if rows is None else rows
        if value.shape[0] != rows:
            raise ValueError(f"redistribute: field {name!r} has {value.shape[0]} rows, other fields {rows}")
        fields[name] = (tuple(value.shape), value.dtype, value.device.type)
    return {"cls": type(batch), "rows": rows or 0, "fields": fields}


def _near_equal(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def pad_to(x: Tensor, dims: tuple[str, ...], widths: dict[str, int]) -> Tensor:
    """``x`` (axes named ``dims``) padded to ``widths`` on its ``p`` (left) and ``t`` (right) axes."""
    for axis, dim in enumerate(dims):
        if dim in _PAD_LEFT and x.shape[axis] < widths[dim]:
            shape = list(x.shape)
            shape[axis] = widths[dim] - x.shape[axis]
            pad = torch.zeros(shape, dtype=x.dtype, device=x.device)
            x = torch.cat([pad, x] if _PAD_LEFT[dim] else [x, pad], dim=axis)
    return x


def trim_to(x: Tensor, dims: tuple[str, ...], widths: dict[str, int]) -> Tensor:
    """``x`` cut to ``widths`` on its ``p`` and ``t`` axes, dropping the padding side (the inverse of
    :func:`pad_to`)."""
    for axis, dim in enumerate(dims):
        if dim in _PAD_LEFT and x.shape[axis] > widths[dim]:
            index = slice(x.shape[axis] - widths[dim], None) if _PAD_LEFT[dim] else slice(0, widths[dim])
            x = x[(slice(None),) * axis + (index,)]
    return x


def _widths(batch: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, dims in _fields(batch):
        value = getattr(batch, name)
        if value is not None:
            for axis, dim in enumerate(dims):
                if dim in _PAD_LEFT:
                    out[dim] = value.shape[axis]
    return out


def concat_padded(batches: Sequence[Any]) -> Any:
    """Concatenate batches of one type along rows, padding to the widest prompt (on the left) and
    response (on the right) first, as :func:`redistribute` does for rows arriving from several ranks."""
    if not batches:
        raise ValueError("concat_padded needs at least one batch")
    widths: dict[str, int] = {}
    for b in batches:
        for dim, width in _widths(b).items():
            widths[dim] = max(widths.get(dim, 0), width)
    changes = {}
    for name, dims in _fields(batches[0]):
        values = [getattr(b, name) for b in batches]
        if all(v is None for v in values):
            continue
        if any(v is None for v in values):
            raise ValueError(f"concat_padded: field {name!r} is set in some batches and not in others")
        changes[name] = torch.cat([pad_to(v, dims, widths) for v in values], dim=0)
    return attrs.evolve(batches[0], **changes)


def redistribute(batch: Any, src_ranks: Sequence[int], dst_ranks: Sequence[int], *, like: Any = None) -> Any:
    """Move the rows of a batch held by ``src_ranks`` to ``dst_ranks``; every rank of the world calls it.

    The global batch is the source ranks' batches concatenated in the order of ``src_ranks``
    (``(b1 + b2 + ...) ...``). Destination rank ``j`` receives a contiguous row range of it: near-equal
    shares by default, or, when it passes ``like``, as many rows as ``like`` has (every destination
    rank must then pass one, and the counts must add up). Rows keep their values exactly; when rows of
    different padded widths end up together, the prompt axis ``p`` is left-padded and the response
    axis ``t`` right-padded with zeros / False, as the batch layout defines. With ``like``, the result
    is cut back to ``like``'s widths (the transfer's own padding, on the way back to the ranks that
    sent the rows). Returns the new batch on destination ranks, None on the others.

    Communication: one ``all_gather_object`` of shapes (every rank), then per piece that changes
    ranks one ``isend`` / ``irecv`` per present field. A rank in both lists keeps its own piece.
    """
    world_rank, world = dist.get_rank(), dist.get_world_size()
    src_ranks, dst_ranks = tuple(src_ranks), tuple(dst_ranks)
    for name, ranks in (("src_ranks", src_ranks), ("dst_ranks", dst_ranks)):
        if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < world for r in ranks):
            raise PlacementError(
                f"redistribute: {name}={ranks} must be distinct ranks of a world of {world}, not empty"
            )
    everyone = _exchange_descriptions(batch, like, world_rank, world, is_src=world_rank in src_ranks)
    metas = _source_metas(everyone, src_ranks)
    cls = metas[0]["cls"]
    present = {k for k, v in metas[0]["fields"].items() if v is not None}
    dst_rows = _destination_rows(everyone, dst_ranks, total=sum(m["rows"] for m in metas))
    src_start = [sum(m["rows"] for m in metas[:i]) for i in range(len(metas))]
    pieces = _pieces([m["rows"] for m in metas], dst_rows)
    fields = [(f.name, tuple((f.metadata.get("shape") or "").split())) for f in attrs.fields(cls) if f.name in present]
    received = _send_and_receive(batch, pieces, fields, metas, src_start, src_ranks, dst_ranks, world_rank)
    if world_rank not in dst_ranks:
        return None
    j_me = dst_ranks.index(world_rank)
    mine = [received[k] for k, (_i, j, _lo, _hi) in enumerate(pieces) if j == j_me]
    return _assemble(cls, mine, fields, like)


def _exchange_descriptions(batch: Any, like: Any, world_rank: int, world: int, *, is_src: bool) -> list[dict]:
    """Every rank's ``{"src": description of its batch or None, "want": (rows, widths) of its ``like`` or
    None, "error"}``. A bad batch on one rank fails every rank (the others would wait in the transfer)."""
    mine: dict[str, Any] = {"src": None, "want": None, "error": None}
    try:
        if is_src and batch is None:
            raise ValueError(f"redistribute: rank {world_rank} is a source but has no batch")
        mine["src"] = _describe(batch) if is_src else None
        mine["want"] = None if like is None else (_describe(like)["rows"], _widths(like))
    except (TypeError, ValueError) as e:
        mine["error"] = f"rank {world_rank}: {e}"
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    errors = [m["error"] for m in everyone if m["error"]]
    if errors:
        raise ValueError("redistribute: " + "; ".join(errors))
    return everyone


def _source_metas(everyone: list[dict], src_ranks: tuple[int, ...]) -> list[dict]:
    """The source ranks' batch descriptions, in ``src_ranks`` order; they must agree on type and fields."""
    metas = [everyone[r]["src"] for r in src_ranks]
    cls, present = metas[0]["cls"], {k for k, v in metas[0]["fields"].items() if v is not None}
    for r, m in zip(src_ranks, metas):
        if m["cls"] is not cls or {k for k, v in m["fields"].items() if v is not None} != present:
            raise ValueError(
                f"redistribute: source ranks disagree on the batch type or its present fields (rank {src_ranks[0]}: "
                f"{cls.__name__} {sorted(present)}, rank {r}: {m['cls'].__name__} "
                f"{sorted(k for k, v in m['fields'].items() if v is not None)})"
            )
    return metas


def _destination_rows(everyone: list[dict], dst_ranks: tuple[int, ...], *, total: int) -> list[int]:
    """Rows each destination rank receives: what its ``like`` holds, or near-equal shares of ``total``."""
    wants = [everyone[r]["want"] for r in dst_ranks]
    if any(w is not None for w in wants):
        if any(w is None for w in wants):
            raise ValueError("redistribute: either every destination rank passes `like` or none does")
        dst_rows = [w[0] for w in wants]
        if sum(dst_rows) != total:
            raise ValueError(f"redistribute: destination ranks want {sum(dst_rows)} rows, the sources hold {total}")
        return dst_rows
    if total < len(dst_ranks):
        raise ValueError(f"redistribute: cannot spread {total} rows over {len(dst_ranks)} destination ranks")
    return _near_equal(total, len(dst_ranks))


def _pieces(src_rows: list[int], dst_rows: list[int]) -> list[tuple[int, int, int, int]]:
    """``(src index, dst index, global lo, global hi)``: the intersections of the source row ranges with
    the destination row ranges, in global order."""
    src_start = [sum(src_rows[:i]) for i in range(len(src_rows))]
    dst_start = [sum(dst_rows[:j]) for j in range(len(dst_rows))]
    pieces = []
    for i, rows in enumerate(src_rows):
        for j, n in enumerate(dst_rows):
            lo, hi = max(src_start[i], dst_start[j]), min(src_start[i] + rows, dst_start[j] + n)
            if lo < hi:
                pieces.append((i, j, lo, hi))
    return pieces


def _send_and_receive(
    batch: Any,
    pieces: list,
    fields: list,
    metas: list[dict],
    src_start: list[int],
    src_ranks: tuple[int, ...],
    dst_ranks: tuple[int, ...],
    world_rank: int,
) -> dict[int, dict[str, Tensor]]:
    """Send this rank's pieces, receive the pieces it gets; ``{piece index: {field: rows}}`` of the received
    (and self-kept) ones."""
    received: dict[int, dict[str, Tensor]] = {}
    requests = []
    for k, (i, j, lo, hi) in enumerate(pieces):
        src, dst = src_ranks[i], dst_ranks[j]
        for f, (name, _dims) in enumerate(fields):
            tag = k * len(fields) + f
            if world_rank == src:
                part = getattr(batch, name)[lo - src_start[i] : hi - src_start[i]].contiguous()
                if dst == src:
                    received.setdefault(k, {})[name] = part
                else:
                    requests.append(dist.isend(part, dst, tag=tag))
            elif world_rank == dst:
                shape, dtype, device_type = metas[i]["fields"][name]
                # the sender's device type: CPU tensors travel over gloo, CUDA tensors over NCCL
                device = (
                    torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
                )
                buf = torch.empty((hi - lo, *shape[1:]), dtype=dtype, device=device)
                received.setdefault(k, {})[name] = buf
                requests.append(dist.irecv(buf, src, tag=tag))
    for req in requests:
        req.wait()
    return received


def _assemble(cls: type, parts: list[dict[str, Tensor]], fields: list, like: Any) -> Any:
    """This destination rank's batch from its pieces (in global row order), padded to their widest widths,
    or to ``like``'s widths when given."""
    widths: dict[str, int] = {}
    for part in parts:
        for name, dims in fields:
            for axis, dim in enumerate(dims):
                if dim in _PAD_LEFT:
                    widths[dim] = max(widths.get(dim, 0), part[name].shape[axis])
    out = {}
    for name, dims in fields:
        value = torch.cat([pad_to(part[name], dims, widths) for part in parts], dim=0)
        if like is not None:
            target = _widths(like)
            value = trim_to(pad_to(value, dims, target), dims, target)
        out[name] = value
    return cls(**out)
