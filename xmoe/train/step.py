"""The work of one optimizer step, shared by the trainer's loop and the simulated rank of `xmoe plan memory
--measure` (so that what the simulation measures is what a training step does): forward and backward over the
micro-batches, then the expert-bias update. Clipping and the optimizer step are the caller's.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from xmoe.model.transformer import Transformer
from xmoe.moe.experts import reuse_weight_casts


def forward_backward(model: Transformer, wrapped: nn.Module, batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
                     accum: int, device: torch.device, autocast: bool, detach_casts: bool
                     ) -> tuple[torch.Tensor, dict[str, Optional[torch.Tensor]]]:
    """Forward and backward of ``accum`` micro-batches drawn from ``batches`` through ``wrapped`` (the model, or
    what wraps it); returns the mean loss and the step's statistics (aux losses, routed rows, tokens per expert
    per layer) as device tensors. ``detach_casts``: reuse_weight_casts' one-process gradient path."""
    loss_sum = torch.zeros((), device=device)
    aux_sum = torch.zeros((), device=device)
    rows = torch.zeros((), dtype=torch.long, device=device)
    load = None
    # one autocast region and one set of expert-weight casts for all micro-batches of the step: the weights do
    # not change within it, so reuse_weight_casts casts each routed expert once per step (and autocast's cache
    # each dense weight used eagerly; inside compiled regions the dense casts happen per micro-batch)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast), \
            reuse_weight_casts(model, torch.bfloat16 if autocast else None, detach=detach_casts):
        for micro in range(accum):
            inputs, targets = next(batches)
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            no_sync = micro < accum - 1 and hasattr(wrapped, "no_sync")
            with wrapped.no_sync() if no_sync else contextlib.nullcontext():
                loss = wrapped(inputs, targets)
                (loss / accum).backward()
            loss_sum += loss.detach()
            stats = model.moe_stats()
            if stats:
                aux_sum += stats["aux_loss"] + stats["z_loss"]
                tpe = stats["tokens_per_expert"]
                rows += tpe.sum() - stats["num_dropped"]
                load = tpe if load is None else load + tpe
    return loss_sum / accum, {"aux": aux_sum / accum, "rows": rows, "load": load}


def update_expert_bias(model: Transformer, load_LE: Optional[torch.Tensor]) -> None:
    """Auxiliary-loss-free balancing after the optimizer step: loads summed over all ranks (one all-reduce), so
    every rank moves its bias identically."""
    layers = model.moe_layers()
    if load_LE is None or not layers or layers[0].cfg.bias_update_rate <= 0:
        return
    load_LE = load_LE.float()
    if dist.is_initialized():
        dist.all_reduce(load_LE)
    for layer, load_E in zip(layers, load_LE):
        layer.update_expert_bias(load_E)
