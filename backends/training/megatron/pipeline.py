"""Running a micro-batch through the pipeline stages: the CPU schedule (gloo send/recv) and, on a
GPU, megatron's own schedules.

CPU schedule (:func:`run_micro_batch`): megatron's schedules and p2p module allocate on CUDA, so the
stages talk with plain ``torch.distributed.send/recv`` over gloo. One micro-batch is in flight at a
time: stage ``k`` receives ``hidden (s b h)`` from ``k-1`` (megatron's ``set_input_tensor``), runs its
layers and sends the result on; the last stage applies the head and the loss and runs backward; the
gradient of each stage's input flows back the same way. Every stage knows the activation shape from
the micro-batch itself (all ranks of a replica hold the same batch), so no shapes are exchanged. With
blocking gloo p2p there is nothing to overlap, so a 1F1B or interleaved order would not be faster here.

GPU schedule (:func:`megatron_forward_backward`): ``get_forward_backward_func()`` with megatron's
``forward_step_func`` / ``loss_func`` contract, used by the engine when CUDA is available.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from backends.training.megatron.layout import ModelInput
from backends.training.megatron.parallel import ParallelDims

__all__ = ["stage_forward", "run_micro_batch", "broadcast_from_last_stage", "megatron_forward_backward"]


def stage_forward(model: nn.Module, inp: ModelInput, hidden_in: Tensor | None) -> Tensor:
    """This stage's output: hidden ``(s b h)`` for a middle stage, the head's ``(b s v_local)`` (or
    ``(b s 1)`` values) for the last. ``hidden_in`` is the previous stage's output (None on the first)."""
    if hidden_in is not None:
        model.set_input_tensor(hidden_in)
        return model(None, None, None, packed_seq_params=inp.packed_seq_params)
    return model(inp.input_ids, None, None, packed_seq_params=inp.packed_seq_params)


def run_micro_batch(
    model: nn.Module,
    dims: ParallelDims,
    inp: ModelInput,
    head: Callable[[Tensor], Any],
    *,
    hidden_size: int,
    dtype: torch.dtype,
    backward: bool,
) -> Any:
    """Forward one micro-batch through every stage; on the last stage return ``head(output)``.

    ``head`` runs on the last stage only. With ``backward``, it must return ``(loss, extra)``:
    ``loss.backward()`` runs there and input gradients travel back to the first stage; the call
    returns ``(loss, extra)`` on the last stage and None elsewhere. Without, everything runs under the
    caller's grad mode and the last stage returns ``head(output)``.
    """
    device = next(model.parameters()).device
    hidden_in = None
    if not dims.first_stage:
        hidden_in = torch.empty(*inp.hidden_shape_prefix, hidden_size, dtype=dtype, device=device)
        dist.recv(hidden_in, src=dims.prev_rank)
        hidden_in.requires_grad_(backward)
    out = stage_forward(model, inp, hidden_in)
    result = None
    if dims.last_stage:
        result = head(out)
        if backward:
            result[0].backward()
    else:
        dist.send(out.detach().contiguous(), dst=dims.next_rank)
        if backward:
            grad = torch.empty_like(out)
            dist.recv(grad, src=dims.next_rank)
            torch.autograd.backward(out, grad)
    if backward and not dims.first_stage:
        grad_in = hidden_in.grad if hidden_in.grad is not None else torch.zeros_like(hidden_in)
        dist.send(grad_in.contiguous(), dst=dims.prev_rank)
    return result


def broadcast_from_last_stage(tensor: Tensor, dims: ParallelDims) -> Tensor:
    """The last stage's ``tensor`` on every stage (others pass a buffer of the same shape/dtype)."""
    if dims.pp == 1:
        return tensor
    tensor = tensor.contiguous()
    dist.broadcast(tensor, src=dims.last_stage_rank, group=dims.pp_group)
    return tensor


# ------------------------------------------------------------------------------ GPU (megatron's)


def megatron_forward_backward(
    model: nn.Module,
    inputs: list[ModelInput],
    head: Callable[[Tensor, int], tuple[Tensor, dict[str, Tensor]]],
    *,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool,
    loss_scale: float,
) -> list[dict[str, Tensor]]:
    """megatron's pipeline schedule over ``inputs`` (CUDA only); returns each micro-batch's ``extra``.

    ``head(output, index) -> (loss, extra)`` runs on the last stage. Megatron divides every
    micro-batch loss by the number of micro-batches (unless per-token loss is configured); rlfunc's
    losses are already normalised by the global counts, so the loss handed back is multiplied by
    ``loss_scale`` (the number of micro-batches times the data-parallel size: megatron's DDP averages
    over data-parallel ranks) to undo both.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("megatron_forward_backward needs CUDA (megatron's schedules allocate on the GPU)")
    from megatron.core.pipeline_parallel import get_forward_backward_func

    index_of = {id(x): i for i, x in enumerate(inputs)}

    def forward_step(data_iterator, stage_model):
        inp = next(data_iterator)
        i = index_of[id(inp)]
        out = stage_model(inp.input_ids, None, None, packed_seq_params=inp.packed_seq_params)

        def loss_func(output_tensor):
            loss, extra = head(output_tensor, i)
            return loss * loss_scale, extra

        return out, loss_func

    forward_backward = get_forward_backward_func()
    return forward_backward(
        forward_step_func=forward_step,
        data_iterator=iter(inputs),
        model=[model],
        num_microbatches=len(inputs),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )
