"""What a simulated rank (xmoe/train/simulate.py) installs in a built model, from outside as all parallelism: the
expert all-to-all's receive counts the planner assumes, and DDP buckets that come back as they went.

# T tokens a rank routes per micro-batch, K top-k, P ranks of an EP group

In torch's fake process group no collective moves data: each leaves its output buffer as it was allocated. Where a
collective's result sizes a buffer (the all-to-all's split counts) the rank takes the planner's counts instead: it
receives as many rows as it routes (T * K, dropless, balanced), times ``imbalance``, spread evenly over the P sources
and its local experts.
"""

from __future__ import annotations

import torch
from torch import nn

from xmoe.dispatch.alltoall import AllToAllDispatcher
from xmoe.moe.layer import moe_layers


class PlannedCounts(AllToAllDispatcher):
    """The flat all-to-all dispatcher of a simulated rank: it sends its real rows, and receives what the planner
    assumes (the fake collective would leave the counts uninitialised) as zeros of that size."""

    imbalance = 1.0

    def receive_counts(self, send_counts_PE: torch.Tensor) -> torch.Tensor:
        rows = int(send_counts_PE.sum()) * self.imbalance  # T * K: what each rank of the group routes
        cells = send_counts_PE.numel()  # (source rank, local expert) pairs
        total = round(rows)
        counts = torch.full((cells,), total // cells, dtype=send_counts_PE.dtype)
        counts[: total % cells] += 1
        return counts.view_as(send_counts_PE).to(send_counts_PE.device)


def plan_counts(model: nn.Module, imbalance: float) -> int:
    """Swap every flat all-to-all dispatcher for a ``PlannedCounts`` one; returns how many were swapped."""
    swapped = 0
    for layer in moe_layers(model):
        d = layer.dispatcher
        if type(d) is AllToAllDispatcher:
            layer.dispatcher = PlannedCounts(d.group, d.num_experts, d.kernels, d.node_of_rank)
            layer.dispatcher.imbalance = imbalance
            swapped += 1
        elif not d.fuses_experts:
            raise ValueError(
                f"--measure simulates the padding-free all-to-all dispatcher; this model's MoE layers "
                f"use {type(d).__name__}: set moe.dispatcher='pft'"
            )
    return swapped


def keep_buckets(wrapped: nn.Module) -> None:
    """A DDP replica (ep = tp = 1) all-reduces its gradient buckets through a hook that hands each bucket back as
    it is: the fake collective's future carries no tensor, which DDP's default hook needs."""
    if not hasattr(wrapped, "register_comm_hook"):
        return

    def keep(state, bucket):
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    wrapped.register_comm_hook(None, keep)  # type: ignore[operator]  # DDP's method, typed Tensor | Module here
