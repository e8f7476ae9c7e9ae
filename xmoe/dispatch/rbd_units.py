"""RBD's step 1 and its index helpers: units, pilots and replicas of a routing, pure tensor code (no communication).

# T tokens, K top-k, E experts, P ranks in the EP group. hierarchical.py's docstring and docs/rbd.md give the
# algorithm these serve.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


def source_units(
    expert_ids_TK: torch.Tensor, node_of_expert_E: torch.Tensor, num_nodes: int, num_local_experts: int, my_node: int
) -> SourceUnits:
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
    node_head = valid & (node_TK != shift_right(node_TK))
    rank_head = valid & (rank_TK != shift_right(rank_TK))
    own = valid & (node_TK == my_node)
    unit_head = torch.where(own, rank_head, node_head)
    arange_K = torch.arange(top_k, device=ids.device).expand(num_tokens, top_k)
    pilot_k = torch.where(node_head, arange_K, -1).cummax(dim=1).values.clamp(min=0)
    return SourceUnits(
        perm_TK=perm_TK,
        ids_TK=ids_TK,
        rank_TK=rank_TK,
        valid_TK=valid,
        own_TK=own,
        node_head_TK=node_head,
        unit_head_TK=unit_head,
        unit_head_k_TK=torch.where(unit_head, arange_K, -1).cummax(dim=1).values.clamp(min=0),
        replica_TK=rank_head & ~own & ~node_head,
        pilot_TK=rank_TK.gather(1, pilot_k),
    )


def shift_right(x_TK: torch.Tensor) -> torch.Tensor:
    """x shifted one slot right with -2 in front: compared with x it marks the heads of equal-value runs."""
    return torch.cat([torch.full_like(x_TK[:, :1], -2), x_TK[:, :-1]], dim=1)


def rows_by_key(key_flat: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Flat positions of the first ``num_rows`` entries in stable key order: the entries whose key is below the
    sentinel, ordered (key, position). ``num_rows`` comes from the host sync, so no nonzero() sync here."""
    return torch.argsort(key_flat, stable=True)[:num_rows]


def index_table(positions: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """(rows, K) table: table.flat[positions[i]] = i, -1 elsewhere (positions are distinct: no accumulation)."""
    table = torch.full((shape[0] * shape[1],), -1, dtype=torch.long, device=positions.device)
    table[positions] = torch.arange(positions.numel(), device=positions.device)
    return table.view(shape)
