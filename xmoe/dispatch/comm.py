"""Communication primitives for expert parallelism: an autograd-aware all-to-all of rows with uneven splits, and
the exchange of per-expert row counts that sizes it.

# P ranks in the EP group, E_local experts per rank, H hidden, N rows sent, M rows received

The all-to-all is its own autograd.Function around ``dist.all_to_all_single`` (rather than
``torch.distributed.nn.functional.all_to_all_single``) so that its backward is exactly the reverse exchange with
the splits swapped, with the split lists held on the host and no extra synchronisation, and so that a group of
one rank costs nothing (no copy, no collective).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_to_all(x_NH: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    out_MH = x_NH.new_empty((sum(output_splits),) + tuple(x_NH.shape[1:]))
    dist.all_to_all_single(out_MH, x_NH.contiguous(), output_splits, input_splits, group=group)
    return out_MH


def all_to_all_plain(x_NH: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """The uneven all-to-all outside autograd (ids, or inside a Function's own forward/backward); a group of one
    rank returns x as is."""
    if dist.get_world_size(group) == 1:
        return x_NH
    return _all_to_all(x_NH, output_splits, input_splits, group)


class AllToAllRows(torch.autograd.Function):
    """Rows [sum(input_splits[:p]), sum(input_splits[:p+1])) go to rank p; rows from rank p arrive in that order."""

    @staticmethod
    def forward(ctx, x_NH, output_splits, input_splits, group):
        ctx.splits = (output_splits, input_splits)
        ctx.group = group
        return _all_to_all(x_NH, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad_MH):
        output_splits, input_splits = ctx.splits
        # the gradient of a row travels back to where the row came from: the same exchange, splits swapped
        return _all_to_all(grad_MH, input_splits, output_splits, ctx.group), None, None, None


def all_to_all_rows(
    x_NH: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Differentiable uneven all-to-all along dim 0. Splits are host lists (NCCL and gloo both need them there)."""
    if x_NH.shape[0] != sum(input_splits):
        raise ValueError(f"x has {x_NH.shape[0]} rows but input_splits {input_splits} sum to {sum(input_splits)}")
    if dist.get_world_size(group) == 1:
        return x_NH
    return AllToAllRows.apply(x_NH, output_splits, input_splits, group)


def exchange_counts(send_counts_PE: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """send_counts_PE[p, e]: rows this rank sends to rank p's local expert e (int64, on the rows' device).

    Returns recv_counts_PE[p, e]: rows rank p sends to this rank's local expert e. One equal-split all-to-all of
    P * E_local integers; it stays on the device (no host synchronisation here).
    """
    if send_counts_PE.dim() != 2 or send_counts_PE.shape[0] != dist.get_world_size(group):
        raise ValueError(
            f"send_counts must be (P={dist.get_world_size(group)}, E_local), got {tuple(send_counts_PE.shape)}"
        )
    if send_counts_PE.shape[0] == 1:
        return send_counts_PE
    recv_counts_PE = torch.empty_like(send_counts_PE)
    dist.all_to_all_single(recv_counts_PE, send_counts_PE.contiguous(), group=group)
    return recv_counts_PE


def splits_to_host(send_counts_PE: torch.Tensor, recv_counts_PE: torch.Tensor) -> tuple[list[int], list[int]]:
    """(input_splits, output_splits) of the row all-to-all as host lists: ONE device-to-host copy.

    This is the host synchronisation of expert-parallel dispatch (its measured cost: docs/architecture.md,
    "Measured reasons"): the collective needs the split sizes on the host, and the receive buffer's size is data
    dependent.
    """
    num_ranks = send_counts_PE.shape[0]
    both = torch.cat([send_counts_PE.sum(1), recv_counts_PE.sum(1)]).tolist()
    return both[:num_ranks], both[num_ranks:]
