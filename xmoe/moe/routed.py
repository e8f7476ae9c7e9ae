"""The routed path of an MoE layer, composed in one place for every dispatcher, precision and kernel backend:
plan(s) -> dispatch -> grouped experts -> combine, with the shared experts, and what overlaps what.

# T tokens, H hidden, K top-k, E experts, N rows a rank's experts compute; n chunks

Overlap (``MoELayer.overlap_mode``, set from ``parallel.ep_overlap`` by xmoe/parallel/expert_parallel.py):
  off     dispatch, experts, combine, then the shared experts, one after another
  shared  the shared experts' up projection (and Qwen2's shared gate) runs while the dispatch all-to-all is in
          flight, their down projection while the combine's is; backward mirrors it (the dispatchers' posted
          exchanges, xmoe/dispatch/comm.py)
  chunks  the tokens split into ``overlap_chunks`` chunks, each routed by a plan of its own, their counts exchanged
          at once (one host sync); the all-to-all of one chunk overlaps the experts of another, forward and backward:
              post dispatch 0, 1;  for each chunk i: wait dispatch i, experts i, post combine i, post dispatch i+2
              then wait every combine, and the shared experts as in ``shared``
          The math is the layer's: each token's rows are summed in the same order; only the weight gradients add
          the chunks' contributions in another order (fp32 rounding). Routing with a capacity factor would drop
          by chunk, so chunks need dropless routing (refused otherwise where the mode is set).
Every rank runs this same program order (chunks may be empty, never skipped), so their collectives match.
A dispatcher that ``fuses_experts`` (one rank) hands the tokens and the plan to the experts in one call instead.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from xmoe.config import MoEConfig
from xmoe.dispatch.base import Dispatcher
from xmoe.dispatch.routing import build_plan
from xmoe.moe.experts import RoutedExperts, SwiGLU
from xmoe.moe.router import RouterOutput

OVERLAP_MODES = ("off", "shared", "chunks")


class Parts(Protocol):
    """What the composition works with: an MoE layer's modules, its dispatcher and its overlap setting
    (xmoe/moe/layer.py's MoELayer has them)."""

    cfg: MoEConfig
    dispatcher: Dispatcher
    experts: RoutedExperts
    shared_experts: SwiGLU | None
    overlap_mode: str
    overlap_chunks: int

    @property
    def shared_gate(self) -> nn.Module | None: ...  # Qwen2-MoE's sigmoid gate on the shared experts' output


def routed_and_shared(
    layer: Parts, x_TH: torch.Tensor, route: RouterOutput, casts: tuple | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the layer's output before its residual add: routed + shared experts, the routed slots dropped)."""
    cfg = layer.cfg
    capacity = cfg.capacity(x_TH.shape[0]) if cfg.capacity_factor is not None else None
    if layer.dispatcher.fuses_experts:  # one rank: the backend may fuse gather -> experts -> combine
        plan = build_plan(route.expert_ids_TK, route.scores_TK, cfg.num_experts, capacity)
        out_TH = layer.experts(x_TH, plan.tokens_per_expert_E, plan, route.weights_TK, casts=casts)
        return _add_shared(layer, out_TH, x_TH), plan.num_dropped
    mode = layer.overlap_mode
    num_chunks = layer.overlap_chunks if mode == "chunks" else 1
    sizes = _chunk_sizes(x_TH.shape[0], num_chunks)
    x_chunks = x_TH.split(sizes)
    weights = route.weights_TK.split(sizes)
    plans = [
        build_plan(ids, scores, cfg.num_experts, capacity)
        for ids, scores in zip(route.expert_ids_TK.split(sizes), route.scores_TK.split(sizes), strict=True)
    ]
    dispatcher = layer.dispatcher
    routes = dispatcher.exchange(plans)  # every chunk's counts at once: the layer call's one host sync

    def begin(i: int) -> Any:
        return dispatcher.dispatch_begin(x_chunks[i], plans[i], routes[i])

    posted = {i: begin(i) for i in range(min(2, num_chunks))}
    shared_up = _shared_up(layer, x_TH) if mode != "off" else None  # while the first dispatches travel
    combines = []
    for i in range(num_chunks):
        rows, counts, ctx = dispatcher.dispatch_end(posted.pop(i))
        y = layer.experts(rows, counts, casts=casts)
        combines.append(dispatcher.combine_begin(y, weights[i], plans[i], ctx))
        if i + 2 < num_chunks:
            posted[i + 2] = begin(i + 2)
    shared = _shared_down(layer, shared_up) if shared_up is not None else None  # while the combines travel
    outs = [dispatcher.combine_end(c) for c in combines]
    out_TH = outs[0] if num_chunks == 1 else torch.cat(outs)
    dropped = plans[0].num_dropped if num_chunks == 1 else torch.stack([p.num_dropped for p in plans]).sum()
    if mode == "off":
        return _add_shared(layer, out_TH, x_TH), dropped
    return (out_TH if shared is None else out_TH + shared), dropped


def _chunk_sizes(num_tokens: int, num_chunks: int) -> list[int]:
    """Near-equal contiguous chunks (the first ones one larger); a chunk may be empty, never dropped."""
    base, extra = divmod(num_tokens, num_chunks)
    return [base + (i < extra) for i in range(num_chunks)]


_SharedUp = tuple[torch.Tensor, torch.Tensor | None, torch.dtype]  # (h, the gate or None, the input's dtype)


def _shared_up(layer: Parts, x_TH: torch.Tensor) -> _SharedUp | None:
    if layer.shared_experts is None:
        return None
    gate = torch.sigmoid(layer.shared_gate(x_TH)) if layer.shared_gate is not None else None
    return layer.shared_experts.up(x_TH), gate, x_TH.dtype


def _shared_down(layer: Parts, up: _SharedUp) -> torch.Tensor:
    assert layer.shared_experts is not None
    h, gate, dtype = up
    shared_TH = layer.shared_experts.down(h, dtype)
    return shared_TH if gate is None else gate * shared_TH


def _add_shared(layer: Parts, out_TH: torch.Tensor, x_TH: torch.Tensor) -> torch.Tensor:
    """The shared experts after the routed path (one rank, or overlap off), as one module call."""
    if layer.shared_experts is None:
        return out_TH
    shared_TH = layer.shared_experts(x_TH)
    if layer.shared_gate is not None:
        shared_TH = torch.sigmoid(layer.shared_gate(x_TH)) * shared_TH
    return out_TH + shared_TH
