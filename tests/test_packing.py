"""Packed sequences equal padded ones; token-budget and balanced micro-batching equal the full batch.

Single-process checks use a plain (unsharded) tiny HF model; the 2-rank checks run once in a
module-scoped spawn (tests/distributed.py) and several tests read its result. Batches have
left-padded prompts and ragged responses (tests/test_fsdp_engine.make_batch), fp32 throughout.
"""

from __future__ import annotations

import types

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from backends.models import TinyModelConfig, load_causal_lm, load_value_model, write_tiny_model
from backends.packing import model_kwargs, pack_rows, pad_layout, unpack
from backends.training import packed_attention
from backends.training.fsdp import FSDPConfig, micro_batch_groups
from backends.training.hf_forward import forward_micro_batch
from backends.training.hf_modules import enable_checkpointing
from backends.training.packed_attention import (
    VARLEN_SDPA,
    enable_packed_attention,
    only_backends,
    varlen_sdpa_attention,
)
from rlfunc.aggregation import aggregate
from rlfunc.balancing import (
    balanced_partition,
    greedy_partition,
    karmarkar_karp,
    partition_sums,
    spread,
    token_budget_balanced_partition,
)
from rlfunc.tree import tree_map
from tests.distributed import run_distributed
from tests.test_fsdp_engine import OPTIM, _max_diff, _numpy, make_batch, pg_loss, rank_rows, reference_updates

pytestmark = pytest.mark.packing

TINY = TinyModelConfig(
    hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128, max_position_embeddings=64, seed=1
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", TINY))


# ---------------------------------------------------------------------------------------- packing


def test_pack_rows_layout_by_hand():
    # row 0: prompt [_, 5, 6] (left pad), response [7, 8, 9] with loss on the first two -> predicts 7, 8
    # row 1: prompt [4, 4, 3], response [2, _, _] -> predicts 2
    # row 2: prompt [_, _, 1], response with no loss token -> predicts one token (zero weight)
    # The last predicted token of each row is not an input: its output would predict nothing.
    prompt_ids = torch.tensor([[0, 5, 6], [4, 4, 3], [0, 0, 1]])
    prompt_mask = torch.tensor([[False, True, True], [True, True, True], [False, False, True]])
    response_ids = torch.tensor([[7, 8, 9], [2, 0, 0], [11, 12, 13]])
    response_mask = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])
    packed = pack_rows(prompt_ids, prompt_mask, response_ids, response_mask)
    assert packed.input_ids.tolist() == [[5, 6, 7, 4, 4, 3, 1]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 0]]
    assert packed.cu_seqlens.tolist() == [0, 3, 6, 7] and packed.cu_seqlens.dtype == torch.int32
    assert packed.max_seqlen == 3
    assert packed.predict_index.tolist() == [1, 2, 5, 6]  # the token before each predicted response token
    assert packed.rows.tolist() == [0, 0, 1, 2] and packed.cols.tolist() == [0, 1, 0, 0]
    assert packed.labels.tolist() == [7, 8, 2, 11]
    back = unpack(torch.tensor([1.0, 2.0, 3.0, 4.0]), packed)
    assert back.tolist() == [[1.0, 2.0, 0.0], [3.0, 0.0, 0.0], [4.0, 0.0, 0.0]]
    # with_last_token keeps each row's last predicted token in the input; the predictions are the same
    full = pack_rows(prompt_ids, prompt_mask, response_ids, response_mask, with_last_token=True)
    assert full.input_ids.tolist() == [[5, 6, 7, 8, 4, 4, 3, 2, 1, 11]]
    assert full.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 0, 1]]
    assert full.cu_seqlens.tolist() == [0, 4, 8, 10] and full.max_seqlen == 4
    assert full.predict_index.tolist() == [1, 2, 6, 8]
    assert full.labels.tolist() == packed.labels.tolist() and full.rows.tolist() == packed.rows.tolist()


def test_pack_rows_errors():
    ids, mask = torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="empty prompt"):
        pack_rows(ids, torch.zeros_like(mask), ids, mask)
    with pytest.raises(ValueError, match="shapes disagree"):
        pack_rows(ids, mask[:1], ids, mask)
    packed = pack_rows(ids, mask, ids, mask)
    with pytest.raises(ValueError, match="unpack"):
        unpack(torch.zeros(3), packed)


