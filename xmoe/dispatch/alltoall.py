"""Flat expert-parallel dispatch: one uneven all-to-all of padding-free rows each way.

# T tokens, H hidden, K top-k, E experts, P ranks in the EP group, E_local = E / P experts per rank,
# N rows this rank routes (its plan's kept slots), M rows this rank computes (received from all P ranks)

Experts are laid out contiguously: EP rank r owns global experts [r * E_local, (r + 1) * E_local). The plan's rows
are sorted by global expert, hence already grouped by destination rank, so dispatch needs no local reordering:

  exchange: 2. exchange per-expert counts: E ints out, P * E_local ints in  exchange_counts
             3. copy the split sizes to the host: THE one host sync per layer call (all chunks of it at once)
  dispatch: 1. gather the N kept rows (expert-major, so rank-major)          ops.gather_rows
            4. ONE all_to_all_single of the rows, uneven splits, posted       post_rows ... wait_rows
            5. received rows are ordered (source rank, local expert); regroup them to (local expert, source rank)
               with one gather by an index computed on device (no per-expert split/cat)
  combine:  the same steps backwards: inverse gather, reverse all-to-all (posted), weighted per-token sum
            (ops.combine_rows, deterministic: a fixed k order, no atomics)

Autograd runs through every step (the all-to-all's backward is the reverse all-to-all). Combine needs no host
sync: it reuses the splits of its dispatch. A rank that sends or receives nothing takes part in the collectives
with empty buffers; nothing is padded. With an ``encoding`` (FP8 dispatch) the dispatched rows travel encoded;
the combine and every gradient travel in the rows' dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from xmoe.dispatch.base import PhasedDispatcher, TrafficStats, experts_per_rank
from xmoe.dispatch.comm import Encoding, Exchange, exchange_counts, host_list, post_rows, wait_rows
from xmoe.dispatch.fp8_dispatch import arrived_rows, fp8_encoding, wire_width
from xmoe.dispatch.routing import RoutingPlan, TokenNodes
from xmoe.kernels.choice import Kernels
from xmoe.kernels.fp8_rows import Fp8Rows


@dataclass
class AllToAllStats(TrafficStats):
    """Traffic of the forward passes since the last reset (backward moves the same volume again, in reverse).

    rows_*: dispatch direction only; rows a rank sends to itself are ``rows_kept`` and count in neither sent nor
    received; ``rows_inter``: those of ``rows_sent`` that go to another node. bytes_*: dispatch + combine payloads
    over the network (rows to self excluded). ``max_token_nodes``: the most nodes one token's rows went to (a
    maximum, not a sum: base.py's ``add_counters``).
    """

    calls: int = 0
    rows_sent: int = 0
    rows_received: int = 0
    rows_kept: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    rows_inter: int = 0
    max_token_nodes: int = 0


@dataclass
class Route:
    """One chunk's share of the count exchange: what its dispatch needs, known on the host after the one sync."""

    recv_counts_PE: torch.Tensor  # rows rank p sends to this rank's local expert e (device)
    input_splits: list[int]  # rows this rank sends to each EP rank
    output_splits: list[int]  # rows this rank receives from each EP rank
    max_token_nodes: int = 0  # the most nodes one of the chunk's tokens sends rows to


@dataclass
class _Posted:
    """A dispatch or combine whose all-to-all is in flight."""

    link: torch.Tensor
    exchange: Exchange
    route: Route
    plan: RoutingPlan | None = None  # combine: the plan and weights of the final per-token sum
    weights_TK: torch.Tensor | None = None
    row_bytes: int = 0


@dataclass
class _Ctx:
    route: Route
    src_of_dst_M: torch.Tensor | None  # received-order row of each expert-major row; None: identity
    dst_of_src_M: torch.Tensor | None  # its inverse
    empty_rows_MH: torch.Tensor | None  # the dispatched (M, H) tensor when M == 0, else None


class _PermuteRows(torch.autograd.Function):
    """out = x[index_M]; index_M is a permutation, so the backward is a gather by its inverse (no atomics)."""

    @staticmethod
    def forward(ctx, x_MH, index_M, inverse_M):
        ctx.save_for_backward(inverse_M)
        return x_MH[index_M]

    @staticmethod
    def backward(ctx, grad_MH):
        (inverse_M,) = ctx.saved_tensors
        return grad_MH[inverse_M], None, None


