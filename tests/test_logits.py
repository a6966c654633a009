"""Tests for rlfunc.logits: log-probs / entropy from logits, plain and chunked paths."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from rlfunc.logits import entropy_from_logits, logprobs_from_logits
from tests.forkserver import call_in_child

GOLDEN = load_file(str(pathlib.Path(__file__).parent / "golden" / "kl.safetensors"))
CHUNKS = [None, 1, 3, 4, 1000]


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def value_and_grad(fn, logits, weights):
    x = logits.detach().clone().requires_grad_()
    out = fn(x)
    (out * weights).sum().backward()
    return out.detach(), x.grad


# ---------------------------------------------------------------------------------------------------------
# Hand-computed


def test_hand_computed():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]]])
    labels = torch.tensor([[2, 3]])
    lse = torch.logsumexp(torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64), 0).float()
    for cs in CHUNKS:
        close(
            logprobs_from_logits(logits, labels, chunk_size=cs),
            torch.stack([torch.tensor(-1.3862944), 4.0 - lse])[None],
        )
        ent = entropy_from_logits(logits, chunk_size=cs)
        p = torch.softmax(torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64), 0)
        close(ent, torch.tensor([[torch.log(torch.tensor(4.0)), float(-(p * p.log()).sum())]]))


def test_returns_fp32_for_bf16_and_fp16_fp64_stays():
    logits = torch.randn(2, 3, 7)
    labels = torch.randint(0, 7, (2, 3))
    for dtype in (torch.bfloat16, torch.float16):
        for cs in (None, 2):
            assert logprobs_from_logits(logits.to(dtype), labels, chunk_size=cs).dtype == torch.float32
            assert entropy_from_logits(logits.to(dtype), chunk_size=cs).dtype == torch.float32
    for cs in (None, 2):
        assert logprobs_from_logits(logits.double(), labels, chunk_size=cs).dtype == torch.float64
        assert entropy_from_logits(logits.double(), chunk_size=cs).dtype == torch.float64


# ---------------------------------------------------------------------------------------------------------
# verl parity


@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_logprobs_match_verl(chunk_size):
    logits, labels, w = GOLDEN["logits/logits"], GOLDEN["logits/labels"], GOLDEN["logits/weights"]
    value, grad = value_and_grad(lambda x: logprobs_from_logits(x, labels, chunk_size=chunk_size), logits, w)
    close(value, GOLDEN["logits/logprobs"])
    close(grad, GOLDEN["logits/logprobs_grad"])


@pytest.mark.parametrize("chunk_size", CHUNKS)
def test_entropy_matches_verl(chunk_size):
    logits, w = GOLDEN["logits/logits"], GOLDEN["logits/weights"]
    value, grad = value_and_grad(lambda x: entropy_from_logits(x, chunk_size=chunk_size), logits, w)
    close(value, GOLDEN["logits/entropy"])
    close(value, GOLDEN["logits/entropy_chunked"])
    close(grad, GOLDEN["logits/entropy_grad"])


def test_bf16_is_more_accurate_than_verls_bf16_path():
    """verl runs log_softmax in bf16 for bf16 logits; we upcast. Documented difference."""
    logits_bf16, labels = GOLDEN["logits/logits_bf16"], GOLDEN["logits/labels"]
    truth = torch.log_softmax(logits_bf16.double(), -1).gather(-1, labels[..., None]).squeeze(-1)
    ours = logprobs_from_logits(logits_bf16, labels).double()
    theirs = GOLDEN["logits/verl_bf16_logprobs"].double()
    close(ours, truth, tol=1e-6)
    assert (ours - truth).abs().max() < (theirs - truth).abs().max()
    close(theirs, truth, tol=0.1)  # verl's is right to bf16 precision


# ---------------------------------------------------------------------------------------------------------
# Chunked == plain (values and gradients)


def _compare_paths(logits, labels, chunk_size, tol, grad_tol):
    """Chunked == plain (values, gradients); both == the fp64 computation of the same inputs."""
    w = torch.randn(labels.shape, generator=torch.Generator().manual_seed(1))
    for fn in (
        lambda x, cs: logprobs_from_logits(x, labels, chunk_size=cs),
        lambda x, cs: entropy_from_logits(x, chunk_size=cs),
    ):
        v_plain, g_plain = value_and_grad(lambda x: fn(x, None), logits, w)
        v_chunk, g_chunk = value_and_grad(lambda x: fn(x, chunk_size), logits, w)
        v_64, g_64 = value_and_grad(lambda x: fn(x, None), logits.double(), w.double())
        close(v_chunk, v_plain, tol)
        assert g_chunk.dtype == logits.dtype
        close(g_chunk.float(), g_plain.float(), grad_tol)
        if logits.dtype == torch.float32:
            close(v_chunk.double(), v_64, tol)
            close(g_chunk.double(), g_64, grad_tol)


@pytest.mark.parametrize("chunk_size", [1, 2, 5, 7, 64])
def test_chunked_equals_plain_fp32(chunk_size):
    g = torch.Generator().manual_seed(chunk_size)
    logits = torch.randn(3, 7, 50, generator=g) * 4
    labels = torch.randint(0, 50, (3, 7), generator=g)
    _compare_paths(logits, labels, chunk_size, 1e-5, 1e-5)


@pytest.mark.parametrize("chunk_size", [1, 4, 64])
def test_chunked_equals_plain_bf16(chunk_size):
    g = torch.Generator().manual_seed(chunk_size)
    logits = (torch.randn(3, 7, 50, generator=g) * 4).bfloat16()
    labels = torch.randint(0, 50, (3, 7), generator=g)
    # the same fp32 numbers from the same bf16 inputs; gradients rounded to bf16 once (1 ulp ~ 0.4%)
    _compare_paths(logits, labels, chunk_size, 1e-5, 1e-2)


def test_non_contiguous_logits_are_not_copied():
    full = torch.randn(3, 8, 20)
    logits = full[:, :-1]  # the usual shift: cannot be viewed as ((b t), v)
    labels = torch.randint(0, 20, (3, 7))
    assert not logits.is_contiguous()
    _compare_paths(logits, labels, 4, 1e-5, 1e-5)
    _compare_paths(full.transpose(0, 1), labels.new_zeros(8, 3), 5, 1e-5, 1e-5)


def test_other_leading_shapes():
    logits = torch.randn(11, 9)
    labels = torch.randint(0, 9, (11,))
    _compare_paths(logits, labels, 4, 1e-5, 1e-5)
    one = torch.randn(9)
    close(logprobs_from_logits(one, torch.tensor(3), chunk_size=2), logprobs_from_logits(one, torch.tensor(3)))
    close(entropy_from_logits(one, chunk_size=2), entropy_from_logits(one))
    assert entropy_from_logits(one, chunk_size=2).shape == ()
    empty = torch.randn(0, 5, 9)
    assert logprobs_from_logits(empty, torch.zeros(0, 5, dtype=torch.long), chunk_size=2).shape == (0, 5)


def test_minus_inf_logits():
    logits = torch.randn(2, 5, 12)
    logits[..., :4] = float("-inf")  # e.g. a padded or top-k masked vocabulary
    labels = torch.randint(4, 12, (2, 5))
    for cs in (None, 3):
        w = torch.randn(2, 5)
        for fn in (
            lambda x: logprobs_from_logits(x, labels, chunk_size=cs),
            lambda x: entropy_from_logits(x, chunk_size=cs),
        ):
            value, grad = value_and_grad(fn, logits, w)
            assert torch.isfinite(value).all() and torch.isfinite(grad).all()
            assert (grad[..., :4] == 0).all()
    close(entropy_from_logits(logits, chunk_size=3), entropy_from_logits(logits[..., 4:]))


@settings(max_examples=30, deadline=None)
@given(
    b=st.integers(1, 3),
    t=st.integers(1, 6),
    v=st.integers(1, 40),
    chunk_size=st.integers(1, 20),
    scale=st.sampled_from([0.1, 1.0, 10.0, 50.0]),
    seed=st.integers(0, 2**16),
)
def test_property_chunked_equals_plain(b, t, v, chunk_size, scale, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=g) * scale
    labels = torch.randint(0, v, (b, t), generator=g)
    _compare_paths(logits, labels, chunk_size, 1e-5, 1e-5)
    # probabilities sum to one: logsumexp over all labels is 0
    all_lp = torch.stack(
        [logprobs_from_logits(logits, torch.full((b, t), k), chunk_size=chunk_size) for k in range(v)], -1
    )
    close(torch.logsumexp(all_lp.double(), -1), torch.zeros(b, t, dtype=torch.float64), 1e-5)
    ent = entropy_from_logits(logits, chunk_size=chunk_size)
    assert (ent >= -1e-5).all() and (ent <= torch.log(torch.tensor(float(v))) + 1e-4).all()


# ---------------------------------------------------------------------------------------------------------
# Functional contract


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_func_grad_equals_autograd(chunk_size):
    logits = torch.randn(2, 4, 10)
    labels = torch.randint(0, 10, (2, 4))
    w = torch.randn(2, 4)
    for fn in (
        lambda x: (logprobs_from_logits(x, labels, chunk_size=chunk_size) * w).sum(),
        lambda x: (entropy_from_logits(x, chunk_size=chunk_size) * w).sum(),
    ):
        x = logits.clone().requires_grad_()
        fn(x).backward()
        close(torch.func.grad(fn)(logits), x.grad)


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_vmap_equals_loop(chunk_size):
    logits = torch.randn(3, 5, 10)
    labels = torch.randint(0, 10, (3, 5))
    batched = torch.func.vmap(lambda x, y: logprobs_from_logits(x, y, chunk_size=chunk_size))(logits, labels)
    looped = torch.stack([logprobs_from_logits(logits[i], labels[i], chunk_size=chunk_size) for i in range(3)])
    close(batched, looped)
    batched = torch.func.vmap(lambda x: entropy_from_logits(x, chunk_size=chunk_size))(logits)
    close(batched, entropy_from_logits(logits))
    # per-example gradients
    per_ex = torch.func.vmap(torch.func.grad(lambda x, y: entropy_from_logits(x, chunk_size=chunk_size).sum()))(
        logits, labels
    )
    close(per_ex, torch.func.grad(lambda x: entropy_from_logits(x).sum())(logits))


def test_inputs_not_modified():
    logits, labels = torch.randn(2, 3, 6), torch.randint(0, 6, (2, 3))
    c1, c2 = logits.clone(), labels.clone()
    x = logits.clone().requires_grad_()
    (logprobs_from_logits(x, labels, chunk_size=2).sum() + entropy_from_logits(x, chunk_size=2).sum()).backward()
    logprobs_from_logits(logits, labels, chunk_size=2)
    assert torch.equal(logits, c1) and torch.equal(labels, c2)


# ---------------------------------------------------------------------------------------------------------
# Memory


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages the autograd graph saves while ``fn`` runs."""
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunked_saves_only_the_logits(dtype):
    b, t, v = 4, 32, 2000
    x = torch.randn(b, t, v, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, v, (b, t))
    logits_bytes = x.numel() * x.element_size()
    fp32_bytes = x.numel() * 4
    per_row = b * t * (8 + 4)  # int64 labels + one fp32 per row
    for fn in (
        lambda cs: logprobs_from_logits(x, labels, chunk_size=cs),
        lambda cs: entropy_from_logits(x, chunk_size=cs),
    ):
        chunked = _saved_bytes(lambda: fn(16))
        plain = _saved_bytes(lambda: fn(None))
        assert chunked <= logits_bytes + per_row, (chunked, logits_bytes)
        if dtype == torch.bfloat16:
            assert plain >= fp32_bytes  # the plain path keeps an fp32 copy (or softmax) of the logits
            assert chunked < 0.6 * plain
        else:
            assert plain >= fp32_bytes  # at least the logits themselves


