"""RBD's exchanges besides the posted rows (xmoe/dispatch/hierarchical.py): which process group each runs on, the
routing weights' trip to the rows' GPUs, and the unweighted sum of partial rows.

# T tokens, K top-k, M rows received, H hidden, R rows summed, P ranks in the EP group

Collectives of one process group run in order, so a blocking exchange issued on the EP group after rows posted
there waits for them. RBDGroups says where each blocking exchange goes instead: the weights' stage 1 on a twin of
the EP group ("side"), all of stage 2 on the node's own group; without them (None), the EP group itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from xmoe.dispatch.comm import all_to_all_plain
from xmoe.dispatch.rbd_plan import DispatchContext


@dataclass(frozen=True)
class RBDGroups:
    """Where one RBD dispatcher's blocking exchanges run (its posted rows and counts stay on its EP group): ``side``
    (a twin of the EP group: the routing weights' stage 1) and ``node`` (stage 2) with ``node_members``, the EP
    ranks it holds in order (None: stage 2 on the EP group, its splits uncut)."""

    side: dist.ProcessGroup | None
    node: dist.ProcessGroup | None
    node_members: tuple[int, ...] | None

    @classmethod
    def of(
        cls,
        ep_group: dist.ProcessGroup | None,
        my_node_ranks: Sequence[int],
        node_group: dist.ProcessGroup | None,
        side_group: dist.ProcessGroup | None,
    ) -> RBDGroups:
        """The groups given (ParallelDims.rbd_groups), each refused unless it holds the ranks it must: the whole EP
        group (side), this rank's node's EP ranks ``my_node_ranks`` (node); a group not given is the EP group."""
        ep_ranks = dist.get_process_group_ranks(ep_group) if ep_group is not None else None

        def checked(group: dist.ProcessGroup, members: Sequence[int]) -> dist.ProcessGroup:
            want = [ep_ranks[p] if ep_ranks is not None else p for p in members]
            have = dist.get_process_group_ranks(group)
            if have != want:
                raise ValueError(
                    f"RBD's extra group holds global ranks {have}, expected {want} (EP ranks {list(members)} of this "
                    "rank's group): build it with ParallelDims.rbd_groups()"
                )
            return group

        side = ep_group if side_group is None else checked(side_group, range(dist.get_world_size(ep_group)))
        if node_group is None:
            return cls(side, ep_group, None)
        return cls(side, checked(node_group, my_node_ranks), tuple(my_node_ranks))

    def stage2(self, splits: tuple[list[int], list[int]], reverse: bool = False) -> tuple[list[int], list[int], Any]:
        """(output splits, input splits, group) of a stage-2 exchange (``reverse``: the partial sums going back):
        on the node's own group, the splits cut to its members (stage 2 sends nothing beyond the node)."""
        send, recv = splits
        if reverse:
            send, recv = recv, send
        if self.node_members is not None:
            send, recv = [send[p] for p in self.node_members], [recv[p] for p in self.node_members]
        return recv, send, self.node


class _SendWeights(torch.autograd.Function):
    """Router weights (T, K) -> the received rows' weights (M, K): stage 1 (on the side group) then stage 2
    (the node group), in ONE autograd node, so its two backward all-to-alls keep a fixed order; the anchors (the
    dispatched rows) order it before them."""

    @staticmethod
    def forward(ctx, weights_TK, c: DispatchContext, groups: RBDGroups, *anchors):
        ctx.c, ctx.groups, ctx.num_anchors = c, groups, len(anchors)
        s1, s2 = c.stage1, c.stage2
        w_UK = torch.where(s1.in_unit_UK, weights_TK.gather(1, s1.units.perm_TK)[s1.token_of_unit_U], 0)
        w1_MK = all_to_all_plain(w_UK, s1.splits[1], s1.splits[0], groups.side)
        if s2 is None:
            return w1_MK
        w2_send = torch.where(s2.rep_mask_U2K, w1_MK[s2.rep_src_U2], 0)
        return torch.cat([w1_MK, all_to_all_plain(w2_send, *groups.stage2(s2.splits))])

    @staticmethod
    def backward(ctx, grad_MK):
        s1, s2, groups = ctx.c.stage1, ctx.c.stage2, ctx.groups
        if not ctx.needs_input_grad[0]:  # weights without gradient on every rank: no collective either
            return None, None, None, *(None for _ in range(ctx.num_anchors))
        grad1 = grad_MK[: s1.num_recv]
        if s2 is not None:
            back2 = all_to_all_plain(grad_MK[s1.num_recv :].contiguous(), *groups.stage2(s2.splits, reverse=True))
            # a slot's gradient is non-zero on exactly one GPU (the one hosting its expert): a gather, no atomics
            cols = torch.arange(grad1.shape[1], device=grad1.device)
            covered = s2.rep_of_slot_M1K >= 0
            grad1 = torch.where(covered, back2[s2.rep_of_slot_M1K.clamp(min=0), cols] if back2.numel() else 0, grad1)
        back1 = all_to_all_plain(grad1.contiguous(), s1.splits[0], s1.splits[1], groups.side)
        units = s1.units
        top_k = units.ids_TK.shape[1]
        cols = torch.arange(top_k, device=back1.device)
        flat = (s1.unit_of_slot_TK * top_k + cols).clamp(min=0)
        grad_sorted = torch.where(units.valid_TK, back1.reshape(-1)[flat] if back1.numel() else 0, 0)
        grad_TK = torch.zeros_like(grad_sorted).scatter(1, units.perm_TK, grad_sorted)  # perm: one write per slot
        return grad_TK, None, None, *(None for _ in range(ctx.num_anchors))


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


def sum_rows(ops, rows_RH, owner_R, slot_R, table_MK) -> torch.Tensor:
    return _SumRows.apply(rows_RH, owner_R, slot_R, table_MK, ops)


def send_weights(
    weights_TK: torch.Tensor, c: DispatchContext, groups: RBDGroups, anchors: tuple[torch.Tensor, ...]
) -> torch.Tensor:
    return _SendWeights.apply(weights_TK, c, groups, *anchors)
