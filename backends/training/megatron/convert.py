"""Hugging Face <-> megatron-core weights for Llama / Qwen2: load into TP/PP shards, gather, save.

Every megatron parameter of a stage is described by a :class:`ParamMap`: the HF tensors it is made
of, how they are fused into one "full" megatron tensor, and the axis along which tensor parallelism
splits that full tensor into ``tp`` equal contiguous chunks (None: replicated on every TP rank).

- ``linear_qkv``: megatron's per-group layout, ``[q heads of group g, k_g, v_g]`` for each of the
  ``num_kv_heads`` groups (``q1 q2 k1 v1 | q3 q4 k2 v2 | ...``); TP ranks hold whole groups (the same
  for the Qwen2 bias);
- ``linear_fc1``: ``[gate_r; up_r]`` per TP rank ``r`` (megatron's ``glu`` chunks its local output in
  two), so the full tensor is ``cat_r [gate.chunk(tp)[r]; up.chunk(tp)[r]]``;
- row-parallel ``linear_proj`` / ``linear_fc2`` split the input axis (1); the embedding and the LM
  head split the (padded) vocabulary (0);
- pipeline stage ``k`` holds layers ``k*L/pp .. (k+1)*L/pp - 1`` (local index from 0), the embedding
  on the first stage, the final norm and the head on the last. A tied head on the last of several
  stages is loaded from ``model.embed_tokens.weight``.

:func:`load_hf_into` loads a stage from an HF dir (every rank reads only the tensors it needs, with
safetensors); :func:`gather_hf_state` streams full HF tensors on every rank (TP all-gather within the
owning stage, then a broadcast over the pipeline); :func:`save_hf` writes them as an HF dir that
``transformers`` loads. Load then save is exact (bit for bit).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator, Mapping

import attrs
import torch
import torch.distributed as dist
from torch import Tensor, nn

from backends.training.megatron.model import ModelShape, check_parallel_sizes, model_shape
from backends.training.megatron.parallel import ParallelDims

__all__ = [
    "ParamMap",
    "param_maps",
    "HFCheckpoint",
    "HFSource",
    "read_hf_source",
    "load_hf_into",
    "gather_hf_state",
    "save_hf",
]


@attrs.frozen
class ParamMap:
    megatron: str  #: local parameter name in this stage's GPTModel
    hf: tuple[str, ...]  #: HF tensor names it is built from
    kind: str  #: copy | vocab | qkv | gate_up
    tp_axis: int | None  #: TP split axis of the full megatron tensor; None = replicated
    stage: int  #: pipeline stage that owns it


def param_maps(shape: ModelShape, pp: int, *, value_head: bool = False) -> list[ParamMap]:
    """Every parameter of every stage, in HF order (embedding, layers, norm, head)."""
    per_stage = shape.num_layers // pp
    maps = [ParamMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", 0, 0)]
    for i in range(shape.num_layers):
        stage, j = divmod(i, per_stage)
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{j}."
        attn = hf + "self_attn."
        maps += [
            ParamMap(mg + "input_layernorm.weight", (hf + "input_layernorm.weight",), "copy", None, stage),
            ParamMap(
                mg + "self_attention.linear_qkv.weight",
                tuple(attn + f"{p}_proj.weight" for p in "qkv"),
                "qkv",
                0,
                stage,
            ),
        ]
        if shape.qkv_bias:
            maps.append(
                ParamMap(
                    mg + "self_attention.linear_qkv.bias",
                    tuple(attn + f"{p}_proj.bias" for p in "qkv"),
                    "qkv",
                    0,
                    stage,
                )
            )
        maps += [
            ParamMap(mg + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), "copy", 1, stage),
            ParamMap(mg + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",), "copy", None, stage),
            ParamMap(
                mg + "mlp.linear_fc1.weight",
                (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"),
                "gate_up",
                0,
                stage,
            ),
            ParamMap(mg + "mlp.linear_fc2.weight", (hf + "mlp.down_proj.weight",), "copy", 1, stage),
        ]
    last = pp - 1
    maps.append(ParamMap("decoder.final_layernorm.weight", ("model.norm.weight",), "copy", None, last))
    if value_head:
        maps += [
            ParamMap("output_layer.score.weight", ("score.weight",), "copy", None, last),
            ParamMap("output_layer.score.bias", ("score.bias",), "copy", None, last),
        ]
    elif not (shape.tie_word_embeddings and pp == 1):  # with one stage the head *is* the embedding
        maps.append(ParamMap("output_layer.weight", ("lm_head.weight",), "vocab", 0, last))
    return maps


# ------------------------------------------------------------------------ fuse / split (full tensors)


def _fuse(kind: str, parts: list[Tensor], shape: ModelShape, tp: int) -> Tensor:
    """HF tensors -> the full megatron tensor (TP then takes equal contiguous chunks of it)."""
    if kind == "copy":
        return parts[0]
    if kind == "vocab":
        w = parts[0]
        pad = shape.padded_vocab(tp) - w.shape[0]
        return torch.cat([w, w.new_zeros(pad, *w.shape[1:])]) if pad else w
    if kind == "qkv":
        q, k, v = parts
        g, d = shape.num_kv_heads, shape.head_dim
        rest = q.shape[1:]
        q = q.reshape(g, (shape.num_heads // g) * d, *rest)
        return torch.cat([q, k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1).reshape(-1, *rest)
    if kind == "gate_up":
        gate, up = (p.chunk(tp, dim=0) for p in parts)
        return torch.cat([torch.cat([gate[r], up[r]]) for r in range(tp)])
    raise ValueError(f"unknown parameter kind {kind!r}")


def _split(kind: str, full: Tensor, shape: ModelShape, tp: int) -> list[Tensor]:
    """The inverse of :func:`_fuse`: the full megatron tensor -> its HF tensors."""
    if kind == "copy":
        return [full]
    if kind == "vocab":
        return [full[: shape.vocab_size]]
    if kind == "qkv":
        g, d = shape.num_kv_heads, shape.head_dim
        per_q = (shape.num_heads // g) * d
        rest = full.shape[1:]
        grouped = full.reshape(g, per_q + 2 * d, *rest)
        q, k, v = grouped.split([per_q, d, d], dim=1)
        return [x.reshape(-1, *rest) for x in (q, k, v)]
    if kind == "gate_up":
        gates, ups = zip(*(chunk.chunk(2, dim=0) for chunk in full.chunk(tp, dim=0)))
        return [torch.cat(gates), torch.cat(ups)]
    raise ValueError(f"unknown parameter kind {kind!r}")


# -------------------------------------------------------------------------------------- loading


class HFCheckpoint:
    """Lazy tensor access to a local HF dir's safetensors files (single file or sharded index)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._files = {name: self.path / f for name, f in weight_map.items()}
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(
                    f"{str(self.path)!r} has no *.safetensors weights (the megatron loader reads safetensors)"
                )
            from safetensors import safe_open

            self._files = {}
            for f in files:
                with safe_open(f, framework="pt") as handle:
                    self._files.update({name: f for name in handle.keys()})

    def names(self) -> set[str]:
        return set(self._files)

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def get(self, name: str) -> Tensor:
        from safetensors import safe_open

        if name not in self._files:
            raise KeyError(f"{str(self.path)!r} has no tensor {name!r}")
        with safe_open(self._files[name], framework="pt") as handle:
            return handle.get_tensor(name)