def _status(key: str) -> int:  # kB -> bytes
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key + ":"))


def _peak_during(run) -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS counter (VmHWM) to the current RSS
    base = _status("VmRSS")
    run()
    return _status("VmHWM") - base


def _chunked_and_plain_peaks(which: str) -> tuple[int, int, int]:
    """In a process of its own: the peak-RSS rise of the chunked and the plain path, and the logits' bytes."""
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # M_MMAP_THRESHOLD: large blocks are mapped, and leave when freed
    n, v = 256, 32000
    x = torch.randn(n, v, dtype=torch.bfloat16).requires_grad_()
    labels = torch.randint(0, v, (n,))
    if which == "logp":
        fn = lambda cs: logprobs_from_logits(x, labels, chunk_size=cs)
    else:
        fn = lambda cs: entropy_from_logits(x, chunk_size=cs)
    y = torch.randn(4, 64, requires_grad=True)  # warm-up: one-time allocations are not counted
    for cs in (None, 2):
        (
            logprobs_from_logits(y, labels[:4] % 64, chunk_size=cs).sum() + entropy_from_logits(y, chunk_size=cs).sum()
        ).backward()

    def run(cs):
        fn(cs).sum().backward()
        x.grad = None

    chunked = _peak_during(lambda: run(8))  # 8 rows: 1 MiB per fp32 temporary
    plain = _peak_during(lambda: run(None))
    return chunked, plain, x.numel() * 2


