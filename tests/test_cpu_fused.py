"""The fused CPU training ops (backends/cpu/fused_modules.py over csrc/packed_attention.c and csrc/norm_act.c)
against float64 references and against the unfused Hugging Face model."""

from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from backends.cpu import accelerate
from backends.cpu import fused_modules as cpu_fused
from backends.cpu.fused_modules import FusedAttention, FusedRMSNorm, FusedSwiGLU, OneDNNLinear, onednn_linear_works, packed_attention
from backends.cpu.kernels import norm_act_kernel, packed_attention_kernel
from backends.models import TinyModelConfig, build_tiny_model
from backends.packing import pack_rows, pad_layout
from backends.training.packed_attention import only_backends, varlen_sdpa_attention
from rlfunc.aggregation import aggregate
from tests.test_cpu_kernels import needs_kernel


def _layout(prompt_lens, response_lens, group, share):
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


def _attention(q, k, v, layout, scale, backend="sdpa"):
    """Causal attention of each packed token over its own sequence by one forced backend of the packed
    attention (the reference: SDPA in float64)."""
    with only_backends(backend):
        out, _ = varlen_sdpa_attention(types.SimpleNamespace(training=False), q, k, v, None, scaling=scale,
                                       packed_layout=layout)
    return out


def _qkv(T, h, kv, d, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    # (1 heads T d) views of T-major tensors, as HF's projections hand them over
    return [torch.randn(1, T, n, d, generator=gen, dtype=dtype).transpose(1, 2).requires_grad_() for n in (h, kv, kv)]


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(1, 7), st.integers(1, 40)), min_size=1, max_size=6),
    group=st.sampled_from([1, 2]),
    share=st.booleans(),
    heads=st.sampled_from([(2, 1), (4, 2), (4, 4), (6, 2), (9, 1)]),
    d=st.sampled_from([16, 32, 64, 80, 128]),
)
def test_packed_attention_matches_float64_reference(rows, group, share, heads, d):
    """Outputs and q / k / v gradients equal a float64 reference through the PyTorch block path, for
    sequences of 1 to 47 tokens (several blocks of 16 slots), GQA (1 to 9 query heads per kv head: the
    kernel's blocks of 8 and 4 query rows and 4 slots end part-full), prompts shared by a group, and
    head dims that end in a partial pass of 64 features."""
    rows = [r for r in rows for _ in range(group)]
    layout, T = _layout([p for p, _ in rows], [r for _, r in rows], group, share)
    h, kv = heads
    q, k, v = _qkv(T, h, kv, d, seed=T)
    ref = _attention(q, k, v, layout, None)
    grad_out = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected = [ref, *torch.autograd.grad(ref, (q, k, v), grad_out)]
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    out = packed_attention(q32, k32, v32, layout, None)
    assert out is not None and out.shape == (1, T, h, d) and out.dtype == torch.float32
    got = [out, *torch.autograd.grad(out, (q32, k32, v32), grad_out.float())]
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected):
        # relative to the largest value, at least 1 (a one-token sequence's dq is 0 in exact arithmetic)
        err = float((a.detach().double() - b.detach()).abs().max() / b.detach().abs().max().clamp(min=1.0))
        assert err < 5e-6, (name, err)


@settings(max_examples=20, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(1, 7), st.integers(1, 40)), min_size=1, max_size=6),
    group=st.sampled_from([1, 2]),
    share=st.booleans(),
    heads=st.sampled_from([(2, 1), (4, 2), (6, 2)]),
    backend=st.sampled_from(["matmul", "sdpa"]),
)
def test_pytorch_backends_match_float64_reference(rows, group, share, heads, backend):
    """The portable backends (run on every machine, kernel or not) in float32 on the layouts the kernel
    test uses: outputs and q / k / v gradients equal the float64 reference to float32 rounding."""
    rows = [r for r in rows for _ in range(group)]
    layout, T = _layout([p for p, _ in rows], [r for _, r in rows], group, share)
    h, kv = heads
    q, k, v = _qkv(T, h, kv, 16, seed=T)
    ref = _attention(q, k, v, layout, 0.3)
    grad_out = torch.randn(ref.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    expected = [ref, *torch.autograd.grad(ref, (q, k, v), grad_out)]
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    out = _attention(q32, k32, v32, layout, 0.3, backend)
    assert out.shape == (1, T, h, 16) and out.dtype == torch.float32
    got = [out, *torch.autograd.grad(out, (q32, k32, v32), grad_out.float())]
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected):
        err = float((a.detach().double() - b.detach()).abs().max() / b.detach().abs().max().clamp(min=1.0))
        assert err < 5e-6, (backend, name, err)


