"""The work of one optimizer step, shared by the trainer's loop and the simulated rank of `xmoe plan memory
--measure` (so that what the simulation measures is what a training step does): forward and backward over the
micro-batches inside the step's MoEStep (xmoe/moe/step.py, the one seam to the MoE layers). Clipping, the
optimizer step and then ``MoEStep.finish()`` (the expert-bias update, the step's statistics) are the caller's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from xmoe.model.transformer import Transformer
from xmoe.moe.step import MoEStep


def forward_backward(
    model: Transformer,
    wrapped: nn.Module,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    accum: int,
    device: torch.device,
    autocast: bool,
    detach_casts: bool,
) -> tuple[torch.Tensor, MoEStep]:
    """Forward and backward of ``accum`` micro-batches drawn from ``batches`` through ``wrapped`` (the model, or
    what wraps it); returns the mean loss (a device tensor) and the step's MoEStep, closed, for its finish() after
    the optimizer step. ``detach_casts``: the experts' one-process gradient path (MoEStep)."""
    loss_sum = torch.zeros((), device=device)
    # one autocast region and one MoEStep for all micro-batches of the step: the weights do not change within it,
    # so each routed expert is cast once per step (and each dense weight used eagerly once, by autocast's cache;
    # inside compiled regions the dense casts happen per micro-batch)
    moe = MoEStep(model, accum, device, cast_dtype=torch.bfloat16 if autocast else None, detach_casts=detach_casts)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast), moe:
        for micro in range(accum):
            inputs, targets = next(batches)
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            no_sync = micro < accum - 1 and hasattr(wrapped, "no_sync")
            # no_sync: DDP's method, which nn.Module's __getattr__ types as Tensor | Module
            with wrapped.no_sync() if no_sync else contextlib.nullcontext():  # type: ignore[operator]
                loss = wrapped(inputs, targets)
                (loss / accum).backward()
            loss_sum += loss.detach()
            moe.end_micro_batch()
    return loss_sum / accum, moe