def _can_reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return any(line.startswith("VmHWM:") for line in open("/proc/self/status"))
    except OSError:
        return False


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not _can_reset_peak_rss(), reason="needs Linux /proc peak RSS"
)
@pytest.mark.parametrize("which", ["logp", "ent"])
def test_chunked_peak_memory_is_lower(which):
    """Peak resident memory of forward+backward on (256, 32000) bf16 logits (15.6 MiB).

    In a process of its own, with glibc told to serve every large allocation with mmap
    (``M_MMAP_THRESHOLD``) so freed memory leaves the process, the peak RSS (``VmHWM``, reset through
    ``/proc/self/clear_refs``) above the starting RSS is the true high-water mark of each call. The chunked
    path needs the bf16 gradient plus a few fp32 chunks; the plain path an fp32 copy of the logits, an
    fp32 softmax / gradient and more.
    """
    chunked, plain, logits_bytes = call_in_child(_chunked_and_plain_peaks, which)
    # plain: > 3x the bf16 logits (an fp32 copy alone is 2x); chunked: the bf16 grad (1x) + a few fp32
    # chunk-sized temporaries, so well below 1.5x whatever the chunk count
    assert plain > 3 * logits_bytes, (chunked, plain, logits_bytes)
    assert chunked < 1.5 * logits_bytes, (chunked, plain, logits_bytes)
    assert chunked < 0.4 * plain, (chunked, plain, logits_bytes)


