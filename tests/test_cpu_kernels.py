"""The CPU kernels' build and loading (backends/cpu/kernels.py) and the decode-attention kernel
(csrc/decode_attention.c) against PyTorch. The training kernels: tests/test_cpu_fused.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from backends.cpu import kernels as cpu_kernels
from backends.cpu.kernels import decode_attention_kernel, key_blocks

ROOT = Path(__file__).resolve().parents[1]


def _has_avx512() -> bool:
    try:
        return " avx512f" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


#: where the kernel can run, it must: a silent fall back to PyTorch would leave it untested
CAN_RUN = _has_avx512() and shutil.which(os.environ.get("CC", "cc")) is not None
needs_kernel = pytest.mark.skipif(not CAN_RUN, reason="needs an AVX-512 CPU and a C compiler")


def reference(q, k, v, bias, length, scale):
    """fp64 softmax attention of q (b kv g d) over slots [0, length) of k, v (b kv T d)."""
    q, k, v, bias = (x.double() for x in (q, k, v, bias))
    scores = torch.einsum("bjgd,bjld->bjgl", q, k[:, :, :length]) * scale + bias[:, None, None, :length]
    return torch.einsum("bjgl,bjld->bjgd", torch.softmax(scores, -1), v[:, :, :length]).float()


def _case(b, kv, g, d, total, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # q as the decoder hands it over: a slice of a wider (b, heads, d) tensor, so rows are strided
    qkv = torch.randn(b, kv * g + 2 * kv, d, generator=gen) * 2
    q = qkv[:, : kv * g].view(b, kv, g, d)
    k = torch.randn(b, kv, total, d, generator=gen)
    v = torch.randn(b, kv, total, d, generator=gen)
    bias = torch.zeros(b, total)
    bias[::2, : min(3, total - 1)] = float("-inf")  # left padding of some rows (never the newest slot)
    return q, k, v, bias


@needs_kernel
def test_kernel_builds_and_loads_here():
    kernel = decode_attention_kernel(64)
    assert kernel is not None and kernel.available
    assert kernel.library.is_file() and kernel.library.parent == cpu_kernels.kernel_cache_dir()


@needs_kernel
@pytest.mark.parametrize("kv,g,d", [(1, 1, 16), (2, 2, 64), (2, 4, 32), (1, 3, 48), (4, 2, 128), (2, 2, 256)])
@pytest.mark.parametrize("length", [1, 5, 16, 17, 64, 65, 150])
def test_decode_attention_matches_reference(kv, g, d, length):
    b, total = 5, 160
    q, k, v, bias = _case(b, kv, g, d, total, seed=length)
    if length <= 3:
        bias[:, :length] = 0.0  # every row keeps at least one slot
    kernel = decode_attention_kernel(d)
    scratch = torch.empty(g * -(-total // 16) * 16)
    out = kernel(q, key_blocks(k), v, bias, length, d**-0.5, torch.empty(b, kv, g, d), scratch)
    torch.testing.assert_close(out, reference(q, k, v, bias, length, d**-0.5), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_masked_and_unread_slots_contribute_nothing():
    """-inf-biased slots get weight exactly 0 (huge values there change nothing); slots past the
    length are never read (NaN there changes nothing)."""
    b, kv, g, d, total, length = 3, 2, 2, 32, 40, 20
    q, k, v, bias = _case(b, kv, g, d, total)
    kernel = decode_attention_kernel(d)
    scratch = torch.empty(g * 48)
    clean = kernel(q, key_blocks(k), v, bias, length, 0.125, torch.empty(b, kv, g, d), scratch).clone()
    v_poisoned, k_poisoned = v.clone(), k.clone()
    v_poisoned[::2, :, :3] = 1e30  # the masked slots of the padded rows
    v_poisoned[:, :, length:] = float("nan")
    k_poisoned[:, :, length:] = float("nan")
    poisoned = kernel(q, key_blocks(k_poisoned), v_poisoned, bias, length, 0.125, torch.empty(b, kv, g, d), scratch)
    assert torch.equal(clean, poisoned)


@needs_kernel
def test_bf16_caches_read_as_their_float32_values():
    """bf16 caches give exactly what fp32 caches holding the same (bf16) numbers give."""
    b, kv, g, d, total, length = 4, 2, 2, 64, 40, 33
    q, k, v, bias = _case(b, kv, g, d, total)
    k_t = key_blocks(k).to(torch.bfloat16)
    v = v.to(torch.bfloat16)
    kernel = decode_attention_kernel(d)
    assert kernel.bf16_cache  # this build reads bf16 (AVX-512BW/VL)
    scratch = torch.empty(g * 48)
    from_bf16 = kernel(q, k_t, v, bias, length, 0.125, torch.empty(b, kv, g, d), scratch).clone()
    from_fp32 = kernel(q, k_t.float(), v.float(), bias, length, 0.125, torch.empty(b, kv, g, d), scratch)
    assert torch.equal(from_bf16, from_fp32)
    with pytest.raises(TypeError, match="caches float32 or bfloat16"):
        kernel(q, k_t, v.float(), bias, length, 0.125, torch.empty(b, kv, g, d), scratch)
    with pytest.raises(ValueError, match="unsupported layout"):  # a length past the cache
        kernel(q, k_t, v, bias, total + 1, 0.125, torch.empty(b, kv, g, d), torch.empty(g * 64))
    with pytest.raises(ValueError, match="unsupported layout"):  # keys not in transposed blocks
        kernel(q, k.to(torch.bfloat16), v, bias, length, 0.125, torch.empty(b, kv, g, d), scratch)


def test_key_blocks_layout():
    """Slot l of a (b kv T d) key tensor sits at [..., l // 16, :, l % 16]; slots past T are zero."""
    k = torch.randn(2, 3, 21, 32)
    blocks = key_blocks(k, length=40)
    assert blocks.shape == (2, 3, 3, 32, 16) and blocks.is_contiguous()
    for slot in (0, 5, 15, 16, 20):
        assert torch.equal(blocks[:, :, slot // 16, :, slot % 16], k[:, :, slot])
    assert not blocks[:, :, 1, :, 5:].any() and not blocks[:, :, 2].any()


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


@needs_kernel
@pytest.mark.parametrize("kv,g,d", [(1, 1, 16), (2, 2, 64), (2, 4, 32), (1, 5, 48)])
@pytest.mark.parametrize("slot", [0, 6, 15, 16, 40])
def test_fused_decode_step_matches_rope_cache_write_and_attention(kv, g, d, slot):
    """kernel.step (a float32 model's decode step from the fused qkv projection on) = RoPE on the new
    query and key, the key and value written to the slot, and attention over slots [0, slot]: checked
    against those three in float64, and the cache slots against the rotated key and the value."""
    b, total, positions_max = 5, 48, 64
    gen = torch.Generator().manual_seed(slot * 7 + d)
    qkv = torch.randn(b, kv * g + 2 * kv, d, generator=gen)
    k_old = torch.randn(b, kv, total, d, generator=gen)
    v_cache = torch.randn(b, kv, total, d, generator=gen)
    angles = torch.rand(positions_max, d // 2, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    sin_signed = torch.cat([-sin[:, : d // 2], sin[:, d // 2 :]], -1).contiguous()
    positions = torch.randint(0, positions_max, (b,), generator=gen)
    bias = torch.zeros(b, total)
    bias[::2, : min(3, slot)] = float("-inf")  # left padding of some rows (never the new slot)
    k_cache = key_blocks(k_old, length=total)
    kernel = decode_attention_kernel(d)
    out = kernel.step(qkv, cos.contiguous(), sin_signed, positions, k_cache, v_cache, bias, slot, d**-0.5,
                      torch.empty(b, kv, g, d), torch.empty(g * total))
    c, s = cos[positions][:, None].double(), sin[positions][:, None].double()
    q_rot = _rope(qkv[:, : kv * g].double(), c, s).view(b, kv, g, d)
    k_new = _rope(qkv[:, kv * g : kv * g + kv].double(), c, s)
    keys = k_old.double().clone()
    keys[:, :, slot] = k_new
    torch.testing.assert_close(v_cache[:, :, slot], qkv[:, kv * g + kv :])  # the new value, written in place
    torch.testing.assert_close(k_cache[:, :, slot // 16, :, slot % 16].double(), k_new, rtol=1e-6, atol=1e-6)
    scores = torch.einsum("bjgd,bjld->bjgl", q_rot, keys[:, :, : slot + 1]) * d**-0.5 + bias[:, None, None, : slot + 1]
    expected = torch.einsum("bjgl,bjld->bjgd", torch.softmax(scores, -1), v_cache.double()[:, :, : slot + 1])
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="positions outside"):
        kernel.step(qkv, cos.contiguous(), sin_signed, positions + positions_max, k_cache, v_cache, bias, slot, 0.1,
                    torch.empty(b, kv, g, d), torch.empty(g * total))


@needs_kernel
def test_working_rows_address_the_caches_by_index():
    """With ``rows``, working row i reads (and the step writes) cache and bias row rows[i]: the same as
    the kernel on caches gathered to those rows, and cache rows outside the index are left as they were."""
    kv, g, d, total, cache_rows, slot = 2, 2, 64, 40, 7, 21
    rows = torch.tensor([5, 0, 3])
    q, k, v, bias = _case(cache_rows, kv, g, d, total, seed=11)
    bias[1, :4] = float("-inf")
    kernel = decode_attention_kernel(d)
    scratch = torch.empty(g * 48)
    out = kernel(q[rows], key_blocks(k), v, bias, slot + 1, 0.125, torch.empty(3, kv, g, d), scratch, rows)
    gathered = kernel(q[rows], key_blocks(k[rows]), v[rows], bias[rows], slot + 1, 0.125, torch.empty(3, kv, g, d),
                      scratch)
    assert torch.equal(out, gathered)

    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(3, kv * g + 2 * kv, d, generator=gen)
    angles = torch.rand(64, d // 2, generator=gen)
    cos = torch.cat([angles.cos()] * 2, -1)
    sin = torch.cat([angles.sin()] * 2, -1)
    sin_signed = torch.cat([-sin[:, : d // 2], sin[:, d // 2 :]], -1).contiguous()
    positions = torch.tensor([30, 4, 17])
    k_cache, v_cache = key_blocks(k, length=total), v.clone()
    k_rows, v_rows = k_cache[rows].clone(), v_cache[rows].clone()
    by_index = kernel.step(qkv, cos, sin_signed, positions, k_cache, v_cache, bias, slot, 0.125,
                           torch.empty(3, kv, g, d), scratch, rows)
    on_gathered = kernel.step(qkv, cos, sin_signed, positions, k_rows, v_rows, bias[rows].contiguous(), slot, 0.125,
                              torch.empty(3, kv, g, d), scratch)
    assert torch.equal(by_index, on_gathered)
    assert torch.equal(k_cache[rows], k_rows) and torch.equal(v_cache[rows], v_rows)  # the step's writes
    untouched = torch.tensor([1, 2, 4, 6])
    assert torch.equal(k_cache[untouched], key_blocks(k, length=total)[untouched])
    assert torch.equal(v_cache[untouched], v[untouched])

    with pytest.raises(ValueError, match="outside the caches' 7 rows"):
        kernel(q[:2], key_blocks(k), v, bias, slot + 1, 0.125, torch.empty(2, kv, g, d), scratch, torch.tensor([0, 7]))
    with pytest.raises(ValueError, match="outside the caches' 7 rows"):
        kernel.step(qkv, cos, sin_signed, positions, k_cache, v_cache, bias, slot, 0.125, torch.empty(3, kv, g, d),
                    scratch, torch.tensor([0, -1, 2]))
    with pytest.raises(ValueError, match="unsupported layout"):  # an int32 index
        kernel(q[rows], key_blocks(k), v, bias, slot + 1, 0.125, torch.empty(3, kv, g, d), scratch, rows.int())
    with pytest.raises(ValueError, match="unsupported layout"):  # no index, but fewer working rows than cache rows
        kernel(q[rows], key_blocks(k), v, bias, slot + 1, 0.125, torch.empty(3, kv, g, d), scratch)


def test_head_dim_not_a_multiple_of_16_uses_pytorch():
    assert decode_attention_kernel(24) is None


@pytest.mark.slow  # fresh interpreters
@pytest.mark.parametrize("env", [{"RLFUNC_CPU_KERNELS": "0"}, {"CC": "/nonexistent/cc"}, {"CC": "false"}])
def test_falls_back_to_pytorch_when_disabled_or_unbuildable(env, tmp_path):
    """Switched off, no compiler, or a compiler that fails: no kernel (None) and no error, for every kernel;
    the rollout gets no kernel decode strategy and the fused modules leave a model as it is."""
    code = (
        "from backends.cpu.kernels import *; from backends.cpu import accelerate, decode_strategy; "
        "from backends.models import build_tiny_model; import torch; "
        "print(decode_attention_kernel(64), packed_attention_kernel(64), norm_act_kernel(), "
        "decode_strategy(head_dim=64, dtype=torch.float32, device='cpu'), accelerate(build_tiny_model()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "RLFUNC_KERNEL_CACHE": str(tmp_path / "cache"), **env},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "None None None None 0"


@pytest.mark.slow  # fresh interpreters
@needs_kernel
def test_ranks_building_at_once_share_one_library(tmp_path):
    """Two processes (as two torchrun ranks would) build into an empty cache at the same time: both load
    a complete library, and one file is left."""
    code = "from backends.cpu.kernels import decode_attention_kernel; print(decode_attention_kernel(64).library)"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RLFUNC_KERNEL_CACHE": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=ROOT, env=env) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    assert outs[0][0] == outs[1][0]
    assert [p.name for p in tmp_path.iterdir()] == [Path(outs[0][0].strip()).name]


@pytest.mark.slow  # fresh interpreters
@needs_kernel
def test_build_is_cached_and_leaves_no_temporary_files(tmp_path):
    code = "from backends.cpu.kernels import decode_attention_kernel; print(decode_attention_kernel(64).library)"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RLFUNC_KERNEL_CACHE": str(tmp_path)}
    first, second = (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
        for _ in range(2)
    )
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert first.stdout == second.stdout
    assert [p.name for p in tmp_path.iterdir()] == [Path(first.stdout.strip()).name]


def test_large_cache_buffers_lie_on_aligned_huge_page_memory():
    """The kernel strategy's cache allocator: buffers of at least one huge page start on a 2 MiB boundary
    of memory advised for huge pages (wherever Linux's madvise exists), hold what is written to them, and
    are views of one region."""
    from backends.cpu.decode import HUGE_PAGE_BYTES, empty_on_huge_pages

    small = empty_on_huge_pages((3, 5), torch.float32)
    assert small.shape == (3, 5) and small.dtype == torch.float32
    big = empty_on_huge_pages((2, 1024, 1024), torch.float32)  # 8 MiB
    assert big.shape == (2, 1024, 1024) and big.dtype == torch.float32 and big.is_contiguous()
    big.copy_(torch.arange(big.numel(), dtype=torch.float32).view_as(big))
    assert big[1, 1023, 1023].item() == big.numel() - 1
    if hasattr(__import__("mmap"), "MADV_HUGEPAGE"):
        assert big.data_ptr() % HUGE_PAGE_BYTES == 0
    bf16 = empty_on_huge_pages((4, HUGE_PAGE_BYTES // 2), torch.bfloat16)
    assert bf16.shape == (4, HUGE_PAGE_BYTES // 2) and bf16.dtype == torch.bfloat16


def test_decode_strategy_seam():
    """``backends.cpu.decode_strategy`` gives the kernel strategy exactly where the kernel runs: never off
    the CPU or for a head dim that is not a multiple of 16."""
    from backends.cpu import decode_strategy

    assert decode_strategy(head_dim=24, dtype=torch.float32, device="cpu") is None
    assert decode_strategy(head_dim=64, dtype=torch.float32, device="meta") is None
    strategy = decode_strategy(head_dim=64, dtype=torch.float32, device="cpu")
    assert (strategy is not None) == (decode_attention_kernel(64) is not None)
    if strategy is not None:
        assert strategy.name == "kernel" and strategy.slot_block == 16 and strategy.fused_step
