"""The dispatcher interface: move each kept routed row to the rank and expert that owns it, and back.

# T tokens, H hidden, K top-k, N rows this rank computes, E_local experts on this rank

Every dispatcher (local, all-to-all, hierarchical RBD, padded baseline) implements:

  dispatch(x_TH, plan) -> (x_NH, tokens_per_expert_local, ctx)
      x_NH: rows grouped contiguously by local expert (expert 0's rows first), or a (E_local, C, H) tensor
      for the padded baseline; tokens_per_expert_local: int64 (E_local,); ctx: whatever combine needs.
  combine(y_NH, weights_TK, plan, ctx) -> out_TH
      out[t] = sum_k weights[t, k] * (expert output of slot (t, k)), dropped slots contribute nothing.

so that the MoE layer's forward stays:  rows = dispatch -> experts(rows) -> combine.
A single-rank dispatcher may set ``fuses_experts = True``: the layer then hands the tokens and the plan to the
experts in one call, which lets a kernel backend fuse gather -> experts -> combine (LocalDispatcher does).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from xmoe.dispatch.routing import RoutingPlan


class Dispatcher(Protocol):
    def dispatch(self, x_TH: torch.Tensor, plan: RoutingPlan) -> tuple[torch.Tensor, torch.Tensor, Any]: ...

    def combine(
        self, y_NH: torch.Tensor, weights_TK: torch.Tensor, plan: RoutingPlan, ctx: Any
    ) -> torch.Tensor: ...
