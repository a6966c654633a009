"""Fused CPU ops for training and scoring (the CPU counterpart of the Triton kernels Liger patches into HF models).

Autograd functions over the C kernels of :mod:`backends.cpu.kernels`, and the modules that put them
into a Hugging Face Llama / Qwen2 model:

- :func:`packed_attention`: causal attention over a packed micro-batch (:mod:`backends.packing`),
  forward and backward in one C pass each, reading the packed ``q, k, v`` in place (shared prompts
  included), where the PyTorch path gathers them into a padded block and runs batched matmuls, a
  mask and a softmax. It is the ``"cpu-kernel"`` backend of ``backends.training.packed_attention``,
  which reaches it through the seam ``backends.cpu.packed_attention``.
- :class:`FusedAttention`: mixed into a Llama / Qwen2 attention module's class; on packed rows one op
  does the stacked q / k / v product, RoPE and that attention, forward and backward.
- :class:`FusedRMSNorm` and :class:`FusedSwiGLU`: drop-in replacements of the models' RMSNorm and MLP
  modules, holding the same parameters under the same names (state dicts, FSDP sharding and
  checkpoints are unchanged). :func:`accelerate` (the seam ``backends.cpu.accelerate``) swaps them in
  before sharding.
- :class:`OneDNNLinear`: ``nn.Linear`` whose forward and input-gradient products run through oneDNN's
  linear (PyTorch's internal CPU inference op, the one ``torch.compile`` uses after freezing) instead
  of MKL, which is faster at training sizes (the input gradient passes the weight as a transposed
  view, so no copy is made). The weight gradient stays a ``matmul``: once its operands' transposes and
  reorders are counted, oneDNN gains nothing there. Used for products of at least :data:`ONEDNN_MIN_MACS`.

All of them compute in float32 on the CPU. The attention and linear paths run for float32 inputs (bf16
attention inputs are upcast, as PyTorch's CPU attention does); RMSNorm and SwiGLU also for bfloat16
ones (FSDP2's bf16 mixed precision), rounding their outputs where Hugging Face's bf16 modules round.
Otherwise, or when the kernels cannot run here (:mod:`backends.cpu.kernels`: no compiler, no AVX-512,
``RLFUNC_CPU_KERNELS=0``), the modules run Hugging Face's own math. Results equal the PyTorch path's
to float32 rounding (the sums run in a different order), which the tests check against float64
references; in bf16 to bf16 rounding.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backends.cpu.kernels import NormAct, PackedAttention, norm_act_kernel, packed_attention_kernel
from backends.packing import BlockLayout, pad_layout

__all__ = ["FusedAttention", "FusedRMSNorm", "FusedSwiGLU", "OneDNNLinear", "accelerate", "onednn_linear_works",
           "packed_attention"]

#: HF modules replaced by :func:`accelerate` (their forward is exactly the math the kernels do:
#: Gemma's RMSNorm, for one, scales by ``1 + weight`` and is not here)
RMS_NORM_CLASSES = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")
SWIGLU_MLP_CLASSES = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP")
#: attention modules given :class:`FusedAttention` (q / k / v projections, RoPE, attention; Qwen3's q/k
#: norms are not in the fused op, so it is not here)
ATTENTION_CLASSES = ("LlamaAttention", "Qwen2Attention")


# ------------------------------------------------------------------------------------- attention


class _PackedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, gather: Tensor, lengths: Tensor, slot_token: Tensor,
                scale: float, kernel: PackedAttention) -> Tensor:
        out, lse = kernel.forward(q, k, v, gather, lengths, slot_token, scale)
        ctx.save_for_backward(q, k, v, out, lse, gather, lengths, slot_token)
        ctx.scale, ctx.kernel = scale, kernel
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, gather, lengths, slot_token = ctx.saved_tensors
        dq, dk, dv = ctx.kernel.backward(q, k, v, out, lse, dout.contiguous(), gather, lengths, slot_token, ctx.scale)
        return dq, dk, dv, None, None, None, None, None


def packed_attention(query: Tensor, key: Tensor, value: Tensor, layout: BlockLayout, scale: float | None) -> Tensor | None:
    """Causal attention within each sequence of a packed row, or None when the kernel cannot run here.

    ``query (1 h T d)``, ``key value (1 kv T d)`` (Hugging Face's layout; T-major in memory, as the
    projections write them), ``layout``: where the sequences sit (:class:`backends.packing.BlockLayout`). Returns
    ``(1 T h d)`` in the query's dtype.
    """
    head_dim = query.shape[-1]
    kernel = packed_attention_kernel(head_dim) if query.device.type == "cpu" else None
    if kernel is None or query.dtype not in (torch.float32, torch.bfloat16):
        return None
    dtype = query.dtype
    q, k, v = (x[0].transpose(0, 1).float().contiguous() for x in (query, key, value))  # (T heads d)
    scale = head_dim**-0.5 if scale is None else float(scale)
    out = _PackedAttention.apply(q, k, v, *_layout_tensors(layout, q.shape[0]), scale, kernel)
    return out.to(dtype)[None]


def _layout_tensors(layout: BlockLayout, tokens: int) -> tuple[Tensor, Tensor, Tensor]:
    """The kernels' view of a BlockLayout: ``gather (n L)``, ``lengths (n)`` and ``slot_token (n L)``, the
    packed token whose output each block slot gives (-1 for slots whose token is owned elsewhere)."""
    n, max_len = layout.gather.shape
    slot_token = torch.full((n * max_len,), -1, dtype=torch.long).index_copy_(0, layout.scatter, torch.arange(tokens))
    return layout.gather.contiguous(), layout.lengths.contiguous(), slot_token.view(n, max_len)


class _FusedQKVAttention(torch.autograd.Function):
    """``x (T H)`` -> attention output ``(T h d)``: one product with the stacked q / k / v weight
    (oneDNN), RoPE on q and k, and the packed causal attention (C kernels), forward and backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, cos: Tensor, sin: Tensor, gather: Tensor,
                lengths: Tensor, slot_token: Tensor, heads: int, kv_heads: int, scale: float,
                kernel: PackedAttention) -> Tensor:
        T, width = x.shape[0], heads + 2 * kv_heads
        qkv = _onednn_product(x, weight.detach())
        if bias is not None:
            qkv.add_(bias)
        qkv = qkv.view(T, width, -1)
        rotated = torch.empty_like(qkv)  # RoPE'd q and k, then v: what the backward reads
        kernel.rope_forward(qkv[:, : heads + kv_heads], cos, sin, rotated[:, : heads + kv_heads])
        rotated[:, heads + kv_heads :] = qkv[:, heads + kv_heads :]
        q, k, v = rotated[:, :heads], rotated[:, heads : heads + kv_heads], rotated[:, heads + kv_heads :]
        out, lse = kernel.forward(q, k, v, gather, lengths, slot_token, scale)
        ctx.save_for_backward(x, weight, rotated, out, lse, cos, sin, gather, lengths, slot_token)
        ctx.dims, ctx.kernel, ctx.has_bias = (heads, kv_heads, scale), kernel, bias is not None
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, rotated, out, lse, cos, sin, gather, lengths, slot_token = ctx.saved_tensors
        (heads, kv_heads, scale), kernel = ctx.dims, ctx.kernel
        T, width, d = rotated.shape
        q, k, v = rotated[:, :heads], rotated[:, heads : heads + kv_heads], rotated[:, heads + kv_heads :]
        grad_rotated = torch.empty(T, heads + kv_heads, d)
        grad_qkv = torch.empty(T, width, d)
        kernel.backward(q, k, v, out, lse, dout.contiguous(), gather, lengths, slot_token, scale,
                        dq=grad_rotated[:, :heads], dk=grad_rotated[:, heads:], dv=grad_qkv[:, heads + kv_heads :])
        kernel.rope_backward(grad_rotated, cos, sin, grad_qkv[:, : heads + kv_heads])
        g = grad_qkv.view(T, width * d)
        dx = _onednn_product(g, weight.detach().t()) if ctx.needs_input_grad[0] else None
        dweight = g.t() @ x if ctx.needs_input_grad[1] else None
        dbias = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dweight, dbias, *([None] * 9)


