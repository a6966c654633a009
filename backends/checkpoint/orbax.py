"""The full (unsharded) train state as an orbax-checkpoint PyTree: the interchange format for JAX users.

API::

    save_orbax(state, path)                   # every rank (gathers); rank 0 writes. -> Path
    tree, meta = read_orbax(path)             # any process, no torch.distributed: numpy arrays
    state = load_orbax(state, path)           # every rank: fills the (sharded) state, returns it with the step
    train_state_tree(state) / tree_to_torch(tree)   # torch <-> numpy helpers

The tree (numpy arrays; bf16 as ``ml_dtypes.bfloat16``; parameter names nested by their dots, so
``model.layers.0.mlp.up_proj.weight`` is ``tree["params"]["model"]["layers"]["0"]["mlp"]["up_proj"]["weight"]``)::

    {"params":    {...},                    # full model weights (HF names; tied weights under each name)
     "opt_state": {"exp_avg": {...}, "exp_avg_sq": {...}, "step": {...}},   # one params-shaped tree per
                                            # optimizer state entry (absent when the optimizer never stepped)
     "step":      int64 scalar}             # the train state's step

The checkpoint's custom metadata (JSON) holds the format tag, the optimizer class and its param
groups (hyper-parameters, parameter names), and the model type. In JAX::

    import orbax.checkpoint as ocp, jax.numpy as jnp
    tree = ocp.PyTreeCheckpointer().restore(path)          # numpy arrays
    params = jax.tree.map(jnp.asarray, tree["params"])

Orbax details handled here: the checkpointer used is the synchronous ``PyTreeCheckpointer``
(the async ``StandardCheckpointer`` needs a wait before restore); dict keys are strings from the start
(integer keys would come back as strings); bf16 goes through ``ml_dtypes``. Only rank 0 touches orbax:
jax in each torchrun process sees itself as a single process, and a multi-process orbax save would
need ``jax.distributed`` and global arrays.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from backends.distributed.collectives import state_ranks
from backends.distributed.sharded_state import reshard

__all__ = ["save_orbax", "read_orbax", "load_orbax", "train_state_tree", "tree_to_torch", "to_numpy", "to_torch"]

FORMAT = "rlfunc.orbax-train-state"
FORMAT_VERSION = 1


# ------------------------------------------------------------------------------------ array conversion


def to_numpy(tensor: Tensor) -> Any:
    """A CPU numpy copy of ``tensor``; bfloat16 becomes ``ml_dtypes.bfloat16`` (bit-exact)."""
    t = tensor.detach().cpu()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
    return t.contiguous().numpy().copy()


def to_torch(array: Any) -> Tensor:
    """The inverse of :func:`to_numpy` (``ml_dtypes.bfloat16`` -> ``torch.bfloat16``)."""
    import numpy as np

    array = np.asarray(array)
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


def _nest(flat: Mapping[str, Any]) -> dict:
    root: dict = {}
    for name, value in flat.items():
        node = root
        parts = name.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"parameter name {name!r} clashes with another parameter")
        if parts[-1] in node:
            raise ValueError(f"parameter name {name!r} clashes with another parameter")
        node[parts[-1]] = value
    return root


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(_flatten(value, name))
        else:
            out[name] = value
    return out


def _json(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_json(v) for v in value]
    if isinstance(value, Tensor) and value.numel() == 1:
        return value.item()
    return str(value)


# ------------------------------------------------------------------------------------------- gather


def _full_state(state: Any) -> tuple[dict[str, Tensor], dict | None]:
    """Full model (and optimizer) state dicts, gathered over the ranks that hold ``state``; complete on
    the first of them (others may get empty dicts)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    optimizer = getattr(state, "optimizer", None)
    with_optim = optimizer is not None and len(optimizer.state) > 0  # never stepped: nothing to save (and
    # get_state_dict would initialise it with a zero step)
    group, _, size = state_ranks(state)
    # cpu_offload keeps the gathered tensors on global rank 0 only: right when the state's first rank is
    # global rank 0 (the world, or the actor pool), else every rank of the group keeps them
    leader_is_rank0 = group is None or dist.get_global_rank(group, 0) == 0
    options = StateDictOptions(full_state_dict=True, cpu_offload=size > 1 and leader_is_rank0)
    msd, osd = get_state_dict(state.module, [optimizer] if with_optim else [], options=options)
    return dict(msd), (osd if with_optim else None)


