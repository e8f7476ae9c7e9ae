"""Routed experts (grouped SwiGLU over uneven groups) and the dense SwiGLU used for shared experts.

# N rows, H hidden, F expert ffn, E experts held by this module, C capacity (padded baseline only)
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from xmoe.dispatch.routing import RoutingPlan
from xmoe.kernels import get_ops
from xmoe.kernels.fp8_rows import Fp8Rows

if TYPE_CHECKING:
    from xmoe.moe.casts import CastCache


def _local(w: torch.Tensor) -> torch.Tensor:
    """Under expert parallelism the weights are DTensors sharded over the EP ranks: compute on this rank's slice."""
    return w.to_local() if hasattr(w, "to_local") else w


class RoutedExperts(nn.Module):
    """E SwiGLU experts: y = (silu(x w1_e) * (x w3_e)) w2_e, weights w1/w3 (E, H, F) and w2 (E, F, H).

    ``fp8``: the GEMMs run in FP8 with fine-grained scales (xmoe/kernels/fp8_experts.py; ``moe.fp8 = "experts"``),
    on GPUs with FP8 matrix instructions; the weights stay what they are (fp32 parameters) and are quantised once
    per optimizer step (``make_casts``, called by xmoe/moe/step.py's MoEStep), else once per forward."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        init_std: float = 0.02,
        kernel_backend: str = "auto",
        fp8: bool = False,
    ):
        super().__init__()
        self.kernel_backend = kernel_backend
        self.init_std = init_std
        self.fp8 = fp8
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in (self.w1, self.w3, self.w2):
            nn.init.normal_(w, std=self.init_std)

    def local_weights(
        self, dtype: torch.dtype, casts: tuple | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, w3, w2) of the experts on this rank, in the compute dtype. ``casts`` (make_casts' copies for the
        optimizer step) serve every call with gradients on (the micro-batches of one step): the gradients of all of
        them flow back through the one cast into the fp32 parameters."""
        if casts is not None and not self.fp8 and casts[0].dtype == dtype and torch.is_grad_enabled():
            return casts
        w1, w3, w2 = (_local(w).to(dtype) for w in (self.w1, self.w3, self.w2))
        return w1, w3, w2

    def fp8_weights(self, fmt: str, casts: tuple | None = None) -> tuple:
        """(w1, w3, w2, Fp8ExpertWeights): what the FP8 GEMMs read and the tensors their weight gradients are
        returned for; ``casts`` (make_casts' for the optimizer step) serve every call with gradients on."""
        from xmoe.kernels.fp8_quant import quantize_expert_weights  # imports triton: only when FP8 is asked for

        if casts is not None and self.fp8 and torch.is_grad_enabled():
            return casts
        w1, w3, w2 = (_local(w) for w in (self.w1, self.w3, self.w2))
        return w1, w3, w2, quantize_expert_weights(w1.detach(), w3.detach(), w2.detach(), fmt)

    def _cached_fp8(self, fmt: str, cache: CastCache | None):
        """The Fp8ExpertWeights the last optimizer step wrote with its update (moe/casts.py: CastCache), or None
        where it wrote none or they no longer hold the weights."""
        if cache is None or cache.fp8_format != fmt:
            return None
        up, down = cache.take_fp8((self.w1, self.w3)), cache.take_fp8((self.w2,))
        if up is None or down is None:
            return None
        from xmoe.kernels.fp8_quant import Fp8ExpertWeights

        return Fp8ExpertWeights.of(up, down)

    def make_casts(self, dtype: torch.dtype, detach: bool, cache: CastCache | None = None) -> tuple:
        """The weight copies one optimizer step's micro-batches share (MoEStep calls this when the step opens).

        bf16: ``dtype`` copies; with ``detach`` (and a dtype other than the parameters'), leaves of their own whose
        gradient is added straight into the fp32 .grad. FP8: the FP8 copies (one quantising pass per weight,
        fp8_quant.quantize_expert_weights), and as gradient receivers the parameters themselves, or with
        ``detach`` zero-stride stand-ins of dtype ``dtype`` (no memory: the FP8 GEMMs never read them) whose
        gradient is added into the fp32 .grad the same way. ``cache``: the copies the last optimizer step wrote
        (moe/casts.py: CastCache; the detached bf16 copies, or the FP8 ones), used where they still hold the
        weights."""
        params = (self.w1, self.w3, self.w2)
        ops = get_ops(self.kernel_backend, self.w1.device)  # whose accumulate_grad adds the copies' gradients
        if self.fp8:
            from xmoe.kernels.fp8_quant import fp8_format

            receivers = tuple(_leaf_into(w, _stand_in(w, dtype), ops) for w in params) if detach else params
            fmt = fp8_format(self.w1.device).name
            return (*receivers, self._cached_fp8(fmt, cache) or self.fp8_weights(fmt)[3])
        if detach and dtype != self.w1.dtype:
            return tuple(_leaf_into(w, _cast(w, dtype, cache), ops) for w in params)
        return tuple(w.to(dtype) for w in params)

    def forward(
        self,
        x: torch.Tensor,
        tokens_per_expert_E: torch.Tensor,
        plan: RoutingPlan | None = None,
        weights_TK: torch.Tensor | None = None,
        casts: tuple | None = None,
    ) -> torch.Tensor:
        """Rows (N, H) grouped by expert -> (N, H) (FP8 experts also take ``Fp8Rows``, rows dispatched in FP8); or,
        with ``plan`` and ``weights_TK``, tokens (T, H) -> the
        weighted sum of each token's expert outputs (T, H): gather, experts and combine in one backend op
        (fused by the Triton backend). Called as a module either way, so wrappers' hooks (FSDP) run. ``casts``:
        the optimizer step's weight copies (make_casts), else the weights are cast here."""
        if self.fp8:
            return self._forward_fp8(x, tokens_per_expert_E, plan, weights_TK, casts)
        if isinstance(x, Fp8Rows):
            raise ValueError("rows dispatched in FP8 reach bf16 experts dequantised; Fp8Rows are for FP8 experts")
        w1, w3, w2 = self.local_weights(x.dtype, casts)
        ops = get_ops(self.kernel_backend, x.device)
        if plan is not None:
            return ops.moe_experts(
                x, weights_TK, plan.token_ids_N, plan.slot_ids_N, plan.row_of_slot_TK, tokens_per_expert_E, w1, w3, w2
            )
        if x.dim() == 3:  # the padded baseline: equal-capacity groups, one batched matmul per weight
            return torch.bmm(F.silu(torch.bmm(x, w1)) * torch.bmm(x, w3), w2)
        return ops.grouped_swiglu(x, w1, w3, w2, tokens_per_expert_E)

    def _forward_fp8(self, x, tokens_per_expert_E, plan, weights_TK, casts):
        from xmoe.kernels.fp8_quant import fp8_format

        fmt = fp8_format(x.q.device if isinstance(x, Fp8Rows) else x.device).name  # refuses devices without FP8
        if isinstance(x, Fp8Rows):  # dispatched in FP8: the rows as they arrived, quantised once
            from xmoe.kernels import fp8_experts

            w1, w3, w2, qw = self.fp8_weights(fmt, casts)
            return fp8_experts.grouped_swiglu_fp8(x, w1, w3, w2, tokens_per_expert_E, qw, fmt)
        if x.dim() != 2:
            raise ValueError(
                "FP8 experts take rows (N, H) or tokens with a plan, not the padded baseline's "
                "(E, C, H) buffers; use dispatcher 'pft' or 'rbd', or moe.fp8='off'"
            )
        from xmoe.kernels import fp8_experts

        w1, w3, w2, qw = self.fp8_weights(fmt, casts)
        if plan is not None:
            return fp8_experts.moe_experts_fp8(
                x,
                weights_TK,
                plan.token_ids_N,
                plan.slot_ids_N,
                plan.row_of_slot_TK,
                tokens_per_expert_E,
                w1,
                w3,
                w2,
                qw,
                fmt,
            )
        return fp8_experts.grouped_swiglu_fp8(x, w1, w3, w2, tokens_per_expert_E, qw, fmt)