# ---------------------------------------------------------------------------------------------------------
# Bad inputs


def test_bad_inputs():
    logits = torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match=r"labels.shape \+ \(v,\)"):
        logprobs_from_logits(logits, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"labels.shape \+ \(v,\)"):
        logprobs_from_logits(logits, torch.zeros(2, 3, 5, dtype=torch.long))
    with pytest.raises(TypeError, match="integer tensor"):
        logprobs_from_logits(logits, torch.zeros(2, 3))
    with pytest.raises(TypeError, match="floating-point"):
        logprobs_from_logits(torch.zeros(2, 3, 5, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="floating-point"):
        entropy_from_logits(torch.zeros(2, 3, 5, dtype=torch.long))
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="chunk_size"):
            logprobs_from_logits(logits, torch.zeros(2, 3, dtype=torch.long), chunk_size=bad)
        with pytest.raises(ValueError, match="chunk_size"):
            entropy_from_logits(logits, chunk_size=bad)
    with pytest.raises(ValueError, match="vocabulary"):
        logprobs_from_logits(torch.zeros(2, 0), torch.zeros(2, dtype=torch.long))
    with pytest.raises(TypeError, match="torch.Tensor"):
        entropy_from_logits([[1.0, 2.0]])
    # out-of-range labels: torch.gather's own error on CPU (not range-checked: that would sync)
    with pytest.raises(RuntimeError):
        logprobs_from_logits(logits, torch.full((2, 3), 5), chunk_size=2)
