"""The dispatcher interface: move each kept routed row to the rank and expert that owns it, and back.

# T tokens, H hidden, K top-k, N rows this rank computes, E_local experts on this rank

Every dispatcher (local, all-to-all, hierarchical RBD, padded baseline) implements:

  dispatch(x_TH, plan) -> (x_NH, tokens_per_expert_local, ctx)
      x_NH: rows grouped contiguously by local expert (expert 0's rows first), or a (E_local, C, H) tensor
      for the padded baseline; tokens_per_expert_local: int64 (E_local,); ctx: whatever combine needs.
  combine(y_NH, weights_TK, plan, ctx) -> out_TH
      out[t] = sum_k weights[t, k] * (expert output of slot (t, k)), dropped slots contribute nothing.

so that the MoE layer's forward stays:  rows = dispatch -> experts(rows) -> combine, and has two attributes:

  fuses_experts  True for a single-rank dispatcher whose layer may hand the tokens and the plan to the experts in
                 one call, which lets a kernel backend fuse gather -> experts -> combine (LocalDispatcher)
  stats          its traffic counters (a TrafficStats), or None when nothing leaves the rank; the optimizer step
                 reads and resets them (xmoe/moe/step.py)
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Protocol

import torch

from xmoe.dispatch.routing import RoutingPlan


class Dispatcher(Protocol):
    fuses_experts: bool

    @property
    def stats(self) -> TrafficStats | None: ...  # read-only: each dispatcher's own TrafficStats subclass

    def dispatch(self, x_TH: torch.Tensor, plan: RoutingPlan) -> tuple[torch.Tensor, torch.Tensor, Any]: ...

    def combine(self, y_NH: torch.Tensor, weights_TK: torch.Tensor, plan: RoutingPlan, ctx: Any) -> torch.Tensor: ...


def experts_per_rank(num_experts: int, ep: int) -> int:
    """Experts each of ``ep`` expert-parallel ranks owns: rank e owns [e * E_local, (e + 1) * E_local). The one
    place xmoe checks that the experts split evenly over the EP ranks."""
    if ep < 1 or num_experts % ep:
        raise ValueError(
            f"num_experts ({num_experts}) must be divisible by the expert-parallel degree ep ({ep}); "
            f"pick ep among the divisors of {num_experts}"
        )
    return num_experts // ep


@dataclass
class TrafficStats:
    """Base of a dispatcher's traffic counters: integer fields that count from zero, summed across calls.
    ``as_dict`` adds the ``derived`` quantities (none here) to the fields, as Python numbers for a metrics log."""

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, 0)

    def add(self, other: TrafficStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def derived(self) -> dict[str, float]:
        return {}

    def as_dict(self) -> dict[str, float]:
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, **self.derived()}
