"""The FP8 GEMM set of the routed experts' autograd Function (experts_fn.py), and the engine of the FP8 weight
gradients (kernels.wgrad = "fp8").

# T tokens, H hidden, F expert ffn, E experts, N kept rows (expert-major); G = 128 (fp8_quant.GROUP)

Fp8Gemms: the GEMMs of fp8_gemm.py over the weights' FP8 copies (fp8_quant.Fp8ExpertWeights), results in the
activations' dtype. Where each operand is quantised:
  rows_in     x once per token (quantize_rows: a (T, H) pass, K times fewer rows than the up GEMM reads by token
              id), or nothing where the rows arrive quantised (x_q: FP8 dispatch)
  up          fp8_swiglu_up_fwd: h1, h3 in the activations' dtype, a quantised in its epilogue
  down        fp8_grouped_mm, y = a w2 (column ranges start on w2's 128-column scale blocks: quantum G)
  swiglu_bwd  the output gradient once per token (quantize_rows), then fp8_swiglu_down_bwd: da = g[tok] w2^T and
              the SwiGLU backward pass, which writes dh1, dh3, w a in the activations' dtype (for the weight
              gradients) and dh1 | dh3 quantised side by side (for dx)
  input_grad  fp8_grouped_mm, dx = (dh1 | dh3)(w1 | w3)^T, one product of depth 2F (fp8_gemm.input_grad_operands)
The weight gradients: in the activations' dtype (gemm_sets.RowWgrad) from x (or the dequantised x_q), grad_out and
the dh1, dh3, w a the SwiGLU backward wrote; or with kernels.wgrad = "fp8" (ColWgrad) in FP8 from those quantised
in 128 x 1 groups down their columns (fp8_wgrad.py: x[tok] and g[tok] straight from x and grad_out by token id,
the others in a pass each; x_q's rows dequantised, then quantised so).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from xmoe.kernels._common import cdiv
from xmoe.kernels.fp8_gemm import fp8_grouped_mm, fp8_swiglu_down_bwd, fp8_swiglu_up_fwd, input_grad_operands
from xmoe.kernels.fp8_quant import GROUP, Fp8ExpertWeights, quantize_rows
from xmoe.kernels.fp8_rows import dequantize_rows
from xmoe.kernels.fp8_wgrad import ColumnGroups, column_groups, fp8_wgrad, quantize_cols
from xmoe.kernels.gemm_sets import RowWgrad, gathers, span


class ColWgrad(NamedTuple):
    """FP8 weight gradients (fp8_wgrad.py): both operands of each quantised in G x 1 groups of each expert's rows
    (column_groups, made once at dW2 and kept for dW1, dW3). As RowWgrad: w2_begin / w2_end bracket the moment
    the backward frees w a, which is quantised first."""

    counts_E: torch.Tensor
    num_rows: int
    fmt: str
    autotune: bool

    @property
    def gather(self) -> bool:
        return False  # rows are read by token id as they are quantised

    def w2_begin(self, a_w, grad, token_ids_N, g_rows) -> list:
        groups = column_groups(self.counts_E, self.num_rows)
        awq, s_aw = quantize_cols(a_w, None, groups.bounds_3E, groups.expert_J, self.fmt)
        return [groups, awq, s_aw]

    def w2_end(self, pending: list, grad, token_ids_N) -> tuple[torch.Tensor, ColumnGroups]:
        groups, awq, s_aw = pending
        pending.clear()
        gq_t, s_gt = quantize_cols(grad, token_ids_N, groups.bounds_3E, groups.expert_J, self.fmt)
        dw2 = fp8_wgrad(awq, s_aw, gq_t, s_gt, groups.bounds_3E, self.fmt, grad.dtype, self.autotune)
        del awq, s_aw, gq_t, s_gt
        return dw2, groups

    def w13(self, groups, gemms, x, token_ids_N, dh1, dh3) -> tuple[torch.Tensor, torch.Tensor]:
        """(dW1, dW3) = x[tok]^T (dh1, dh3) per expert: x's rows quantised down their columns once for both."""
        rows, ids = gemms.wgrad_rows(x, token_ids_N, False)
        xq_t, s_xt = quantize_cols(rows, ids, groups.bounds_3E, groups.expert_J, self.fmt)
        del rows  # the dequantised rows of x_q: freed before the dh operands are quantised
        dw = []
        for dh in (dh1, dh3):
            dhq_t, s_dht = quantize_cols(dh, None, groups.bounds_3E, groups.expert_J, self.fmt)
            dw.append(fp8_wgrad(xq_t, s_xt, dhq_t, s_dht, groups.bounds_3E, self.fmt, gemms.dtype, self.autotune))
            del dhq_t, s_dht
        return dw[0], dw[1]


