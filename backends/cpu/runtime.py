"""Process-wide CPU tuning for training and rollout: an explicit call a recipe makes (never a side effect of
joining a process group), because it changes the allocator and library settings of the whole process."""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["ONEDNN_CACHE_CAPACITY", "bound_onednn_caches", "reuse_freed_cpu_memory", "tune_process"]


def tune_process() -> dict[str, bool]:
    """Apply every CPU process setting below; returns which applied. Call it first thing in a recipe (before
    the first CPU linear runs): oneDNN reads its cache sizes once. Harmless on GPU runs (the host side of a
    GPU job allocates too)."""
    bound_onednn_caches()
    return {"malloc": reuse_freed_cpu_memory(), "onednn_caches": True}


def reuse_freed_cpu_memory() -> bool:
    """Ask glibc's malloc to keep freed blocks up to 32 MiB in the heap rather than unmapping them.

    By default glibc serves allocations above a (dynamic) threshold with fresh ``mmap`` pages and
    returns them on ``free``, so every activation tensor of a training step page-faults its memory in
    again. Raising the mmap and trim thresholds (what jemalloc / tcmalloc, the allocators PyTorch's CPU
    tuning guides recommend, do by design) lets a step reuse the previous step's memory instead, which
    avoids many of those page faults. Process-wide; a no-op without glibc. Returns whether it applied.
    Opt out with ``RLFUNC_MALLOC_TUNING=0``.
    """
    if os.environ.get("RLFUNC_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    ok = libc.mallopt(m_mmap_threshold, 32 * 2**20) == 1  # glibc's largest mmap threshold on 64-bit
    return libc.mallopt(m_trim_threshold, 2**30) == 1 and ok


#: entries kept by each of oneDNN's two shape-keyed caches (see :func:`bound_onednn_caches`)
ONEDNN_CACHE_CAPACITY = 128


def bound_onednn_caches(capacity: int = ONEDNN_CACHE_CAPACITY) -> None:
    """Keep at most ``capacity`` entries in oneDNN's primitive cache and in ideep's LRU cache (PyTorch's
    CPU linear), where each defaults to 1024.

    Both are keyed by the full shape, and RL keeps meeting new shapes: the native rollout's prepacked
    linears see a new row count whenever its working batch shrinks, and where PyTorch runs a CPU product
    through oneDNN (bf16 products, on CPUs with AVX-512) a packed micro-batch's token count is new at every
    step. Each new shape adds GEMM primitives that stay cached until 1024 of them are: the heap grows step
    after step (the retained primitives and the fragmentation around them), and a phase that grows it is
    slowed by page faults on fresh memory. A bound of 128 still holds the few dozen shapes the rollout
    reuses every step, and the heap levels off. The variables are read when oneDNN
    first creates a primitive, so this must run before the first CPU linear; a value the user has set is
    kept.
    """
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(capacity))
