"""FP8 routed experts: triton_ops.py's fused path and its grouped SwiGLU, with the GEMMs of fp8_gemm.py.

# T tokens, H hidden, F expert ffn, E experts, K top-k, N kept rows (expert-major); G = 128 (fp8_quant.GROUP)

  moe_experts_fp8(x_TH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK, tokens_per_expert_E,
                  w1_EHF, w3_EHF, w2_EFH, qw, fmt) -> out_TH        == triton_ops.moe_experts, FP8 GEMMs
  grouped_swiglu_fp8(x_NH, w1_EHF, w3_EHF, w2_EFH, tokens_per_expert_E, qw, fmt) -> y_NH
                                                                     == triton_ops.grouped_swiglu, FP8 GEMMs
qw: fp8_quant.Fp8ExpertWeights, the FP8 copies of w1, w3, w2 (quantize_expert_weights). w1, w3, w2 are what the
weight gradients are returned for; their values are not read (any float dtype, or a zero-stride stand-in of their
shape: moe/experts.py). fmt: the FP8 format's name (fp8_formats.fp8_format(device).name).

Where each operand is quantised, fused path (the grouped one quantises its (N, H) input and gradient instead):
  forward   x_TH once per token (a (T, H) pass: K times fewer rows than the up GEMM reads by token id); a in the
            up GEMM's epilogue; the down GEMM's output and its per-token sum as in bf16
  backward  grad_out once per token (a (T, H) pass); dh1, dh3 in the SwiGLU backward pass that produces them; the
            weight gradients in bf16 from x, grad_out and the dh1, dh3, w * a that pass also writes in the
            activations' dtype, or with kernels.wgrad = "fp8" in FP8 from those quantised in 128 x 1 groups
            (fp8_wgrad.py: x[tok] and g[tok] straight from x and grad_out by token id, the others in a pass each)
Saved between forward and backward: h1, h3 in the activations' dtype, as in bf16 (the FP8 weights are held by
their maker, once per step). As in triton_ops: w * a (in h1's storage) is freed after dW2, dx is summed per token
one column chunk at a time; here the FP8 dh1, dh3 are dropped after dx, before dW1 and dW3.
"""

from __future__ import annotations

import torch

from xmoe.kernels._common import cdiv
from xmoe.kernels.combine import combine_fwd, combine_into
from xmoe.kernels.fp8_gemm import fp8_grouped_mm, fp8_swiglu_down_bwd, fp8_swiglu_up_fwd, input_grad_operands
from xmoe.kernels.fp8_quant import GROUP, Fp8ExpertWeights, quantize_rows
from xmoe.kernels.fp8_wgrad import column_groups, fp8_wgrad, quantize_cols, use_fp8_wgrad
from xmoe.kernels.grouped_gemm import can_reuse_saved
from xmoe.kernels.grouped_wgrad import grouped_wgrad, wgrad_engine
from xmoe.kernels.triton_ops import _mark_overwritten, column_chunks

__all__ = ["grouped_swiglu_fp8", "moe_experts_fp8"]