def test_pack_rows_shared_prompts_by_hand():
    # rows 0 and 2 share the prompt [5, 6] (row 2 with more left padding); row 1 has its own
    prompt_ids = torch.tensor([[0, 5, 6], [4, 4, 3], [0, 5, 6]])
    prompt_mask = torch.tensor([[False, True, True], [True, True, True], [False, True, True]])
    response_ids = torch.tensor([[7, 8, 9], [2, 0, 0], [11, 12, 13]])
    response_mask = torch.tensor([[True, True, False], [True, False, False], [True, True, True]])
    packed = pack_rows(prompt_ids, prompt_mask, response_ids, response_mask, share_prompts=True)
    # stream: prompt A, row 0's response, row 2's response, then prompt B and row 1's response, each
    # response without its last predicted token (row 1's only token goes, so B stands alone)
    assert packed.input_ids.tolist() == [[5, 6, 7, 11, 12, 4, 4, 3]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 2, 3, 0, 1, 2]]
    assert packed.cu_seqlens is None and packed.max_seqlen == 4
    assert packed.rows.tolist() == [0, 0, 1, 2, 2, 2] and packed.cols.tolist() == [0, 1, 0, 0, 1, 2]
    assert packed.predict_index.tolist() == [1, 2, 7, 1, 3, 4]  # row 2's first token: prompt A's last
    assert packed.labels.tolist() == [7, 8, 2, 11, 12, 13]
    layout = packed.layout
    # block row i = sequence i: its prompt (row 2 reads row 0's copy), its response, then its last token again
    assert layout.gather.tolist() == [[0, 1, 2, 2], [5, 6, 7, 7], [0, 1, 3, 4]]
    # each stored token's output comes from the slot of the row that stores it
    assert layout.scatter.tolist() == [0, 1, 2, 10, 11, 4, 5, 6]
    unshared = pack_rows(prompt_ids, prompt_mask, response_ids, response_mask)
    assert unshared.num_tokens == packed.num_tokens + 2 and unshared.layout is None


def test_pack_rows_needs_left_padded_prompts():
    ids = torch.ones(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="left-padded"):
        pack_rows(ids, torch.tensor([[True, True, False]]), ids, torch.ones(1, 3, dtype=torch.bool))


def _grouped(batch, k: int = 3):
    """``batch`` with the prompts of every ``k`` consecutive rows made equal, then rows 1 and 4 swapped
    (groups need not be contiguous)."""
    prompt_ids, prompt_mask = batch.prompt_ids.clone(), batch.prompt_mask.clone()
    lead = torch.arange(prompt_ids.shape[0]) // k * k
    perm = torch.arange(prompt_ids.shape[0])
    perm[[1, 4]] = perm[[4, 1]]
    return batch.replace(prompt_ids=prompt_ids[lead][perm], prompt_mask=prompt_mask[lead][perm])


def _outputs_and_grads(model, batch, packed: bool, role: str = "actor"):
    model.zero_grad(set_to_none=True)
    out = forward_micro_batch(model, batch, with_entropy=role == "actor", role=role, packed=packed)
    if role == "actor":
        loss = aggregate(-batch.advantages * out.logprobs, batch.response_mask, mode="seq-mean-token-mean")
        quantities = (out.logprobs, out.entropy)
    else:
        loss = aggregate((out.values - batch.advantages) ** 2, batch.response_mask, mode="token-mean")
        quantities = (out.values,)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return [q.detach() for q in quantities], float(loss.detach()), grads


def _masked_max_diff(a, b, mask):
    return float(torch.where(mask, (a - b).abs(), 0.0).max())


@pytest.fixture(params=list(packed_attention.BACKENDS))
def attention_backend(request):
    """Run a test with each packed attention backend forced (backends/training/packed_attention.py):
    PyTorch's batched matmuls and SDPA."""
    with only_backends(request.param):
        yield request.param


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_packed_actor_equals_padded(model_dir, gradient_checkpointing, attention_backend):
    torch.manual_seed(0)
    model, _ = load_causal_lm(model_dir)
    model.train()
    if gradient_checkpointing:
        enable_checkpointing(model)  # the engine's own switch (the HF method name differs across versions)
    batch = make_batch(3)
    padded, padded_loss, padded_grads = _outputs_and_grads(model, batch, packed=False)
    assert enable_packed_attention(model) == VARLEN_SDPA
    # the padded forward through the packed-aware attention is the plain sdpa forward
    again, _, _ = _outputs_and_grads(model, batch, packed=False)
    assert torch.equal(again[0], padded[0])
    packed, packed_loss, packed_grads = _outputs_and_grads(model, batch, packed=True)
    _assert_actor_equal(batch, (padded, padded_loss, padded_grads), (packed, packed_loss, packed_grads))
    mask = batch.response_mask
    # after each row's last loss token (its first token for a row without one) the packed outputs are 0
    kept = mask | ((~mask.any(-1, keepdim=True)) & (torch.arange(mask.shape[1]) == 0))
    assert float(torch.where(kept, 0.0, packed[0]).abs().max()) == 0.0