class FusedAttention:
    """Mixed into a Llama / Qwen2 attention module's class by :func:`accelerate` (its parameters
    and state stay the module's). On the packed CPU path (a ``packed_layout`` or ``cu_seq_lens_q`` in
    the forward's kwargs, float32, no KV cache, no dropout, no sliding window) the q / k / v
    projections, RoPE and attention run as :class:`_FusedQKVAttention`; anything else is the model's
    own forward."""

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, None]:
        fused = self._fused_forward(hidden_states, args, kwargs)
        if fused is not None:
            return fused, None
        return super().forward(hidden_states, *args, **kwargs)

    def _fused_forward(self, x: Tensor, args: tuple, kwargs: dict) -> Tensor | None:
        position_embeddings = args[0] if args else kwargs.get("position_embeddings")
        projections = (self.q_proj, self.k_proj, self.v_proj)
        if (position_embeddings is None or x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 3
                or x.shape[0] != 1 or kwargs.get("past_key_values") is not None
                or getattr(self, "sliding_window", None) is not None
                or (self.training and getattr(self, "attention_dropout", 0.0))
                or not all(isinstance(m, nn.Linear) and m.weight.dtype == torch.float32 for m in projections)
                or not onednn_linear_works(torch.float32)):
            return None
        layout = kwargs.get("packed_layout")
        if layout is None and kwargs.get("cu_seq_lens_q") is not None:
            bounds = tuple(int(b) for b in kwargs["cu_seq_lens_q"].tolist())
            layout = pad_layout(bounds, x.device) if bounds[-1] == x.shape[1] else None
        kernel = packed_attention_kernel(self.head_dim)
        if not isinstance(layout, BlockLayout) or kernel is None:
            return None
        heads, kv_heads = self.config.num_attention_heads, self.config.num_key_value_heads
        weight = torch.cat([m.weight for m in projections])
        biases = [m.bias for m in projections]
        bias = None if all(b is None for b in biases) else torch.cat(
            [b if b is not None else m.weight.new_zeros(m.weight.shape[0]) for b, m in zip(biases, projections)])
        cos, sin = (t.reshape(-1, self.head_dim).to(torch.float32).contiguous() for t in position_embeddings)
        T = x.shape[1]
        out = _FusedQKVAttention.apply(x.reshape(T, -1), weight, bias, cos, sin, *_layout_tensors(layout, T), heads,
                                       kv_heads, float(self.scaling), kernel)
        return self.o_proj(out.view(1, T, heads * self.head_dim))