@needs_kernel
def test_packed_attention_in_bf16_runs_on_a_float32_upcast():
    layout, T = _layout([3, 5, 5, 2], [9, 30, 1, 17], 1, False)
    q, k, v = _qkv(T, 4, 2, 32, seed=0, dtype=torch.float32)
    out32 = packed_attention(q, k, v, layout, 0.2)
    assert float((out32 - _attention(q, k, v, layout, 0.2, "sdpa")).detach().abs().max()) < 1e-5  # the portable path
    qb, kb, vb = (x.detach().bfloat16().requires_grad_() for x in (q, k, v))
    out16 = packed_attention(qb, kb, vb, layout, 0.2)
    assert out16.dtype == torch.bfloat16
    assert float((out16.detach().float() - out32.detach()).abs().max()) < 2e-2
    # the bf16 matmul backend (the portable path's choice for short bf16 blocks) within bf16 precision of it
    matmul16 = _attention(qb.detach(), kb.detach(), vb.detach(), layout, 0.2, "matmul")
    assert float((matmul16.float() - out16.detach().float()).abs().max()) < 3e-2
    out16.float().sum().backward()
    assert qb.grad.dtype == torch.bfloat16 and bool(torch.isfinite(kb.grad.float()).all())


@needs_kernel
def test_packed_attention_checks_its_layout():
    layout, T = _layout([3, 4], [5, 6], 1, False)
    kernel = packed_attention_kernel(32)
    q, k, v = (x.detach().float()[0].transpose(0, 1).contiguous() for x in _qkv(T, 2, 1, 32, seed=0))
    slot_token = torch.full((layout.gather.numel(),), -1).index_copy_(0, layout.scatter, torch.arange(T))
    slot_token = slot_token.view(layout.gather.shape)
    bad_gather = layout.gather.clone()
    bad_gather[0, 0] = T  # past the packed row: the kernel would read out of bounds
    with pytest.raises(ValueError, match="out of range"):
        kernel.forward(q, k, v, bad_gather, layout.lengths, slot_token, 0.1)
    with pytest.raises(ValueError, match="kv dividing h"):
        kernel.forward(q, k[:, :1].repeat(1, 3, 1).contiguous(), v, layout.gather, layout.lengths, slot_token, 0.1)
    with pytest.raises(ValueError, match="float32 CPU"):
        kernel.forward(q.double(), k, v, layout.gather, layout.lengths, slot_token, 0.1)
    with pytest.raises(ValueError, match="contiguous rows"):  # heads not contiguous within a row
        kernel.forward(q.transpose(0, 1).contiguous().transpose(0, 1), k, v, layout.gather, layout.lengths, slot_token, 0.1)
    assert packed_attention_kernel(24) is None  # head dim not a multiple of 16: the PyTorch path


