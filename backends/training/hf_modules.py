"""Hugging Face modules made ready for a training engine: loaded, checked, checkpointed, compiled.

What the FSDP engine does to a model before it shards it, apart from the sharding itself: the decoder
layers (the units FSDP shards and ``torch.compile`` compiles), activation checkpointing, and the
check that a given critic module is a value model.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only

from backends.models import load_causal_lm

__all__ = [
    "load_model",
    "enable_checkpointing",
    "decoder_layers",
    "check_value_module",
    "compile_layers",
    "outputs_without_views",
]


def load_model(
    model: str | os.PathLike | nn.Module, dtype: torch.dtype, attn_implementation: str = "sdpa"
) -> nn.Module:
    """A causal LM from a local HF dir (on the CPU, with ``attn_implementation``), or the given module, in
    ``dtype``: the whole model in this process. A sharded role reads a checkpoint shard by shard instead
    (:mod:`backends.training.sharded_loading`)."""
    if isinstance(model, nn.Module):
        return model.to(dtype)
    module, _tokenizer = load_causal_lm(model, dtype=dtype, device="cpu", attn_implementation=attn_implementation)
    return module


def enable_checkpointing(model: nn.Module) -> None:
    """HF activation checkpointing of every decoder layer, non-reentrant (needed under FSDP2)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks (HF's ``_no_split_modules`` classes, e.g. Qwen2DecoderLayer)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        inner = getattr(getattr(model, "model", None), "layers", None)
        layers = list(inner) if inner is not None else []
    if not layers:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard")
    return layers


class _SameTensor(torch.autograd.Function):
    """The input's storage, as a tensor that autograd does not count as a view of it (no copy); gradients pass
    through unchanged."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _unviewed(module: nn.Module, args: object, output: object) -> object:
    return tree_map_only(
        torch.Tensor, lambda t: _SameTensor.apply(t) if t.requires_grad and t._base is not None else t, output
    )


def outputs_without_views(module: nn.Module) -> None:
    """Make ``module`` hand back no output that is a view of another tensor, before ``fully_shard`` wraps it.

    FSDP2 registers its pre-backward hook (which all-gathers the parameters for backward) on a wrapped module's
    outputs, and warns when one is a view ("returned a view tensor ... can cause backward to fail or produce wrong
    gradients"): an in-place op on such a view would drop the hook. A module whose last op reshapes its result with
    ``.view`` returns one: a fused linear that computes a 2-D product and reshapes it (as the lm_head of a multi-turn
    micro-batch, with its long responses, would run), or a module of the user's. A forward hook registered before
    ``fully_shard`` (so it runs before FSDP's) hands FSDP the same storage as a plain tensor.
    """
    module.register_forward_hook(_unviewed)


def check_value_module(model: nn.Module) -> nn.Module:
    """A given module must be a one-label token classifier; its head dropout is turned off (as verl)."""
    config = getattr(model, "config", None)
    name = type(model).__name__
    if not name.endswith("ForTokenClassification") or getattr(config, "num_labels", None) != 1:
        labels = getattr(config, "num_labels", None)
        raise ValueError(
            f"a critic module must be a *ForTokenClassification with num_labels=1 (a value model), got {name}"
            f" with num_labels={labels}; pass a HF dir to build one from a causal LM"
        )
    dropout = getattr(model, "dropout", None)
    if isinstance(dropout, nn.Dropout) and dropout.p != 0.0:
        model.dropout = nn.Dropout(0.0)
        config.classifier_dropout = 0.0
    return model


def compile_layers(model: nn.Module) -> bool:
    """``torch.compile`` every decoder layer in place; returns whether it did.

    Inductor's CPU backend builds C++ kernels: without a C++ compiler (``$CXX`` or ``g++`` on the
    PATH) every forward would fail at its first call, so the model stays eager and one warning says so.
    """
    import logging
    import shutil

    if _on_cpu(model) and shutil.which(os.environ.get("CXX", "g++")) is None:
        logging.getLogger("rlfunc.compile").warning(
            "reference compile=True: no C++ compiler found (CXX=%r, g++ not on PATH), which torch.compile's "
            "inductor backend needs on CPU; running the reference eagerly",
            os.environ.get("CXX"),
        )
        return False
    for layer in decoder_layers(model):
        layer.compile()
    return True


def _on_cpu(model: nn.Module) -> bool:
    """Whether the model's parameters live on the CPU (local shards for an FSDP2 module)."""
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        return local.device.type == "cpu"
    return True