def _stand_in(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of param's shape holding one element (zero strides): a leaf to receive gradients for param."""
    return torch.zeros((), dtype=dtype, device=param.device).expand(param.shape)


def _cast(weight: torch.Tensor, dtype: torch.dtype, cache: CastCache | None) -> torch.Tensor:
    """``weight`` in ``dtype``, detached: the cache's copy where it holds one, else a cast."""
    copy = cache.take(weight, dtype) if cache is not None else None
    return weight.detach().to(dtype) if copy is None else copy


def _leaf_into(param: torch.Tensor, leaf: torch.Tensor, ops: ModuleType) -> torch.Tensor:
    """leaf as an autograd leaf of its own whose gradient each backward adds into param's .grad (by the kernel
    backend's ``accumulate_grad``)."""
    leaf.requires_grad_(param.requires_grad)
    if param.requires_grad:
        leaf.register_post_accumulate_grad_hook(functools.partial(_accumulate_fp32, param, ops))
    return leaf


def _accumulate_fp32(param: torch.Tensor, ops: ModuleType, cast: torch.Tensor) -> None:
    """Add a compute-dtype copy's gradient into its fp32 parameter's .grad (one mixed-dtype pass) and drop it."""
    assert cast.grad is not None  # a post-accumulate-grad hook runs once the gradient is there
    param.grad = ops.accumulate_grad(param.grad, cast.grad, param.dtype)
    cast.grad = None


class SwiGLU(nn.Module):
    """A dense SwiGLU FFN: w2(silu(w1 x) * w3 x). Shared experts are one of these, num_shared x ffn wide."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, init_std: float = 0.02):
        super().__init__()
        self.init_std = init_std
        self.w1 = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.w3 = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.w2 = nn.Linear(ffn_hidden_size, hidden_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for lin in (self.w1, self.w3, self.w2):
            nn.init.normal_(lin.weight, std=self.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(x), x.dtype)

    def up(self, x: torch.Tensor) -> torch.Tensor:
        """silu(w1 x) * w3 x: the first half, which the MoE layer may run while an all-to-all is in flight."""
        dtype = self.w1.weight.dtype
        if x.dtype == dtype or torch.is_autocast_enabled(x.device.type):
            return F.silu(self.w1(x)) * self.w3(x)
        # an input in another dtype (bf16 activations on fp32 weights, float64 in a test) computes in the weights'
        # dtype and returns in its own (down's out_dtype), as the routed experts accept any floating input: the MoE
        # block takes whatever dtype its caller uses (nn.Linear would refuse the mix)
        h = x.to(dtype)
        return F.silu(self.w1(h)) * self.w3(h)

    def down(self, h: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """w2 h, in ``out_dtype`` (the input's dtype; None: h's)."""
        y = self.w2(h)
        return y if out_dtype is None or torch.is_autocast_enabled(h.device.type) else y.to(out_dtype)