@functools.lru_cache(maxsize=None)
def _fused_attention_class(cls: type) -> type:
    return type(f"Fused{cls.__name__}", (FusedAttention, cls), {"__module__": __name__})


# ------------------------------------------------------------------------------------- RMSNorm, SwiGLU


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float, kernel: NormAct) -> Tensor:
        y, rstd = kernel.rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.kernel = kernel
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, rstd = ctx.saved_tensors
        dx, dweight = ctx.kernel.rms_norm_backward(x, weight, rstd, dy.contiguous())
        return dx, dweight.to(weight.dtype), None, None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: Tensor, up: Tensor, kernel: NormAct) -> Tensor:
        ctx.save_for_backward(gate, up)
        ctx.kernel = kernel
        return kernel.swiglu_forward(gate, up)

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        gate, up = ctx.saved_tensors
        dgate, dup = ctx.kernel.swiglu_backward(gate, up, dout.contiguous())
        return dgate, dup, None


def _fused_kernel(*tensors: Tensor) -> NormAct | None:
    """The RMSNorm / SwiGLU kernels if they run these tensors (CPU, all float32 or all bfloat16)."""
    kernel = norm_act_kernel()
    return kernel if kernel is not None and kernel.supports(*tensors) else None


class FusedRMSNorm(nn.Module):
    """Llama / Qwen2 RMSNorm, ``weight * (x * rsqrt(mean(x^2) + eps))``: one C pass each way for float32
    or bfloat16 CPU input and weight, Hugging Face's math otherwise. Holds the replaced module's
    ``weight`` Parameter."""

    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps

    def forward(self, hidden_states: Tensor) -> Tensor:
        kernel = _fused_kernel(hidden_states, self.weight)
        if kernel is not None:
            shape = hidden_states.shape
            x = hidden_states.reshape(-1, shape[-1]).contiguous()
            return _RMSNorm.apply(x, self.weight, self.variance_epsilon, kernel).view(shape)
        dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, fused"


class FusedSwiGLU(nn.Module):
    """The gated MLP ``down(silu(gate(x)) * up(x))`` with ``silu(g) * u`` fused (one C pass each way for
    float32 or bfloat16 CPU activations; it also saves no ``silu(g)`` for the backward). Holds the replaced
    module's ``gate_proj``, ``up_proj`` and ``down_proj``."""

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        kernel = _fused_kernel(gate, up)
        if kernel is not None:
            hidden = _SwiGLU.apply(gate.contiguous(), up.contiguous(), kernel)
        else:
            hidden = F.silu(gate) * up
        return self.down_proj(hidden)


# ------------------------------------------------------------------------------------- linear


