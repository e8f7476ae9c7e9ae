"""The work of one optimizer step, shared by the trainer's loop and the simulated rank of `xmoe plan memory
--measure` (so that what the simulation measures is what a training step does): forward and backward over the
micro-batches inside the step's MoEStep (xmoe/moe/step.py, the one seam to the MoE layers), then the gradient
clipping and the optimizer step (``clip_gradients``, ``optimizer_step``: a fused AdamW clips in its own pass).
The caller calls them, and ``MoEStep.finish()`` after (the expert-bias update, the step's statistics).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from xmoe.model.transformer import Transformer
from xmoe.moe.step import MoEStep
from xmoe.parallel.dims import ParallelDims
from xmoe.parallel.expert_parallel import clip_grad_norm_, total_grad_norm
from xmoe.train.source_loss import SourceLosses


def forward_backward(
    model: Transformer,
    wrapped: nn.Module,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    accum: int,
    device: torch.device,
    autocast: bool,
    source_losses: SourceLosses | None = None,
) -> tuple[torch.Tensor, MoEStep]:
    """Forward and backward of ``accum`` micro-batches drawn from ``batches`` through ``wrapped`` (the model, or
    what wraps it); returns the mean loss (a device tensor) and the step's MoEStep, closed, for its finish() after
    the optimizer step (how the routed experts' weight copies are made, and their gradients returned, was chosen
    when the model was built: xmoe/moe/weights.py). A batch (``loader.Batch``) that carries ``segments_BS`` (documents
    "mask") passes it to the model; one that carries ``sources_B`` adds its rows' losses to ``source_losses``."""
    loss_sum = torch.zeros((), device=device)
    # one autocast region and one MoEStep for all micro-batches of the step: the weights do not change within it,
    # so each routed expert is cast once per step (and each dense weight used eagerly once, by autocast's cache;
    # inside compiled regions the dense casts happen per micro-batch)
    moe = MoEStep(model, accum, device, cast_dtype=torch.bfloat16 if autocast else None)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast), moe:
        for micro in range(accum):
            batch = next(batches)
            inputs = batch[0].to(device, non_blocking=True)
            targets = batch[1].to(device, non_blocking=True)
            segments = getattr(batch, "segments_BS", None)
            sources = getattr(batch, "sources_B", None)
            kwargs = {} if segments is None else {"segments_BS": segments.to(device, non_blocking=True)}
            # positions without a target count in no balance; an MTP block's, those without one at its depth
            moe.set_real_tokens(*model.real_tokens(targets, kwargs.get("segments_BS")))
            no_sync = micro < accum - 1 and hasattr(wrapped, "no_sync")
            watch = (
                source_losses.watching(model, targets, sources)
                if source_losses is not None and sources is not None
                else contextlib.nullcontext()
            )
            # no_sync: DDP's method, which nn.Module's __getattr__ types as Tensor | Module
            with wrapped.no_sync() if no_sync else contextlib.nullcontext(), watch:  # type: ignore[operator]
                loss = wrapped(inputs, targets, **kwargs)
                (loss / accum).backward()
            loss_sum += loss.detach()
            moe.end_micro_batch()
    return loss_sum / accum, moe


# folds_clipping's decisions: optimizer -> (its groups' fused flags, the parameter sequence, its length, the decision)
_Decision = tuple[tuple[bool, ...], Sequence[torch.Tensor], int, bool]
_FOLDS: weakref.WeakKeyDictionary[torch.optim.Optimizer, _Decision] = weakref.WeakKeyDictionary()


def folds_clipping(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> bool:
    """True where ``optimizer`` can clip in its own pass: xmoe's TritonAdamW, or a fused Adam/AdamW over plain
    tensors, whose kernel divides every gradient by its ``grad_scale`` tensor as it reads it (the protocol
    torch's GradScaler uses).
    Clipping in place instead reads and writes every fp32 gradient once more (8 bytes per parameter). Decided
    once for an optimizer and its parameter sequence, not on every step (it looks at every parameter): again
    when the optimizer's param groups change (one added, a group's ``fused`` set) or another sequence, or one of
    another length, is passed."""
    fused = tuple(bool(group.get("fused")) for group in optimizer.param_groups)
    cached = _FOLDS.get(optimizer)
    if cached is not None and cached[0] == fused and cached[1] is params and cached[2] == len(params):
        return cached[3]
    folds = _decide_folding(optimizer, params)
    _FOLDS[optimizer] = (fused, params, len(params), folds)
    return folds


def _decide_folding(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> bool:
    from torch.distributed.tensor import DTensor

    from xmoe.train.optim import TritonAdamW

    if isinstance(optimizer, TritonAdamW):  # plain tensors only, and it reads grad_scale as torch's fused does
        return True

    fused = all(group.get("fused") for group in optimizer.param_groups)
    adam = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
    return adam and fused and not any(isinstance(p, DTensor) for p in params)


def clip_divisor(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What to divide every gradient by to clip as ``torch.nn.utils.clip_grads_with_norm_`` multiplies: its
    coefficient is max_norm / (norm + 1e-6), at most 1; this is its reciprocal, at least 1 (a device tensor)."""
    return torch.clamp((total_norm.float() + 1e-6) / max_norm, min=1.0)


def clip_gradients(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], max_norm: float, dims: ParallelDims | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Clip the step's gradients to ``max_norm`` (inf: measure only). Returns (the total norm, the divisor to hand
    ``optimizer_step``): where the optimizer folds clipping (``folds_clipping``) the gradients are left as they
    are and the divisor is returned, else they are scaled in place and the divisor is None."""
    if folds_clipping(optimizer, params):
        norm = total_grad_norm(params, dims=dims)
        return norm, clip_divisor(norm, max_norm)
    return clip_grad_norm_(params, max_norm, dims=dims), None


def optimizer_step(optimizer: torch.optim.Optimizer, divisor: torch.Tensor | None) -> None:
    """``optimizer.step()``, dividing every gradient by ``divisor`` inside a fused Adam's pass when given."""
    if divisor is None:
        optimizer.step()
        return
    optimizer.grad_scale = divisor  # type: ignore[attr-defined]
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale  # type: ignore[attr-defined]