def _assert_actor_equal(batch, padded_result, packed_result):
    (padded, padded_loss, padded_grads), (packed, packed_loss, packed_grads) = padded_result, packed_result
    mask = batch.response_mask
    assert _masked_max_diff(packed[0], padded[0], mask) < 2e-6  # log-probs
    assert _masked_max_diff(packed[1], padded[1], mask) < 2e-6  # entropies
    assert packed_loss == pytest.approx(padded_loss, rel=1e-6, abs=1e-7)
    scale = max(float(g.abs().max()) for g in padded_grads.values())
    assert set(packed_grads) == set(padded_grads)
    assert max(float((packed_grads[k] - padded_grads[k]).abs().max()) for k in padded_grads) / scale < 1e-5


@pytest.mark.parametrize("packed", [False, True])
def test_chunked_logits_equal_unchunked(model_dir, packed):
    """The update's log-probs and entropies taken a few logit rows at a time (FSDPConfig.logits_chunk_mib) give
    the same outputs and gradients, through the entropy too, as the whole micro-batch at once."""
    torch.manual_seed(0)
    model, _ = load_causal_lm(model_dir)
    model.train()
    batch = make_batch(3)

    def run(chunk_rows):
        model.zero_grad(set_to_none=True)
        out = forward_micro_batch(model, batch, with_entropy=True, packed=packed, chunk_rows=chunk_rows)
        loss = aggregate(-batch.advantages * out.logprobs - 0.1 * out.entropy, batch.response_mask, mode="token-mean")
        loss.backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    whole, whole_grads = run(None)
    chunked, chunked_grads = run(3)
    mask = batch.response_mask
    assert _masked_max_diff(chunked.logprobs, whole.logprobs, mask) < 1e-6
    assert _masked_max_diff(chunked.entropy, whole.entropy, mask) < 1e-6
    scale = max(float(g.abs().max()) for g in whole_grads.values())
    assert set(chunked_grads) == set(whole_grads) and scale > 0
    assert max(float((chunked_grads[k] - whole_grads[k]).abs().max()) for k in whole_grads) / scale < 1e-5


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_shared_prompts_equal_padded(model_dir, gradient_checkpointing, attention_backend):
    """Rows with the same prompt hold it once in the packed row: same log-probs, entropies, loss and
    gradients as the padded forward, with fewer packed tokens."""
    model, _ = load_causal_lm(model_dir)
    model.train()
    if gradient_checkpointing:
        enable_checkpointing(model)
    batch = _grouped(make_batch(3))
    padded = _outputs_and_grads(model, batch, packed=False)
    enable_packed_attention(model)
    model.zero_grad(set_to_none=True)
    out = forward_micro_batch(model, batch, with_entropy=True, packed=True, share_prompts=True)
    loss = aggregate(-batch.advantages * out.logprobs, batch.response_mask, mode="seq-mean-token-mean")
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    _assert_actor_equal(batch, padded, ((out.logprobs.detach(), out.entropy.detach()), float(loss.detach()), grads))
    args = (batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask)
    shared, unshared = pack_rows(*args, share_prompts=True), pack_rows(*args)
    prompts = [tuple(r[m].tolist()) for r, m in zip(batch.prompt_ids, batch.prompt_mask)]
    assert len(set(prompts)) < len(prompts)
    # every prompt is held once
    assert shared.num_tokens == unshared.num_tokens - sum(map(len, prompts)) + sum(map(len, set(prompts)))


