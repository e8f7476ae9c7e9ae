"""RBD, redundancy-bypassing hierarchical dispatch: one pilot row per (token, remote node) crosses the network.

# T tokens, H hidden, K top-k, E experts, P ranks in the EP group, E_local = E / P experts per rank (contiguous),
# L most EP ranks on one node, U rows this rank sends in stage 1, M1 rows it receives there, U2 / M2 the same for
# stage 2, M = M1 + M2, N rows its local experts compute. docs/rbd.md walks through the algorithm.

dispatch:
  1. each token's kept slots are sorted by (node, expert). A "unit" is a run on one remote node (a pilot) or on
     one GPU of this rank's own node (a direct row). PILOT RULE: a pilot lands on the GPU hosting the token's
     lowest-numbered expert on that node. A unit carries the token's row once, with its K expert ids masked to it.
  2. ONE count exchange (equal-split all-to-all of P x (E_local + 1 + 2L) ints: per destination, the flat
     per-expert counts, the stage-1 rows, and the stage-2 rows each pilot's GPU will forward / receive, which the
     source knows), then ONE host sync of every split size.
  3. stage 1, all-to-all-v over the EP group: pilots cross nodes, direct rows stay inside, rows to self are copied.
  4. stage 2, all-to-all-v whose non-zero splits are all intra-node: a pilot's GPU forwards one replica per other
     GPU of its node hosting the token's experts, ids masked to that GPU. No collective at all when no node holds
     two ranks of the group, or one node holds them all.
  5. each GPU expands its received rows to its local experts, expert-major: flat's rows, in another order.
combine, the reverse, every sum in a fixed order (ops.combine_rows: k in order, fp32 accumulation, no atomics):
  6. router weights reach the rows' GPUs (stage 1 then 2, one autograd node: _SendWeights; they travel here since
     the dispatcher interface hands them to combine only); each GPU sums its experts' outputs of a row, WEIGHTED:
     the only place weights are applied.
  7. replicas' partial sums return to the pilot's GPU (reverse stage 2), added to its own in expert order.
  8. one row per unit returns (reverse stage 1); the source sums a token's units in (node, expert) order.

Collectives per layer call: forward 9 (counts; rows + ids in stages 1 and 2; weights in stages 1 and 2; partial
sums back in stages 2 and 1), backward 6; with one stage 5 and 3 (flat: 3 and 2). Host syncs: ONE, in step 2
(2P + 2L + 6 ints: all split sizes, the expanded-row count, the counters); combine and backward reuse them. No
(tokens x experts) structure: metadata is O(T K + M K) ints, deduplicated by sorting each token's K keys and
marking run heads, which needs no host sync (torch.unique would).

Backward order: every rank must enter backward's collectives in the same order. The row path and combine's chain
are linear; the weights' node is a side branch, so it takes the dispatched rows as extra inputs ("anchors"):
autograd must then run it before the dispatch all-to-alls' backward, on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from xmoe.dispatch.base import TrafficStats, experts_per_rank
from xmoe.dispatch.comm import all_to_all_plain, all_to_all_rows, exchange_counts
from xmoe.dispatch.routing import RoutingPlan, count_ids
from xmoe.kernels import get_ops


@dataclass
class RBDStats(TrafficStats):
    """Traffic this rank SENT in forward passes since reset() (backward moves as much again, reversed); the
    meaning of each field is in docs/rbd.md ("Counters"). Python numbers, from dispatch's one host sync."""

    calls: int = 0
    slots: int = 0
    token_nodes: int = 0
    rows_local: int = 0
    rows_intra_direct: int = 0
    rows_inter: int = 0
    rows_replica: int = 0
    replicas_caused: int = 0
    flat_rows_intra: int = 0
    flat_rows_inter: int = 0
    bytes_intra: int = 0
    bytes_inter: int = 0

    @property
    def rows_intra(self) -> int:
        return self.rows_intra_direct + self.rows_replica

    @property
    def redundancy_rate(self) -> float:
        """R = redundant slots / dispatched slots = 1 - distinct (token, node) / slots (the paper's R)."""
        return 1.0 - self.token_nodes / self.slots if self.slots else 0.0

    def derived(self) -> dict[str, float]:
        return {"rows_intra": self.rows_intra, "redundancy_rate": self.redundancy_rate}


