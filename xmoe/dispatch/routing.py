"""The padding-free routing plan (PFT): flat arrays describing every kept (token, expert) slot.

# T tokens, K top-k, E experts, N kept slots (N = T*K when dropless), C capacity per expert

Instead of a (T, E, C) dispatch mask, routing is described by a handful of 1-D arrays in expert-major order:
row n of the expert buffer holds token ``token_ids_N[n]`` for expert ``expert_ids_N[n]``; expert e owns rows
``[offsets_E[e] - tokens_per_expert_E[e], offsets_E[e])``. ``row_of_slot_TK`` is the inverse map, used by
combine to sum a token's K rows in a fixed order (deterministic, no atomics).

Host synchronisation: none in the dropless path (argsort, scatter-add counts stay on device, N = T*K is
known on the host). With a capacity factor the number of kept rows is data dependent, so sizing the buffer needs
one device-to-host read of that count (``int(keep.sum())``), once per layer call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class RoutingPlan:
    token_ids_N: torch.Tensor  # int64: token of each kept slot, expert-major
    expert_ids_N: torch.Tensor  # int64: expert of each kept slot (non-decreasing)
    slot_ids_N: torch.Tensor  # int64: t * K + k of each kept slot
    row_of_slot_TK: torch.Tensor  # int64 (T, K): row of slot (t, k) in the expert buffer, -1 if dropped
    tokens_per_expert_E: torch.Tensor  # int64: kept rows per expert
    offsets_E: torch.Tensor  # int32: inclusive prefix sum of tokens_per_expert_E (torch._grouped_mm's `offs`)
    num_dropped: torch.Tensor  # int64 scalar: routed slots dropped by capacity
    capacity: int | None  # slots kept per expert, None when dropless

    @property
    def num_tokens(self) -> int:
        return self.row_of_slot_TK.shape[0]

    @property
    def top_k(self) -> int:
        return self.row_of_slot_TK.shape[1]

    @property
    def num_experts(self) -> int:
        return self.tokens_per_expert_E.shape[0]

    @property
    def num_rows(self) -> int:
        return self.token_ids_N.shape[0]

    def positions_N(self) -> torch.Tensor:
        """Rank of each kept row inside its expert's group (0-based): the slot index of the padded layout."""
        starts_E = self.offsets_E.long() - self.tokens_per_expert_E
        return torch.arange(self.num_rows, device=self.token_ids_N.device) - starts_E[self.expert_ids_N]


def count_ids(ids: torch.Tensor, num_bins: int) -> torch.Tensor:
    """int64 histogram of ``ids`` over [0, num_bins). torch.bincount would read the ids' max back to the host on
    CUDA (a sync); an integer scatter-add needs none and is exact in any order."""
    flat = ids.reshape(-1).long()
    return torch.zeros(num_bins, dtype=torch.long, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))


