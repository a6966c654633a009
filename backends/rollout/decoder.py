"""The native rollout's decoder: Llama / Qwen2 math read straight from a HF module's parameters.

:class:`Decoder` runs ``prefill`` once over the left-padded prompts, then ``step`` once per new token,
over a KV cache (:mod:`backends.rollout.kv_cache`).
Around the attention it does less than the HF module does per step: one fused QKV GEMM, oneDNN
prepacked weights with a fused SiLU and residual add (:class:`Linear`), no per-step mask building or
cache concatenation, and only the last position's logits. :class:`Workspace` keeps the decoder's
weights and caches between calls.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

from backends.rollout.kv_cache import KVCache, apply_rope

__all__ = [
    "PREPACK_MIN_FP32_WEIGHT",
    "Decoder",
    "Layer",
    "Linear",
    "Workspace",
    "decoder_layers",
    "onednn_linear_works",
]


#: fp32 weights with fewer elements run through ``F.linear`` (MKL), not prepacked oneDNN: for small
#: weights MKL is as fast or faster, and oneDNN compiles a kernel for every new row count it meets,
#: which a short rollout whose working batch shrinks meets often. bf16 linears run through oneDNN either way.
PREPACK_MIN_FP32_WEIGHT = 65536


@functools.lru_cache(maxsize=None)
def onednn_linear_works(dtype: torch.dtype) -> bool:
    """Whether this torch build runs oneDNN's linear for ``dtype`` (PyTorch's internal CPU inference ops, the
    ones ``torch.compile`` uses after weight freezing) with prepacked weights, fused SiLU and residual add, as
    :class:`Linear` runs them, and gives ``F.linear``'s numbers. Probed once per dtype, on a tiny product."""
    try:
        w = torch.arange(32, dtype=dtype).view(4, 8) / 32
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 2)
        x = torch.ones(2, 8, dtype=dtype)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "swish", [], "")
        z = torch.ops.mkldnn._linear_pointwise.binary(x, y[:, :4].contiguous(), packed, None, "add")
        # oneDNN adds the residual before rounding to the output dtype, the reference after: in bfloat16
        # the two differ by up to one unit in the last place, so the tolerance is the dtype's
        tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
        reference = F.linear(x, w).float() + F.silu(F.linear(x, w)).float()[:, :4]
        return bool(torch.allclose(z.float(), reference, **tol))
    except Exception:  # noqa: BLE001 - any failure means: use F.linear
        return False


class Linear:
    """``x @ W.T + b`` with an optional fused SiLU or residual add; oneDNN-prepacked on CPU.

    Prepacking is a one-off reorder of the weight into oneDNN's blocked layout, redone by the
    :class:`Workspace` whenever a parameter has changed (so it always sees the current weights). It
    runs bf16 weights, and fp32 weights of at least :data:`PREPACK_MIN_FP32_WEIGHT` elements; otherwise,
    off the CPU, or if the internal ops are missing, this is plain ``F.linear``.
    """

    __slots__ = ("weight", "bias", "packed")

    def __init__(self, weight: Tensor, bias: Tensor | None, rows_hint: int, prepack: bool) -> None:
        self.weight, self.bias, self.packed = weight, bias, None
        large_enough = weight.dtype != torch.float32 or weight.numel() >= PREPACK_MIN_FP32_WEIGHT
        if prepack and large_enough and weight.device.type == "cpu" and onednn_linear_works(weight.dtype):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), rows_hint)

    def __call__(self, x: Tensor) -> Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def silu(self, x: Tensor) -> Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "swish", [], "")
        return F.silu(F.linear(x, self.weight, self.bias))

    def add_to(self, residual: Tensor, x: Tensor) -> Tensor:
        """``residual + linear(x)``."""
        if self.packed is not None and residual.is_contiguous():
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, self.bias, "add")
        return residual + F.linear(x, self.weight, self.bias)


def _cat_bias(*linears: Any) -> Tensor | None:
    biases = [m.bias for m in linears]
    if all(b is None for b in biases):
        return None
    return torch.cat([b if b is not None else m.weight.new_zeros(m.weight.shape[0]) for b, m in zip(biases, linears)])