class HFSource:
    """HF tensors by name: a checkpoint dir, a module's state dict, plus overrides (a fresh head)."""

    def __init__(self, base: Any, extra: dict[str, Tensor] | None = None) -> None:
        self.base, self.extra = base, extra or {}

    def __contains__(self, name: str) -> bool:
        return name in self.extra or name in self.base

    def get(self, name: str) -> Tensor:
        return self.extra[name] if name in self.extra else self.base.get(name)


def read_hf_source(model: str | os.PathLike | nn.Module, tp: int, pp: int) -> tuple[Any, Any]:
    """(hf_config, tensor source) after the architecture and parallel sizes were checked against the
    config alone (``tp`` / ``pp``: the layout): a bad model or layout fails before any weight file is
    opened."""
    if isinstance(model, nn.Module):
        config = getattr(model, "config", None)
        if config is None:
            raise ValueError(
                f"a module for the megatron backend must be an HF model with .config, got {type(model).__name__}"
            )
        check_parallel_sizes(model_shape(config), tp, pp)
        return config, {k: v.detach() for k, v in model.state_dict().items()}
    from transformers import AutoConfig

    from backends.models import check_model_dir

    path = Path(model)
    if not path.exists():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{str(path)!r} has no config.json: not a Hugging Face checkpoint dir")
    check_parallel_sizes(model_shape(json.loads((path / "config.json").read_text())), tp, pp)
    check_model_dir(path)
    return AutoConfig.from_pretrained(path, local_files_only=True), HFCheckpoint(path)


def load_hf_into(
    model: nn.Module,
    source: HFCheckpoint | Mapping[str, Tensor],  # anything with `in` and .get(name)
    shape: ModelShape,
    dims: ParallelDims,
    *,
    value_head: bool = False,
) -> None:
    """Copy this rank's shard of every parameter of its stage from ``source`` (HF names) into ``model``.

    A tied LM head (``lm_head.weight`` absent) reads ``model.embed_tokens.weight``. A value model
    without ``score.*`` raises (the engine supplies a fresh head first). Every parameter of the stage
    must be covered, and the shapes must match: errors name the tensor.
    """
    params = dict(model.named_parameters())
    expected = [m for m in param_maps(shape, dims.pp, value_head=value_head) if m.stage == dims.pp_rank]
    missing = set(params) - {m.megatron for m in expected}
    if missing:
        raise RuntimeError(f"megatron parameters with no HF source: {sorted(missing)}")

    def fetch(name: str) -> Tensor:
        if name == "lm_head.weight" and name not in source and shape.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        if name not in source:
            raise KeyError(f"the HF checkpoint has no tensor {name!r}")
        return source.get(name)

    with torch.no_grad():
        for m in expected:
            full = _fuse(m.kind, [fetch(n) for n in m.hf], shape, dims.tp)
            local = full if m.tp_axis is None else full.chunk(dims.tp, dim=m.tp_axis)[dims.tp_rank]
            target = params[m.megatron]
            if tuple(local.shape) != tuple(target.shape):
                raise ValueError(
                    f"{m.hf} -> {m.megatron}: shard shape {tuple(local.shape)} != parameter shape {tuple(target.shape)}"
                )
            target.copy_(local.to(target.dtype))