@functools.lru_cache(maxsize=None)
def onednn_linear_works(dtype: torch.dtype) -> bool:
    """Whether this torch build runs oneDNN's linear (PyTorch's internal CPU inference kernels, the
    ones ``torch.compile`` uses after weight freezing) for ``dtype``: with prepacked weights, fused
    SiLU and residual add (the native rollout), and with plain and transposed-view weights (training)."""
    try:
        w = torch.arange(32, dtype=dtype).view(4, 8) / 32
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 2)
        x = torch.ones(2, 8, dtype=dtype)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "swish", [], "")
        z = torch.ops.mkldnn._linear_pointwise.binary(x, y[:, :4].contiguous(), packed, None, "add")
        # oneDNN adds the residual before rounding to the output dtype, the reference after: in bfloat16
        # the two differ by up to one unit in the last place, so the tolerance is the dtype's
        tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
        close = functools.partial(torch.allclose, **tol)
        prepacked = close(z.float(), F.linear(x, w).float() + F.silu(F.linear(x, w)).float()[:, :4])
        plain = close(torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "").float(), F.linear(x, w).float())
        g = torch.ones(2, 4, dtype=dtype)
        transposed = close(torch.ops.mkldnn._linear_pointwise(g, w.t(), None, "none", [], "").float(), (g @ w).float())
        return bool(prepacked and plain and transposed)
    except Exception:  # noqa: BLE001 - any failure means: use F.linear
        return False


#: rows x in x out of a product below which :class:`OneDNNLinear` runs ``F.linear``: oneDNN's lead
#: over MKL is in the product itself, and for small products the extra op call per product costs
#: more than it saves.
ONEDNN_MIN_MACS = 1 << 26


def _onednn_product(x: Tensor, weight: Tensor) -> Tensor:
    """``x @ weight.T`` through oneDNN's linear (float32, CPU, 2-D; ``weight`` may be a transposed view)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        out = _onednn_product(x, weight.detach())
        return out if bias is None else out.add_(bias)

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        dout = dout.contiguous()
        dx = _onednn_product(dout, weight.detach().t()) if ctx.needs_input_grad[0] else None
        dweight = dout.t() @ x if ctx.needs_input_grad[1] else None
        dbias = dout.sum(0) if ctx.needs_input_grad[2] else None
        return dx, dweight, dbias


class OneDNNLinear(nn.Linear):
    """``nn.Linear`` (the same parameters and state) whose large float32 CPU products run through
    oneDNN's linear (see the module docstring); anything else is ``F.linear``.
    :func:`accelerate` turns a model's ``nn.Linear`` modules into this class in place."""

    def forward(self, x: Tensor) -> Tensor:
        w = self.weight
        rows = x.numel() // max(x.shape[-1], 1)
        if (x.dtype == w.dtype == torch.float32 and x.device.type == "cpu" and rows * w.numel() >= ONEDNN_MIN_MACS
                and onednn_linear_works(torch.float32)):
            out = _OneDNNLinear.apply(x.reshape(rows, x.shape[-1]), w, self.bias)
            return out.view(*x.shape[:-1], w.shape[0])
        return F.linear(x, w, self.bias)


def accelerate(model: nn.Module) -> int:
    """Replace a Llama / Qwen2-family model's RMSNorm and SiLU-gated MLP modules by the fused ones, and
    make its ``nn.Linear`` modules :class:`OneDNNLinear`, in place, before sharding; returns how
    many modules were changed (0 when the kernels cannot run here; other architectures' norms and
    MLPs are left as they are)."""
    if norm_act_kernel() is None:
        return 0
    act = getattr(getattr(model, "config", None), "hidden_act", None)
    replaced = 0
    if onednn_linear_works(torch.float32):
        for module in model.modules():
            if type(module) is nn.Linear:
                module.__class__ = OneDNNLinear  # a subclass with no state of its own: same parameters
                replaced += 1
            elif type(module).__name__ in ATTENTION_CLASSES and packed_attention_kernel(module.head_dim) is not None:
                module.__class__ = _fused_attention_class(type(module))
                replaced += 1
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            kind = type(child).__name__
            if kind in RMS_NORM_CLASSES and isinstance(getattr(child, "weight", None), nn.Parameter):
                setattr(parent, name, FusedRMSNorm(child.weight, float(child.variance_epsilon)))
                replaced += 1
            elif kind in SWIGLU_MLP_CLASSES and act in ("silu", "swish"):
                setattr(parent, name, FusedSwiGLU(child.gate_proj, child.up_proj, child.down_proj))
                replaced += 1
    return replaced
