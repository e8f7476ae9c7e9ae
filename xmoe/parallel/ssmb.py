"""SSMB, sequence-sharded MoE blocks (X-MoE, SC'25): under tensor parallelism each TP rank runs its MoE blocks on
1/tp of the tokens instead of all of them.

# tp tensor-parallel degree, T tokens of a micro-batch (B sequences x S positions), R = T / tp rows of one slice,
# H hidden, b bytes per element

With TP (``tensor.py``) the residual stream is replicated over the tp ranks of a TP group, so without SSMB every rank
runs the MoE block (ffn norm, router, dispatch, experts, combine, shared experts) on the same T tokens: tp-fold
redundant compute, activation memory and all-to-all traffic. ``apply_ssmb(model, dims)`` shards the block:

  h (B, S, H) replicated     1. scatter: rank t keeps its contiguous 1/tp of the T token rows, as a copy (so nothing
                                keeps the full h alive); no communication. Whole sequences, (B/tp, S, H), when tp
                                divides B; otherwise (T/S, H)
  ffn_norm -> MoELayer       2. norm, router, experts (local or EP all-to-all within this rank's EP group, which
                                shares its TP coordinate), shared experts: all on T/tp tokens
  y (B, S, H) replicated     3. gather: one all-gather over "tp" of the T/tp output rows
  h + y                         the residual add, unchanged

Autograd. The residual stream's gradient is replicated too (ColwiseParallel all-reduces input gradients), so the
gather's backward needs no communication: a rank keeps its own rows. The scatter's backward all-gathers the slices'
input gradients, making the gradient into h full and identical again. Collectives added per MoE layer: one
all-gather forward and one backward, b*T*H*(tp-1)/tp bytes sent per rank each, and the all-reduce of the block's
parameter gradients below. Removed: (tp-1)/tp of the block's compute, activation memory and, under EP, all-to-all rows
(each TP rank dispatches only its slice). Under sequence parallelism (``tensor.py``) the block's input is already this
rank's tokens and the scatter / gather are not needed at all (docs/ssmb.md tabulates both layouts).

Gradients of replicated parameters. The ffn norm, router, shared experts and routed experts are identical on the tp TP
peers, but each peer now sees only its tokens, so its gradient is a partial sum: left alone the peers' weights drift
apart after the first optimizer step (the original X-MoE code forgot this reduction). Here every such parameter gets a
gradient hook that all-reduces its gradient over "tp" before autograd accumulates it; whatever wraps the model
(nothing, or FSDP2 over "dp" / "dp_ep") then sees the reduced gradient, and gradient accumulation stays exact
(``grads.TensorParallelGradAverage``; ``grads.py`` tabulates every scale a gradient receives).
Cost: 2*(tp-1)/tp times the gradient bytes of router, shared and local experts per backward, on intra-node links.

The hook averages, and the gather's backward multiplies the gradient entering the block by tp (the scatter's backward
divides it back), so the block's parameters see tp times their slice's gradient and the average over "tp" is the exact
sum of the slices' contributions to the LM loss. Why not plain sums: the auxiliary losses that MoELayer attaches (with
the same fixed gradient on every rank) then enter as the MEAN over the tp slices of each slice's loss, as data-parallel
ranks' do (averaged gradients), rather than tp times that. A per-sequence ("sequence") balance loss over whole
sequences is a mean over sequences, so it equals the unsharded block's exactly; the "micro_batch" balance loss is the
mean of the slices' losses (as under data parallelism), and a capacity factor applies per slice. The "global" scope
sums every slice's counts (xmoe/moe/balance.py) and is exact; the optimizer step's real-token mask reaches each
slice cut as its tokens are (``local_positions``).

Expert weights are not split over TP: the tp peers hold the same experts (sharded over "ep", FSDP over "dp"), which is
what ``xmoe.plan.memory`` assumes; their gradients are averaged over "tp" like the router's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from xmoe.parallel.dims import ParallelDims
from xmoe.parallel.grads import ScaleGrad, TensorParallelGradAverage

if TYPE_CHECKING:
    from xmoe.model.transformer import Block

# recent torch renamed all_gather_into_tensor (keeping it as a deprecated alias); older versions have only that name
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_gather_rows(x_RH: torch.Tensor, group, size: int) -> torch.Tensor:
    """Concatenate the (R, ...) tensors of the group's ranks along dim 0, in group-rank order."""
    x_RH = x_RH.contiguous()
    out = x_RH.new_empty((size * x_RH.shape[0],) + tuple(x_RH.shape[1:]))
    _all_gather_single(out, x_RH, group=group)
    return out


class _ScatterTokens(torch.autograd.Function):
    """Forward: a copy of rows [rank * R, (rank + 1) * R) of x_TH, R = T / size. Backward: the group's row gradients
    all-gathered, divided by ``size`` (undoing the gather's scaling, see the module docstring)."""

    @staticmethod
    def forward(ctx, x_TH, group, rank: int, size: int):
        ctx.group, ctx.size = group, size
        rows = x_TH.shape[0] // size
        return x_TH[rank * rows : (rank + 1) * rows].clone()

    @staticmethod
    def backward(ctx, grad_RH):
        return _all_gather_rows(grad_RH / ctx.size, ctx.group, ctx.size), None, None, None


class _GatherTokens(torch.autograd.Function):
    """Forward: all-gather of the group's (R, H) rows into (T, H). Backward: this rank's rows of the (replicated)
    output gradient, times ``size``."""

    @staticmethod
    def forward(ctx, y_RH, group, rank: int, size: int):
        ctx.rank, ctx.size = rank, size
        return _all_gather_rows(y_RH, group, size)

    @staticmethod
    def backward(ctx, grad_TH):
        rows = grad_TH.shape[0] // ctx.size
        return grad_TH[ctx.rank * rows : (ctx.rank + 1) * rows] * ctx.size, None, None, None


