"""What a checkpoint records to be recognised again: its config (flattened to dotted keys, hashed, diffed
against the config of a resume) and each model's fingerprint (parameter names and global shapes).

A resume compares both before loading any weight, so a checkpoint of another model or another run's
settings is refused with every differing key or parameter named, not loaded into the wrong place.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Mapping

import attrs
import torch
from torch import Tensor

__all__ = [
    "json_value",
    "flatten_config",
    "config_hash",
    "config_diff",
    "state_dict_fingerprint",
    "model_fingerprint",
    "model_config_json",
    "fingerprint_diff",
]


def json_value(value: Any) -> Any:
    """A JSON-safe version of a config value (tuples -> lists, dtypes / paths / enums -> strings)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if attrs.has(type(value)):
        return {f.name: json_value(getattr(value, f.name)) for f in attrs.fields(type(value))}
    if isinstance(value, Mapping):
        return {str(k): json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_value(v) for v in value]
    if hasattr(value, "value") and type(value).__module__ == "enum":  # pragma: no cover - rare
        return json_value(value.value)
    return str(value)


def flatten_config(config: Mapping[str, Any] | Any | None) -> dict[str, Any]:
    """Flatten a config (nested dicts and attrs objects) to ``{"dotted.key": json_value}``.

    ``flatten_config({"actor": OptimConfig(lr=1e-5)})["actor.lr"] == 1e-5``. Lists and tuples are
    leaves (as JSON lists).
    """
    if config is None:
        return {}
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if attrs.has(type(value)):
            value = {f.name: getattr(value, f.name) for f in attrs.fields(type(value))}
        if isinstance(value, Mapping):
            if not value and prefix:
                out[prefix] = {}
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
            return
        out[prefix] = json_value(value)

    if not (isinstance(config, Mapping) or attrs.has(type(config))):
        raise TypeError(f"config must be a mapping or an attrs object, got {type(config).__name__}")
    walk("", config)
    return out


def config_hash(flat_config: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of a flattened config."""
    return hashlib.sha256(json.dumps(dict(flat_config), sort_keys=True).encode()).hexdigest()


def config_diff(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """One line per key whose value differs: ``key: checkpoint <saved>, now <current>``."""
    missing = object()
    lines = []
    for key in sorted(set(saved) | set(current)):
        a, b = saved.get(key, missing), current.get(key, missing)
        if a != b:
            fa = "<not set>" if a is missing else json.dumps(a)
            fb = "<not set>" if b is missing else json.dumps(b)
            lines.append(f"{key}: checkpoint {fa}, now {fb}")
    return lines


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def state_dict_fingerprint(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``{"sha256", "params": [[name, shape, dtype], ...]}`` of a state dict's tensors (see
    :func:`model_fingerprint`)."""
    params = [
        [name, list(value.shape), _dtype_name(value.dtype)]
        for name, value in state_dict.items()
        if isinstance(value, Tensor)
    ]
    digest = hashlib.sha256(json.dumps([[n, s] for n, s, _ in sorted(params)]).encode()).hexdigest()
    return {"sha256": digest, "params": params}


def model_fingerprint(module: torch.nn.Module) -> dict[str, Any]:
    """``{"sha256", "params": [[name, global_shape, dtype], ...], "model_type"}`` of a (sharded) model.

    The hash covers names and global shapes (not dtypes, not values): two checkpoints of the same
    architecture have the same fingerprint.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    fp = state_dict_fingerprint(get_model_state_dict(module))
    fp["model_type"] = getattr(getattr(module, "config", None), "model_type", None)
    return fp


#: HF config entries that do not change the model's function (runtime switches, bookkeeping)
_VOLATILE_CONFIG_KEYS = frozenset(
    {
        "use_cache",
        "dtype",
        "torch_dtype",
        "transformers_version",
        "_name_or_path",
        "architectures",
        "attn_implementation",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "_commit_hash",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "gradient_checkpointing",
    }
)


def model_config_json(module: torch.nn.Module) -> dict[str, Any] | None:
    """The module's HF config as JSON, without runtime switches (compared on load: a warning if it differs)."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return None
    return {k: json_value(v) for k, v in sorted(config.to_dict().items()) if k not in _VOLATILE_CONFIG_KEYS}


def fingerprint_diff(saved: list, current: list, limit: int = 6) -> list[str]:
    """Lines naming the parameters missing on either side and the shapes that differ (at most ``limit`` each)."""
    a = {n: s for n, s, _ in saved}
    b = {n: s for n, s, _ in current}
    lines = []
    missing = sorted(set(a) - set(b))
    unexpected = sorted(set(b) - set(a))
    shapes = sorted(n for n in set(a) & set(b) if list(a[n]) != list(b[n]))
    if missing:
        lines.append(
            f"{len(missing)} parameter(s) in the checkpoint but not in the model: {', '.join(missing[:limit])}"
            + (" ..." if len(missing) > limit else "")
        )
    if unexpected:
        lines.append(
            f"{len(unexpected)} parameter(s) in the model but not in the checkpoint: {', '.join(unexpected[:limit])}"
            + (" ..." if len(unexpected) > limit else "")
        )
    for n in shapes[:limit]:
        lines.append(f"shape of {n}: checkpoint {tuple(a[n])}, model {tuple(b[n])}")
    if len(shapes) > limit:
        lines.append(f"... and {len(shapes) - limit} more shape mismatches")
    return lines
