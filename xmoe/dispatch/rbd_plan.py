"""What an RBD layer call records (hierarchical.py runs the exchanges): the split sizes and counters of dispatch's
one host sync, each stage's index tables, the context that combine and backward replay, and the traffic counters
they add up to (RBDStats).

# T tokens, K top-k; U rows this rank sends in stage 1, M1 rows it receives there, U2 / M2 the same for stage 2,
# M = M1 + M2, N rows its local experts compute. The steps are numbered as in hierarchical.py and docs/rbd.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xmoe.dispatch.base import TrafficStats
from xmoe.dispatch.comm import Exchange
from xmoe.dispatch.rbd_units import SourceUnits


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
    max_token_nodes: int = 0  # the most nodes one token was sent to (a maximum: base.py's combine_counter)

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
class Counts:
    """Step 2's results, read by the one host sync: split sizes and this layer call's counters."""

    stage1: tuple[list[int], list[int]]  # (send, receive) rows per EP rank, stage 1
    stage2: tuple[list[int], list[int]] | None  # the same for stage 2; None when it is skipped
    tokens_per_expert_local: torch.Tensor  # rows each local expert computes (device)
    num_rows: int  # N: rows this rank's experts compute
    slots: int  # the counters of RBDStats that only the source knows
    token_nodes: int
    replicas_caused: int
    flat_rows_intra: int
    flat_rows_inter: int
    max_token_nodes: int


@dataclass
class Stage1:
    """Step 3: unit rows sent across the EP group (U rows out, M1 in)."""

    splits: tuple[list[int], list[int]]  # (send, receive) per EP rank
    units: SourceUnits
    token_of_unit_U: torch.Tensor  # token of each stage-1 row sent
    unit_slot_U: torch.Tensor  # its head's flat sorted slot (t * K + k)
    table_src_TK: torch.Tensor  # sorted slot (t, k) -> stage-1 row sent, at unit heads
    unit_of_slot_TK: torch.Tensor  # stage-1 row of the slot's unit
    in_unit_UK: torch.Tensor  # (U, K) which sorted slots of its token a unit carries
    num_recv: int  # M1


@dataclass
class Stage2:
    """Step 4: replicas forwarded inside the node (U2 rows out, M2 in)."""

    splits: tuple[list[int], list[int]]  # (send, receive) per EP rank, non-zero only inside the node
    rep_src_U2: torch.Tensor  # stage-1 row each replica copies
    rep_slot_U2: torch.Tensor  # its head slot (i * K + k) in the stage-1 rows
    rep_mask_U2K: torch.Tensor  # which k of that row the replica carries
    rep_of_slot_M1K: torch.Tensor  # replica covering stage-1 slot (i, k), -1 if none
    table_node_M1K: torch.Tensor  # node sum: row of cat(own partials, replica partials) per head
    own_slot_M1: torch.Tensor  # i * K + k of the row's head on this rank


@dataclass
class LocalRows:
    """Step 5: the received rows expanded to this rank's experts, expert-major."""

    token_ids_N: torch.Tensor  # expanded row -> received row (of the M)
    slot_ids_N: torch.Tensor  # expanded row -> received slot (m * K + k)
    table_loc_MK: torch.Tensor  # received slot -> expanded row, -1 if not on this rank


@dataclass
class DispatchContext:
    """What dispatch hands to combine (the interface's ctx), and combine's autograd nodes to backward."""

    stage1: Stage1
    stage2: Stage2 | None
    local: LocalRows
    anchors: tuple[torch.Tensor, ...]  # the dispatch all-to-alls' outputs (hierarchical.py's docstring)
    empty_rows_NH: torch.Tensor | None  # the dispatched tensor when this rank computes nothing


@dataclass
class RBDRoute:
    """One chunk's units and its share of the count exchange."""

    units: SourceUnits
    key1: torch.Tensor  # each sorted slot's stage-1 destination (P where it sends nothing)
    counts: Counts


@dataclass
class PostedDispatch:
    """Stage 1 of a dispatch in flight (its rows' ids inside the same exchange)."""

    link: torch.Tensor
    exchange: Exchange
    counts: Counts
    stage1: Stage1
    row_bytes: int


@dataclass
class PostedCombine:
    """The last exchange of a combine (one row per unit back to its source) in flight."""

    link: torch.Tensor
    exchange: Exchange
    stage1: Stage1


# ---- counters: host numbers only, from the one sync of dispatch ---------------------------------------------


def link_rows(splits: list[int], node_of_rank: list[int], rank: int) -> tuple[int, int, int]:
    """(to itself, to other GPUs of its node, to other nodes) of ``rank``'s split list."""
    local = splits[rank]
    intra = sum(s for p, s in enumerate(splits) if node_of_rank[p] == node_of_rank[rank]) - local
    return local, intra, sum(splits) - local - intra


def dispatch_stats(counts: Counts, node_of_rank: list[int], rank: int, row_bytes: int) -> RBDStats:
    """The counters of one dispatch by ``rank`` (a call; combine's bytes are added by combine_bytes)."""
    local, direct, inter = link_rows(counts.stage1[0], node_of_rank, rank)
    replica = sum(counts.stage2[0]) if counts.stage2 is not None else 0
    return RBDStats(
        calls=1,
        slots=counts.slots,
        token_nodes=counts.token_nodes,
        rows_local=local,
        rows_intra_direct=direct,
        rows_inter=inter,
        rows_replica=replica,
        replicas_caused=counts.replicas_caused,
        flat_rows_intra=counts.flat_rows_intra,
        flat_rows_inter=counts.flat_rows_inter,
        bytes_intra=(direct + replica) * row_bytes,
        bytes_inter=inter * row_bytes,
        max_token_nodes=counts.max_token_nodes,
    )


def combine_bytes(
    c: DispatchContext, node_of_rank: list[int], rank: int, row_bytes: int, weight_bytes: int
) -> tuple[int, int]:
    """(intra-node, inter-node) bytes a combine sends: weights the dispatch way (to where its rows went) and partial
    sums back the other way (to where its received rows came from): same links as dispatch, other row sizes."""
    _, direct_w, inter_w = link_rows(c.stage1.splits[0], node_of_rank, rank)
    _, direct_y, inter_y = link_rows(c.stage1.splits[1], node_of_rank, rank)
    intra = direct_w * weight_bytes + direct_y * row_bytes
    if c.stage2 is not None:
        intra += sum(c.stage2.splits[0]) * weight_bytes + sum(c.stage2.splits[1]) * row_bytes
    return intra, inter_w * weight_bytes + inter_y * row_bytes