@attrs.frozen
class Layer:
    """One decoder layer's weights, as the decoder runs them."""

    ln1: Tensor
    eps1: float
    qkv: Linear  # q, k and v projections stacked: one GEMM
    o: Linear
    ln2: Tensor
    eps2: float
    gate: Linear
    up: Linear
    down: Linear


def decoder_layers(model: Any, rows_hint: int, prepack: bool) -> list[Layer]:
    """The layers of a HF Llama / Qwen2 ``model`` (views of its parameters, plus the fused QKV weight)."""
    out = []
    for layer in model.model.layers:
        att, mlp = layer.self_attn, layer.mlp
        qkv_w = torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight])
        out.append(
            Layer(
                ln1=layer.input_layernorm.weight,
                eps1=layer.input_layernorm.variance_epsilon,
                qkv=Linear(qkv_w, _cat_bias(att.q_proj, att.k_proj, att.v_proj), rows_hint, prepack),
                o=Linear(att.o_proj.weight, att.o_proj.bias, rows_hint, prepack),
                ln2=layer.post_attention_layernorm.weight,
                eps2=layer.post_attention_layernorm.variance_epsilon,
                gate=Linear(mlp.gate_proj.weight, mlp.gate_proj.bias, rows_hint, prepack),
                up=Linear(mlp.up_proj.weight, mlp.up_proj.bias, rows_hint, prepack),
                down=Linear(mlp.down_proj.weight, mlp.down_proj.bias, rows_hint, prepack),
            )
        )
    return out


class Workspace:
    """What ``generate`` keeps between calls on one model, as vLLM keeps its KV cache and weights.

    - The decoder's weights (the fused QKV weight, oneDNN-prepacked linears): rebuilt only when a
      parameter has changed, tracked by each parameter's storage and version counter (``sync_weights``
      copies in place, which bumps the versions).
    - On the CPU, the KV caches of the most recent shapes, reused as they are: prefill and every step
      write a slot before anything reads it, and fresh caches would page-fault in again on every call.
      On a GPU, PyTorch's caching allocator already reuses freed blocks, and a colocated trainer needs
      the memory back between rollouts, so nothing is kept there.

    Parameters created under ``torch.inference_mode`` have no version counter: their weights are then
    rebuilt at every call, as without a workspace.
    """

    #: distinct cache shapes kept (a recipe generates training rollouts and evaluations of other sizes)
    MAX_CACHE_SHAPES = 2

    def __init__(self) -> None:
        self._weights_key: tuple | None = None
        self._weights: dict[tuple[int, bool], tuple[list[Layer], Linear]] = {}
        self._buffers: dict[tuple, list[Tensor]] = {}

    def weights(self, model: Any, rows_hint: int, prepack: bool) -> tuple[list[Layer], Linear]:
        """The decoder layers and LM head of ``model``'s current parameters."""
        params = list(model.parameters())
        key = None if any(p.is_inference() for p in params) else tuple((p.data_ptr(), p._version) for p in params)
        if key is None or key != self._weights_key:
            self._weights_key, self._weights = key, {}
        if (rows_hint, prepack) not in self._weights:
            self._weights[rows_hint, prepack] = (
                decoder_layers(model, rows_hint, prepack),
                Linear(model.get_output_embeddings().weight, None, rows_hint, prepack),
            )
        return self._weights[rows_hint, prepack]

    def buffers(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, count: int
    ) -> list[Tensor]:
        """``count`` uninitialised tensors of ``shape``: on the CPU the same ones as the last call with these
        arguments (new ones are views of one ``torch.empty((count, *shape))``), elsewhere new ones."""
        if torch.device(device).type != "cpu":
            return [torch.empty(shape, dtype=dtype, device=device) for _ in range(count)]
        key = (name, tuple(shape), dtype, str(device), count)
        found = self._buffers.pop(key, None)
        if found is None:
            found = list(torch.empty((count, *shape), dtype=dtype).unbind(0))
        self._buffers[key] = found  # most recently used last
        kept = [k for k in self._buffers if k[0] == name]
        for old in kept[: -self.MAX_CACHE_SHAPES]:
            del self._buffers[old]
        return found


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


