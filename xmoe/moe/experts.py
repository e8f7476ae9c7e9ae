"""Routed experts (grouped SwiGLU over uneven groups) and the dense SwiGLU used for shared experts.

# N rows, H hidden, F expert ffn, E experts held by this module, C capacity (padded baseline only)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xmoe.dispatch.routing import RoutingPlan
from xmoe.kernels.choice import Kernels, resolve_kernels
from xmoe.kernels.fp8_rows import Fp8Rows
from xmoe.moe.weights import CopyWriter, ExpertWeights


class RoutedExperts(nn.Module):
    """E SwiGLU experts: y = (silu(x w1_e) * (x w3_e)) w2_e, weights w1/w3 (E, H, F) and w2 (E, F, H).

    ``fp8``: the GEMMs run in FP8 with fine-grained scales (xmoe/kernels/fp8_experts.py; ``moe.fp8 = "experts"``),
    on GPUs with FP8 matrix instructions; the weights stay what they are (fp32 parameters) and are quantised once
    per optimizer step (``step_copies``, called by xmoe/moe/step.py's MoEStep), else once per forward.

    ``expert_weights`` (xmoe/moe/weights.py) owns what a step computes with: the compute copies of w1, w3, w2,
    their gradients' way into the fp32 .grad and the copies the optimizer writes for the next step.

    ``kernels``: the layer's (xmoe/kernels/choice.py): the backend's ops, and the weight-gradient engine and tile
    autotuning the Triton ops are called with (None: the "auto" backend on the default device under the
    environment's kernels section)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        ffn_hidden_size: int,
        init_std: float = 0.02,
        kernels: Kernels | None = None,
        fp8: bool = False,
    ):
        super().__init__()
        self.kernels = kernels if kernels is not None else resolve_kernels()
        self.init_std = init_std
        self.fp8 = fp8
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))
        self.expert_weights = ExpertWeights(self, fp8)
        self.register_load_state_dict_post_hook(_drop_waiting_copies)  # loaded weights: their old copies are stale
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in (self.w1, self.w3, self.w2):
            nn.init.normal_(w, std=self.init_std)
        self.expert_weights.invalidate()

    def step_copies(self, dtype: torch.dtype) -> tuple | None:
        """The weight copies one optimizer step's micro-batches share (MoEStep calls this when the step opens):
        ExpertWeights.step_copies, whose detached copies' gradients this module's kernel backend adds into the fp32
        .grad."""
        return self.expert_weights.step_copies(dtype, self.kernels.ops)

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
        the optimizer step's weight copies (step_copies), else the weights are cast here."""
        if self.fp8:
            return self._forward_fp8(x, tokens_per_expert_E, plan, weights_TK, casts)
        if isinstance(x, Fp8Rows):
            raise ValueError("rows dispatched in FP8 reach bf16 experts dequantised; Fp8Rows are for FP8 experts")
        w1, w3, w2 = self.expert_weights.compute(x.dtype, casts)
        k = self.kernels
        if plan is not None:
            return k.ops.moe_experts(
                x, weights_TK, plan.token_ids_N, plan.slot_ids_N, plan.row_of_slot_TK, tokens_per_expert_E, w1, w3, w2,
                wgrad=k.wgrad, autotune=k.autotune,
            )  # fmt: skip
        if x.dim() == 3:  # the padded baseline: equal-capacity groups, one batched matmul per weight
            return torch.bmm(F.silu(torch.bmm(x, w1)) * torch.bmm(x, w3), w2)
        return k.ops.grouped_swiglu(x, w1, w3, w2, tokens_per_expert_E, wgrad=k.wgrad, autotune=k.autotune)

    def _forward_fp8(self, x, tokens_per_expert_E, plan, weights_TK, casts):
        from xmoe.kernels.fp8_quant import fp8_format

        k = self.kernels  # how the Triton ops compute: the kernels section this module was built with
        fmt = fp8_format(x.q.device if isinstance(x, Fp8Rows) else x.device).name  # refuses devices without FP8
        if isinstance(x, Fp8Rows):  # dispatched in FP8: the rows as they arrived, quantised once
            from xmoe.kernels import fp8_experts

            w1, w3, w2, qw = self.expert_weights.compute_fp8(fmt, casts)
            return fp8_experts.grouped_swiglu_fp8(
                x, w1, w3, w2, tokens_per_expert_E, qw, fmt, wgrad=k.wgrad, autotune=k.autotune
            )
        if x.dim() != 2:
            raise ValueError(
                "FP8 experts take rows (N, H) or tokens with a plan, not the padded baseline's "
                "(E, C, H) buffers; use dispatcher 'pft' or 'rbd', or moe.fp8='off'"
            )
        from xmoe.kernels import fp8_experts

        w1, w3, w2, qw = self.expert_weights.compute_fp8(fmt, casts)
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
                wgrad=k.wgrad,
                autotune=k.autotune,
            )
        return fp8_experts.grouped_swiglu_fp8(
            x, w1, w3, w2, tokens_per_expert_E, qw, fmt, wgrad=k.wgrad, autotune=k.autotune
        )


def _drop_waiting_copies(module: nn.Module, incompatible_keys: object) -> None:
    """RoutedExperts' load_state_dict post-hook: the weights loaded make the copies waiting for the next step
    stale (a module-level function, so that a pickled module keeps its hook)."""
    assert isinstance(module, RoutedExperts)
    module.expert_weights.invalidate()


def use_one_process(model: nn.Module, copy_dtype: torch.dtype | None) -> list[tuple[torch.Tensor, CopyWriter]]:
    """Every routed expert module of ``model`` on the detached one-process path (ExpertWeights.use_one_process:
    xmoe/parallel/build.py calls this once for a model that one process trains); the (parameter, writer) pairs
    the fused AdamW is built with."""
    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    return [pair for m in experts for pair in m.expert_weights.use_one_process(copy_dtype)]


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
