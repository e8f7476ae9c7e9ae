"""Single-rank padding-free dispatch: gather the kept rows into one expert-major buffer, and combine them back."""

from __future__ import annotations

from typing import Any

import torch

from xmoe.dispatch.base import PhasedDispatcher, TrafficStats
from xmoe.dispatch.routing import RoutingPlan
from xmoe.kernels.choice import Kernels


class LocalDispatcher(PhasedDispatcher):
    """All experts live on this rank. dispatch is a row gather, combine a weighted per-token sum.

    ``fuses_experts``: the layer may skip dispatch / combine and call the experts on the tokens directly, so a
    kernel backend can fuse gather -> experts -> combine (RoutedExperts.forward with a plan). ``kernels``: the
    layer's (choice.py), whose ops gather and combine.
    """

    fuses_experts = True
    stats: TrafficStats | None = None  # nothing leaves the rank

    def __init__(self, kernels: Kernels):
        self.kernels = kernels

    def dispatch_begin(self, x_TH: torch.Tensor, plan: RoutingPlan, route: Any) -> Any:
        return self.kernels.ops.gather_rows(x_TH, plan.token_ids_N, plan.row_of_slot_TK), plan.tokens_per_expert_E

    def dispatch_end(self, posted: Any) -> tuple[torch.Tensor, torch.Tensor, Any]:
        x_NH, counts_E = posted
        return x_NH, counts_E, None

    def combine_begin(self, y_NH: torch.Tensor, weights_TK: torch.Tensor, plan: RoutingPlan, ctx: Any) -> Any:
        return self.kernels.ops.combine_rows(y_NH, weights_TK, plan.token_ids_N, plan.slot_ids_N, plan.row_of_slot_TK)

    def combine_end(self, posted: Any) -> torch.Tensor:
        return posted