@dataclass
class SourceUnits:
    """Step 1 for one rank's tokens, in each token's slots sorted by (node, expert) ("sorted layout", (T, K))."""

    perm_TK: torch.Tensor  # sorted position k -> original slot index of the token
    ids_TK: torch.Tensor  # expert id, -1 for a dropped slot (sorted last)
    rank_TK: torch.Tensor  # owning EP rank, -1 if dropped
    valid_TK: torch.Tensor  # kept slot
    own_TK: torch.Tensor  # the expert is on this rank's node
    node_head_TK: torch.Tensor  # first slot of a (token, node) run: count = distinct (token, node) pairs
    unit_head_TK: torch.Tensor  # first slot of a unit: a stage-1 row to rank_TK
    unit_head_k_TK: torch.Tensor  # k of the head of the slot's unit
    replica_TK: torch.Tensor  # first slot of a (token, GPU) run on a remote node that is not the pilot's GPU
    pilot_TK: torch.Tensor  # rank of the pilot of the slot's node run


def source_units(expert_ids_TK: torch.Tensor, node_of_expert_E: torch.Tensor, num_nodes: int,
                 num_local_experts: int, my_node: int) -> SourceUnits:
    """Units, pilots and replicas of a routing (pure; -1 marks a dropped slot; nodes numbered 0 .. num_nodes - 1).
    Sorting by node * E + expert makes a node's slots contiguous with its lowest expert first (the pilot rule),
    whatever the rank-to-node map."""
    num_tokens, top_k = expert_ids_TK.shape
    num_experts = node_of_expert_E.numel()
    valid = expert_ids_TK >= 0
    ids = expert_ids_TK.clamp(min=0)
    sentinel = num_nodes * num_experts  # sorts after every kept slot
    key_TK = torch.where(valid, node_of_expert_E[ids] * num_experts + ids, sentinel)
    key_TK, perm_TK = torch.sort(key_TK, dim=1, stable=True)
    valid = key_TK < sentinel
    ids_TK = torch.where(valid, key_TK % num_experts, -1)
    rank_TK = torch.where(valid, ids_TK // num_local_experts, -1)
    node_TK = torch.where(valid, key_TK // num_experts, -1)
    node_head = valid & (node_TK != _shift_right(node_TK))
    rank_head = valid & (rank_TK != _shift_right(rank_TK))
    own = valid & (node_TK == my_node)
    unit_head = torch.where(own, rank_head, node_head)
    arange_K = torch.arange(top_k, device=ids.device).expand(num_tokens, top_k)
    pilot_k = torch.where(node_head, arange_K, -1).cummax(dim=1).values.clamp(min=0)
    return SourceUnits(
        perm_TK=perm_TK, ids_TK=ids_TK, rank_TK=rank_TK, valid_TK=valid, own_TK=own, node_head_TK=node_head,
        unit_head_TK=unit_head,
        unit_head_k_TK=torch.where(unit_head, arange_K, -1).cummax(dim=1).values.clamp(min=0),
        replica_TK=rank_head & ~own & ~node_head,
        pilot_TK=rank_TK.gather(1, pilot_k),
    )


def _shift_right(x_TK: torch.Tensor) -> torch.Tensor:
    """x shifted one slot right with -2 in front: compared with x it marks the heads of equal-value runs."""
    return torch.cat([torch.full_like(x_TK[:, :1], -2), x_TK[:, :-1]], dim=1)


def _rows_by_key(key_flat: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Flat positions of the first ``num_rows`` entries in stable key order: the entries whose key is below the
    sentinel, ordered (key, position). ``num_rows`` comes from the host sync, so no nonzero() sync here."""
    return torch.argsort(key_flat, stable=True)[:num_rows]


def _index_table(positions: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """(rows, K) table: table.flat[positions[i]] = i, -1 elsewhere (positions are distinct: no accumulation)."""
    table = torch.full((shape[0] * shape[1],), -1, dtype=torch.long, device=positions.device)
    table[positions] = torch.arange(positions.numel(), device=positions.device)
    return table.view(shape)


@dataclass
class _Ctx:
    splits1: tuple[list[int], list[int]]  # (send, receive) per EP rank, stage 1
    splits2: Optional[tuple[list[int], list[int]]]  # stage 2; None when it is skipped
    units: SourceUnits
    token_of_unit_U: torch.Tensor  # token of each stage-1 row sent
    unit_slot_U: torch.Tensor  # its head's flat sorted slot (t * K + k)
    table_src_TK: torch.Tensor  # sorted slot (t, k) -> stage-1 row sent, at unit heads
    unit_of_slot_TK: torch.Tensor  # stage-1 row of the slot's unit
    in_unit_UK: torch.Tensor  # (U, K) which sorted slots of its token a unit carries
    num_recv1: int  # M1
    rep_src_U2: Optional[torch.Tensor]  # stage-1 row each replica copies
    rep_slot_U2: Optional[torch.Tensor]  # its head slot (i * K + k) in the stage-1 rows
    rep_mask_U2K: Optional[torch.Tensor]  # which k of that row the replica carries
    rep_of_slot_M1K: Optional[torch.Tensor]  # replica covering stage-1 slot (i, k), -1 if none
    table_node_M1K: Optional[torch.Tensor]  # node sum: row of cat(own partials, replica partials) per head
    own_slot_M1: Optional[torch.Tensor]  # i * K + k of the row's head on this rank
    token_ids_N: torch.Tensor  # expanded row -> received row (of the M)
    slot_ids_N: torch.Tensor  # expanded row -> received slot (m * K + k)
    table_loc_MK: torch.Tensor  # received slot -> expanded row, -1 if not on this rank
    anchors: tuple[torch.Tensor, ...]  # the dispatch all-to-alls' outputs (see the module docstring)
    empty_rows_NH: Optional[torch.Tensor]  # the dispatched tensor when this rank computes nothing


class _SendWeights(torch.autograd.Function):
    """Router weights (T, K) -> the received rows' weights (M, K): stage 1 then stage 2, in ONE autograd node, so
    its two backward all-to-alls keep a fixed order; the anchors (the dispatched rows) order it before them."""

    @staticmethod
    def forward(ctx, weights_TK, c: _Ctx, group, *anchors):
        ctx.c, ctx.group, ctx.num_anchors = c, group, len(anchors)
        u = c.units
        w_UK = torch.where(c.in_unit_UK, weights_TK.gather(1, u.perm_TK)[c.token_of_unit_U], 0)
        w1_MK = all_to_all_plain(w_UK, c.splits1[1], c.splits1[0], group)
        if c.splits2 is None:
            return w1_MK
        w2_send = torch.where(c.rep_mask_U2K, w1_MK[c.rep_src_U2], 0)
        return torch.cat([w1_MK, all_to_all_plain(w2_send, c.splits2[1], c.splits2[0], group)])

    @staticmethod
    def backward(ctx, grad_MK):
        c, group = ctx.c, ctx.group
        if not ctx.needs_input_grad[0]:  # weights without gradient on every rank: no collective either
            return None, None, None, *(None for _ in range(ctx.num_anchors))
        grad1 = grad_MK[:c.num_recv1]
        if c.splits2 is not None:
            back2 = all_to_all_plain(grad_MK[c.num_recv1:].contiguous(), c.splits2[0], c.splits2[1], group)
            # a slot's gradient is non-zero on exactly one GPU (the one hosting its expert): a gather, no atomics
            cols = torch.arange(grad1.shape[1], device=grad1.device)
            covered = c.rep_of_slot_M1K >= 0
            grad1 = torch.where(covered, back2[c.rep_of_slot_M1K.clamp(min=0), cols] if back2.numel() else 0, grad1)
        back1 = all_to_all_plain(grad1.contiguous(), c.splits1[0], c.splits1[1], group)
        u = c.units
        top_k = u.ids_TK.shape[1]
        cols = torch.arange(top_k, device=back1.device)
        flat = (c.unit_of_slot_TK * top_k + cols).clamp(min=0)
        grad_sorted = torch.where(u.valid_TK, back1.reshape(-1)[flat] if back1.numel() else 0, 0)
        grad_TK = torch.zeros_like(grad_sorted).scatter(1, u.perm_TK, grad_sorted)  # perm: one write per slot
        return grad_TK, None, None, *(None for _ in range(ctx.num_anchors))


class HierarchicalDispatcher:
    """RBD over ``ep_group`` (interface: xmoe/dispatch/base.py). ``node_of_rank[p]``: node label of EP rank p.

    ``stats`` accumulates :class:`RBDStats` over calls; ``last_stats`` holds the latest layer call's (dispatch +
    combine) as a dict of Python numbers. Neither costs a host sync of its own.
    """

    def __init__(self, ep_group: Optional[dist.ProcessGroup], num_experts: int, node_of_rank: Sequence[int],
                 kernel_backend: str = "auto"):
        self.group = ep_group
        self.num_ranks = dist.get_world_size(ep_group)
        self.ep_rank = dist.get_rank(ep_group)
        if len(node_of_rank) != self.num_ranks:
            raise ValueError(f"node_of_rank has {len(node_of_rank)} entries for an EP group of {self.num_ranks}")
        self.num_experts = num_experts
        self.num_local_experts = experts_per_rank(num_experts, self.num_ranks)
        self.kernel_backend = kernel_backend
        labels = sorted(set(node_of_rank))
        self.node_of_rank = [labels.index(n) for n in node_of_rank]  # compact node ids 0 .. nodes - 1
        self.ranks_of_node = [[p for p, n in enumerate(self.node_of_rank) if n == m] for m in range(len(labels))]
        self.my_node = self.node_of_rank[self.ep_rank]
        self.width = max(len(r) for r in self.ranks_of_node)  # L
        self.local_index = [self.ranks_of_node[n].index(p) for p, n in enumerate(self.node_of_rank)]
        # replicas exist only if some node holds two ranks AND some node is remote
        self.two_stage = len(labels) > 1 and self.width > 1
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.stats = RBDStats()
        self.last_stats: dict[str, float] = {}
        self._last = RBDStats()

    def _device_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(node of each expert, node-local index of each rank) on ``device``, copied there once (a host-to-device
        copy per call would be a synchronisation of its own)."""
        if device not in self._tables:
            nodes = torch.tensor(self.node_of_rank, dtype=torch.long)
            self._tables[device] = (nodes.repeat_interleave(self.num_local_experts).to(device),
                                    torch.tensor(self.local_index, dtype=torch.long).to(device))
        return self._tables[device]

    def dispatch(self, x_TH: torch.Tensor, plan: RoutingPlan) -> tuple[torch.Tensor, torch.Tensor, Any]:
        if plan.num_experts != self.num_experts:
            raise ValueError(
                f"plan routes to {plan.num_experts} experts but the dispatcher was built for {self.num_experts}")
        ops = get_ops(self.kernel_backend, x_TH.device)
        dev, P, L, E_loc, me = x_TH.device, self.num_ranks, self.width, self.num_local_experts, self.ep_rank
        num_tokens, top_k = plan.row_of_slot_TK.shape

        # 1. units of this rank's tokens, from the plan's flat arrays (kept slots only)
        ids_flat = torch.full((num_tokens * top_k,), -1, dtype=torch.long, device=dev)
        ids_flat[plan.slot_ids_N] = plan.expert_ids_N
        node_of_expert, local_idx = self._device_tables(dev)
        u = source_units(ids_flat.view(num_tokens, top_k), node_of_expert, len(self.ranks_of_node), E_loc,
                         self.my_node)

        # 2. counts: flat per expert | stage-1 rows | stage-2 rows each pilot sends / receives, per node-local rank
        key1 = torch.where(u.unit_head_TK, u.rank_TK, P).view(-1)
        parts = [plan.tokens_per_expert_E.view(P, E_loc), count_ids(key1, P + 1)[:P, None]]
        if self.two_stage:
            pilot, target = u.pilot_TK.clamp(min=0), u.rank_TK.clamp(min=0)
            for a, b in ((pilot, target), (target, pilot)):  # (pilot q, its peer r): to q, then to r
                key = torch.where(u.replica_TK, a * L + local_idx[b], P * L).view(-1)
                parts.append(count_ids(key, P * L + 1)[:P * L].view(P, L))
        send_PC = torch.cat(parts, dim=1)
        recv_PC = exchange_counts(send_PC, self.group)
        tokens_per_expert_local = recv_PC[:, :E_loc].sum(0)
        v, own = u.valid_TK, u.own_TK
        mine = u.rank_TK == me
        scalars = torch.stack([v.sum(), u.node_head_TK.sum(), u.replica_TK.sum(), (own & ~mine).sum(),
                               (v & ~own).sum(), tokens_per_expert_local.sum()])
        host_parts = [send_PC[:, E_loc], recv_PC[:, E_loc]]
        if self.two_stage:
            host_parts += [recv_PC[:, E_loc + 1:E_loc + 1 + L].sum(0), recv_PC[:, E_loc + 1 + L:].sum(0)]
        host = torch.cat(host_parts + [scalars]).tolist()  # THE host sync of the layer
        send1, recv1 = host[:P], host[P:2 * P]
        slots, token_nodes, caused, flat_intra, flat_inter, num_rows = host[-6:]
        splits2 = None
        if self.two_stage:
            send2, recv2 = [0] * P, [0] * P
            for j, peer in enumerate(self.ranks_of_node[self.my_node]):
                send2[peer], recv2[peer] = host[2 * P + j], host[2 * P + L + j]
            splits2 = (send2, recv2)

        # 3. stage 1: unit rows in (destination rank, token, k) order, with their ids masked to the unit
        unit_slot = _rows_by_key(key1, sum(send1))
        token_of_unit = unit_slot // top_k
        table_src = _index_table(unit_slot, (num_tokens, top_k))
        unit_of_slot = torch.where(v, table_src.gather(1, u.unit_head_k_TK), -1)
        in_unit = unit_of_slot[token_of_unit] == torch.arange(unit_slot.numel(), device=dev)[:, None]
        ids_send = torch.where(in_unit, u.ids_TK[token_of_unit], -1).to(torch.int32)
        x1 = all_to_all_rows(ops.gather_rows(x_TH, token_of_unit, table_src), recv1, send1, self.group)
        ids1 = all_to_all_plain(ids_send, recv1, send1, self.group).long()
        num_recv1 = ids1.shape[0]

        # 4. stage 2: a replica per (received row, other GPU of this node hosting its experts)
        c_rep = dict(rep_src_U2=None, rep_slot_U2=None, rep_mask_U2K=None, rep_of_slot_M1K=None,
                     table_node_M1K=None, own_slot_M1=None)
        x_loc, ids_loc, anchors = x1, ids1, (x1,)
        if splits2 is not None:
            valid1 = ids1 >= 0
            rank1 = torch.where(valid1, ids1 // E_loc, -1)
            head1 = valid1 & (rank1 != _shift_right(rank1))
            own_head = head1 & (rank1 == me)  # exactly one per row: the pilot rule puts the row on a host
            rep_slot = _rows_by_key(torch.where(head1 & ~own_head, rank1, P).view(-1), sum(splits2[0]))
            rep_src = rep_slot // top_k
            table_rep = _index_table(rep_slot, (num_recv1, top_k))
            rep_mask = rank1[rep_src] == rank1.view(-1)[rep_slot][:, None]
            ids2_send = torch.where(rep_mask, ids1[rep_src], -1).to(torch.int32)
            x2 = all_to_all_rows(ops.gather_rows(x1, rep_src, table_rep), splits2[1], splits2[0], self.group)
            ids2 = all_to_all_plain(ids2_send, splits2[1], splits2[0], self.group).long()
            arange_K = torch.arange(top_k, device=dev).expand(num_recv1, top_k)
            head_k = torch.where(head1, arange_K, -1).cummax(dim=1).values.clamp(min=0)
            rows_M1 = torch.arange(num_recv1, device=dev)
            table_node = torch.where(own_head, rows_M1[:, None], -1).view(-1)
            table_node[rep_slot] = num_recv1 + torch.arange(rep_slot.numel(), device=dev)
            c_rep = dict(rep_src_U2=rep_src, rep_slot_U2=rep_slot, rep_mask_U2K=rep_mask,
                         rep_of_slot_M1K=torch.where(valid1 & (rank1 != me), table_rep.gather(1, head_k), -1),
                         table_node_M1K=table_node.view(num_recv1, top_k),
                         own_slot_M1=rows_M1 * top_k + own_head.int().argmax(dim=1))
            x_loc, ids_loc, anchors = torch.cat([x1, x2]), torch.cat([ids1, ids2]), (x1, x2)

        # 5. expand to local experts, expert-major: the same (key, position) sort, keys = local expert ids
        local = (ids_loc >= 0) & (ids_loc // E_loc == me)
        slot_ids = _rows_by_key(torch.where(local, ids_loc - me * E_loc, E_loc).view(-1), num_rows)
        table_loc = _index_table(slot_ids, tuple(ids_loc.shape))
        x_NH = ops.gather_rows(x_loc, slot_ids // top_k, table_loc)

        self._record(send1, splits2, slots, token_nodes, caused, flat_intra, flat_inter,
                     x_TH.shape[1] * x_TH.element_size() + 4 * top_k)
        ctx = _Ctx(splits1=(send1, recv1), splits2=splits2, units=u, token_of_unit_U=token_of_unit,
                   unit_slot_U=unit_slot, table_src_TK=table_src, unit_of_slot_TK=unit_of_slot, in_unit_UK=in_unit,
                   num_recv1=num_recv1, token_ids_N=slot_ids // top_k, slot_ids_N=slot_ids, table_loc_MK=table_loc,
                   anchors=anchors, empty_rows_NH=x_NH if num_rows == 0 else None, **c_rep)
        return x_NH, tokens_per_expert_local, ctx

    def combine(self, y_NH: torch.Tensor, weights_TK: torch.Tensor, plan: RoutingPlan, ctx: _Ctx) -> torch.Tensor:
        ops = get_ops(self.kernel_backend, y_NH.device)
        c, dev = ctx, y_NH.device
        if c.empty_rows_NH is not None and c.empty_rows_NH.requires_grad:
            # experts given no rows may return an output detached from their input: the backward would skip this
            # rank's dispatch all-to-alls while its peers enter them (a hang). Re-attach, as AllToAllDispatcher does.
            y_NH = y_NH + 0 * c.empty_rows_NH.sum()
        # 6. weights to the rows' GPUs; each GPU's weighted sum of a received row's local experts
        # the anchors leave the context here: held there until backward they would keep the (M, H) rows alive
        anchors, c.anchors = c.anchors, ()
        w_MK = _SendWeights.apply(weights_TK, c, self.group, *anchors)
        partial_MH = ops.combine_rows(y_NH, w_MK, c.token_ids_N, c.slot_ids_N, c.table_loc_MK)
        # 7. replicas' partials back to the pilot: own partial and replicas' summed in expert (= k) order
        node_MH = partial_MH
        if c.splits2 is not None:
            m1 = c.num_recv1
            back_MH = all_to_all_rows(partial_MH[m1:], c.splits2[0], c.splits2[1], self.group)
            rows = torch.cat([partial_MH[:m1], back_MH])
            owner = torch.cat([torch.arange(m1, device=dev), c.rep_src_U2])
            slots = torch.cat([c.own_slot_M1, c.rep_slot_U2])
            node_MH = _sum_rows(ops, rows, owner, slots, c.table_node_M1K)
        # 8. one row per unit back to its source; a token's units summed in (node, expert) order
        back_UH = all_to_all_rows(node_MH, c.splits1[0], c.splits1[1], self.group)
        out_TH = _sum_rows(ops, back_UH, c.token_of_unit_U, c.unit_slot_U, c.table_src_TK)
        self._record_combine(c, y_NH.shape[1] * y_NH.element_size(), weights_TK.shape[1] * weights_TK.element_size())
        return out_TH

    # ---- counters: host numbers only, from the one sync of dispatch ----------------------------------------

    def _link_rows(self, splits: list[int]) -> tuple[int, int, int]:
        """(to itself, to other GPUs of its node, to other nodes) of a split list."""
        local = splits[self.ep_rank]
        intra = sum(s for p, s in enumerate(splits) if self.node_of_rank[p] == self.my_node) - local
        return local, intra, sum(splits) - local - intra

    def _record(self, send1, splits2, slots, token_nodes, caused, flat_intra, flat_inter, row_bytes) -> None:
        local, direct, inter = self._link_rows(send1)
        replica = sum(splits2[0]) if splits2 is not None else 0
        self._last = RBDStats(calls=1, slots=slots, token_nodes=token_nodes, rows_local=local,
                              rows_intra_direct=direct, rows_inter=inter, rows_replica=replica,
                              replicas_caused=caused, flat_rows_intra=flat_intra, flat_rows_inter=flat_inter,
                              bytes_intra=(direct + replica) * row_bytes, bytes_inter=inter * row_bytes)
        self.stats.add(self._last)
        self.last_stats = self._last.as_dict()

    def _record_combine(self, c: _Ctx, row_bytes: int, weight_bytes: int) -> None:
        """Combine sends weights the dispatch way (to where its rows went) and partial sums back the other way (to
        where its received rows came from): same links as dispatch, other row sizes."""
        _, direct_w, inter_w = self._link_rows(c.splits1[0])
        _, direct_y, inter_y = self._link_rows(c.splits1[1])
        intra = direct_w * weight_bytes + direct_y * row_bytes
        if c.splits2 is not None:
            intra += sum(c.splits2[0]) * weight_bytes + sum(c.splits2[1]) * row_bytes
        for stats in (self._last, self.stats):
            stats.bytes_intra += intra
            stats.bytes_inter += inter_w * weight_bytes + inter_y * row_bytes
        self.last_stats = self._last.as_dict()


class _SumRows(torch.autograd.Function):
    """out[m] = sum over k of rows[table[m, k]], k in order, fp32 accumulation (ops.combine_rows, unit weights).
    Each row feeds exactly one (owner, slot), so the backward is a gather by owner; unlike combine_rows' own
    autograd it saves no (rows, H) tensor for a weight gradient nobody needs."""

    @staticmethod
    def forward(ctx, rows_RH, owner_R, slot_R, table_MK, ops):
        ctx.save_for_backward(owner_R, table_MK)
        ctx.ops = ops
        ones_MK = torch.ones(table_MK.shape, dtype=torch.float32, device=rows_RH.device)
        return ops.combine_rows(rows_RH, ones_MK, owner_R, slot_R, table_MK)  # grad mode is off in forward

    @staticmethod
    def backward(ctx, grad_MH):
        owner_R, table_MK = ctx.saved_tensors
        return ctx.ops.gather_rows(grad_MH.contiguous(), owner_R, table_MK), None, None, None, None


def _sum_rows(ops, rows_RH, owner_R, slot_R, table_MK) -> torch.Tensor:
    return _SumRows.apply(rows_RH, owner_R, slot_R, table_MK, ops)
