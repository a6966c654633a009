"""Uniforms keyed by ``(seed, row, draw)``: the randomness of a row depends on nothing but its own key.

A sampler that draws from one shared generator gives row ``r`` the ``r``-th number of each step's draw, so its
samples depend on how many rows step with it and in which order. The native engine's lock-step loop and its
continuous-batching scheduler step different sets of rows at different times; both invert each row's CDF at
``row_uniforms(seed, row, k)`` for its ``k``-th sampled token, so a row samples the same tokens in either (given
the same logits), and a request admitted late draws what it would have drawn first.

The hash is MurmurHash3's 32-bit finaliser (``fmix32``) chained over the key's 32-bit words; each product is
split into 16-bit halves so no intermediate leaves int64's range. The uniform is the hash's top 24 bits times
2**-24: exactly representable in float32, in [0, 1).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["row_uniforms", "fmix32"]

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # 2**32 / golden ratio: separates the words of the key


def _mul32(x: Tensor | int, c: int) -> Tensor | int:
    """``(x * c) mod 2**32`` for ``x`` in [0, 2**32) without overflowing int64: ``c * (hi * 2**16 + lo)``."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _MASK32


def fmix32(x: Tensor | int) -> Tensor | int:
    """MurmurHash3's finaliser on 32-bit words (int64 tensors or Python ints in [0, 2**32))."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _seed_word(seed: int) -> int:
    """A 32-bit word from any Python int seed (negative and 64-bit seeds included)."""
    seed = int(seed) & ((1 << 64) - 1)
    return fmix32(fmix32((seed & _MASK32) ^ _GOLDEN) ^ (seed >> 32))


def row_uniforms(seed: int, rows: Tensor, draws: Tensor | int) -> Tensor:
    """float32 uniforms in [0, 1): element ``i`` is keyed by ``(seed, rows[i], draws[i])`` (``draws`` broadcasts).

    ``rows`` and ``draws`` are non-negative integer tensors (or ``draws`` an int) below 2**32.
    """
    key = _seed_word(seed)
    rows = rows.long()
    draws = torch.as_tensor(draws, dtype=torch.long, device=rows.device)
    h = fmix32((rows & _MASK32) ^ key)
    h = fmix32((h + _GOLDEN) & _MASK32 ^ (draws & _MASK32))
    h = fmix32(h ^ key)
    return (h >> 8).float() * (2.0**-24)
