"""Fused CPU ops for training and scoring (the CPU counterpart of the Triton kernels Liger patches into HF models).

Autograd functions over the C kernels of :mod:`backends.cpu_kernels`, and the modules that put them
into a Hugging Face Llama / Qwen2 model:

- :func:`packed_attention`: causal attention over a packed micro-batch (:mod:`backends.packing`),
  forward and backward in one C pass each, reading the packed ``q, k, v`` in place (shared prompts
  included), where the PyTorch path gathers them into a padded block and runs batched matmuls, a
  mask and a softmax (on config B of the benchmarks, about 110 ms of a 800 ms update). Called by
  :func:`backends.packing.varlen_sdpa_attention`.
- :class:`FusedRMSNorm` and :class:`FusedSwiGLU`: drop-in replacements of the models' RMSNorm and MLP
  modules, holding the same parameters under the same names (state dicts, FSDP sharding and
  checkpoints are unchanged). :func:`use_fused_modules` swaps them in before sharding.

All of them compute in float32 on the CPU; the fused paths run for float32 inputs (bf16 attention
inputs are upcast, as PyTorch's CPU attention does) and otherwise, or when the kernels cannot run
here (:mod:`backends.cpu_kernels`: no compiler, no AVX-512, ``RLFUNC_CPU_KERNELS=0``), the modules run
Hugging Face's own math. Results equal the PyTorch path's to float32 rounding (the sums run in a
different order), which the tests check against float64 references.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backends.cpu_kernels import NormAct, PackedAttention, norm_act_kernel, packed_attention_kernel

__all__ = ["FusedRMSNorm", "FusedSwiGLU", "packed_attention", "use_fused_modules"]

#: HF modules replaced by :func:`use_fused_modules` (their forward is exactly the math the kernels do:
#: Gemma's RMSNorm, for one, scales by ``1 + weight`` and is not here)
RMS_NORM_CLASSES = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")
SWIGLU_MLP_CLASSES = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP")


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


def packed_attention(query: Tensor, key: Tensor, value: Tensor, layout: Any, scale: float | None) -> Tensor | None:
    """Causal attention within each sequence of a packed row, or None when the kernel cannot run here.

    ``query (1 h T d)``, ``key value (1 kv T d)`` (Hugging Face's layout; T-major in memory, as the
    projections write them), ``layout``: a :class:`backends.packing.BlockLayout`. Returns
    ``(1 T h d)`` in the query's dtype.
    """
    head_dim = query.shape[-1]
    kernel = packed_attention_kernel(head_dim) if query.device.type == "cpu" else None
    if kernel is None or query.dtype not in (torch.float32, torch.bfloat16):
        return None
    dtype = query.dtype
    q, k, v = (x[0].transpose(0, 1).float().contiguous() for x in (query, key, value))  # (T heads d)
    n, max_len = layout.gather.shape
    slot_token = torch.full((n * max_len,), -1, dtype=torch.long).index_copy_(
        0, layout.scatter, torch.arange(q.shape[0])
    ).view(n, max_len)
    scale = head_dim**-0.5 if scale is None else float(scale)
    out = _PackedAttention.apply(q, k, v, layout.gather.contiguous(), layout.lengths.contiguous(), slot_token, scale, kernel)
    return out.to(dtype)[None]


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
        return dx, dweight, None, None


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
    if all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors):
        return norm_act_kernel()
    return None


class FusedRMSNorm(nn.Module):
    """Llama / Qwen2 RMSNorm, ``weight * (x * rsqrt(mean(x^2) + eps))``: one C pass each way for float32
    CPU input, Hugging Face's math otherwise. Holds the replaced module's ``weight`` Parameter."""

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
    float32 CPU activations; it also saves no ``silu(g)`` for the backward). Holds the replaced
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


def use_fused_modules(model: nn.Module) -> int:
    """Replace a Llama / Qwen2-family model's RMSNorm and SiLU-gated MLP modules by the fused ones, in
    place, before sharding; returns how many were replaced (0 when the kernels cannot run here, or
    for other architectures, which are left as they are)."""
    if norm_act_kernel() is None:
        return 0
    act = getattr(getattr(model, "config", None), "hidden_act", None)
    replaced = 0
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