# ------------------------------------------------------------------------------------ gathering


def _full_shape(m: ParamMap, shape: ModelShape, tp: int) -> tuple[int, ...]:
    h, d = shape.hidden_size, shape.head_dim
    qkv = (shape.num_heads + 2 * shape.num_kv_heads) * d
    name = m.megatron
    if m.kind == "vocab":
        return (shape.padded_vocab(tp), h)
    if m.kind == "qkv":
        return (qkv, h) if name.endswith("weight") else (qkv,)
    if m.kind == "gate_up":
        return (2 * shape.intermediate_size, h)
    if name.endswith("linear_proj.weight"):
        return (h, shape.num_heads * d)
    if name.endswith("linear_fc2.weight"):
        return (h, shape.intermediate_size)
    if name.endswith("score.weight"):
        return (1, h)
    if name.endswith("score.bias"):
        return (1,)
    return (h,)  # norms


def gather_hf_state(
    model: nn.Module,
    shape: ModelShape,
    dims: ParallelDims,
    *,
    value_head: bool = False,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> Iterator[tuple[str, Tensor]]:
    """Stream ``(hf_name, full_tensor)`` on every rank, one parameter at a time, in HF order.

    The owning stage all-gathers the TP shards (over its TP group) and broadcasts the full tensor over
    the pipeline group. A collective: every rank of the replica must consume the whole iterator in
    step. Tied embeddings are streamed as ``model.embed_tokens.weight`` and ``lm_head.weight``.
    A tensor that needs no gathering (``tp == 1`` or replicated, on its own stage) is a view of the
    parameter itself: copy it before the next update if it must outlive it (the rollout engines do).
    """
    params = dict(model.named_parameters())
    comm_device = next(iter(params.values())).device
    for m in param_maps(shape, dims.pp, value_head=value_head):
        if m.stage == dims.pp_rank:
            local = params[m.megatron].detach()
            if m.tp_axis is None or dims.tp == 1:
                full = local
            else:
                shards = [torch.empty_like(local) for _ in range(dims.tp)]
                dist.all_gather(shards, local.contiguous(), group=dims.tp_group)
                full = torch.cat(shards, dim=m.tp_axis)
        else:
            full = torch.empty(
                _full_shape(m, shape, dims.tp), dtype=next(iter(params.values())).dtype, device=comm_device
            )
        if dims.pp > 1:
            full = full.contiguous()
            dist.broadcast(full, src=dims.pp_ranks[m.stage], group=dims.pp_group)
        for name, tensor in zip(m.hf, _split(m.kind, full, shape, dims.tp)):
            tensor = tensor.to(dtype=dtype or tensor.dtype, device=device or tensor.device)
            yield name, tensor
            if name == "model.embed_tokens.weight" and shape.tie_word_embeddings and not value_head:
                yield "lm_head.weight", tensor


# ---------------------------------------------------------------------------------------- saving


def save_hf(
    tensors: Iterator[tuple[str, Tensor]],
    hf_config: Any,
    out_dir: str | os.PathLike,
    *,
    value_head: bool = False,
    tokenizer: Any = None,
    write: bool = True,
) -> Path:
    """Write streamed HF tensors as a checkpoint dir ``transformers`` loads (config + safetensors).

    ``hf_config``: the source model's ``PretrainedConfig``. ``value_head``: save as a one-label
    ``*ForTokenClassification`` (the critic). Every rank must pass the (collective) stream; only the
    rank with ``write=True`` keeps the tensors and writes. The model class is built from the config
    and loaded ``strict``, so a missing or extra tensor is an error, not a silent gap.
    """
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    state = {}
    for name, tensor in tensors:
        if write:
            state[name] = tensor.detach().to("cpu").clone()
    out = Path(out_dir)
    if not write:
        return out
    config = hf_config.__class__.from_dict(hf_config.to_dict())
    if value_head:
        config.num_labels = 1
        config.classifier_dropout = 0.0
        config.architectures = [SUPPORTED_VALUE_CLASSES[config.model_type]]
    cls = AutoModelForTokenClassification if value_head else AutoModelForCausalLM
    dtype = next(iter(state.values())).dtype
    with torch.device("meta"):
        model = cls.from_config(config, dtype=dtype)
    model.load_state_dict(state, strict=True, assign=True)
    if getattr(config, "tie_word_embeddings", False) and not value_head:
        model.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


SUPPORTED_VALUE_CLASSES = {"llama": "LlamaForTokenClassification", "qwen2": "Qwen2ForTokenClassification"}