def test_shared_prompts_critic_equal_padded(model_dir):
    model, _ = load_value_model(model_dir, dtype=torch.float32, device="cpu", seed=0)
    model.train()
    batch = _grouped(make_batch(4))
    padded, padded_loss, padded_grads = _outputs_and_grads(model, batch, packed=False, role="critic")
    enable_packed_attention(model)
    model.zero_grad(set_to_none=True)
    out = forward_micro_batch(model, batch, with_entropy=False, role="critic", packed=True, share_prompts=True)
    loss = aggregate((out.values - batch.advantages) ** 2, batch.response_mask, mode="token-mean")
    loss.backward()
    assert _masked_max_diff(out.values.detach(), padded[0], batch.response_mask) < 2e-6
    assert float(loss.detach()) == pytest.approx(padded_loss, rel=1e-6)
    scale = max(float(g.abs().max()) for g in padded_grads.values())
    assert max(float((p.grad - padded_grads[n]).abs().max()) for n, p in model.named_parameters()) / scale < 1e-5


def test_packed_critic_values_equal_padded(model_dir):
    model, _ = load_value_model(model_dir, dtype=torch.float32, device="cpu", seed=0)
    model.train()
    batch = make_batch(4)
    padded, padded_loss, padded_grads = _outputs_and_grads(model, batch, packed=False, role="critic")
    enable_packed_attention(model)
    packed, packed_loss, packed_grads = _outputs_and_grads(model, batch, packed=True, role="critic")
    assert _masked_max_diff(packed[0], padded[0], batch.response_mask) < 2e-6
    assert packed_loss == pytest.approx(padded_loss, rel=1e-6)
    scale = max(float(g.abs().max()) for g in padded_grads.values())
    assert max(float((packed_grads[k] - padded_grads[k]).abs().max()) for k in padded_grads) / scale < 1e-5