def _chunked_mm_combine(
    a1, sa1, b1_ENK, sb1, a2, sa2, b2_ENK, sb2, counts_E, row_of_slot_TK, weights_TK, num_tokens, out_dtype, input_grad
):
    """combine(a1 b1^T (+ a2 b2^T), weights) -> (T, width), one column chunk of the (N, width) product at a time;
    chunks start on the weights' 128-column scale blocks. input_grad: as fp8_grouped_mm's."""
    width = b1_ENK.shape[1]
    chunks = column_chunks(width, a1.shape[0], num_tokens, GROUP)
    second = a2 is not None

    def product(c0, c1):
        cols = slice(c0, c1)
        groups = slice(c0 // GROUP, cdiv(c1, GROUP))
        return fp8_grouped_mm(
            a1,
            sa1,
            b1_ENK[:, cols],
            sb1[:, groups],
            a2,
            sa2,
            b2_ENK[:, cols] if second else None,
            sb2[:, groups] if second else None,
            counts_E,
            out_dtype,
            input_grad,
        )

    if len(chunks) == 1:
        return combine_fwd(product(0, width), row_of_slot_TK, weights_TK)
    out_TH = torch.empty(num_tokens, width, dtype=out_dtype, device=a1.device)
    for c0, c1 in chunks:
        part = product(c0, c1)
        combine_into(part, row_of_slot_TK, weights_TK, out_TH[:, c0:c1])
        del part  # one chunk's buffer alive at a time
    return out_TH


def _down_operands(
    aq: torch.Tensor, scale_a: torch.Tensor, qw: Fp8ExpertWeights
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, None, None, None, None]:
    """fp8_grouped_mm's (a1, scale_a1, b1, scale_b1, a2, scale_a2, b2, scale_b2) for y = a w2: one pair."""
    return aq, scale_a, qw.w2_EHF, qw.scale2.transpose(1, 2), None, None, None, None


def _fp8_wgrad_pair(x, idx_N, dh1, dh3, groups, fmt):
    """(dW1, dW3) = x[idx]^T (dh1, dh3) per expert in FP8: x's rows quantised down their columns once for both."""
    xq_t, s_xt = quantize_cols(x, idx_N, *groups, fmt)
    dw = []
    for dh in (dh1, dh3):
        dhq_t, s_dht = quantize_cols(dh, None, *groups, fmt)
        dw.append(fp8_wgrad(xq_t, s_xt, dhq_t, s_dht, groups.bounds_3E, fmt, x.dtype))
        del dhq_t, s_dht
    return dw[0], dw[1]


class MoEExpertsFp8Fn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x_TH,
        weights_TK,
        token_ids_N,
        slot_ids_N,
        row_of_slot_TK,
        tokens_per_expert_E,
        w1_EHF,
        w3_EHF,
        w2_EFH,
        qw: Fp8ExpertWeights,
        fmt: str,
    ):
        if token_ids_N.shape != slot_ids_N.shape:
            raise ValueError(
                f"token_ids_N {tuple(token_ids_N.shape)} and slot_ids_N {tuple(slot_ids_N.shape)} must have one shape"
            )
        xq, scale_x = quantize_rows(x_TH, fmt)
        h1, h3, aq, scale_a = fp8_swiglu_up_fwd(
            xq,
            scale_x,
            token_ids_N,
            qw.w1_EFH,
            qw.w3_EFH,
            qw.scale1.transpose(1, 2),
            qw.scale3.transpose(1, 2),
            tokens_per_expert_E,
            any(ctx.needs_input_grad),
            fmt,
            x_TH.dtype,
        )
        del xq, scale_x
        out_TH = _chunked_mm_combine(
            *_down_operands(aq, scale_a, qw),
            tokens_per_expert_E,
            row_of_slot_TK,
            weights_TK,
            x_TH.shape[0],
            x_TH.dtype,
            False,
        )
        ctx.save_for_backward(
            x_TH,
            weights_TK,
            token_ids_N,
            slot_ids_N,
            row_of_slot_TK,
            tokens_per_expert_E,
            qw.w13_EHF,
            qw.w2_EFH,
            qw.scale13,
            qw.scale2,
            h1,
            h3,
        )
        ctx.fmt = fmt
        return out_TH

    @staticmethod
    def backward(ctx, grad_TH):
        (x_TH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK, counts_E, q13, q2, s13, s2, h1, h3) = (
            ctx.saved_tensors
        )
        grad_TH = grad_TH.contiguous()
        row_w_N = weights_TK.reshape(-1)[slot_ids_N].float()
        reuse = can_reuse_saved()
        num_rows, hidden, ffn = token_ids_N.shape[0], q13.shape[1], q13.shape[2] // 2
        gather = wgrad_engine(x_TH, num_rows, counts_E.shape[0], hidden, ffn) == "grouped_mm"
        # 1. da = g[token] w2^T from FP8 g; the SwiGLU backward pass writes dh1 (over da), dh3 and w * a (over h3,
        #    h1 when allowed) for the weight gradients, dh1 | dh3 in FP8 for dx, and the combine-weight gradient
        gq, scale_g = quantize_rows(grad_TH, ctx.fmt)
        dh1, dh3, a_w, grad_w_N, dhq, scale_dh = fp8_swiglu_down_bwd(
            gq, scale_g, token_ids_N, q2, s2, h1, h3, row_w_N, counts_E, reuse, ctx.fmt
        )
        del gq, scale_g
        if reuse:
            _mark_overwritten(h1, h3)
        # 2. dW2_e = (w * a)_e^T grad_out[token]_e: bf16, or FP8 from both quantised down their columns
        fp8_wg = use_fp8_wgrad()
        if fp8_wg:
            groups = column_groups(counts_E, num_rows)
            awq, s_aw = quantize_cols(a_w, None, *groups, ctx.fmt)
        else:
            g_rows, g_ids = (grad_TH.index_select(0, token_ids_N), None) if gather else (grad_TH, token_ids_N)
            dw2 = grouped_wgrad(a_w, None, g_rows, None, g_ids, counts_E)[0]
            del g_rows
        if reuse:  # a_w is h1's storage, which ctx holds until the backward returns: free it now, before dx
            a_w.untyped_storage().resize_(0)
        del a_w
        if fp8_wg:
            gq_t, s_gt = quantize_cols(grad_TH, token_ids_N, *groups, ctx.fmt)
            dw2 = fp8_wgrad(awq, s_aw, gq_t, s_gt, groups.bounds_3E, ctx.fmt, grad_TH.dtype)
            del awq, s_aw, gq_t, s_gt
        # 3. dx = dh1 w1^T + dh3 w3^T = (dh1 | dh3)(w1 | w3)^T in FP8, summed per token (k in order), one column
        #    chunk at a time
        operands = input_grad_operands(dhq, scale_dh, q13, s13)
        dx_TH = _chunked_mm_combine(*operands, counts_E, row_of_slot_TK, None, x_TH.shape[0], x_TH.dtype, True)
        del operands, dhq, scale_dh
        # 4. dW1_e, dW3_e = x[token]_e^T (dh1_e, dh3_e), bf16 or FP8
        if fp8_wg:
            dw1, dw3 = _fp8_wgrad_pair(x_TH, token_ids_N, dh1, dh3, groups, ctx.fmt)
        else:
            x_rows, x_ids = (x_TH.index_select(0, token_ids_N), None) if gather else (x_TH, token_ids_N)
            dw1, dw3 = grouped_wgrad(x_rows, x_ids, dh1, dh3, None, counts_E)
            del x_rows
        del dh1, dh3
        grad_w = torch.zeros(weights_TK.numel(), dtype=weights_TK.dtype, device=weights_TK.device)
        grad_w[slot_ids_N] = grad_w_N.to(grad_w.dtype)  # slots are unique: a permutation, no accumulation
        return dx_TH, grad_w.view_as(weights_TK), None, None, None, None, dw1, dw3, dw2, None, None