@needs_kernel
@pytest.mark.parametrize("hidden", [256, 70, 8])
def test_rms_norm_matches_float64(hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(37, hidden, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    w = torch.nn.Parameter(torch.randn(hidden, generator=gen, dtype=torch.float64))
    ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    grad_out = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    expected = [ref, *torch.autograd.grad(ref, (x, w), grad_out)]
    x32, w32 = x.detach().float().requires_grad_(), torch.nn.Parameter(w.detach().float())
    out = FusedRMSNorm(w32, 1e-6)(x32.view(37, 1, hidden)).view(37, hidden)  # any leading shape
    got = [out, *torch.autograd.grad(out, (x32, w32), grad_out.float())]
    for name, a, b in zip(("y", "dx", "dw"), got, expected):
        assert float((a.detach().double() - b.detach()).abs().max() / b.detach().abs().max()) < 2e-6, name


@needs_kernel
@pytest.mark.parametrize("n", [688 * 5, 77])
def test_swiglu_matches_float64(n):
    gen = torch.Generator().manual_seed(n)
    gate = (torch.randn(n, generator=gen, dtype=torch.float64) * 5).requires_grad_()  # both signs, large |x|
    up = torch.randn(n, generator=gen, dtype=torch.float64).requires_grad_()
    ref = F.silu(gate) * up
    grad_out = torch.randn(n, generator=gen, dtype=torch.float64)
    expected = [ref, *torch.autograd.grad(ref, (gate, up), grad_out)]
    g32, u32 = gate.detach().float().requires_grad_(), up.detach().float().requires_grad_()
    out = cpu_fused._SwiGLU.apply(g32, u32, norm_act_kernel())
    got = [out, *torch.autograd.grad(out, (g32, u32), grad_out.float())]
    plain = F.silu(g32) * u32  # PyTorch's own float32 ops, for their rounding error
    torch_fp32 = [plain, *torch.autograd.grad(plain, (g32, u32), grad_out.float())]

    def err(a, b):
        return float(((a.detach().double() - b).abs() / (b.abs() + 1e-3)).max())

    for name, a, t, b in zip(("h", "dgate", "dup"), got, torch_fp32, expected):
        # dgate loses digits to cancellation near silu's minimum (x = -1.28) in float32, PyTorch's too
        assert err(a, b) < max(5e-6, 2 * err(t, b)), name


def _fused_and_plain(arch="qwen2"):
    plain = build_tiny_model(TinyModelConfig(arch=arch, hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=96))
    fused = copy.deepcopy(plain)
    replaced = accelerate(fused)
    return plain, fused, replaced


@needs_kernel
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_fused_modules_keep_the_parameters_and_the_math(arch, monkeypatch):
    """accelerate swaps every RMSNorm and MLP (2 norms + 1 MLP per layer, and the final norm) and
    makes every nn.Linear a OneDNNLinear, keeps the state dict's names, and the model's logits and
    gradients stay those of HF's modules (here with every product through oneDNN)."""
    plain, fused, replaced = _fused_and_plain(arch)
    layers = plain.config.num_hidden_layers
    linears = sum(type(m) is torch.nn.Linear for m in plain.modules())
    assert replaced == 3 * layers + 1 + (linears + layers if onednn_linear_works(torch.float32) else 0)
    if onednn_linear_works(torch.float32):
        assert isinstance(fused.model.layers[0].self_attn, FusedAttention)
    assert isinstance(fused.model.layers[0].input_layernorm, FusedRMSNorm)
    assert isinstance(fused.model.layers[0].mlp, FusedSwiGLU)
    if onednn_linear_works(torch.float32):
        assert type(fused.model.layers[0].mlp.up_proj) is OneDNNLinear and type(fused.lm_head) is OneDNNLinear
        monkeypatch.setattr(cpu_fused, "ONEDNN_MIN_MACS", 0)
    assert list(fused.state_dict()) == list(plain.state_dict())
    ids = torch.randint(3, 60, (3, 11), generator=torch.Generator().manual_seed(0))
    out_plain, out_fused = plain(input_ids=ids).logits, fused(input_ids=ids).logits
    assert float((out_plain - out_fused).abs().max()) < 1e-5
    out_plain.square().mean().backward()
    out_fused.square().mean().backward()
    grads = dict(plain.named_parameters())
    for name, p in fused.named_parameters():
        ref = grads[name].grad
        assert float((p.grad - ref).abs().max() / ref.abs().max().clamp(min=1e-12)) < 1e-4, name


@needs_kernel
@pytest.mark.parametrize("rows,bias", [(3, True), (300, False)])
def test_onednn_linear_matches_float64(rows, bias, monkeypatch):
    """OneDNNLinear's output and input / weight / bias gradients against float64, through oneDNN
    (threshold lowered) and through F.linear below the threshold; the parameters are nn.Linear's."""
    if not onednn_linear_works(torch.float32):
        pytest.skip("this torch build has no oneDNN linear")
    gen = torch.Generator().manual_seed(rows)
    layer = torch.nn.Linear(48, 40, bias=bias)
    ref_layer = copy.deepcopy(layer).double()
    layer.__class__ = OneDNNLinear
    x = torch.randn(2, rows, 48, generator=gen)
    grad_out = torch.randn(2, rows, 40, generator=gen)
    for threshold in (0, 1 << 62):
        monkeypatch.setattr(cpu_fused, "ONEDNN_MIN_MACS", threshold)
        layer.zero_grad()
        ref_layer.zero_grad()
        xf, xd = x.clone().requires_grad_(), x.double().requires_grad_()
        out, ref = layer(xf), ref_layer(xd)
        out.backward(grad_out)
        ref.backward(grad_out.double())
        pairs = [(out, ref), (xf.grad, xd.grad), (layer.weight.grad, ref_layer.weight.grad)]
        if bias:
            pairs.append((layer.bias.grad, ref_layer.bias.grad))
        for a, b in pairs:
            assert float((a.detach().double() - b.detach()).abs().max() / b.detach().abs().max()) < 2e-6


def test_onednn_linear_works_in_bf16_where_the_op_runs():
    """The self-test takes bf16 where oneDNN runs it: its fused residual add rounds once and the
    reference twice, one bf16 unit apart (a float32 tolerance refused bf16, and the bf16 rollout lost its
    prepacked weights and fused SiLU / residual add)."""
    x = torch.ones(2, 8, dtype=torch.bfloat16)
    try:
        torch.ops.mkldnn._linear_pointwise(x, torch.ones(4, 8, dtype=torch.bfloat16), None, "swish", [], "")
    except Exception:  # noqa: BLE001 - no bf16 oneDNN linear in this build
        pytest.skip("this torch build has no bf16 oneDNN linear")
    assert onednn_linear_works(torch.bfloat16)


@needs_kernel
def test_fused_modules_in_bf16_keep_hf_math_to_bf16_rounding():
    """In bfloat16 (FSDP2's bf16 compute) the fused RMSNorm and SwiGLU run their bf16 kernels where this
    CPU has them, else Hugging Face's math: logits and gradients within bf16 rounding of HF's modules."""
    plain, fused, _ = _fused_and_plain()
    plain, fused = plain.bfloat16(), fused.bfloat16()
    ids = torch.randint(3, 60, (2, 7), generator=torch.Generator().manual_seed(0))
    out_plain, out_fused = plain(input_ids=ids).logits, fused(input_ids=ids).logits
    if not norm_act_kernel().bf16:
        assert torch.equal(out_plain, out_fused)  # the same ops, bit for bit
        return
    scale = out_plain.float().abs().max()
    assert float((out_plain.float() - out_fused.float()).abs().max() / scale) < 2e-2
    out_plain.float().square().mean().backward()
    out_fused.float().square().mean().backward()
    grads = dict(plain.named_parameters())
    for name, p in fused.named_parameters():
        assert p.grad.dtype == torch.bfloat16, name
        ref = grads[name].grad.float()
        assert float((p.grad.float() - ref).abs().max() / ref.abs().max().clamp(min=1e-12)) < 5e-2, name


@needs_kernel
def test_norm_act_kernels_in_bf16_match_float64():
    """bf16 RMSNorm and SwiGLU (float32 math, rounded where HF's bf16 modules round) against float64 on
    the same bf16 inputs: within a bf16 unit or two."""
    kernel = norm_act_kernel()
    if not kernel.bf16:
        pytest.skip("this CPU has no AVX-512BW/VL: bf16 runs Hugging Face's math")
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 70, generator=gen) * 3).bfloat16()
    w = torch.randn(70, generator=gen).bfloat16()
    dy = torch.randn(37, 70, generator=gen).bfloat16()
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    ref = wd * (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6))
    ref_dx, ref_dw = torch.autograd.grad(ref, (xd, wd), dy.double())
    y, rstd = kernel.rms_norm_forward(x, w, 1e-6)
    dx, dw = kernel.rms_norm_backward(x, w, rstd, dy)
    assert y.dtype == dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    for name, a, b in (("y", y, ref), ("dx", dx, ref_dx), ("dw", dw, ref_dw)):
        assert float((a.double() - b.detach()).abs().max() / b.detach().abs().max()) < 1e-2, name
    # HF's bf16 module rounds x * rstd to bf16 before the weight: the kernel's y is exactly that product
    hf = (w.float() * (x.float() * rstd[:, None]).bfloat16().float()).bfloat16()
    assert float((y.float() - hf.float()).abs().max() / hf.float().abs().max()) < 1e-2
    g, u, dh = ((torch.randn(688 * 3 + 5, generator=gen) * s).bfloat16() for s in (5, 1, 1))
    gd, ud = g.double().requires_grad_(), u.double().requires_grad_()
    ref = F.silu(gd) * ud
    ref_dg, ref_du = torch.autograd.grad(ref, (gd, ud), dh.double())
    h = kernel.swiglu_forward(g, u)
    dg, du = kernel.swiglu_backward(g, u, dh)
    for name, a, b in (("h", h, ref), ("dgate", dg, ref_dg), ("dup", du, ref_du)):
        assert a.dtype == torch.bfloat16
        assert float(((a.double() - b.detach()).abs() / (b.detach().abs() + 1e-2)).max()) < 2e-2, name
    with pytest.raises(TypeError, match="one dtype"):
        kernel.swiglu_forward(g, u.float())