class Decoder:
    """Runs the model over a fixed KV cache: :meth:`prefill` once, then :meth:`step` once per new token.

    The cache (``self.cache``, a :class:`~backends.rollout.kv_cache.KVCache`) lies in the rollout's
    :class:`Workspace` (reused between calls) or is allocated here. The working batch (the rows a step
    computes) shrinks through :meth:`keep_rows`, which copies the caches down.

    ``own_cache``: allocate the caches here rather than take the workspace's, so that they outlive other
    calls on the same workspace (a multi-turn rollout keeps its cache across turns while ``generate``
    may run in between); :meth:`release` drops them.

    ``make_cache``: build another cache in place of the contiguous one (the paged cache of
    :mod:`backends.rollout.paged_kv`), from keyword arguments ``num_heads``, ``num_kv``, ``head_dim``,
    ``layers``, ``att_dtype``, ``device``, ``rope``, ``scale`` and ``buffers``; it is stepped by :meth:`step_paged`.
    """

    def __init__(
        self,
        model: Any,
        rows: int,
        total_len: int,
        prepack: bool,
        workspace: Workspace | None = None,
        *,
        own_cache: bool = False,
        make_cache: Callable[..., Any] | None = None,
    ) -> None:
        workspace = workspace if workspace is not None else Workspace()
        cfg = model.config
        self.num_heads = cfg.num_attention_heads
        self.num_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.head_dim**-0.5
        self._weights_of = (model, rows, prepack, workspace)
        self.reload_weights()
        weight = self.embed
        self.dtype, self.device = weight.dtype, weight.device
        # cos/sin of every position from the model's own rotary module (handles rope scaling variants)
        positions = torch.arange(total_len, device=self.device)[None]
        cos, sin = model.model.rotary_emb(weight[:1][None], positions)
        half = self.head_dim // 2
        self.cos = cos[0]  # (L d)
        self.sin = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)
        # On CPU the attention math stays fp32 for a bf16 model: small batched matmuls and softmax run
        # slower in bf16 there, and fp32 keeps the log-probs closer to an fp32 trainer's.
        self.att_dtype = torch.float32 if self.device.type == "cpu" else self.dtype

        def buffers(name: str, shape: tuple[int, ...], dtype: torch.dtype, count: int) -> list[Tensor]:
            if not own_cache:
                return workspace.buffers(name, shape, dtype, self.device, count)
            if self.device.type == "cpu":
                return list(torch.empty((count, *shape), dtype=dtype).unbind(0))
            return [torch.empty(shape, dtype=dtype, device=self.device) for _ in range(count)]

        # uninitialised: prefill writes every prompt slot, and a step writes its slot before reading up
        # to it, so no slot is read before it is written (the paged cache says how it keeps to that)
        if make_cache is None:
            make_cache = functools.partial(KVCache.allocate, rows=rows, total_len=total_len)
        self.cache = make_cache(
            num_heads=self.num_heads,
            num_kv=self.num_kv,
            head_dim=self.head_dim,
            layers=len(self.layers),
            att_dtype=self.att_dtype,
            device=self.device,
            rope=(self.cos, self.sin),
            scale=self.scale,
            buffers=buffers,
        )

    def reload_weights(self) -> None:
        """Read the model's current parameters again: the fused QKV weight and the prepacked linears are copies,
        so after new weights were copied into the model (``sync_weights``) the decoder would still run the old
        ones. The caches are left as they are: keys and values computed by the old weights are the caller's to
        recompute (:meth:`backends.rollout.scheduler.ContinuousBatcher` prefills its rows again)."""
        model, rows, prepack, workspace = self._weights_of
        self.layers, self.lm_head = workspace.weights(model, rows, prepack)
        self.embed = model.get_input_embeddings().weight
        self.norm_w = model.model.norm.weight
        self.norm_eps = model.model.norm.variance_epsilon

    @property
    def k_cache(self) -> list[Tensor]:
        """The key cache of each layer."""
        return self.cache.k

    @property
    def v_cache(self) -> list[Tensor]:
        """The value cache of each layer."""
        return self.cache.v

    def _mlp(self, x: Tensor, lw: Layer) -> Tensor:
        h = _rms_norm(x, lw.ln2, lw.eps2)
        return lw.down.add_to(x, lw.gate.silu(h).mul_(lw.up(h)))

    def _logits(self, x: Tensor) -> Tensor:
        return self.lm_head(_rms_norm(x, self.norm_w, self.norm_eps))

    def prefill(self, ids: Tensor, mask: Tensor, copies: int) -> Tensor:
        """Run ``(b0 p)`` left-padded prompts; fill cache rows ``[i*copies, (i+1)*copies)`` with prompt i
        (and mask the prompt's padding there).

        Returns the last position's logits ``(b0 v)``.
        """
        b0, p = ids.shape
        h, kv, d = self.num_heads, self.num_kv, self.head_dim
        self.cache.mask_prompts(mask, copies)
        pos = (mask.long().cumsum(-1) - 1).clamp_(min=0)
        cos, sin = self.cos[pos][:, :, None], self.sin[pos][:, :, None]  # (b0 p 1 d)
        causal = torch.ones(p, p, dtype=torch.bool, device=ids.device).tril_()
        allowed = (causal[None] & mask[:, None, :]) | torch.eye(p, dtype=torch.bool, device=ids.device)
        bias = torch.zeros(allowed.shape, dtype=self.att_dtype, device=ids.device).masked_fill_(~allowed, float("-inf"))
        bias = bias[:, None]  # (b0 1 p p); a pad query sees itself only, so no row is empty (no NaN)
        x = F.embedding(ids, self.embed).view(b0 * p, -1)
        last_layer = len(self.layers) - 1
        for i, lw in enumerate(self.layers):
            qkv = lw.qkv(_rms_norm(x, lw.ln1, lw.eps1)).view(b0, p, h + 2 * kv, d)
            qk = apply_rope(qkv[:, :, : h + kv], cos, sin).to(self.att_dtype)
            q = qk[:, :, :h].transpose(1, 2)
            k = qk[:, :, h:].transpose(1, 2)
            v = qkv[:, :, h + kv :].transpose(1, 2).to(self.att_dtype)
            self.cache.write_prompt(i, k, v, copies)
            if i == last_layer:
                # past the last layer's keys and values only the last position's output is read (its
                # logits): its query alone attends, and o_proj and the MLP run on its row alone
                q, bias, x = q[:, :, -1:], bias[:, :, -1:], x.view(b0, p, -1)[:, -1].contiguous()
            rows = x.shape[0]
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=self.scale, enable_gqa=True)
            x = lw.o.add_to(x, att.transpose(1, 2).reshape(rows, h * d).to(self.dtype))
            x = self._mlp(x, lw)
        return self._logits(x)

    def step(
        self, tokens: Tensor, positions: Tensor, slot: int, masked: Tensor | None = None, rows: Tensor | None = None
    ) -> Tensor:
        """One new token per working row: ``tokens (b)`` at RoPE ``positions (b)``, written to cache ``slot``.
        Returns the logits ``(b v)``.

        ``masked (B)`` bool: the rows whose token is a dummy (nothing to feed this step): their slot is
        masked for them, so none of their later steps attends to it. With ``rows (b)`` (int64 indices of the
        cache's ``B`` rows, those not masked) only those rows step: ``tokens``, ``positions`` and the logits are
        theirs, and the masked rows cost nothing but their slot's mask.
        """
        if masked is not None:
            self.cache.mask_slot(slot, masked)
        self.cache.begin_step(positions, slot, rows)
        return self._decode_layers(tokens)

    def step_paged(self, tokens: Tensor, slots: Tensor, positions: Tensor, length: int) -> Tensor:
        """:meth:`step` over a paged cache: ``tokens (b)`` of cache slots ``slots (b)`` at ``positions (b)`` (each
        slot's blocks grown to hold them); ``length`` > every position. Returns the logits ``(b v)``."""
        self.cache.begin_step(slots, positions, length)
        return self._decode_layers(tokens)

    def _decode_layers(self, tokens: Tensor) -> Tensor:
        """The layers over one token per working row, attending through the cache's prepared step."""
        b = tokens.shape[0]
        h, kv, d = self.num_heads, self.num_kv, self.head_dim
        x = F.embedding(tokens, self.embed)  # (b hidden)
        for i, lw in enumerate(self.layers):
            qkv = lw.qkv(_rms_norm(x, lw.ln1, lw.eps1)).view(b, h + 2 * kv, d)
            att = self.cache.attend(i, qkv)
            x = self._mlp(lw.o.add_to(x, att.view(b, h * d).to(self.dtype)), lw)
        return self._logits(x)

    def extend(self, tokens: Tensor, positions: Tensor, slot: int, valid: Tensor) -> Tensor:
        """Several given tokens per row in one forward: ``tokens (b c)`` at RoPE ``positions (b c)`` into cache
        slots ``[slot, slot + c)``; ``valid (b c)`` marks the real ones (the rest are masked dummies, as
        :meth:`step`'s ``masked`` rows). Returns the logits ``(b v)`` after each row's last valid token (rows
        without one get the logits of a dummy: the caller keeps its own).
        """
        for j in range(tokens.shape[1]):
            self.cache.mask_slot(slot + j, ~valid[:, j])
        self.cache.begin_chunk(positions, slot)
        return self._chunk_layers(tokens, valid)

    def extend_paged(self, tokens: Tensor, slots: Tensor, positions: Tensor, valid: Tensor, length: int) -> Tensor:
        """:meth:`extend` over a paged cache: ``tokens (b c)`` of cache slots ``slots (b)`` at ``positions (b c)``
        (each slot's blocks grown to hold them), ``valid (b c)`` the real ones; ``length`` > every position. Returns
        the logits ``(b v)`` after each row's last valid token."""
        self.cache.begin_chunk(slots, positions, valid, length)
        return self._chunk_layers(tokens, valid)

    def step_and_extend_paged(
        self, step: tuple[Tensor, Tensor, Tensor, int], chunk: tuple[Tensor, Tensor, Tensor, Tensor, int]
    ) -> Tensor:
        """:meth:`step_paged` of ``step = (tokens (b1), slots, positions, length)`` and :meth:`extend_paged` of
        ``chunk = (tokens (b2 c), slots, positions, valid, length)`` in one forward: the linears run once over both
        rows' tokens (a small batch's forward costs about its launches, not its rows), the attention apart. Returns
        the logits ``(b1 + b2, v)``: the step's rows, then each chunk row's after its last valid token."""
        tokens, slots, positions, length = step
        chunk_tokens, chunk_slots, chunk_positions, valid, chunk_length = chunk
        b1, (b2, c) = tokens.shape[0], chunk_tokens.shape
        h, kv, d = self.num_heads, self.num_kv, self.head_dim
        self.cache.begin_step(slots, positions, length)
        self.cache.begin_chunk(chunk_slots, chunk_positions, valid, chunk_length)
        x = F.embedding(torch.cat([tokens, chunk_tokens.flatten()]), self.embed)
        for i, lw in enumerate(self.layers):
            qkv = lw.qkv(_rms_norm(x, lw.ln1, lw.eps1))
            stepped = self.cache.attend(i, qkv[:b1].view(b1, h + 2 * kv, d)).reshape(b1, h * d)
            chunked = self.cache.attend_chunk(i, qkv[b1:].view(b2, c, h + 2 * kv, d)).reshape(b2 * c, h * d)
            x = self._mlp(lw.o.add_to(x, torch.cat([stepped, chunked]).to(self.dtype)), lw)
        last = (valid.sum(-1) - 1).clamp_(min=0)
        ends = x[b1:].view(b2, c, -1)[torch.arange(b2, device=x.device), last]
        return self._logits(torch.cat([x[:b1], ends]))

    def _chunk_layers(self, tokens: Tensor, valid: Tensor) -> Tensor:
        """The layers over ``tokens (b c)``, attending through the cache's prepared chunk; the logits after each
        row's last valid token."""
        b, c = tokens.shape
        h, kv, d = self.num_heads, self.num_kv, self.head_dim
        x = F.embedding(tokens, self.embed).view(b * c, -1)
        for i, lw in enumerate(self.layers):
            qkv = lw.qkv(_rms_norm(x, lw.ln1, lw.eps1)).view(b, c, h + 2 * kv, d)
            att = self.cache.attend_chunk(i, qkv)
            x = self._mlp(lw.o.add_to(x, att.reshape(b * c, h * d).to(self.dtype)), lw)
        last = (valid.sum(-1) - 1).clamp_(min=0)
        return self._logits(x.view(b, c, -1)[torch.arange(b, device=x.device), last])

    def keep_rows(self, index: Tensor) -> None:
        """Keep working rows ``index`` (int64, into the current working batch), in that order."""
        self.cache.keep_rows(index)

    def release(self) -> None:
        """Drop the caches (the decoder cannot step afterwards)."""
        self.cache = None