def moe_experts_fp8(
    x_TH,
    weights_TK,
    token_ids_N,
    slot_ids_N,
    row_of_slot_TK,
    tokens_per_expert_E,
    w1_EHF,
    w3_EHF,
    w2_EFH,
    qw: Fp8ExpertWeights,
    fmt: str,
):
    """out[t] = sum_k w[t,k] * expert_{e(t,k)}(x[t]) with FP8 expert GEMMs; gradients for x, the weights and the
    routing weights as moe_experts gives them."""
    return MoEExpertsFp8Fn.apply(
        x_TH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK, tokens_per_expert_E, w1_EHF, w3_EHF, w2_EFH, qw, fmt
    )


class GroupedSwiGLUFp8Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NH, w1_EHF, w3_EHF, w2_EFH, tokens_per_expert_E, qw: Fp8ExpertWeights, fmt: str):
        xq, scale_x = quantize_rows(x_NH, fmt)
        h1, h3, aq, scale_a = fp8_swiglu_up_fwd(
            xq,
            scale_x,
            None,
            qw.w1_EFH,
            qw.w3_EFH,
            qw.scale1.transpose(1, 2),
            qw.scale3.transpose(1, 2),
            tokens_per_expert_E,
            any(ctx.needs_input_grad),
            fmt,
            x_NH.dtype,
        )
        del xq, scale_x
        y_NH = fp8_grouped_mm(*_down_operands(aq, scale_a, qw), tokens_per_expert_E, x_NH.dtype, False)
        ctx.save_for_backward(x_NH, tokens_per_expert_E, qw.w13_EHF, qw.w2_EFH, qw.scale13, qw.scale2, h1, h3)
        ctx.fmt = fmt
        return y_NH

    @staticmethod
    def backward(ctx, grad_NH):
        x_NH, counts_E, q13, q2, s13, s2, h1, h3 = ctx.saved_tensors
        grad_NH = grad_NH.contiguous()
        reuse = can_reuse_saved()
        gq, scale_g = quantize_rows(grad_NH, ctx.fmt)
        dh1, dh3, a, _, dhq, scale_dh = fp8_swiglu_down_bwd(
            gq, scale_g, None, q2, s2, h1, h3, None, counts_E, reuse, ctx.fmt
        )
        del gq, scale_g
        if reuse:
            _mark_overwritten(h1, h3)
        dx = fp8_grouped_mm(*input_grad_operands(dhq, scale_dh, q13, s13), counts_E, x_NH.dtype, True)
        del dhq, scale_dh
        if use_fp8_wgrad():
            groups = column_groups(counts_E, x_NH.shape[0])
            dw2 = fp8_wgrad(
                *quantize_cols(a, None, *groups, ctx.fmt),
                *quantize_cols(grad_NH, None, *groups, ctx.fmt),
                groups.bounds_3E,
                ctx.fmt,
                grad_NH.dtype,
            )
            del a
            dw1, dw3 = _fp8_wgrad_pair(x_NH, None, dh1, dh3, groups, ctx.fmt)
            return dx, dw1, dw3, dw2, None, None, None
        dw2 = grouped_wgrad(a, None, grad_NH, None, None, counts_E)[0]
        del a
        dw1, dw3 = grouped_wgrad(x_NH, None, dh1, dh3, None, counts_E)
        return dx, dw1, dw3, dw2, None, None, None


def grouped_swiglu_fp8(x_NH, w1_EHF, w3_EHF, w2_EFH, tokens_per_expert_E, qw: Fp8ExpertWeights, fmt: str):
    """Per expert e: (silu(x w1_e) * (x w3_e)) w2_e over its rows, with FP8 GEMMs."""
    return GroupedSwiGLUFp8Fn.apply(x_NH, w1_EHF, w3_EHF, w2_EFH, tokens_per_expert_E, qw, fmt)
