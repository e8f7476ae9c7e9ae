"""The GShard / DeepSpeed-MoE capacity-buffer dispatcher: a BASELINE, kept for benchmarks and loss parity.

# T tokens, H hidden, E experts, C capacity, K top-k

It builds the (T, E, C) one-hot dispatch mask and the matching combine-weight tensor and moves tokens with
einsums, so memory is O(T*E*C + E*C*H) however few tokens are routed: exactly the cost PFT removes. It keeps
the same slots as the PFT plan (same capacity rule), so both paths compute the same function when nothing is
dropped and when something is. Dropless routing is emulated with C = T.

Under expert parallelism (PaddedAllToAllDispatcher, DeepSpeed-MoE style) the (E, C, H) buffer moves with one
equal-split all-to-all: every rank sends each expert's C rows, padding included, to the expert's owner.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from xmoe.dispatch.base import PhasedDispatcher, TrafficStats
from xmoe.dispatch.comm import all_to_all_rows
from xmoe.dispatch.routing import RoutingPlan


class PaddedDispatcher(PhasedDispatcher):
    """The baseline's phases run whole at their begin (its all-to-alls are not posted: a baseline)."""

    fuses_experts = False
    stats: TrafficStats | None = None  # the baseline counts no traffic

    def _masks(self, plan: RoutingPlan, weights_TK: torch.Tensor | None, dtype: torch.dtype):
        num_tokens, num_experts = plan.num_tokens, plan.num_experts
        capacity = plan.capacity or num_tokens
        mask_TEC = torch.zeros(num_tokens, num_experts, capacity, dtype=dtype, device=plan.token_ids_N.device)
        pos_N = plan.positions_N()
        if weights_TK is None:
            values_N = torch.ones(plan.num_rows, dtype=dtype, device=mask_TEC.device)
        else:
            values_N = weights_TK.reshape(-1)[plan.slot_ids_N].to(dtype)
        # (token, expert, position) triples are unique per kept slot: plain index_put, no accumulation
        mask_TEC = mask_TEC.index_put((plan.token_ids_N, plan.expert_ids_N, pos_N), values_N)
        return mask_TEC

    def dispatch_begin(self, x_TH: torch.Tensor, plan: RoutingPlan, route: Any) -> Any:
        return self.dispatch(x_TH, plan)

    def dispatch_end(self, posted: Any) -> tuple[torch.Tensor, torch.Tensor, Any]:
        return posted

    def combine_begin(self, y_NH: torch.Tensor, weights_TK: torch.Tensor, plan: RoutingPlan, ctx: Any) -> Any:
        return self.combine(y_NH, weights_TK, plan, ctx)

    def combine_end(self, posted: Any) -> torch.Tensor:
        return posted

    def dispatch(self, x_TH: torch.Tensor, plan: RoutingPlan) -> tuple[torch.Tensor, torch.Tensor, Any]:
        dispatch_TEC = self._masks(plan, None, x_TH.dtype)
        x_ECH = torch.einsum("tec,th->ech", dispatch_TEC, x_TH)
        capacity = x_ECH.shape[1]
        counts_E = torch.full((plan.num_experts,), capacity, dtype=torch.long, device=x_TH.device)
        return x_ECH, counts_E, None

    def combine(self, y_ECH: torch.Tensor, weights_TK: torch.Tensor, plan: RoutingPlan, ctx: Any) -> torch.Tensor:
        combine_TEC = self._masks(plan, weights_TK, torch.float32)
        return torch.einsum("tec,ech->th", combine_TEC, y_ECH.float()).to(y_ECH.dtype)


class PaddedAllToAllDispatcher(PaddedDispatcher):
    """The capacity-buffer baseline under expert parallelism over P ranks holding E_local = E / P experts each.

    dispatch: (E, C, H) as on one rank -> all-to-all of E_local * C rows to each rank -> (E_local, P * C, H), the
    C rows of every source rank for each local expert (one batched matmul per weight). combine: the reverse
    exchange, then the one-rank combine. Every rank must route the same number of tokens (C is derived from it),
    as the trainer's equal micro-batches do; a mismatch fails in the collective.
    """

    def __init__(self, ep_group: dist.ProcessGroup | None):
        self.group = ep_group
        self.num_ranks = dist.get_world_size(ep_group)  # shard_experts has checked that it divides E

    def dispatch(self, x_TH: torch.Tensor, plan: RoutingPlan) -> tuple[torch.Tensor, torch.Tensor, Any]:
        x_ECH, _, _ = super().dispatch(x_TH, plan)
        num_ranks = self.num_ranks
        num_experts, capacity, hidden = x_ECH.shape
        num_local = num_experts // num_ranks
        splits = [num_local * capacity] * num_ranks
        recv = all_to_all_rows(x_ECH.reshape(num_experts * capacity, hidden), splits, splits, self.group)
        x_local = (
            recv.view(num_ranks, num_local, capacity, hidden)
            .transpose(0, 1)
            .reshape(num_local, num_ranks * capacity, hidden)
        )
        counts_E = torch.full((num_local,), num_ranks * capacity, dtype=torch.long, device=x_TH.device)
        return x_local, counts_E, capacity

    def combine(self, y_ECH: torch.Tensor, weights_TK: torch.Tensor, plan: RoutingPlan, ctx: Any) -> torch.Tensor:
        capacity, num_ranks = ctx, self.num_ranks
        num_local, _, hidden = y_ECH.shape
        send = y_ECH.view(num_local, num_ranks, capacity, hidden).transpose(0, 1).reshape(-1, hidden)
        splits = [num_local * capacity] * num_ranks
        back = all_to_all_rows(send, splits, splits, self.group)
        return super().combine(back.view(num_ranks * num_local, capacity, hidden), weights_TK, plan, None)