def train_state_tree(state: Any) -> tuple[dict, dict]:
    """``(tree, metadata)`` of a train state as numpy (collective over the ranks that hold the state: valid
    on the first of them only)."""
    msd, osd = _full_state(state)
    tree: dict[str, Any] = {"params": _nest({k: to_numpy(v) for k, v in msd.items()})}
    meta: dict[str, Any] = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "model_type": getattr(getattr(state.module, "config", None), "model_type", None),
        "param_shapes": {k: list(v.shape) for k, v in msd.items()},
        "optimizer_class": None if getattr(state, "optimizer", None) is None else type(state.optimizer).__name__,
        "optimizer_state": "none" if getattr(state, "optimizer", None) is None else ("saved" if osd else "empty"),
        "param_groups": None,
    }
    if osd:
        per_key: dict[str, dict[str, Any]] = {}
        for fqn, entries in osd["state"].items():
            for key, value in entries.items():
                if not isinstance(value, Tensor):
                    raise TypeError(f"optimizer state {fqn}.{key} is a {type(value).__name__}, not a tensor")
                per_key.setdefault(key, {})[fqn] = to_numpy(value)
        tree["opt_state"] = {key: _nest(values) for key, values in per_key.items()}
        meta["param_groups"] = [{k: _json(v) for k, v in group.items()} for group in osd["param_groups"]]
    import numpy as np

    tree["step"] = np.asarray(int(getattr(state, "step", 0)), dtype=np.int64)
    return tree, meta


# --------------------------------------------------------------------------------------- save / read