def test_varlen_attention_equals_hf_block_diagonal_mask(model_dir):
    """Hugging Face's own packed path (sdpa, restarting position ids, no attention mask: masking_utils
    builds a block-diagonal causal mask) and the per-sequence varlen SDPA give the same logits."""
    model, _ = load_causal_lm(model_dir)
    model.eval()
    batch = make_batch(5)
    packed = pack_rows(batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask)
    with torch.no_grad():
        hf = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False).logits
        whole_row = model(input_ids=packed.input_ids, use_cache=False).logits  # one long sequence: differs
        enable_packed_attention(model)
        ours = model(**model_kwargs(packed)).logits
        # the layout made once per forward (what the engine passes: no layer reads cu_seq_lens back to the host)
        kwargs = model_kwargs(packed, block_layout=True)
        assert "packed_layout" in kwargs and "cu_seq_lens_q" not in kwargs
        with_layout = model(**kwargs).logits
        # without cu_seq_lens the packed-aware attention reads the boundaries off the position ids
        from_positions = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False).logits
    assert float((ours - hf).abs().max()) < 1e-5
    assert torch.equal(with_layout, ours)
    assert float((from_positions - hf).abs().max()) < 1e-5
    assert float((whole_row - hf).abs().max()) > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_attention_block_equals_per_sequence_sdpa(dtype):
    """The left-aligned block (one SDPA call) equals causal SDPA run on each sequence alone, GQA
    included; empty sequences in cu_seqlens are allowed; bf16 in gives bf16 out."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 9, 8, generator=g) for h in (4, 2, 2))
    cu = torch.tensor([0, 3, 3, 7, 9, 9], dtype=torch.int32)
    out, _ = varlen_sdpa_attention(
        types.SimpleNamespace(training=False), q.to(dtype), k.to(dtype), v.to(dtype), None, cu_seq_lens_q=cu
    )
    ref = torch.cat(
        [
            F.scaled_dot_product_attention(
                q[:, :, s:e], k[:, :, s:e].repeat_interleave(2, 1), v[:, :, s:e].repeat_interleave(2, 1), is_causal=True
            )
            for s, e in [(0, 3), (3, 7), (7, 9)]
        ],
        dim=2,
    ).transpose(1, 2)
    assert out.dtype == dtype and out.shape == ref.shape
    assert float((out.float() - ref).abs().max()) < (1e-6 if dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", list(packed_attention.BACKENDS))
def test_packed_attention_backends_agree(dtype, backend):
    """Each backend of the packed attention, forced (the batched matmuls and SDPA), gives the fp32 SDPA
    reference's outputs and q / k / v gradients: to rounding in fp32, to bf16 precision in bf16 (where
    SDPA runs on an fp32 upcast and the matmul form in bf16)."""
    g = torch.Generator().manual_seed(0)
    q0, k0, v0 = (torch.randn(1, h, 40, 16, generator=g) for h in (4, 2, 2))
    cu = torch.tensor([0, 11, 30, 31, 40], dtype=torch.int32)
    grad_out = torch.randn(1, 40, 4, 16, generator=g)

    def run(name: str, dt: torch.dtype) -> list[Tensor]:
        q, k, v = (x.detach().to(dt).requires_grad_() for x in (q0, k0, v0))
        with only_backends(name):
            out, _ = varlen_sdpa_attention(types.SimpleNamespace(training=True), q, k, v, None, cu_seq_lens_q=cu)
        assert out.dtype == dt
        out.backward(grad_out.to(dt))
        return [out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]

    reference = run("sdpa", torch.float32)
    for name, a, b in zip(("out", "dq", "dk", "dv"), run(backend, dtype), reference):
        err = float((a - b).abs().max() / b.abs().max())
        assert err < (1e-5 if dtype == torch.float32 else 1e-2), (backend, name, err)


def _ragged_layout(prompt_lens, response_lens, group, share):
    """A packed row's attention layout: rows with left-padded prompts (``group`` rows per prompt) and
    responses of the given lengths."""
    b, p, t = len(prompt_lens), max(prompt_lens), max(response_lens)
    gen = torch.Generator().manual_seed(sum(response_lens))
    prompt = torch.randint(3, 60, (b // group, p), generator=gen).repeat_interleave(group, 0)
    prompt_mask = torch.arange(p)[None] >= (p - torch.tensor(prompt_lens))[:, None]
    response = torch.randint(3, 60, (b, t), generator=gen)
    response_mask = torch.arange(t)[None] < torch.tensor(response_lens)[:, None]
    packed = pack_rows(prompt, prompt_mask, response, response_mask, share_prompts=share)
    if share:
        return packed.layout, packed.num_tokens
    bounds = tuple(int(x) for x in packed.cu_seqlens.tolist())
    return pad_layout(bounds, torch.device("cpu")), packed.num_tokens


def _forced_attention(q, k, v, layout, scale, backend):
    """Causal attention of each packed token over its own sequence by one forced backend."""
    with only_backends(backend):
        out, _ = varlen_sdpa_attention(
            types.SimpleNamespace(training=False), q, k, v, None, scaling=scale, packed_layout=layout
        )
    return out


@settings(max_examples=20, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(1, 7), st.integers(1, 40)), min_size=1, max_size=6),
    group=st.sampled_from([1, 2]),
    share=st.booleans(),
    heads=st.sampled_from([(2, 1), (4, 2), (6, 2)]),
    backend=st.sampled_from(["matmul", "sdpa"]),
)
def test_pytorch_backends_match_float64_reference(rows, group, share, heads, backend):
    """Each backend in float32 on ragged layouts (sequences of 1 to 47 tokens, GQA, prompts shared by a
    group): outputs and q / k / v gradients equal SDPA's in float64 to float32 rounding."""
    rows = [r for r in rows for _ in range(group)]
    layout, T = _ragged_layout([p for p, _ in rows], [r for _, r in rows], group, share)
    h, kv = heads
    gen = torch.Generator().manual_seed(T)
    # (1 heads T d) views of T-major tensors, as HF's projections hand them over
    q, k, v = (
        torch.randn(1, T, n, 16, generator=gen, dtype=torch.float64).transpose(1, 2).requires_grad_()
        for n in (h, kv, kv)
    )
    ref = _forced_attention(q, k, v, layout, 0.3, "sdpa")
    grad_out = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected = [ref, *torch.autograd.grad(ref, (q, k, v), grad_out)]
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    out = _forced_attention(q32, k32, v32, layout, 0.3, backend)
    assert out.shape == (1, T, h, 16) and out.dtype == torch.float32
    got = [out, *torch.autograd.grad(out, (q32, k32, v32), grad_out.float())]
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected):
        # relative to the largest value, at least 1 (a one-token sequence's dq is 0 in exact arithmetic)
        err = float((a.detach().double() - b.detach()).abs().max() / b.detach().abs().max().clamp(min=1.0))
        assert err < 5e-6, (backend, name, err)


def _chosen_backends(monkeypatch) -> list[str]:
    """The names of the backends that run from now on (each wrapped to record itself)."""
    chosen: list[str] = []
    for name, backend in packed_attention.BACKENDS.items():

        def run(*args, _name=name, _run=backend.run):
            chosen.append(_name)
            return _run(*args)

        monkeypatch.setitem(packed_attention.BACKENDS, name, attrs.evolve(backend, run=run))
    return chosen


