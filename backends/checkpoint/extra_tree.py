"""The recipe's ``extra`` tree in a checkpoint: a JSON skeleton plus its tensor leaves.

``extra`` (data position, KL-controller state, counters) is small and mostly scalars, so it is stored as
JSON in the checkpoint's marker; its tensors go through DCP with the weights, and the skeleton names
them by ``{"__tensor__": key}``. Nothing in it is pickled.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor

__all__ = ["TENSOR_TAG", "split_extra", "join_extra"]

#: the key of a skeleton node that stands for a tensor leaf (reserved: ``extra`` may not use it)
TENSOR_TAG = "__tensor__"


def split_extra(extra: Any) -> tuple[Any, dict[str, Tensor]]:
    """Replace tensor leaves with ``{"__tensor__": key}``; return (JSON skeleton, {key: tensor})."""
    tensors: dict[str, Tensor] = {}

    def walk(value: Any, where: str) -> Any:
        if isinstance(value, Tensor):
            if type(value) is not Tensor and not isinstance(value, torch.nn.Parameter):
                raise TypeError(f"extra{where} is a {type(value).__name__}; only plain tensors can go in extra")
            key = f"t{len(tensors)}"
            tensors[key] = value.detach().cpu().clone()
            return {TENSOR_TAG: key}
        if isinstance(value, Mapping):
            out = {}
            for k, v in value.items():
                if not isinstance(k, str):
                    raise TypeError(f"extra{where} has a {type(k).__name__} key {k!r}; keys must be str (JSON)")
                if k == TENSOR_TAG:
                    raise ValueError(f"extra{where} uses the reserved key {TENSOR_TAG!r}")
                out[k] = walk(v, f"{where}[{k!r}]")
            return out
        if isinstance(value, (list, tuple)):
            return [walk(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            return float(value)
        if type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():
            return value.item()
        raise TypeError(
            f"extra{where} is a {type(value).__name__}; extra holds dicts, lists, None, bool, int, float, str "
            "and torch tensors (convert arrays to tensors)"
        )

    skeleton = walk({} if extra is None else extra, "")
    return skeleton, tensors


def join_extra(skeleton: Any, tensors: Mapping[str, Tensor]) -> Any:
    """The tree :func:`split_extra` was given, from its skeleton and tensors."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {TENSOR_TAG}:
            return tensors[skeleton[TENSOR_TAG]]
        return {k: join_extra(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [join_extra(v, tensors) for v in skeleton]
    return skeleton
