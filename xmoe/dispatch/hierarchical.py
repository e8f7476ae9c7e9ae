"""RBD, redundancy-bypassing hierarchical dispatch: one pilot row per (token, remote node) crosses the network.

# T tokens, H hidden, K top-k, E experts, P ranks in the EP group, E_local = E / P experts per rank (contiguous),
# Q most EP ranks on one node, U rows this rank sends in stage 1, M1 rows it receives there, U2 / M2 the same for
# stage 2, M = M1 + M2, N rows its local experts compute. docs/rbd.md walks through the algorithm; step 1 (units,
# pilots, replicas) is pure tensor code in rbd_units.py; what each step records, and the counters, in rbd_plan.py.

dispatch:
  1. each token's kept slots are sorted by (node, expert). A "unit" is a run on one remote node (a pilot) or on
     one GPU of this rank's own node (a direct row). PILOT RULE: a pilot lands on the GPU hosting the token's
     lowest-numbered expert on that node. A unit carries the token's row once, with its K expert ids masked to it.
  2. ONE count exchange (equal-split all-to-all of P x (E_local + 1 + 2Q) ints: per destination, the flat
     per-expert counts, the stage-1 rows, and the stage-2 rows each pilot's GPU will forward / receive, which the
     source knows), then ONE host sync of every split size.
  3. stage 1, all-to-all-v over the EP group: pilots cross nodes, direct rows stay inside, rows to self are copied.
  4. stage 2, all-to-all-v inside the node (on the node's own process group where one is given: it never waits
     on another node, nor behind rows posted on the EP group): a pilot's GPU forwards one replica per other GPU of
     its node hosting the token's experts, ids masked to that GPU. No collective at all when no node holds two
     ranks of the group, or one node holds them all.
  5. each GPU expands its received rows to its local experts, expert-major: flat's rows, in another order.
combine, the reverse, every sum in a fixed order (ops.combine_rows: k in order, fp32 accumulation, no atomics):
  6. router weights reach the rows' GPUs (stage 1 then 2, one autograd node: rbd_exchange.send_weights; they
     travel here since the dispatcher interface hands them to combine only); each GPU sums its experts' outputs of
     a row, WEIGHTED: the only place weights are applied.
  7. replicas' partial sums return to the pilot's GPU (reverse stage 2), added to its own in expert order.
  8. one row per unit returns (reverse stage 1); the source sums a token's units in (node, expert) order.

Collectives per layer call: forward 8 (counts; stage 1's rows with their ids inside the payload; stage 2's rows
and ids; weights in stages 1 and 2; partial sums back in stages 2 and 1), backward 6; with one stage 4 and 3
(flat: 3 and 2). Host syncs: ONE, in step 2
(2P + 2Q + 7 ints: all split sizes, the expanded-row count, the counters); combine and backward reuse them. No
(tokens x experts) structure: metadata is O(T K + M K) ints, deduplicated by sorting each token's K keys and
marking run heads, which needs no host sync (torch.unique would).

Groups: collectives of one process group run in order, so a blocking exchange issued on the EP group after rows
posted there (another chunk's, or the combine's) waits for them. Stage 1's ids therefore ride inside its posted
rows (comm.carrying: K int32 a row appended to the payload), and the other blocking exchanges run elsewhere where
ParallelDims.rbd_groups provides the groups: the weights' stage 1 on a twin of the EP group, all of stage 2 on the
node's group (rbd_exchange.RBDGroups); only the posted rows of stage 1 and of the combine's return, and the counts,
use the EP group.

Backward order: every rank must enter backward's collectives in the same order. The row path and combine's chain
are linear; the weights' node is a side branch, so it takes the dispatched rows as extra inputs ("anchors"):
autograd must then run it before the dispatch all-to-alls' backward, on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from xmoe.dispatch.base import PhasedDispatcher, experts_per_rank
from xmoe.dispatch.comm import (
    Encoding,
    Exchange,
    all_to_all_plain,
    all_to_all_rows,
    carrying,
    exchange_counts,
    host_list,
    post_rows,
    wait_rows,
)
from xmoe.dispatch.fp8_dispatch import fp8_encoding, wire_width
from xmoe.dispatch.rbd_exchange import RBDGroups, send_weights, sum_rows
from xmoe.dispatch.rbd_plan import (
    Counts,
    DispatchContext,
    LocalRows,
    PostedCombine,
    PostedDispatch,
    RBDRoute,
    RBDStats,
    Stage1,
    Stage2,
    combine_bytes,
    dispatch_stats,
)
from xmoe.dispatch.rbd_units import SourceUnits, index_table, rows_by_key, shift_right, source_units
from xmoe.dispatch.routing import RoutingPlan, count_ids
from xmoe.kernels.choice import Kernels


class HierarchicalDispatcher(PhasedDispatcher):
    """RBD over ``ep_group`` (interface: xmoe/dispatch/base.py). ``node_of_rank[p]``: node label of EP rank p;
    ``kernels``: the layer's (choice.py), whose ops gather and sum the rows; ``node_group``: this rank's node's
    members of ``ep_group`` (stage 2), ``side_group``: a twin of ``ep_group`` (the weights); either None: that
    traffic on ``ep_group`` (see "Groups" above).

    ``stats`` accumulates :class:`RBDStats` over calls; ``last_stats`` holds the latest layer call's (dispatch +
    combine) as a dict of Python numbers. Neither costs a host sync of its own.
    """

    fuses_experts = False

    def __init__(
        self,
        ep_group: dist.ProcessGroup | None,
        num_experts: int,
        node_of_rank: Sequence[int],
        kernels: Kernels,
        node_group: dist.ProcessGroup | None = None,
        side_group: dist.ProcessGroup | None = None,
    ):
        self.group = ep_group
        self.num_ranks = dist.get_world_size(ep_group)
        self.ep_rank = dist.get_rank(ep_group)
        if len(node_of_rank) != self.num_ranks:
            raise ValueError(f"node_of_rank has {len(node_of_rank)} entries for an EP group of {self.num_ranks}")
        self.num_experts = num_experts
        self.num_local_experts = experts_per_rank(num_experts, self.num_ranks)
        self.kernels = kernels
        labels = sorted(set(node_of_rank))
        self.node_of_rank = [labels.index(n) for n in node_of_rank]  # compact node ids 0 .. nodes - 1
        self.ranks_of_node = [[p for p, n in enumerate(self.node_of_rank) if n == m] for m in range(len(labels))]
        self.my_node = self.node_of_rank[self.ep_rank]
        self.width = max(len(r) for r in self.ranks_of_node)  # Q
        self.local_index = [self.ranks_of_node[n].index(p) for p, n in enumerate(self.node_of_rank)]
        # replicas exist only if some node holds two ranks AND some node is remote
        self.two_stage = len(labels) > 1 and self.width > 1
        # the blocking exchanges off the EP group, where they would queue behind the rows posted there
        self.groups = RBDGroups.of(ep_group, self.ranks_of_node[self.my_node], node_group, side_group)
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.encoding: Encoding | None = None  # how stage 1's rows travel (use_fp8 sets one)
        self.stats = RBDStats()
        self.last_stats: dict[str, float] = {}
        self._last = RBDStats()

    def use_fp8(self, to_experts: bool) -> None:
        """Stage 1's rows (those that cross nodes) travel in FP8 (fp8_dispatch.py), dequantised on arrival: stage 2
        forwards them inside the node in the activations' dtype, and the experts quantise their rows themselves."""
        self.encoding = fp8_encoding(False)

    def _device_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(node of each expert, node-local index of each rank) on ``device``, copied there once (a host-to-device
        copy per call would be a synchronisation of its own)."""
        if device not in self._tables:
            nodes = torch.tensor(self.node_of_rank, dtype=torch.long)
            self._tables[device] = (
                nodes.repeat_interleave(self.num_local_experts).to(device),
                torch.tensor(self.local_index, dtype=torch.long).to(device),
            )
        return self._tables[device]

    def exchange(self, plans: Sequence[RoutingPlan]) -> list[RBDRoute]:
        """1.-2. every chunk's units, then their counts in ONE exchange and ONE host sync (the layer call's)."""
        prepared = []
        for plan in plans:
            if plan.num_experts != self.num_experts:
                raise ValueError(
                    f"plan routes to {plan.num_experts} experts but the dispatcher was built for {self.num_experts}"
                )
            units = self._units(plan, plan.token_ids_N.device)  # 1.
            key1 = torch.where(units.unit_head_TK, units.rank_TK, self.num_ranks).view(-1)  # stage-1 destination
            prepared.append((units, key1, self._send_counts(units, key1, plan)))
        widths = [send_PC.shape[1] for _, _, send_PC in prepared]
        recv_all = exchange_counts(torch.cat([send_PC for _, _, send_PC in prepared], dim=1), self.group)
        recvs = recv_all.split(widths, dim=1)
        values = [self._host_values(units, send, recv) for (units, _, send), recv in zip(prepared, recvs, strict=True)]
        host = host_list(torch.cat(values))  # THE host sync of the layer call
        size = values[0].numel()
        return [
            RBDRoute(units, key1, self._chunk_counts(host[i * size : (i + 1) * size], recv))
            for i, ((units, key1, _), recv) in enumerate(zip(prepared, recvs, strict=True))
        ]

    def dispatch_begin(self, x_TH: torch.Tensor, plan: RoutingPlan, route: RBDRoute) -> PostedDispatch:
        """3. stage 1 posted: pilots cross nodes, direct rows stay inside (each row's ids in the same payload)."""
        link, ex, stage1 = self._stage1(x_TH, route.units, route.key1, route.counts.stage1, self.kernels.ops)
        width = x_TH.shape[1] * x_TH.element_size() if self.encoding is None else wire_width(x_TH.shape[1])
        row_bytes = width + 4 * route.units.ids_TK.shape[1]  # a row, its K int32 ids
        return PostedDispatch(link, ex, route.counts, stage1, row_bytes)

    def dispatch_end(self, posted: PostedDispatch) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """4.-5. stage 2 inside the node, then each GPU's rows expanded to its experts."""
        ops = self.kernels.ops
        counts = posted.counts
        x1 = wait_rows(posted.link, posted.exchange)
        ids1 = posted.exchange.extra[1].long()  # the ids rode in the rows' payload (comm.carrying)
        anchors: tuple[torch.Tensor, ...]
        x_loc, ids_loc, anchors, stage2 = x1, ids1, (x1,), None
        if counts.stage2 is not None:  # 4.
            x2, ids2, stage2 = self._stage2(x1, ids1, counts.stage2, ops)
            x_loc, ids_loc, anchors = torch.cat([x1, x2]), torch.cat([ids1, ids2]), (x1, x2)
        x_NH, local = self._expand(x_loc, ids_loc, counts.num_rows, ops)  # 5.
        self._record(counts, posted.row_bytes)
        ctx = DispatchContext(
            stage1=posted.stage1,
            stage2=stage2,
            local=local,
            anchors=anchors,
            empty_rows_NH=x_NH if counts.num_rows == 0 else None,
        )
        return x_NH, counts.tokens_per_expert_local, ctx

    def _units(self, plan: RoutingPlan, device: torch.device) -> SourceUnits:
        """1. units of this rank's tokens, from the plan's flat arrays (kept slots only)."""
        num_tokens, top_k = plan.row_of_slot_TK.shape
        ids_flat = torch.full((num_tokens * top_k,), -1, dtype=torch.long, device=device)
        ids_flat[plan.slot_ids_N] = plan.expert_ids_N
        node_of_expert, _ = self._device_tables(device)
        return source_units(
            ids_flat.view(num_tokens, top_k),
            node_of_expert,
            len(self.ranks_of_node),
            self.num_local_experts,
            self.my_node,
        )

    def _send_counts(self, units: SourceUnits, key1: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
        """2. counts to send: flat per expert | stage-1 rows | stage-2 rows each pilot sends / receives, per
        node-local rank: (P, E_local + 1 (+ 2Q))."""
        num_ranks, width, num_local = self.num_ranks, self.width, self.num_local_experts
        _, local_idx = self._device_tables(key1.device)
        parts = [plan.tokens_per_expert_E.view(num_ranks, num_local), count_ids(key1, num_ranks + 1)[:num_ranks, None]]
        if self.two_stage:
            pilot, target = units.pilot_TK.clamp(min=0), units.rank_TK.clamp(min=0)
            for a, b in ((pilot, target), (target, pilot)):  # (pilot q, its peer r): to q, then to r
                key = torch.where(units.replica_TK, a * width + local_idx[b], num_ranks * width).view(-1)
                parts.append(count_ids(key, num_ranks * width + 1)[: num_ranks * width].view(num_ranks, width))
        return torch.cat(parts, dim=1)

    def _host_values(self, units: SourceUnits, send_PC: torch.Tensor, recv_PC: torch.Tensor) -> torch.Tensor:
        """What the host needs of one chunk's counts: every split size, the expanded-row count, the counters."""
        num_local, width = self.num_local_experts, self.width
        tokens_per_expert_local = recv_PC[:, :num_local].sum(0)
        valid, own = units.valid_TK, units.own_TK
        mine = units.rank_TK == self.ep_rank
        nodes_T = units.node_head_TK.sum(1)
        scalars = torch.stack(
            [
                valid.sum(),
                nodes_T.sum(),
                torch.cat([nodes_T, nodes_T.new_zeros(1)]).max(),  # the most nodes of one token (0: no tokens)
                units.replica_TK.sum(),
                (own & ~mine).sum(),
                (valid & ~own).sum(),
                tokens_per_expert_local.sum(),
            ]
        )
        host_parts = [send_PC[:, num_local], recv_PC[:, num_local]]
        if self.two_stage:
            host_parts += [
                recv_PC[:, num_local + 1 : num_local + 1 + width].sum(0),
                recv_PC[:, num_local + 1 + width :].sum(0),
            ]
        return torch.cat(host_parts + [scalars])

    def _chunk_counts(self, host: list[int], recv_PC: torch.Tensor) -> Counts:
        """One chunk's Counts from its host values (``_host_values``, read by the layer call's one sync)."""
        num_ranks, width = self.num_ranks, self.width
        stage2 = None
        if self.two_stage:
            send2, recv2 = [0] * num_ranks, [0] * num_ranks
            for j, peer in enumerate(self.ranks_of_node[self.my_node]):
                send2[peer], recv2[peer] = host[2 * num_ranks + j], host[2 * num_ranks + width + j]
            stage2 = (send2, recv2)
        slots, token_nodes, most_nodes, caused, flat_intra, flat_inter, num_rows = host[-7:]
        return Counts(
            stage1=(host[:num_ranks], host[num_ranks : 2 * num_ranks]),
            stage2=stage2,
            tokens_per_expert_local=recv_PC[:, : self.num_local_experts].sum(0),
            num_rows=num_rows,
            slots=slots,
            token_nodes=token_nodes,
            replicas_caused=caused,
            flat_rows_intra=flat_intra,
            flat_rows_inter=flat_inter,
            max_token_nodes=most_nodes,
        )

    def _stage1(
        self, x_TH: torch.Tensor, units: SourceUnits, key1: torch.Tensor, splits: tuple[list[int], list[int]], ops
    ) -> tuple[torch.Tensor, Exchange, Stage1]:
        """3. stage 1 posted: unit rows in (destination rank, token, k) order, each with its ids masked to the unit
        inside the same payload (a blocking exchange of their own would be a point where every rank waits)."""
        send, recv = splits
        num_tokens, top_k = units.ids_TK.shape
        unit_slot = rows_by_key(key1, sum(send))
        token_of_unit = unit_slot // top_k
        table_src = index_table(unit_slot, (num_tokens, top_k))
        unit_of_slot = torch.where(units.valid_TK, table_src.gather(1, units.unit_head_k_TK), -1)
        in_unit = unit_of_slot[token_of_unit] == torch.arange(unit_slot.numel(), device=x_TH.device)[:, None]
        ids_send = torch.where(in_unit, units.ids_TK[token_of_unit], -1).to(torch.int32)
        rows = ops.gather_rows(x_TH, token_of_unit, table_src)
        link, ex = post_rows(rows, recv, send, self.group, carrying(ids_send, self.encoding))
        return (
            link,
            ex,
            Stage1(
                splits=splits,
                units=units,
                token_of_unit_U=token_of_unit,
                unit_slot_U=unit_slot,
                table_src_TK=table_src,
                unit_of_slot_TK=unit_of_slot,
                in_unit_UK=in_unit,
                num_recv=sum(recv),
            ),
        )

    def _stage2(
        self, x1: torch.Tensor, ids1: torch.Tensor, splits: tuple[list[int], list[int]], ops
    ) -> tuple[torch.Tensor, torch.Tensor, Stage2]:
        """4. stage 2: a replica per (received row, other GPU of this node hosting its experts)."""
        send = splits[0]
        num_recv1, top_k = ids1.shape
        device, num_local, ep_rank = x1.device, self.num_local_experts, self.ep_rank
        valid1 = ids1 >= 0
        rank1 = torch.where(valid1, ids1 // num_local, -1)
        head1 = valid1 & (rank1 != shift_right(rank1))
        own_head = head1 & (rank1 == ep_rank)  # exactly one per row: the pilot rule puts the row on a host
        rep_slot = rows_by_key(torch.where(head1 & ~own_head, rank1, self.num_ranks).view(-1), sum(send))
        rep_src = rep_slot // top_k
        table_rep = index_table(rep_slot, (num_recv1, top_k))
        rep_mask = rank1[rep_src] == rank1.view(-1)[rep_slot][:, None]
        ids2_send = torch.where(rep_mask, ids1[rep_src], -1).to(torch.int32)
        on_node = self.groups.stage2(splits)  # (output splits, input splits, group)
        x2 = all_to_all_rows(ops.gather_rows(x1, rep_src, table_rep), *on_node)
        ids2 = all_to_all_plain(ids2_send, *on_node).long()
        arange_K = torch.arange(top_k, device=device).expand(num_recv1, top_k)
        head_k = torch.where(head1, arange_K, -1).cummax(dim=1).values.clamp(min=0)
        rows_M1 = torch.arange(num_recv1, device=device)
        table_node = torch.where(own_head, rows_M1[:, None], -1).view(-1)
        table_node[rep_slot] = num_recv1 + torch.arange(rep_slot.numel(), device=device)
        return (
            x2,
            ids2,
            Stage2(
                splits=splits,
                rep_src_U2=rep_src,
                rep_slot_U2=rep_slot,
                rep_mask_U2K=rep_mask,
                rep_of_slot_M1K=torch.where(valid1 & (rank1 != ep_rank), table_rep.gather(1, head_k), -1),
                table_node_M1K=table_node.view(num_recv1, top_k),
                own_slot_M1=rows_M1 * top_k + own_head.int().argmax(dim=1),
            ),
        )

    def _expand(self, x_MH: torch.Tensor, ids_MK: torch.Tensor, num_rows: int, ops) -> tuple[torch.Tensor, LocalRows]:
        """5. expand to local experts, expert-major: the same (key, position) sort, keys = local expert ids."""
        num_local, ep_rank, top_k = self.num_local_experts, self.ep_rank, ids_MK.shape[1]
        local = (ids_MK >= 0) & (ids_MK // num_local == ep_rank)
        slot_ids = rows_by_key(torch.where(local, ids_MK - ep_rank * num_local, num_local).view(-1), num_rows)
        table_loc = index_table(slot_ids, (ids_MK.shape[0], top_k))
        x_NH = ops.gather_rows(x_MH, slot_ids // top_k, table_loc)
        return x_NH, LocalRows(token_ids_N=slot_ids // top_k, slot_ids_N=slot_ids, table_loc_MK=table_loc)

    def combine_begin(
        self, y_NH: torch.Tensor, weights_TK: torch.Tensor, plan: RoutingPlan, ctx: DispatchContext
    ) -> PostedCombine:
        ops = self.kernels.ops
        s1, s2, local = ctx.stage1, ctx.stage2, ctx.local
        if ctx.empty_rows_NH is not None and ctx.empty_rows_NH.requires_grad:
            # experts given no rows may return an output detached from their input: the backward would skip this
            # rank's dispatch all-to-alls while its peers enter them (a hang). Re-attach, as AllToAllDispatcher does.
            y_NH = y_NH + 0 * ctx.empty_rows_NH.sum()
        # 6. weights to the rows' GPUs; each GPU's weighted sum of a received row's local experts
        # the anchors leave the context here: held there until backward they would keep the (M, H) rows alive
        anchors, ctx.anchors = ctx.anchors, ()
        w_MK = send_weights(weights_TK, ctx, self.groups, anchors)
        partial_MH = ops.combine_rows(y_NH, w_MK, local.token_ids_N, local.slot_ids_N, local.table_loc_MK)
        # 7. replicas' partials back to the pilot: own partial and replicas' summed in expert (= k) order
        node_MH = partial_MH
        if s2 is not None:
            m1 = s1.num_recv
            back_MH = all_to_all_rows(partial_MH[m1:], *self.groups.stage2(s2.splits, reverse=True))
            rows = torch.cat([partial_MH[:m1], back_MH])
            owner = torch.cat([torch.arange(m1, device=y_NH.device), s2.rep_src_U2])
            slots = torch.cat([s2.own_slot_M1, s2.rep_slot_U2])
            node_MH = sum_rows(ops, rows, owner, slots, s2.table_node_M1K)
        # 8. one row per unit back to its source, posted
        link, ex = post_rows(node_MH, s1.splits[0], s1.splits[1], self.group)
        self._record_combine(ctx, y_NH.shape[1] * y_NH.element_size(), weights_TK.shape[1] * weights_TK.element_size())
        return PostedCombine(link, ex, s1)

    def combine_end(self, posted: PostedCombine) -> torch.Tensor:
        """8. (continued) a token's units summed in (node, expert) order."""
        s1 = posted.stage1
        back_UH = wait_rows(posted.link, posted.exchange)
        return sum_rows(self.kernels.ops, back_UH, s1.token_of_unit_U, s1.unit_slot_U, s1.table_src_TK)

    # ---- counters: host numbers only, from the one sync of dispatch ----------------------------------------

    def _record(self, counts: Counts, row_bytes: int) -> None:
        self._last = dispatch_stats(counts, self.node_of_rank, self.ep_rank, row_bytes)
        self.stats.add(self._last)
        self.last_stats = self._last.as_dict()

    def _record_combine(self, c: DispatchContext, row_bytes: int, weight_bytes: int) -> None:
        intra, inter = combine_bytes(c, self.node_of_rank, self.ep_rank, row_bytes, weight_bytes)
        for stats in (self._last, self.stats):
            stats.bytes_intra += intra
            stats.bytes_inter += inter
        self.last_stats = self._last.as_dict()