def test_packed_attention_chooses_its_backend(monkeypatch):
    """The automatic choice: the batched matmuls for short CPU blocks (per dtype:
    :data:`MATMUL_ATTENTION_MAX_LEN`), with or without dropout; SDPA for longer ones and for dtypes the
    matmul form does not take."""
    chosen = _chosen_backends(monkeypatch)
    g = torch.Generator().manual_seed(0)
    limit = packed_attention.MATMUL_ATTENTION_MAX_LEN[torch.float32]

    def attend(length: int, dtype: torch.dtype = torch.float32, dropout: float = 0.0, head_dim: int = 16) -> str:
        q, k, v = (torch.randn(1, 2, length, head_dim, generator=g, dtype=dtype) for _ in range(3))
        layout = pad_layout((0, length), q.device)
        packed_attention.packed_rows_attention(q, k, v, layout, None, dropout)
        return chosen.pop()

    assert attend(limit) == "matmul" and attend(limit + 1) == "sdpa"
    assert attend(limit, dropout=0.1) == "matmul" and attend(limit + 1, dropout=0.1) == "sdpa"
    assert attend(limit, dtype=torch.float64) == "sdpa"  # the matmul form does not take float64
    assert attend(limit, head_dim=24) == "matmul" and attend(limit + 1, head_dim=24) == "sdpa"
    with only_backends("matmul", "sdpa"):  # the PyTorch backends, chosen among as usual
        assert attend(limit) == "matmul" and attend(limit + 1) == "sdpa"
    with only_backends("matmul"):  # forced, whatever the length
        assert attend(limit + 1) == "matmul"
    for removed_or_unknown in ("flash", "cpu-kernel"):
        with pytest.raises(ValueError, match="unknown packed attention backends"):
            with only_backends(removed_or_unknown):
                pass
    assert not chosen


def test_config_errors():
    with pytest.raises(ValueError, match="token_budget_grouping"):
        FSDPConfig(token_budget_grouping="random")


# --------------------------------------------------------------------------------------- balancing

lengths_st = st.lists(st.integers(0, 500), min_size=1, max_size=60)


def _is_partition(parts, n):
    flat = sorted(i for p in parts for i in p)
    return flat == list(range(n))


