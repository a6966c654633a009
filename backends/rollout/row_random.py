"""Uniforms keyed by ``(seed, row, draw)``: the randomness of a row depends on nothing but its own key.

A sampler that draws from one shared generator gives row ``r`` the ``r``-th number of each step's draw, so its
samples depend on how many rows step with it and in which order. The native engine's lock-step loop and its
continuous-batching scheduler step different sets of rows at different times; both invert each row's CDF at
``row_uniforms(seed, row, k)`` for its ``k``-th sampled token, so a row samples the same tokens in either (given
the same logits), and a request admitted late draws what it would have drawn first.

A call that runs several requests' prompts as one batch (a rollout server gathering its agents' calls) passes
:class:`RowKeys` as its seed instead of an int: row ``r`` then draws what row ``rows[r]`` of a call seeded
``seeds[r]`` draws, so each request samples what it would alone, whichever requests share the call.

The hash is MurmurHash3's 32-bit finaliser (``fmix32``) chained over the key's 32-bit words; each product is
split into 16-bit halves so no intermediate leaves int64's range. The uniform is the hash's top 24 bits times
2**-24: exactly representable in float32, in [0, 1).
"""

from __future__ import annotations

from typing import Sequence

import attrs
import torch
from torch import Tensor

__all__ = ["RowKeys", "keyed_uniforms", "row_uniforms", "fmix32", "seed_word"]

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


def seed_word(seed: int) -> int:
    """A 32-bit word from any Python int seed (negative and 64-bit seeds included)."""
    seed = int(seed) & ((1 << 64) - 1)
    return fmix32(fmix32((seed & _MASK32) ^ _GOLDEN) ^ (seed >> 32))


def _check_keys(instance: RowKeys, attribute: attrs.Attribute, value: tuple[int, ...]) -> None:
    if len(instance.seeds) != len(instance.rows):
        raise ValueError(f"RowKeys: {len(instance.seeds)} seeds for {len(instance.rows)} rows; give one seed per row")
    if any(r < 0 for r in instance.rows):
        raise ValueError(f"RowKeys: rows must be non-negative, got {min(instance.rows)}")


@attrs.frozen
class RowKeys:
    """The key of each row of one batched call: row ``r`` draws as row ``rows[r]`` of a call seeded ``seeds[r]``."""

    seeds: tuple[int, ...] = attrs.field(converter=lambda v: tuple(int(x) for x in v))
    rows: tuple[int, ...] = attrs.field(converter=lambda v: tuple(int(x) for x in v), validator=_check_keys)
    #: the seeds as hash words, once (a decode step asks for them every token)
    words: tuple[int, ...] = attrs.field(init=False, eq=False, repr=False)

    #: (words, rows) as int64 tensors per device, built at the first draw there (a decode step draws every token)
    _tensors: dict = attrs.field(init=False, factory=dict, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "words", tuple(seed_word(s) for s in self.seeds))

    def tensors(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """The seeds' hash words and the rows as int64 tensors on ``device``."""
        if device not in self._tensors:
            self._tensors[device] = tuple(
                torch.tensor(x, dtype=torch.long, device=device) for x in (self.words, self.rows)
            )
        return self._tensors[device]

    @classmethod
    def of_requests(cls, seeds: Sequence[int], row_counts: Sequence[int]) -> RowKeys:
        """The keys of requests laid end to end: request ``i`` has ``row_counts[i]`` rows, seeded ``seeds[i]``."""
        return cls(
            seeds=[s for s, count in zip(seeds, row_counts) for _ in range(count)],
            rows=[r for count in row_counts for r in range(count)],
        )


def row_uniforms(seed: int | RowKeys, rows: Tensor, draws: Tensor | int) -> Tensor:
    """float32 uniforms in [0, 1): element ``i`` is keyed by ``(seed, rows[i], draws[i])`` (``draws`` broadcasts);
    with :class:`RowKeys`, by ``(seed.seeds[rows[i]], seed.rows[rows[i]], draws[i])``.

    ``rows`` and ``draws`` are non-negative integer tensors (or ``draws`` an int) below 2**32.
    """
    rows = rows.long()
    if isinstance(seed, RowKeys):
        words, keyed_rows = seed.tensors(rows.device)
        return keyed_uniforms(words[rows], keyed_rows[rows], draws)
    return keyed_uniforms(seed_word(seed), rows, draws)


def keyed_uniforms(key: Tensor | int, rows: Tensor, draws: Tensor | int) -> Tensor:
    """float32 uniforms in [0, 1) keyed by ``(key, rows, draws)``, ``key`` a seed's hash word (:func:`seed_word`)
    per element or one for all: what :func:`row_uniforms` draws, for a caller that keeps each row's key itself (a
    batch whose rows come and go)."""
    rows = rows.long()
    draws = torch.as_tensor(draws, dtype=torch.long, device=rows.device)
    h = fmix32((rows & _MASK32) ^ key)
    h = fmix32((h + _GOLDEN) & _MASK32 ^ (draws & _MASK32))
    h = fmix32(h ^ key)
    return (h >> 8).float() * (2.0**-24)