def save_orbax(state: Any, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Gather ``state`` (model, optimizer, step) and write it as an orbax PyTree checkpoint from the first
    of the ranks that hold it (its mesh's group: the whole world when colocated, the role's pool under
    split placement).

    Call on every rank that holds ``state`` (and only those). ``path`` must not exist unless
    ``overwrite``. Returns the absolute path on each of them once written. Orbax writes into a temp dir
    and renames it when complete.
    """
    path = Path(path).absolute()
    if path.exists() and not overwrite:
        raise FileExistsError(f"orbax checkpoint {str(path)!r} already exists (pass overwrite=True to replace it)")
    group, rank, size = state_ranks(state)
    tree, meta = train_state_tree(state)
    if rank == 0:
        import orbax.checkpoint as ocp

        path.parent.mkdir(parents=True, exist_ok=True)
        with ocp.PyTreeCheckpointer() as checkpointer:
            checkpointer.save(path, args=ocp.args.PyTreeSave(tree, custom_metadata=meta), force=overwrite)
    if size > 1:
        dist.barrier(group=group)
    return path


def read_orbax(path: str | os.PathLike) -> tuple[dict, dict]:
    """``(tree, metadata)`` of a checkpoint written by :func:`save_orbax`: numpy arrays, no process group."""
    import numpy as np
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    if not path.is_dir():
        raise FileNotFoundError(f"orbax checkpoint {str(path)!r} does not exist")
    with ocp.PyTreeCheckpointer() as checkpointer:
        try:
            step_meta = checkpointer.metadata(path)
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(f"{str(path)!r} is not a complete orbax checkpoint: {e}") from None
        item_meta = getattr(step_meta, "item_metadata", step_meta)
        meta = dict(getattr(item_meta, "custom_metadata", None) or {})
        if meta.get("format") != FORMAT:
            raise ValueError(f"{str(path)!r} is an orbax checkpoint but not an rlfunc train state (format {FORMAT!r})")
        structure = getattr(item_meta, "tree", item_meta)
        restore_args = _map_leaves(structure, lambda _: ocp.RestoreArgs(restore_type=np.ndarray))
        tree = checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=restore_args))
    return tree, meta


def _map_leaves(tree: Any, fn: Any) -> Any:
    if isinstance(tree, Mapping):
        return {k: _map_leaves(v, fn) for k, v in tree.items()}
    return fn(tree)


def tree_to_torch(tree: Mapping[str, Any]) -> tuple[dict[str, Tensor], dict[str, dict[str, Tensor]], int]:
    """``(model_state_dict, {param_name: {optimizer_key: tensor}}, step)`` from a :func:`read_orbax` tree."""
    params = {k: to_torch(v) for k, v in _flatten(tree["params"]).items()}
    optim: dict[str, dict[str, Tensor]] = {}
    for key, values in (tree.get("opt_state") or {}).items():
        for fqn, value in _flatten(values).items():
            optim.setdefault(fqn, {})[key] = to_torch(value)
    return params, optim, int(tree["step"])


# ---------------------------------------------------------------------------------------------- load


def load_orbax(state: Any, path: str | os.PathLike) -> Any:
    """Fill ``state`` (FSDP2-sharded or plain) from an orbax train state; returns it with the saved step.

    Call on every rank: each rank reads the full arrays (the path must be visible to all ranks) and
    keeps its shard (``set_state_dict(..., full_state_dict=True)``). Errors before anything is
    loaded: a missing or foreign checkpoint; other parameter names or shapes (named); an optimizer
    the checkpoint has no state for, or of another class. An optimizer saved as never stepped is left
    empty.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_state_dict

    path = Path(path).absolute()
    tree, meta = read_orbax(path)  # every rank reads (a shared filesystem, as for DCP checkpoints)

    current = {k: list(v.shape) for k, v in get_model_state_dict(state.module).items()}
    saved = meta["param_shapes"]
    if current != saved:
        missing = sorted(set(saved) - set(current))
        unexpected = sorted(set(current) - set(saved))
        shapes = sorted(k for k in set(saved) & set(current) if saved[k] != current[k])
        details = [
            f"in the checkpoint only: {', '.join(missing[:6])}" if missing else "",
            f"in the model only: {', '.join(unexpected[:6])}" if unexpected else "",
            *(f"shape of {k}: checkpoint {tuple(saved[k])}, model {tuple(current[k])}" for k in shapes[:6]),
        ]
        raise ValueError(
            f"orbax checkpoint {str(path)!r} is of another model:\n  " + "\n  ".join(d for d in details if d)
        )
    optimizer = getattr(state, "optimizer", None)
    if optimizer is not None:
        if meta["optimizer_state"] == "none":
            raise ValueError(
                f"orbax checkpoint {str(path)!r} has no optimizer state, but the state being restored has an optimizer"
            )
        if meta["optimizer_class"] != type(optimizer).__name__:
            raise ValueError(
                f"orbax checkpoint {str(path)!r} was saved with optimizer {meta['optimizer_class']}, "
                f"the state being restored uses {type(optimizer).__name__}"
            )
    load_optim = optimizer is not None and meta["optimizer_state"] == "saved"

    msd, optim, step = tree_to_torch(tree)
    osd: dict[str, Any] = {}
    if load_optim:
        groups = []
        for saved_group, group in zip(meta["param_groups"], optimizer.param_groups):
            groups.append(
                {
                    k: (tuple(v) if isinstance(group.get(k), tuple) and isinstance(v, list) else v)
                    for k, v in saved_group.items()
                }
            )
        osd = {"state": optim, "param_groups": groups}
    # every rank holds the full tensors and keeps its own shard of them
    options = StateDictOptions(full_state_dict=True)
    reshard(state.module)
    tuple_keys = (
        [{k for k, v in g.items() if isinstance(v, tuple)} for g in optimizer.param_groups] if load_optim else []
    )
    set_state_dict(
        state.module,
        [optimizer] if load_optim else [],
        model_state_dict=msd,
        optim_state_dict=osd if load_optim else {},
        options=options,
    )
    for group, keys in zip(optimizer.param_groups if load_optim else [], tuple_keys):
        for k in keys:  # DCP's full-state-dict path rebuilds tuples (Adam's betas) as lists
            if isinstance(group.get(k), list):
                group[k] = tuple(group[k])
    if optimizer is not None and not load_optim:
        optimizer.state.clear()
    if hasattr(state, "replace"):
        return state.replace(step=step)
    state.step = step
    return state
