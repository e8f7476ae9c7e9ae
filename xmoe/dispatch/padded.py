"""The GShard / DeepSpeed-MoE capacity-buffer dispatcher: a BASELINE, kept for benchmarks and loss parity.

# T tokens, H hidden, E experts, C capacity, K top-k

It builds the (T, E, C) one-hot dispatch mask and the matching combine-weight tensor and moves tokens with
einsums, so memory is O(T*E*C + E*C*H) however few tokens are routed: exactly the cost PFT removes. It keeps
the same slots as the PFT plan (same capacity rule), so both paths compute the same function when nothing is
dropped and when something is. Dropless routing is emulated with C = T.
"""

from __future__ import annotations

from typing import Any

import torch

from xmoe.moe.routing import RoutingPlan


class PaddedDispatcher:
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

    def dispatch(self, x_TH: torch.Tensor, plan: RoutingPlan) -> tuple[torch.Tensor, torch.Tensor, Any]:
        dispatch_TEC = self._masks(plan, None, x_TH.dtype)
        x_ECH = torch.einsum("tec,th->ech", dispatch_TEC, x_TH)
        capacity = x_ECH.shape[1]
        counts_E = torch.full((plan.num_experts,), capacity, dtype=torch.long, device=x_TH.device)
        return x_ECH, counts_E, None

    def combine(self, y_ECH: torch.Tensor, weights_TK: torch.Tensor, plan: RoutingPlan, ctx: Any) -> torch.Tensor:
        combine_TEC = self._masks(plan, weights_TK, torch.float32)
        return torch.einsum("tec,ech->th", combine_TEC, y_ECH.float()).to(y_ECH.dtype)