def build_plan(
    expert_ids_TK: torch.Tensor,
    scores_TK: torch.Tensor,
    num_experts: int,
    capacity: int | None = None,
) -> RoutingPlan:
    """Sort the T*K routed slots by expert and apply the capacity rule.

    Dropless (``capacity`` None or >= T): rows of one expert keep token order (a stable sort of the flat ids).
    With capacity C < T: inside each expert the slots are ranked by routing score, highest first, ties by lower
    (token, k) index; ranks >= C are dropped. Kept rows of an expert then appear in that rank order.
    """
    if expert_ids_TK.dim() != 2:
        raise ValueError(f"expert_ids_TK must be (T, K), got shape {tuple(expert_ids_TK.shape)}")
    num_tokens, top_k = expert_ids_TK.shape
    device = expert_ids_TK.device
    flat_ids = expert_ids_TK.reshape(-1).long()
    num_slots = flat_ids.numel()
    counts_E = count_ids(flat_ids, num_experts)

    if capacity is None or capacity >= num_tokens:
        # 1. stable sort by expert: slot order inside an expert is token-major
        order = torch.argsort(flat_ids, stable=True)
        kept_order = order
        tokens_per_expert_E = counts_E
        num_dropped = torch.zeros((), dtype=torch.long, device=device)
        capacity = None
    else:
        # 1. rank slots by score (desc, stable keeps index order on ties), then stable sort by expert
        by_score = torch.argsort(-scores_TK.reshape(-1).float(), stable=True)
        order = by_score[torch.argsort(flat_ids[by_score], stable=True)]
        # 2. rank inside the expert = sorted position - start of the expert's run
        starts_E = torch.cumsum(counts_E, 0) - counts_E
        rank_S = torch.arange(num_slots, device=device) - starts_E[flat_ids[order]]
        keep_S = rank_S < capacity
        kept_order = order[keep_S]  # the one host sync: the kept count sizes the buffer
        tokens_per_expert_E = counts_E.clamp(max=capacity)
        num_dropped = num_slots - tokens_per_expert_E.sum()

    num_rows = kept_order.numel()
    row_of_slot = torch.full((num_slots,), -1, dtype=torch.long, device=device)
    row_of_slot[kept_order] = torch.arange(num_rows, device=device)  # a permutation: no accumulation
    return RoutingPlan(
        token_ids_N=kept_order // top_k,
        expert_ids_N=flat_ids[kept_order],
        slot_ids_N=kept_order,
        row_of_slot_TK=row_of_slot.view(num_tokens, top_k),
        tokens_per_expert_E=tokens_per_expert_E,
        offsets_E=torch.cumsum(tokens_per_expert_E, 0).to(torch.int32),
        num_dropped=num_dropped,
        capacity=capacity,
    )


class TokenNodes:
    """Which nodes a plan's tokens send rows to, for an EP group whose rank p lives on node ``node_of_rank[p]`` and
    owns ``num_local`` contiguous experts: the counters of node-limited routing (docs/routing.md)."""

    def __init__(self, node_of_rank: Sequence[int], num_local: int):
        labels = sorted(set(node_of_rank))
        self.node_of_rank = [labels.index(n) for n in node_of_rank]  # compact: nodes 0 .. num_nodes - 1
        self.num_nodes = len(labels)
        self.num_local = num_local
        self._tables: dict[torch.device, torch.Tensor] = {}

    def _node_of_expert(self, device: torch.device) -> torch.Tensor:
        """(E,) node of each expert on ``device``, copied there once (a copy per call would cost a sync)."""
        if device not in self._tables:
            nodes = torch.tensor(self.node_of_rank, dtype=torch.long).repeat_interleave(self.num_local)
            self._tables[device] = nodes.to(device)
        return self._tables[device]

    def most_of(self, plans: Sequence[RoutingPlan]) -> list[torch.Tensor]:
        """Per plan, a 1-element int64 tensor on its device: the most distinct nodes any of its tokens sends kept
        rows to (0 for a plan without rows), computed on the device for the caller's one host read; [] with one
        node, where the answer is 1 for a plan with rows and 0 without (known on the host)."""
        if self.num_nodes <= 1:
            return []
        out = []
        for plan in plans:
            device = plan.token_ids_N.device
            node_of_E = self._node_of_expert(device)
            # (token, node) pairs of the kept rows: a boolean table, written without accumulation
            hits_TN = torch.zeros(plan.num_tokens, self.num_nodes, dtype=torch.bool, device=device)
            hits_TN[plan.token_ids_N, node_of_E[plan.expert_ids_N]] = True
            nodes_T = torch.cat([hits_TN.sum(1), torch.zeros(1, dtype=torch.long, device=device)])
            out.append(nodes_T.max().reshape(1))
        return out

    def inter_rows(self, splits: Sequence[int], rank: int) -> int:
        """Rows of a split list (rows to each EP rank) that ``rank`` sends to other nodes."""
        mine = self.node_of_rank[rank]
        return sum(s for p, s in enumerate(splits) if self.node_of_rank[p] != mine)
