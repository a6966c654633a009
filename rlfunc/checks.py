"""Input checks shared by the pure functions: clear errors that name the argument and the problem.

Checks that need a value on the host (finite-ness) are skipped under ``torch.func`` transforms, where a
data-dependent branch is not allowed; shapes and dtypes are always checked.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

__all__ = [
    "bind",
    "check_finite",
    "check_finite_fast",
    "check_floating",
    "check_mask",
    "check_same_shape",
    "check_shape",
    "is_transformed",
]


def is_transformed(x: Tensor) -> bool:
    """True when ``x`` is wrapped by ``torch.func`` (vmap / grad), where host syncs are not allowed."""
    return torch._C._functorch.is_functorch_wrapped_tensor(x)


def check_shape(name: str, x: Tensor, dims: str, bound: dict[str, int] | None = None) -> dict[str, int]:
    """Check ``x`` against an einops-style spec such as ``"b t"``; return the bindings of the dim names.

    Names already in ``bound`` must match; a dim written as a number must equal it.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    names = dims.split()
    bound = {} if bound is None else bound
    expected = "(" + ", ".join(str(bound.get(n, n)) for n in names) + ("," if len(names) == 1 else "") + ")"
    if x.dim() != len(names):
        raise ValueError(f"{name} must have shape {expected} [{dims}], got {tuple(x.shape)}")
    for n, size in zip(names, x.shape):
        want = int(n) if n.isdigit() else bound.get(n)
        if want is not None and want != size:
            raise ValueError(f"{name} must have shape {expected} [{dims}], got {tuple(x.shape)}")
        if not n.isdigit():
            bound[n] = size
    return bound


def check_same_shape(ref_name: str, ref: Tensor, **others: Tensor | None) -> None:
    for name, x in others.items():
        if x is None:
            continue
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.shape != ref.shape:
            raise ValueError(
                f"{name} has shape {tuple(x.shape)} but {ref_name} has shape {tuple(ref.shape)}; they must match"
            )


def check_mask(name: str, mask: Tensor) -> None:
    """Masks are ``torch.bool``: a float mask could carry fractional weights that the ops would ignore."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must be a torch.bool mask, got {mask.dtype}; convert with `{name}.bool()`")


def check_finite(name: str, x: Tensor, where: Tensor | None = None) -> None:
    """Raise if ``x`` holds NaN or inf (only where ``where`` is true, when given)."""
    if is_transformed(x) or (where is not None and is_transformed(where)):
        return
    bad = ~torch.isfinite(x)
    if where is not None:
        bad = bad & where
    if bool(bad.any()):
        idx = bad.nonzero()[0].tolist()
        raise ValueError(f"{name} contains a non-finite value ({x[tuple(idx)]}) at index {tuple(idx)}")


def check_finite_fast(name: str, x: Tensor, where: Tensor | None = None) -> bool:
    """:func:`check_finite` after a one-pass screen: a finite sum proves every entry finite.

    Only when the sum is not finite (a NaN/inf somewhere, possibly outside ``where``, or an overflow)
    does the exact, masked check run, so the common case costs one reduction and one host read.
    Skipped under ``torch.func`` transforms, as ``check_finite``. Returns whether every entry of ``x``
    (inside the mask or not) is known to be finite, in which case masking may multiply by 0 instead of
    selecting.
    """
    if is_transformed(x) or (where is not None and is_transformed(where)):
        return False
    if bool(torch.isfinite(x.sum())):
        return True
    check_finite(name, x, where=where)
    return False


def check_floating(name: str, x: Tensor) -> None:
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")


def bind(specs: Mapping[str, tuple[Tensor | None, str]]) -> dict[str, int]:
    """Check several tensors against their specs with shared dim names; ``None`` entries are skipped."""
    bound: dict[str, int] = {}
    for name, (x, dims) in specs.items():
        if x is not None:
            check_shape(name, x, dims, bound)
    return bound
