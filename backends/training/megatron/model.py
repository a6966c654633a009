"""A megatron-core ``GPTModel`` stage for a Hugging Face Llama / Qwen2 config.

The layer is megatron's local spec (``get_gpt_layer_local_spec``: column/row-parallel linears, torch
RMSNorm, SwiGLU through ``gated_linear_unit``, grouped-query attention through ``num_query_groups``)
with one submodule of ours, :class:`TorchCoreAttention` (torch SDPA, causal, on CPU or GPU; also the
packed THD layout). The rotary module is replaced by :class:`CPURotaryEmbedding`, megatron's own
with the one line that moves ``inv_freq`` to CUDA taken out. Nothing of megatron is edited.

Mapping from the HF config (errors name the field, before any weight is read):

- ``rms_norm_eps`` -> ``layernorm_epsilon``; ``rope_theta`` -> ``rotary_base``;
- ``num_key_value_heads`` -> ``num_query_groups``; ``head_dim`` -> ``kv_channels``;
- Qwen2 -> ``add_qkv_bias=True`` (q/k/v have biases, o_proj and the MLP do not);
- ``tie_word_embeddings`` -> ``share_embeddings_and_output_weights`` (with one pipeline stage; across
  stages the last stage keeps its own copy, loaded from the same tensor, and the engine sums the two
  gradients, because megatron's cross-stage tie moves the weight to CUDA at construction);
- the vocabulary is padded to a multiple of ``tp`` (megatron splits it evenly); the padded logits are
  masked out of every softmax (:mod:`backends.training.megatron.vocab_parallel`) and dropped on export.

Unsupported (a clear error): other architectures (GPT-2, ...), sliding-window attention (Mistral,
Qwen2 with ``use_sliding_window``), RoPE scaling, attention biases on Llama, MLP biases.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from backends.packing import pad_layout
from backends.training.packed_attention import packed_rows_attention

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ModelShape",
    "model_shape",
    "check_parallel_sizes",
    "TorchCoreAttention",
    "CPURotaryEmbedding",
    "ValueHead",
    "transformer_config",
    "layer_spec",
    "build_stage",
]

#: ``config.model_type`` -> the HF causal-LM class name this backend converts.
SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@attrs.frozen
class ModelShape:
    """Everything the conversion and the model need from an HF config (validated)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool

    def padded_vocab(self, tp: int) -> int:
        return int(math.ceil(self.vocab_size / tp) * tp)


def _get(config: Any, name: str, default: Any = None) -> Any:
    return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)


def _rope_theta(config: Any) -> float:
    params = _get(config, "rope_parameters") or {}
    scaling = _get(config, "rope_scaling")
    rope_type = (params or {}).get("rope_type", "default") if isinstance(params, dict) else "default"
    if scaling not in (None, {}) and (scaling or {}).get("rope_type", "default") != "default" or rope_type != "default":
        raise ValueError(f"RoPE scaling {scaling or params} is not supported by the megatron backend (plain RoPE only)")
    theta = _get(config, "rope_theta")
    if theta is None and isinstance(params, dict):
        theta = params.get("rope_theta")
    return float(theta if theta is not None else 10000.0)