def test_other_architectures_and_no_kernels_are_left_alone(monkeypatch):
    class GemmaRMSNorm(torch.nn.Module):  # scales by 1 + weight: not the math of the fused norm
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(4))
            self.variance_epsilon = 1e-6

    model = torch.nn.Sequential(GemmaRMSNorm())
    assert accelerate(model) == 0 and isinstance(model[0], GemmaRMSNorm)
    monkeypatch.setattr(cpu_fused, "norm_act_kernel", lambda: None)
    plain, fused, replaced = _fused_and_plain()
    assert replaced == 0 and type(fused.model.norm) is type(plain.model.norm)


@needs_kernel
@pytest.mark.parametrize("share_prompts", [True, False])
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_fused_model_packed_equals_hf_padded(tmp_path, share_prompts, kv_heads, monkeypatch):
    """A model with every fused module (q / k / v product, RoPE and attention in FusedAttention; fused
    norms, SwiGLU, oneDNN linears) on packed rows gives the log-probs, entropies, loss and gradients
    of the plain HF model on padded rows; the fused attention path is the one that ran."""
    from backends.training.hf_forward import forward_micro_batch
    from backends.models import load_causal_lm, write_tiny_model
    from backends.training.packed_attention import enable_packed_attention
    from tests.test_packing import _assert_actor_equal, _grouped, _outputs_and_grads
    from tests.test_fsdp_engine import make_batch

    if not onednn_linear_works(torch.float32):
        pytest.skip("this torch build has no oneDNN linear")
    monkeypatch.setattr(cpu_fused, "ONEDNN_MIN_MACS", 0)  # the tiny model's products through oneDNN too
    config = TinyModelConfig(hidden_size=64 * kv_heads, num_layers=2, num_heads=2 * kv_heads, num_kv_heads=kv_heads,
                             intermediate_size=128, max_position_embeddings=64, seed=1)
    model_dir = write_tiny_model(tmp_path / "model", config)
    plain, _ = load_causal_lm(model_dir)
    fused, _ = load_causal_lm(model_dir)
    plain.train(), fused.train()
    batch = _grouped(make_batch(3))
    padded = _outputs_and_grads(plain, batch, packed=False)
    enable_packed_attention(fused)
    assert accelerate(fused) > 0
    calls = []
    # the cpu-kernel backend (behind the seam) is not used: FusedAttention runs the attention itself
    monkeypatch.setattr(cpu_fused, "packed_attention", lambda *a: calls.append(a))
    fused.zero_grad(set_to_none=True)
    out = forward_micro_batch(fused, batch, with_entropy=True, packed=True, share_prompts=share_prompts)
    loss = aggregate(-batch.advantages * out.logprobs, batch.response_mask, "seq-mean-token-mean")
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in fused.named_parameters() if p.grad is not None}
    _assert_actor_equal(batch, padded, ((out.logprobs.detach(), out.entropy.detach()), float(loss.detach()), grads))
    assert not calls