class Fp8Gemms(NamedTuple):
    """The experts' GEMMs in FP8 (module docstring). qw: the weights' FP8 copies (in the backward only those it
    reads: w13_EHF, w2_EFH, scale13, scale2); fmt: the format's name; dtype: the activations'; x_q: the input rows
    as (values, scales) where they arrive quantised, else None; wgrad, autotune: kernels.wgrad and
    kernels.autotune, as the Function was handed them."""

    qw: Fp8ExpertWeights
    fmt: str
    dtype: torch.dtype
    x_q: tuple[torch.Tensor, torch.Tensor] | None
    wgrad: str
    autotune: bool

    @property
    def quantum(self) -> int:
        return GROUP  # column chunks of y and dx start on the weights' scale blocks

    @classmethod
    def restore(cls, tensors: list[torch.Tensor], fmt: str, dtype: torch.dtype, wgrad: str, autotune: bool) -> Fp8Gemms:
        """From what ``saved`` gave."""
        q13, q2, s13, s2, *x_q = tensors
        qw = Fp8ExpertWeights(None, None, None, w13_EHF=q13, w2_EFH=q2, scale13=s13, scale2=s2)  # type: ignore[arg-type]
        return cls(qw, fmt, dtype, (x_q[0], x_q[1]) if x_q else None, wgrad, autotune)

    def saved(self) -> tuple[torch.Tensor, ...]:
        # the weights' other copies are held by their maker (once per step); only these are read in backward
        return (self.qw.w13_EHF, self.qw.w2_EFH, self.qw.scale13, self.qw.scale2, *(self.x_q or ()))

    @property
    def hidden(self) -> int:
        return self.qw.w13_EHF.shape[1]

    @property
    def ffn(self) -> int:
        return self.qw.w13_EHF.shape[2] // 2

    def rows_in(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x_q if self.x_q is not None else quantize_rows(x, self.fmt)

    def up(self, rows, token_ids_N, counts_E, store_h):
        qw = self.qw
        h1, h3, aq, scale_a = fp8_swiglu_up_fwd(
            rows[0],
            rows[1],
            token_ids_N,
            qw.w1_EFH,
            qw.w3_EFH,
            qw.scale1.transpose(1, 2),
            qw.scale3.transpose(1, 2),
            counts_E,
            store_h,
            self.fmt,
            self.dtype,
            self.autotune,
        )
        return h1, h3, (aq, scale_a)

    def down(self, a, counts_E, c0: int, c1: int) -> torch.Tensor:
        w2, s2 = self.qw.w2_EHF, self.qw.scale2.transpose(1, 2)
        g0, g1 = c0 // GROUP, cdiv(c1, GROUP)
        w2, s2 = span(w2, 1, c0, c1), span(s2, 1, g0, g1)
        return fp8_grouped_mm(a[0], a[1], w2, s2, None, None, None, None, counts_E, self.dtype, False, self.autotune)

    def grad_rows(self, grad: torch.Tensor, fused: bool) -> torch.Tensor:
        return grad.contiguous()

    def swiglu_bwd(self, grad, token_ids_N, h1, h3, row_w_N, counts_E, reuse, gather):
        gq, scale_g = quantize_rows(grad, self.fmt)
        dh1, dh3, a_w, grad_w_N, dhq, scale_dh = fp8_swiglu_down_bwd(
            gq, scale_g, token_ids_N, self.qw.w2_EFH, self.qw.scale2, h1, h3, row_w_N, counts_E, reuse, self.fmt,
            self.autotune,
        )  # fmt: skip
        del gq, scale_g
        return dh1, dh3, a_w, grad_w_N, (dhq, scale_dh), None

    def input_grad(self, dh, counts_E, c0: int, c1: int) -> torch.Tensor:
        a1, sa1, b1, sb1, a2, sa2, b2, sb2 = input_grad_operands(dh[0], dh[1], self.qw.w13_EHF, self.qw.scale13)
        g0, g1 = c0 // GROUP, cdiv(c1, GROUP)
        b1, sb1 = span(b1, 1, c0, c1), span(sb1, 1, g0, g1)
        if a2 is not None:
            b2, sb2 = span(b2, 1, c0, c1), span(sb2, 1, g0, g1)
        return fp8_grouped_mm(a1, sa1, b1, sb1, a2, sa2, b2, sb2, counts_E, self.dtype, True, self.autotune)

    def wgrad_rows(self, x, token_ids_N, gather: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.x_q is not None:  # the rows arrived quantised: their weight gradients read them dequantised
            return dequantize_rows(*self.x_q, self.dtype), None
        return (x.index_select(0, token_ids_N), None) if gather and token_ids_N is not None else (x, token_ids_N)

    def weight_grads(self, x, token_ids_N, counts_E, num_rows: int) -> RowWgrad | ColWgrad:
        if self.wgrad == "fp8":  # kernels.wgrad = "fp8": the weight gradients in FP8 too
            return ColWgrad(counts_E, num_rows, self.fmt, self.autotune)
        gather = gathers(x, token_ids_N, counts_E, num_rows, self.hidden, self.ffn, self.wgrad)
        return RowWgrad(counts_E, gather, self.wgrad, self.autotune)