def model_shape(config: Any) -> ModelShape:
    """Validate an HF config (object or ``config.json`` dict) for this backend and read its shape."""
    model_type = _get(config, "model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture model_type={model_type!r} for the megatron backend; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)} (Llama and Qwen2 families)"
        )
    window = _get(config, "sliding_window")
    if model_type == "qwen2" and _get(config, "use_sliding_window", False) or model_type == "llama" and window:
        raise ValueError(f"sliding-window attention (sliding_window={window}) is not supported by the megatron backend")
    if _get(config, "mlp_bias", False):
        raise ValueError("MLP biases (mlp_bias=True) are not supported by the megatron backend")
    if model_type == "llama" and _get(config, "attention_bias", False):
        raise ValueError(
            "attention biases on a Llama config (attention_bias=True) are not supported by the megatron backend"
        )
    act = _get(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act={act!r} is not supported (SwiGLU with silu only)")
    hidden, heads = int(_get(config, "hidden_size")), int(_get(config, "num_attention_heads"))
    kv_heads = int(_get(config, "num_key_value_heads") or heads)
    head_dim = int(_get(config, "head_dim") or hidden // heads)
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads={heads} is not divisible by num_key_value_heads={kv_heads}")
    return ModelShape(
        model_type=model_type,
        vocab_size=int(_get(config, "vocab_size")),
        hidden_size=hidden,
        num_layers=int(_get(config, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=int(_get(config, "intermediate_size")),
        rms_norm_eps=float(_get(config, "rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(config),
        max_position_embeddings=int(_get(config, "max_position_embeddings", 2048)),
        tie_word_embeddings=bool(_get(config, "tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2",
    )


def check_parallel_sizes(shape: ModelShape, tp: int, pp: int) -> None:
    """TP must divide the query heads, the KV heads and the MLP width; PP must divide the layers."""
    if tp < 1 or pp < 1:
        raise ValueError(f"tp and pp must be >= 1, got tp={tp}, pp={pp}")
    if shape.num_heads % tp:
        raise ValueError(f"tp={tp} does not divide num_attention_heads={shape.num_heads}")
    if shape.num_kv_heads % tp:
        raise ValueError(
            f"tp={tp} does not divide num_key_value_heads={shape.num_kv_heads} (each TP rank holds whole KV heads)"
        )
    if shape.intermediate_size % tp:
        raise ValueError(f"tp={tp} does not divide intermediate_size={shape.intermediate_size}")
    if shape.num_layers % pp:
        raise ValueError(f"pp={pp} does not divide num_hidden_layers={shape.num_layers} (equal layers per stage)")


# --------------------------------------------------------------------------------- our submodules


class TorchCoreAttention(nn.Module):
    """Core attention with torch SDPA: causal, grouped-query, fp32-exact on CPU; no CUDA buffers.

    Same constructor and forward as megatron's ``DotProductAttention`` (it is built from the layer
    spec). ``query`` ``(s b hq d)``, ``key``/``value`` ``(s b hk d)`` -> ``(s b (hq d))``; in the packed
    THD layout (``packed_seq_params.qkv_format == "thd"``) ``(t hq d)`` with ``cu_seqlens``: causal
    within each sequence, nothing across. ``attention_mask`` is unused: the engine lays every row out
    left-aligned (pads after the last token), so the causal mask is the whole mask.
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.softmax_scale = softmax_scale if softmax_scale is not None else config.kv_channels**-0.5

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: Any = None,
        attention_bias: Optional[Tensor] = None,
        packed_seq_params: Any = None,
    ) -> Tensor:
        if attention_bias is not None:
            raise ValueError("TorchCoreAttention does not take an attention bias")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._packed(query, key, value, packed_seq_params)
        groups = query.shape[2] // key.shape[2]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # (b h s d)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=groups > 1)
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _packed(self, query: Tensor, key: Tensor, value: Tensor, params: Any) -> Tensor:
        """THD: ``(t h d)`` with sequence boundaries ``cu_seqlens``; causal within each sequence, through the
        packed-row attention of :mod:`backends.training.packed_attention` (each sequence a left-aligned block,
        ``n x L^2`` work, no dense ``t x t`` mask). The block layout comes with the params (made once per
        micro-batch by ``layout_micro_batch``); else it is built from ``cu_seqlens`` here."""
        t = query.shape[0]
        layout = getattr(params, "block_layout", None)
        if layout is None:
            layout = pad_layout(tuple(int(x) for x in params.cu_seqlens_q.tolist()), query.device)
        q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))  # (1 h t d)
        out = packed_rows_attention(q, k, v, layout, self.softmax_scale)  # (1 t h d)
        return out[0].reshape(t, -1)


def _rotary_base_class() -> type:
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    return RotaryEmbedding


class CPURotaryEmbedding(_rotary_base_class()):  # type: ignore[misc]
    """Megatron's ``RotaryEmbedding`` whose ``inv_freq`` stays on the model's device.

    Megatron's ``get_emb`` moves ``inv_freq`` to ``torch.cuda.current_device()`` on first use; this
    keeps it where the module's parameters live (CPU here, the GPU there). Frequencies are those of
    HF's default RoPE: ``1 / theta^(2i/d)`` at positions ``0 .. s-1``, halves concatenated (not
    interleaved), so position ``p`` here is HF's ``position_ids == p``.
    """

    def get_emb(self, max_seq_len: int, offset: int = 0) -> Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]

    def to_device(self, device: torch.device) -> "CPURotaryEmbedding":
        self.inv_freq = self.inv_freq.to(device)
        return self


class ValueHead(nn.Module):
    """The critic's head in place of ``GPTModel.output_layer``: ``hidden -> 1`` with a bias (HF's
    ``*ForTokenClassification.score``). Replicated on every TP rank (its input is the full hidden
    state), so its gradients need no TP reduction. Called like megatron's output layer."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.score = nn.Linear(hidden_size, 1, bias=True)

    def forward(self, hidden_states: Tensor, weight: Tensor | None = None, runtime_gather_output: Any = None):
        return self.score(hidden_states), None


# ------------------------------------------------------------------------------------- building


def transformer_config(shape: ModelShape, tp: int, pp: int, *, params_dtype: torch.dtype = torch.float32) -> Any:
    """megatron's ``TransformerConfig`` for this shape, with every CUDA-only fusion off."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=shape.intermediate_size,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=params_dtype,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=shape.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=True,
        perform_initialization=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        sequence_parallel=False,
    )


def layer_spec() -> Any:
    """megatron's local GPT layer spec (RMSNorm) with :class:`TorchCoreAttention` as core attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.submodules.self_attention.submodules.core_attention = TorchCoreAttention
    return spec


def build_stage(
    shape: ModelShape,
    tp: int,
    pp: int,
    *,
    pre_process: bool,
    post_process: bool,
    value_head: bool = False,
    params_dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    tie_across_stages: bool = False,
) -> nn.Module:
    """This rank's ``GPTModel`` stage (its ``num_layers / pp`` layers, its ``1 / tp`` of every matrix).

    Weights are uninitialised placeholders (``perform_initialization=False``): load them with
    :func:`backends.training.megatron.convert.load_hf_into`. ``value_head`` swaps the LM head for a
    :class:`ValueHead` (the critic). ``tie_across_stages``: with several stages, let megatron tie a
    shared embedding across them (its construction all-reduces the copy on CUDA, and its
    ``finalize_model_grads`` sums the two gradients): the GPU schedule. Otherwise the last stage's
    copy is untied and the caller sums the gradients. Needs
    :func:`backends.training.megatron.parallel.init_model_parallel`.
    """
    from megatron.core.models.gpt import GPTModel

    check_parallel_sizes(shape, tp, pp)
    config = transformer_config(shape, tp, pp, params_dtype=params_dtype)
    share = shape.tie_word_embeddings and not value_head and (pp == 1 or tie_across_stages)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(),
        vocab_size=shape.padded_vocab(tp),
        max_sequence_length=shape.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=share,
        position_embedding_type="rope",
        rotary_base=int(shape.rope_theta) if float(shape.rope_theta).is_integer() else shape.rope_theta,
        parallel_output=True,
    )
    rotary = CPURotaryEmbedding(
        kv_channels=shape.head_dim, rotary_percent=1.0, rotary_base=shape.rope_theta, use_cpu_initialization=True
    )
    model.rotary_pos_emb = rotary
    if post_process and value_head:
        model.output_layer = ValueHead(shape.hidden_size)
    model.to(device=device)
    rotary.to_device(torch.device(device))
    return model
