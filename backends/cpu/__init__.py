"""Optional CPU acceleration: C kernels (``csrc/``, built on first use) and the modules that run them.

Nothing outside this package imports its submodules: the rest of ``backends`` reaches it only through
the seams named here, each of which falls back to plain PyTorch (or says it cannot help) where a kernel
is missing, the CPU lacks the instructions, or the tensors are not on the CPU:

- ``accelerate(model)``: swap the fused training modules (RMSNorm, SwiGLU, packed attention) into a HF
  model; returns how many were swapped.
- ``packed_attention(query, key, value, layout, scale)``: causal attention over packed rows (the
  kernel attention backend for packed micro-batches).
- ``onednn_linear_works(dtype)``: whether oneDNN's prepacked linear runs here (the native rollout's
  linear layers use it).
- ``decode_strategy(...)``: the native rollout decoder's kernel KV-cache / attention strategy.
- ``tune_process()``: process-wide allocator and oneDNN cache settings, called explicitly by recipes.

The submodules load lazily, on the first use of a seam, so importing ``backends.cpu`` compiles nothing.
"""

from __future__ import annotations

import importlib
from typing import Any

_SEAMS = {
    "accelerate": "backends.cpu.fused_modules",
    "packed_attention": "backends.cpu.fused_modules",
    "onednn_linear_works": "backends.cpu.fused_modules",
    "decode_strategy": "backends.cpu.decode",
    "tune_process": "backends.cpu.runtime",
}

__all__ = sorted(_SEAMS)


def __getattr__(name: str) -> Any:
    module = _SEAMS.get(name)
    if module is None:
        raise AttributeError(f"module 'backends.cpu' has no attribute {name!r} (its seams: {', '.join(__all__)})")
    return getattr(importlib.import_module(module), name)