@settings(max_examples=150, deadline=None)
@given(lengths=lengths_st, k=st.integers(1, 8), equal=st.booleans())
def test_partitions_cover_every_index_once(lengths, k, equal):
    if equal:
        lengths = lengths[: len(lengths) - len(lengths) % k] or [1] * k
    elif len(lengths) < k:
        lengths = lengths + [0] * (k - len(lengths))
    for fn in (karmarkar_karp, greedy_partition, balanced_partition):
        parts = fn(lengths, k, equal_size=equal)
        assert len(parts) == k
        assert _is_partition(parts, len(lengths))
        assert all(p for p in parts)
        if equal:
            assert {len(p) for p in parts} == {len(lengths) // k}


@settings(max_examples=150, deadline=None)
@given(lengths=lengths_st, k=st.integers(1, 8))
def test_balanced_partition_no_worse_than_greedy_and_bounded(lengths, k):
    if len(lengths) < k:
        lengths = lengths + [0] * (k - len(lengths))
    best = balanced_partition(lengths, k)
    greedy = greedy_partition(lengths, k)
    assert max(partition_sums(lengths, best)) <= max(partition_sums(lengths, greedy))
    # LPT's guarantee, inherited: the heaviest part exceeds the mean by less than the longest item
    assert max(partition_sums(lengths, best)) <= sum(lengths) / k + max(lengths)


def test_karmarkar_karp_by_hand():
    # 2 parts of [8, 7, 6, 5, 4]: differencing 8-7, 6-5 -> {4, 1, 1} -> 4-1 -> {3, 1} -> 2
    parts = karmarkar_karp([8, 7, 6, 5, 4], 2)
    assert sorted(partition_sums([8, 7, 6, 5, 4], parts)) == [14, 16]
    # a long tail: LPT puts both big items apart; so does KK, with equal counts
    lengths = [100, 90, 5, 5, 4, 4, 3, 3]
    parts = karmarkar_karp(lengths, 2, equal_size=True)
    assert [len(p) for p in parts] == [4, 4] and spread(lengths, parts) <= 12


@settings(max_examples=100, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=50),
    budget=st.integers(40, 120),
    min_parts=st.integers(1, 6),
)
def test_token_budget_balanced_partition(lengths, budget, min_parts):
    parts = token_budget_balanced_partition(lengths, budget, min_parts=min_parts)
    assert _is_partition(parts, len(lengths))
    assert max(partition_sums(lengths, parts)) <= budget
    assert len(parts) >= min(min_parts, len(lengths))
    assert len(parts) >= -(-sum(lengths) // budget)


def test_partition_errors():
    with pytest.raises(ValueError, match="multiple of k"):
        karmarkar_karp([1, 2, 3], 2, equal_size=True)
    with pytest.raises(ValueError, match="non-empty parts"):
        greedy_partition([1], 2)
    with pytest.raises(ValueError, match="more than the micro-batch budget"):
        token_budget_balanced_partition([5, 50], 10)
    with pytest.raises(ValueError, match="unknown partition method"):
        balanced_partition([1, 2], 2, method="random")


def test_balanced_micro_batch_groups_fit_the_budget():
    batch = make_batch(0)
    tokens = (batch.prompt_mask.sum(-1) + batch.response_mask.sum(-1)).tolist()
    sequential = micro_batch_groups(batch, max_tokens=14)
    balanced = micro_batch_groups(batch, max_tokens=14, grouping="balanced")
    assert _is_partition(balanced, len(tokens))
    assert max(partition_sums(tokens, balanced)) <= 14
    assert len(balanced) <= len(sequential)
    assert spread(tokens, balanced) <= spread(tokens, sequential)


# ------------------------------------------------------------------------------ 2 gloo ranks (FSDP)


def _packing_worker(rank, world_size, model_dir):
    from backends.distributed.setup import init_distributed
    from backends.training.fsdp import (
        balance_across_ranks,
        build_actor,
        build_critic,
        build_reference,
        compute_logprobs,
        compute_values,
        full_state_dict,
        update,
        value_loss_fn,
    )

    env = init_distributed()
    batches = [make_batch(0), make_batch(1)]
    mode = "seq-mean-token-mean"
    configs = {
        "padded": FSDPConfig(micro_batch_size=4),
        "packed": FSDPConfig(micro_batch_size=4, use_remove_padding=True),
        "budget-balanced": FSDPConfig(max_tokens_per_micro_batch=14, token_budget_grouping="balanced"),
        "dp-balanced": FSDPConfig(micro_batch_size=4, balance_dp=True),
        "all": FSDPConfig(
            max_tokens_per_micro_batch=14,
            token_budget_grouping="balanced",
            balance_dp=True,
            use_remove_padding=True,
            gradient_checkpointing=True,
        ),
    }
    out = {}
    for name, cfg in configs.items():
        state = build_actor(model_dir, env, OPTIM, cfg)
        counts = []
        for batch in batches:
            state, m = update(state, rank_rows(batch, rank, world_size), lambda o, mb, n: pg_loss(o, mb, n, mode))
            counts.append(m["num_micro_batches"])
        out[name] = {"params": _numpy(dict(full_state_dict(state))), "micro_batches": counts}

    local = rank_rows(make_batch(0), rank, world_size)
    state = build_actor(model_dir, env, OPTIM, FSDPConfig(micro_batch_size=4))
    balanced = balance_across_ranks(local, state)
    tokens = lambda b: int(b.prompt_mask.sum() + b.response_mask.sum())
    out["tokens_before"], out["tokens_after"] = tokens(local), tokens(balanced)
    out["rows_after"] = int(balanced.prompt_ids.shape[0])
    out["group_ids_after"] = balanced.group_ids.tolist()

    # log-probs / entropies / values: packed vs padded through the FSDP engine, actor, reference, critic
    for packed in (False, True):
        cfg = FSDPConfig(micro_batch_size=4, use_remove_padding=packed)
        actor = build_actor(model_dir, env, OPTIM, cfg)
        lp = compute_logprobs(actor, local, with_entropy=True)
        ref = compute_logprobs(build_reference(model_dir, env, cfg), local)
        critic = build_critic(model_dir, env, OPTIM, cfg)
        values = compute_values(critic, local)
        target = local.replace(
            returns=torch.randn(local.response_ids.shape, generator=torch.Generator().manual_seed(7)), old_values=values
        )
        for _ in range(2):
            critic, cm = update(critic, target, value_loss_fn(clip_range=0.5))
        out[f"forward-{packed}"] = {
            "logprobs": _numpy(lp.logprobs),
            "entropy": _numpy(lp.entropy),
            "ref": _numpy(ref.logprobs),
            "values": _numpy(values),
            "critic_params": _numpy(dict(full_state_dict(critic))),
            "critic_loss": cm["loss"],
        }
    return out


@pytest.fixture(scope="module")
def two_ranks(model_dir):
    return run_distributed(_packing_worker, 2, model_dir)


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["packed", "budget-balanced", "dp-balanced", "all"])
def test_two_rank_update_equals_single_process(two_ranks, model_dir, name):
    ref_params, _, _, _ = reference_updates(model_dir, [make_batch(0), make_batch(1)], "seq-mean-token-mean")
    ref_params = _numpy(ref_params)
    for rank in range(2):
        diff = _max_diff(two_ranks[rank][name]["params"], ref_params)
        assert diff < 1e-6, f"{name} rank {rank}: max |param diff| vs the full batch = {diff:.3g}"
        diff = _max_diff(two_ranks[rank][name]["params"], two_ranks[rank]["padded"]["params"])
        assert diff < 1e-6, f"{name} rank {rank}: max |param diff| vs padded row micro-batches = {diff:.3g}"


