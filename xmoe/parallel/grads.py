"""Gradient scaling applied inside the autograd graph by the parallel layers.

``ScaleGrad`` is the identity forward whose backward multiplies the gradient by a constant; expert parallelism
(``expert_parallel.py``) and SSMB (``ssmb.py``) use it to give parameters the gradient of the global mean loss.
"""

from __future__ import annotations

import torch
from torch import nn


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
        return (ScaleGrad.apply(args[0], 1.0 / scale), *args[1:])

    def scale_output(mod, args, out):
        return ScaleGrad.apply(out, scale)

    module.register_forward_pre_hook(scale_input)
    module.register_forward_hook(scale_output)
