"""The dispatcher interface: move each kept routed row to the rank and expert that owns it, and back.

# T tokens, H hidden, K top-k, N rows this rank computes, E_local experts on this rank

Every dispatcher (local, all-to-all, hierarchical RBD, padded baseline) implements:

  dispatch(x_TH, plan) -> (x_NH, tokens_per_expert_local, ctx)
      x_NH: rows grouped contiguously by local expert (expert 0's rows first), or a (E_local, C, H) tensor
      for the padded baseline; tokens_per_expert_local: int64 (E_local,); ctx: whatever combine needs.
  combine(y_NH, weights_TK, plan, ctx) -> out_TH
      out[t] = sum_k weights[t, k] * (expert output of slot (t, k)), dropped slots contribute nothing.

and the same in phases, so that work placed between a phase's begin and end overlaps its all-to-all (the MoE
layer's composition, xmoe/moe/routed.py, does that; ``dispatch`` and ``combine`` are these phases back to back):

  exchange(plans) -> routes            every chunk's counts in one exchange and ONE host sync (the layer call's)
  dispatch_begin(x_TH, plan, route)    gather the rows, post the all-to-all
  dispatch_end(posted) -> (x_NH, tokens_per_expert_local, ctx)
  combine_begin(y_NH, weights_TK, plan, ctx)    post the reverse all-to-all
  combine_end(posted) -> out_TH        the weighted per-token sum

and two attributes:

  fuses_experts  True for a single-rank dispatcher whose layer may hand the tokens and the plan to the experts in
                 one call, which lets a kernel backend fuse gather -> experts -> combine (LocalDispatcher)
  stats          its traffic counters (a TrafficStats), or None when nothing leaves the rank; the optimizer step
                 reads and resets them (xmoe/moe/step.py)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

import torch

from xmoe.dispatch.routing import RoutingPlan


class Dispatcher(Protocol):
    fuses_experts: bool

    @property
    def stats(self) -> TrafficStats | None: ...  # read-only: each dispatcher's own TrafficStats subclass

    def exchange(self, plans: Sequence[RoutingPlan]) -> list[Any]: ...

    def dispatch_begin(self, x_TH: torch.Tensor, plan: RoutingPlan, route: Any) -> Any: ...

    def dispatch_end(self, posted: Any) -> tuple[torch.Tensor, torch.Tensor, Any]: ...

    def combine_begin(self, y_NH: torch.Tensor, weights_TK: torch.Tensor, plan: RoutingPlan, ctx: Any) -> Any: ...

    def combine_end(self, posted: Any) -> torch.Tensor: ...

    def dispatch(self, x_TH: torch.Tensor, plan: RoutingPlan) -> tuple[torch.Tensor, torch.Tensor, Any]: ...

    def combine(self, y_NH: torch.Tensor, weights_TK: torch.Tensor, plan: RoutingPlan, ctx: Any) -> torch.Tensor: ...


class PhasedDispatcher:
    """``dispatch`` and ``combine`` as their phases back to back, for a dispatcher that implements the phases."""

    def exchange(self, plans: Sequence[RoutingPlan]) -> list[Any]:
        return [None] * len(plans)  # nothing to exchange: one rank, or the padded baseline's fixed splits

    def dispatch(self, x_TH: torch.Tensor, plan: RoutingPlan) -> tuple[torch.Tensor, torch.Tensor, Any]:
        (route,) = self.exchange([plan])
        return self.dispatch_end(self.dispatch_begin(x_TH, plan, route))

    def combine(self, y_NH: torch.Tensor, weights_TK: torch.Tensor, plan: RoutingPlan, ctx: Any) -> torch.Tensor:
        return self.combine_end(self.combine_begin(y_NH, weights_TK, plan, ctx))

    def dispatch_begin(self, x_TH: torch.Tensor, plan: RoutingPlan, route: Any) -> Any:
        raise NotImplementedError

    def dispatch_end(self, posted: Any) -> tuple[torch.Tensor, torch.Tensor, Any]:
        raise NotImplementedError

    def combine_begin(self, y_NH: torch.Tensor, weights_TK: torch.Tensor, plan: RoutingPlan, ctx: Any) -> Any:
        raise NotImplementedError

    def combine_end(self, posted: Any) -> torch.Tensor:
        raise NotImplementedError


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
    """Base of a dispatcher's traffic counters: integer fields that count from zero, summed across calls, except
    those named ``max_*``, which keep the largest value (``add_counters``). ``as_dict`` adds the ``derived``
    quantities (none here) to the fields, as Python numbers for a metrics log."""

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, 0)

    def add(self, other: TrafficStats) -> None:
        for f in fields(self):
            setattr(self, f.name, combine_counter(f.name, getattr(self, f.name), getattr(other, f.name)))

    def derived(self) -> dict[str, float]:
        return {}

    def as_dict(self) -> dict[str, float]:
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, **self.derived()}


def combine_counter(name: str, a: int, b: int) -> int:
    """Two values of counter ``name`` together: the larger for a ``max_*`` counter (the most nodes one token was
    sent to stays a maximum over calls, layers and steps), else their sum."""
    return max(a, b) if name.startswith("max_") else a + b


def add_counters(into: dict[str, int], counters: dict[str, int]) -> None:
    """``counters`` added into ``into``, key by key (``combine_counter``)."""
    for key, value in counters.items():
        into[key] = combine_counter(key, into[key], value) if key in into else value