@pytest.mark.distributed
def test_balanced_token_budget_agrees_on_micro_batch_count(two_ranks):
    # both ranks run the same number of micro-batches (no dummy ones), fewer than the sequential split's
    counts = [two_ranks[r]["budget-balanced"]["micro_batches"] for r in range(2)]
    assert counts[0] == counts[1]
    batch = make_batch(0)
    seq = max(len(micro_batch_groups(rank_rows(batch, r, 2), max_tokens=14)) for r in range(2))
    assert counts[0][0] <= seq


@pytest.mark.distributed
def test_dp_redistribution_balances_tokens(two_ranks):
    before = [two_ranks[r]["tokens_before"] for r in range(2)]
    after = [two_ranks[r]["tokens_after"] for r in range(2)]
    assert sum(before) == sum(after)
    assert abs(after[0] - after[1]) < abs(before[0] - before[1])
    assert [two_ranks[r]["rows_after"] for r in range(2)] == [6, 6]
    groups = sorted(two_ranks[0]["group_ids_after"] + two_ranks[1]["group_ids_after"])
    assert groups == sorted(make_batch(0).group_ids.tolist())


@pytest.mark.distributed
def test_two_rank_packed_forward_and_critic_equal_padded(two_ranks):
    local_mask = [rank_rows(make_batch(0), r, 2).response_mask.numpy() for r in range(2)]
    for rank in range(2):
        padded, packed = two_ranks[rank]["forward-False"], two_ranks[rank]["forward-True"]
        mask = local_mask[rank]
        for key in ("logprobs", "entropy", "ref", "values"):
            diff = float(np.abs(np.where(mask, packed[key] - padded[key], 0.0)).max())
            assert diff < 2e-6, f"rank {rank} {key}: {diff:.3g}"
        assert _max_diff(packed["critic_params"], padded["critic_params"]) < 1e-6
        assert packed["critic_loss"] == pytest.approx(padded["critic_loss"], rel=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("attn", ["sdpa", "flash_attention_2"])
def test_packed_equals_padded_on_cuda(model_dir, attn):
    """On a GPU: the packed row through flash-attention's varlen kernel (or the per-sequence SDPA)
    gives the padded log-probs (bf16 compute, so a bf16 tolerance)."""
    if attn == "flash_attention_2":
        pytest.importorskip("flash_attn")
    model, _ = load_causal_lm(model_dir, dtype=torch.bfloat16, device="cuda", attn_implementation=attn)
    batch = make_batch(6)
    batch = tree_map(lambda x: x.cuda(), batch)
    with torch.no_grad():
        padded = forward_micro_batch(model, batch, with_entropy=False)
        enable_packed_attention(model)
        packed = forward_micro_batch(model, batch, with_entropy=False, packed=True)
    assert model.config._attn_implementation == (attn if attn != "sdpa" else VARLEN_SDPA)
    assert _masked_max_diff(packed.logprobs, padded.logprobs, batch.response_mask) < 5e-2