class SSMBRegion:
    """The hooks that shard one block's MoE part over the TP group. Built by ``apply_ssmb``.

    Replicated input (plain TP): ``enter`` is the ffn norm's forward pre-hook (1. scatter) and ``exit`` the MoE
    layer's forward hook (3. gather). Sequence-parallel input (``tensor.py`` with ``sequence_parallel=True``: the ffn
    norm already returns this rank's tokens): no collectives, ``enter`` / ``exit`` on the MoE layer only apply the
    gradient scaling (1/tp into the block's input, tp into its output) that the gather and scatter would have applied.
    """

    def __init__(self, group, sequence_parallel: bool):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.sequence_parallel = sequence_parallel
        self.grad_average = TensorParallelGradAverage(group)
        self._shape: torch.Size | None = None

    def enter(self, module: nn.Module, args: tuple):
        h = args[0]
        if self.sequence_parallel:
            return (ScaleGrad.apply(h, 1.0 / self.size), *args[1:])
        # 1. scatter
        hidden = h.shape[-1]
        num_tokens = h.numel() // hidden
        if num_tokens % self.size:
            raise ValueError(
                f"SSMB splits the {num_tokens} tokens of a micro-batch (shape {tuple(h.shape[:-1])}) over tp "
                f"({self.size}) ranks: make micro-batch x seq_len divisible by {self.size}"
            )
        self._shape = h.shape
        h_RH = _ScatterTokens.apply(h.reshape(num_tokens, hidden), self.group, self.rank, self.size)
        if h.dim() == 3 and h.shape[0] % self.size == 0:  # whole sequences: keeps the per-sequence balance loss exact
            h_RH = h_RH.view(h.shape[0] // self.size, h.shape[1], hidden)
        return (h_RH, *args[1:])

    def exit(self, module: nn.Module, args: tuple, y: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return ScaleGrad.apply(y, float(self.size))
        # 3. gather
        if self._shape is None:
            raise RuntimeError("SSMB: the MoE layer ran without its ffn norm's scatter; call the block, not the layer")
        shape, self._shape = self._shape, None
        y_TH = _GatherTokens.apply(y.reshape(-1, y.shape[-1]), self.group, self.rank, self.size)
        return y_TH.view(shape)

    def local_positions(self, per_position: torch.Tensor) -> torch.Tensor:
        """This rank's share of a per-position tensor of the micro-batch ((B, S, ...): the real-token mask the
        optimizer step gives the MoE layer), cut as ``enter`` cuts the tokens: its contiguous 1/tp of the B x S
        positions, or under sequence parallelism its 1/tp of each sequence's positions."""
        if self.sequence_parallel:
            share = per_position.shape[1] // self.size
            return per_position[:, self.rank * share : (self.rank + 1) * share]
        flat = per_position.reshape(-1, *per_position.shape[2:])
        rows = flat.shape[0] // self.size
        return flat[self.rank * rows : (self.rank + 1) * rows]

    # gradient reduction: forward pre-hook of the MoE layer and of every module inside the region that owns
    # parameters. A fused dispatcher reads the experts' weights without calling their forward, so both the layer's
    # and each module's view are hooked (once each; grads.TensorParallelGradAverage).
    def hook_params(self, module: nn.Module, args: tuple) -> None:
        self.grad_average.hook_params(module, args)

    @property
    def num_grad_reductions(self) -> int:
        """Gradients averaged over "tp" so far (tests and benchmarks read it)."""
        return self.grad_average.num_reductions


def moe_blocks(model: nn.Module) -> list[Block]:
    from xmoe.model.transformer import Block

    return [m for m in model.modules() if isinstance(m, Block) and m.is_moe]


def apply_ssmb(model: nn.Module, dims: ParallelDims, *, sequence_parallel: bool = False) -> nn.Module:
    """Shard every MoE block's tokens over "tp" (see the module docstring); returns the model. A no-op when tp == 1.

    Apply after tensor parallelism and before EP / FSDP2 (it only registers hooks, so parameter names, shapes and
    checkpoints are unchanged). Each block's ``ssmb_region`` attribute holds its ``SSMBRegion``; blocks that have one
    already are left alone (``apply_tensor_parallel(sequence_parallel=True)`` installs them itself, with
    ``sequence_parallel=True``: the block's input is then already this rank's tokens, and its ffn norm, a
    SequenceParallel DTensor module, gets its gradient reduced by DTensor rather than by the hooks here).
    """
    if dims.tp == 1:
        return model
    group = dims.group("tp")
    for block in moe_blocks(model):
        if isinstance(getattr(block, "ssmb_region", None), SSMBRegion):
            continue
        region = SSMBRegion(group, sequence_parallel)
        inside = list(block.ffn.modules()) if sequence_parallel else [block.ffn_norm, *block.ffn.modules()]
        inside[0].register_forward_pre_hook(region.enter)
        block.ffn.register_forward_hook(region.exit)
        for module in inside:
            if module is block.ffn or any(True for _ in module.parameters(recurse=False)):
                module.register_forward_pre_hook(region.hook_params)
        # the real-token mask, cut as the tokens are (setattr: nn.Module's __setattr__ is typed for modules only)
        setattr(block.ffn, "local_positions", region.local_positions)  # noqa: B010
        block.ssmb_region = region  # type: ignore[assignment]  # a plain attribute (nn.Module's __setattr__ takes modules)
    return model
