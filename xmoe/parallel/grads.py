"""Every scale a gradient receives under dp x ep x tp, in one place, and the autograd pieces that apply them.

# dp, ep, tp the parallel degrees; A micro-batches accumulated per optimizer step

The target: each parameter's gradient is that of the GLOBAL loss, the mean over all dp x ep data ranks' tokens of
their per-token losses, averaged over the A micro-batches of a step. Each rank backpropagates loss / A of its own
micro-batch (the trainer), and the rest follows from where a parameter lives:

  dense weights (attention, norms, embedding, head, dense FFN)
      local gradient: from this rank's tokens
      scaled by: the wrapper's average over "dp_ep" (FSDP2, or DDP at ep = tp = 1)        -> the global mean
  TP-split dense weights (DTensors on "tp")
      local gradient: partial sums that DTensor reduces over "tp"; then as dense weights  -> the global mean
  routed experts under EP
      local gradient: the SUM over the ep ranks of the EP group (the dispatch all-to-all's backward brings every
      rank's rows home)
      scaled by: 1 / ep (``scale_weight_grads``), then FSDP2's average over "dp"          -> the global mean
  the MoE block under SSMB (ffn norm, router, shared and routed experts)
      local gradient: this TP slice's tokens only
      scaled by: tp into the block's output gradient and 1 / tp out of its input gradient (SSMB's gather and
      scatter, or ``ScaleGrad``), then the average over "tp" (``TensorParallelGradAverage``)
                                                              -> the full micro-batch's, as without SSMB
  auxiliary losses (balance, z) attached by MoELayer, over real tokens only
      fixed gradient ``aux_loss_scale`` = 1 / A (the optimizer step's, xmoe/moe/step.py), as the LM loss's
                                                              -> the mean over the step's micro-batches
      then the router's average over the ranks (the wrappers' over "dp_ep", SSMB's over "tp"):
        "sequence", "micro_batch": each rank's loss over its own tokens  -> the mean of the ranks' losses
        "global": each rank's loss sums its real tokens' terms divided by N_a / W (the micro-batch's real tokens
        on all W ranks, over W; xmoe/moe/balance.py), with expert frequencies from every rank
                                                              -> the loss over all ranks' real tokens of the
                                                                 micro-batch, as one process with all of them

FSDP2's ``set_gradient_divide_factor`` could fold the 1/ep into its reduction, but with dp == 1 (no reduce-scatter)
its handling differs across torch versions and dtypes (torch 2.13 divides twice in float64), so the expert scale is
applied inside the autograd graph: the experts' output gradient is divided by ep and their input gradient
multiplied back, so only the weight gradients change (exactly, when ep is a power of two).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn

from xmoe.kernels.fp8_rows import Fp8Rows


class ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def scale_weight_grads(module: nn.Module, scale: float) -> None:
    """Scale the gradients of ``module``'s weights by ``scale`` and leave the gradient of its input unchanged:
    the output gradient is scaled by ``scale`` on the way in, the input gradient by 1 / scale on the way out."""

    def scale_input(mod, args):
        rows = args[0]
        if isinstance(rows, Fp8Rows):  # rows dispatched in FP8: their gradient flows through the stand-in
            return (rows._replace(stand_in=ScaleGrad.apply(rows.stand_in, 1.0 / scale)), *args[1:])
        return (ScaleGrad.apply(rows, 1.0 / scale), *args[1:])

    def scale_output(mod, args, out):
        # a tensor hook, not ScaleGrad: an autograd.Function's identity output is a view, and FSDP2 warns about
        # (and an in-place op on it would break) a module that returns a view
        if out.requires_grad:
            out.register_hook(lambda grad: grad * scale)

    module.register_forward_pre_hook(scale_input)
    module.register_forward_hook(scale_output)


class TensorParallelGradAverage:
    """Averages over a TP group the gradients of parameters replicated on its ranks but computed on different
    tokens (SSMB's MoE block). ``hook_params`` is a forward pre-hook: it puts a gradient hook on each parameter
    the module holds at that moment, once. Hooks go on the tensors the forward really uses because FSDP2 swaps in
    unsharded parameters in its own pre-forward (which always runs first); a parameter object is hooked once,
    remembered by id (tensors compare elementwise, so no WeakSet) with a weak reference that tells a reused id
    from the same tensor. The hook runs before autograd accumulates, so gradient accumulation stays exact."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.num_reductions = 0  # gradients averaged so far (tests and benchmarks read it)
        self._hooked: dict[int, weakref.ref] = {}

    def hook_params(self, module: nn.Module, args: tuple) -> None:
        for p in module.parameters():
            ref = self._hooked.get(id(p))
            if p.requires_grad and (ref is None or ref() is not p):
                p.register_hook(self._average)
                self._hooked[id(p)] = weakref.ref(p)

    def _average(self, grad: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        self.num_reductions += 1
        if isinstance(grad, DTensor):  # expert stacks under EP: the local experts, the same on every TP peer
            local = grad.to_local() / self.size
            dist.all_reduce(local, group=self.group)
            return DTensor.from_local(
                local, grad.device_mesh, grad.placements, run_check=False, shape=grad.shape, stride=grad.stride()
            )
        out = grad / self.size  # a new tensor: never modify the buffer autograd handed in
        dist.all_reduce(out, group=self.group)
        return out