def regroup_indices(recv_counts_PE: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Permutation from received order (source p, expert e) to expert-major order (e, p), all on device.

    Block (p, e) holds recv_counts_PE[p, e] rows; it starts at src_start[p, e] in received order and at
    dst_start[p, e] in expert-major order. Row i of block b moves to dst_start[b] + (i - src_start[b]).
    Returns (src_of_dst_M, dst_of_src_M): the gather index for dispatch and its inverse for combine.
    """
    num_ranks, num_local = recv_counts_PE.shape
    counts_B = recv_counts_PE.reshape(-1)  # blocks in received (p-major) order
    src_start_B = torch.cumsum(counts_B, 0) - counts_B
    counts_EP = recv_counts_PE.t().reshape(-1)  # blocks in expert-major order
    dst_start_PE = (torch.cumsum(counts_EP, 0) - counts_EP).view(num_local, num_ranks).t()
    dst_start_B = dst_start_PE.reshape(-1)
    # output_size: the length is known on the host, so repeat_interleave does not sync to find it
    block_M = torch.repeat_interleave(
        torch.arange(counts_B.numel(), device=counts_B.device), counts_B, output_size=num_rows
    )
    row_M = torch.arange(num_rows, device=counts_B.device)
    dst_of_src_M = dst_start_B[block_M] + row_M - src_start_B[block_M]
    src_of_dst_M = torch.empty_like(dst_of_src_M)
    src_of_dst_M[dst_of_src_M] = row_M  # a permutation: each target written once
    return src_of_dst_M, dst_of_src_M


class AllToAllDispatcher(PhasedDispatcher):
    """Dispatcher for experts sharded over ``ep_group`` (see xmoe/dispatch/base.py for the interface)."""

    fuses_experts = False

    def __init__(
        self,
        ep_group: dist.ProcessGroup | None,
        num_experts: int,
        kernels: Kernels,
        node_of_rank: Sequence[int] | None = None,
    ):
        """``kernels``: the layer's (choice.py), whose ops gather and combine the rows; ``node_of_rank[p]``: the
        node of EP rank p, for the inter-node counters (None: one node)."""
        self.group = ep_group
        self.num_ranks = dist.get_world_size(ep_group)
        self.ep_rank = dist.get_rank(ep_group)
        self.num_local_experts = experts_per_rank(num_experts, self.num_ranks)
        self.num_experts = num_experts
        self.kernels = kernels
        self.encoding: Encoding | None = None  # how dispatched rows travel (use_fp8 sets one)
        self.fp8_to_experts = False
        self.stats = AllToAllStats()
        self.node_of_rank = node_of_rank
        self.token_nodes = TokenNodes(node_of_rank or [0] * self.num_ranks, self.num_local_experts)

    def use_fp8(self, to_experts: bool) -> None:
        """Dispatch in FP8 (fp8_dispatch.py); ``to_experts``: FP8 experts, which take the rows as they arrive."""
        self.encoding, self.fp8_to_experts = fp8_encoding(to_experts), to_experts

    def exchange(self, plans: Sequence[RoutingPlan]) -> list[Route]:
        """2.-3. every chunk's counts in ONE exchange, then the layer call's only host synchronisation."""
        for plan in plans:
            if plan.num_experts != self.num_experts:
                raise ValueError(
                    f"plan routes to {plan.num_experts} experts but the dispatcher was built for {self.num_experts}"
                )
        num_ranks, num_local = self.num_ranks, self.num_local_experts
        send_PE = torch.cat([p.tokens_per_expert_E.view(num_ranks, num_local) for p in plans], dim=1)
        recv_PE = self.receive_counts(send_PE)
        sums = [
            send_PE.view(num_ranks, len(plans), num_local).sum(2),
            recv_PE.view(num_ranks, len(plans), num_local).sum(2),
        ]
        # (2, chunks, P) split sizes, then each chunk's most nodes per token, on the host: the one sync
        sizes = torch.stack(sums).transpose(1, 2).reshape(-1)
        host = host_list(torch.cat([sizes, *self.token_nodes.most_of(plans)]))
        splits = [host[i * num_ranks : (i + 1) * num_ranks] for i in range(2 * len(plans))]
        most = host[sizes.numel() :] or [int(p.num_rows > 0) for p in plans]  # one node: 1 if the chunk sends any
        return [
            Route(recv_PE[:, i * num_local : (i + 1) * num_local], splits[i], splits[len(plans) + i], most[i])
            for i in range(len(plans))
        ]

    def receive_counts(self, send_counts_PE: torch.Tensor) -> torch.Tensor:
        """recv_counts_PE[p, e]: rows rank p sends to this rank's local expert e (one count exchange). A simulated
        rank, whose collectives move nothing, overrides it with the counts it assumes (xmoe/parallel/simulated.py)."""
        return exchange_counts(send_counts_PE, self.group)

    def dispatch_begin(self, x_TH: torch.Tensor, plan: RoutingPlan, route: Route) -> _Posted:
        # 1. rows in expert order = destination-rank order; 4. ONE uneven all-to-all, posted
        x_NH = self.kernels.ops.gather_rows(x_TH, plan.token_ids_N, plan.row_of_slot_TK)
        link, ex = post_rows(x_NH, route.output_splits, route.input_splits, self.group, self.encoding)
        return _Posted(link, ex, route, row_bytes=_wire_row_bytes(x_NH, self.encoding))

    def dispatch_end(self, posted: _Posted) -> tuple[torch.Tensor, torch.Tensor, Any]:
        route = posted.route
        x_MH = wait_rows(posted.link, posted.exchange)
        # 5. (source, expert) -> (expert, source); nothing to do with one rank or one local expert
        src_of_dst_M = dst_of_src_M = None
        if self.num_ranks > 1 and self.num_local_experts > 1:
            src_of_dst_M, dst_of_src_M = regroup_indices(route.recv_counts_PE, x_MH.shape[0])
        rows: torch.Tensor | Fp8Rows
        if self.fp8_to_experts:  # FP8 values, scales and a stand-in for the gradient, regrouped
            rows = arrived_rows(x_MH, posted.exchange.extra, src_of_dst_M, dst_of_src_M)
            x_MH = rows.stand_in
        else:
            if src_of_dst_M is not None:
                x_MH = _PermuteRows.apply(x_MH, src_of_dst_M, dst_of_src_M)
            rows = x_MH
        self._record(route.input_splits, route.output_splits, posted.row_bytes)
        self.stats.rows_inter += self.token_nodes.inter_rows(route.input_splits, self.ep_rank)
        self.stats.max_token_nodes = max(self.stats.max_token_nodes, route.max_token_nodes)
        ctx = _Ctx(route, src_of_dst_M, dst_of_src_M, x_MH if x_MH.shape[0] == 0 else None)
        return rows, route.recv_counts_PE.sum(0), ctx  # type: ignore[return-value]

    def combine_begin(self, y_MH: torch.Tensor, weights_TK: torch.Tensor, plan: RoutingPlan, ctx: _Ctx) -> _Posted:
        if ctx.empty_rows_MH is not None and ctx.empty_rows_MH.requires_grad:
            # Experts given no rows may return an empty output detached from their empty input. The backward
            # would then skip the dispatch all-to-all on this rank while its peers enter it: a hang. Re-attach.
            y_MH = y_MH + 0 * ctx.empty_rows_MH.sum()
        if ctx.dst_of_src_M is not None:
            y_MH = _PermuteRows.apply(y_MH, ctx.dst_of_src_M, ctx.src_of_dst_M)
        # the reverse exchange: what this rank received, it sends back; no new counts, no host sync
        route = ctx.route
        link, ex = post_rows(y_MH, route.input_splits, route.output_splits, self.group)
        self.stats.bytes_sent += (sum(route.output_splits) - route.output_splits[self.ep_rank]) * _row_bytes(y_MH)
        self.stats.bytes_received += (sum(route.input_splits) - route.input_splits[self.ep_rank]) * _row_bytes(y_MH)
        return _Posted(link, ex, route, plan, weights_TK)

    def combine_end(self, posted: _Posted) -> torch.Tensor:
        y_NH = wait_rows(posted.link, posted.exchange)
        plan, weights_TK = posted.plan, posted.weights_TK
        assert plan is not None and weights_TK is not None
        return self.kernels.ops.combine_rows(y_NH, weights_TK, plan.token_ids_N, plan.slot_ids_N, plan.row_of_slot_TK)

    def _record(self, input_splits: list[int], output_splits: list[int], row_bytes: int) -> None:
        kept = input_splits[self.ep_rank]
        sent, received = sum(input_splits) - kept, sum(output_splits) - output_splits[self.ep_rank]
        self.stats.calls += 1
        self.stats.rows_kept += kept
        self.stats.rows_sent += sent
        self.stats.rows_received += received
        self.stats.bytes_sent += sent * row_bytes
        self.stats.bytes_received += received * row_bytes


def _wire_row_bytes(x_NH: torch.Tensor, encoding: Encoding | None) -> int:
    """Bytes one dispatched row takes on the wire (FP8's values and scales, or the row itself)."""
    return _row_bytes(x_NH) if encoding is None else wire_width(x_NH.shape[1])


def _row_bytes(rows_MH: torch.Tensor) -> int:
    return rows_MH.shape[1] * rows_MH.element_size()
