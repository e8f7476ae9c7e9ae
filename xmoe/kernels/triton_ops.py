"""The Triton backend of xmoe's MoE ops (same signatures and semantics as reference.py), plus the fused path.

# T tokens, H hidden, F expert ffn, E experts, K top-k, N kept rows (expert-major)

  gather_rows(x_TH, token_ids_N, row_of_slot_TK) -> x_NH                              permute.py
  combine_rows(y_NH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK) -> out_TH   combine.py
  grouped_swiglu(x_NH, w1_EHF, w3_EHF, w2_EFH, tokens_per_expert_E) -> y_NH           grouped_gemm.py, grouped_wgrad.py
  moe_experts(x_TH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK, tokens_per_expert_E,
              w1_EHF, w3_EHF, w2_EFH) -> out_TH
      == combine_rows(grouped_swiglu(gather_rows(x_TH, ...), ...), weights_TK, ...), fused:
      forward  the up GEMM reads x_TH rows by token id (no (N, H) dispatch buffer); the down GEMM and the
               deterministic per-token sum (combine weights applied) run one column chunk of H at a time, so y
               exists only as an (N, chunk) buffer;
      backward the down-dgrad GEMM reads grad_out rows by token id; the SwiGLU-backward pass applies the combine
               weight and yields its gradient as <grad_out w2^T, a> (y is never saved), writing dh1 over da and
               (w a, dh3) over the saved (h1, h3); dx is computed and summed per token (k in order) one column
               chunk at a time; the wgrad of w1/w3 reads x_TH rows by token id. Saved: h1, h3 (2*N*F elements);
               h1's storage (then holding w a) is freed once dW2 is made, before dx; allocated by the backward
               besides its results: da (N*F), one (N, chunk) dx buffer, and on the Hopper weight-gradient path
               one (N, H) gathered buffer at a time.

Every op is a torch.autograd.Function over torch.library custom ops, so torch.compile treats the kernels as
opaque calls and traces the code around them.
"""

from __future__ import annotations

import math

import torch

from xmoe.kernels._common import cdiv, interpreting
from xmoe.kernels.accumulate import accumulate_grad as accumulate_grad
from xmoe.kernels.combine import combine_fwd, combine_into, combine_rows
from xmoe.kernels.grouped_gemm import can_reuse_saved, grouped_mm, swiglu_down_bwd, swiglu_up_fwd
from xmoe.kernels.grouped_wgrad import grouped_wgrad, wgrad_engine
from xmoe.kernels.permute import gather_rows
from xmoe.kernels.router_topk import router_topk, router_topk_supports

__all__ = ["combine_rows", "gather_rows", "grouped_swiglu", "moe_experts", "router_topk", "router_topk_supports"]


def _mark_overwritten(*saved: torch.Tensor) -> None:
    """Saved tensors the backward wrote gradients over: a second backward through the same graph (retain_graph)
    then fails with autograd's in-place error instead of reading them."""
    for t in saved:
        torch.autograd.graph.increment_version(t)


def column_chunks(hidden: int, num_rows: int, num_tokens: int, quantum: int = 1) -> list[tuple[int, int]]:
    """Column ranges of H for the (N, H) results that are summed per token at once (y, dx): each chunk's (N, C)
    buffer is about as large as the (T, H) output it is summed into (C ~ H * T / N = H / K), at least 1024
    columns (4 of the widest 256-column tiles: each chunk's launch keeps several waves of programs), and every
    chunk starts at a multiple of ``quantum`` (the FP8 weights' 128-column scale blocks). Under torch.compile one
    chunk."""
    if torch.compiler.is_compiling() or hidden == 0:
        return [(0, hidden)]
    align, floor = (32, 32) if interpreting() else (256, 1024)
    align = math.lcm(align, quantum)
    cols = max(cdiv(cdiv(hidden * num_tokens, max(num_rows, 1)), align) * align, floor)
    return [(c0, min(c0 + cols, hidden)) for c0 in range(0, hidden, cols)]


def _chunked_mm_combine(a1, b1_EKN, a2, b2_EKN, counts_E, row_of_slot_TK, weights_TK, num_tokens):
    """combine(a1 b1 (+ a2 b2), weights) -> (T, width), one column chunk of the (N, width) product at a time."""
    width = b1_EKN.shape[2]
    chunks = column_chunks(width, a1.shape[0], num_tokens)
    if len(chunks) == 1:
        return combine_fwd(grouped_mm(a1, b1_EKN, a2, b2_EKN, counts_E), row_of_slot_TK, weights_TK)
    out_TH = a1.new_empty(num_tokens, width)
    for c0, c1 in chunks:
        part = grouped_mm(a1, b1_EKN[:, :, c0:c1], a2, b2_EKN[:, :, c0:c1] if b2_EKN is not None else None, counts_E)
        combine_into(part, row_of_slot_TK, weights_TK, out_TH[:, c0:c1])
        del part  # freed before the next chunk's buffer is allocated: one chunk alive at a time
    return out_TH


class MoEExpertsFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x_TH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK, tokens_per_expert_E, w1_EHF, w3_EHF, w2_EFH
    ):
        if token_ids_N.shape != slot_ids_N.shape:
            raise ValueError(
                f"token_ids_N {tuple(token_ids_N.shape)} and slot_ids_N {tuple(slot_ids_N.shape)} must have one shape"
            )
        store_h = any(ctx.needs_input_grad)
        h1, h3, a = swiglu_up_fwd(x_TH, token_ids_N, w1_EHF, w3_EHF, tokens_per_expert_E, store_h)
        out_TH = _chunked_mm_combine(
            a, w2_EFH, None, None, tokens_per_expert_E, row_of_slot_TK, weights_TK, x_TH.shape[0]
        )
        del a
        ctx.save_for_backward(
            x_TH,
            weights_TK,
            token_ids_N,
            slot_ids_N,
            row_of_slot_TK,
            tokens_per_expert_E,
            w1_EHF,
            w3_EHF,
            w2_EFH,
            h1,
            h3,
        )
        return out_TH

    @staticmethod
    def backward(ctx, grad_TH):
        x_TH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK, counts_E, w1, w3, w2, h1, h3 = ctx.saved_tensors
        grad_TH = grad_TH.contiguous()
        row_w_N = weights_TK.reshape(-1)[slot_ids_N].float()
        # 1. da = w_n * (grad_out[token] w2^T) -> dh1 (over da), dh3 (over h3 when allowed); a_w = w_n * a (over
        #    h1 when allowed); grad_w_n = <grad_out[token] w2^T, a_n>
        reuse = can_reuse_saved()
        num_rows, (hidden, ffn) = token_ids_N.shape[0], w1.shape[1:]
        # the Hopper path (grouped_wgrad.wgrad_engine): weight gradients by torch._grouped_mm, which needs the rows
        # gathered; one (N, H) gathered buffer alive at a time (grad_out's rows, then x's)
        gather = wgrad_engine(x_TH, num_rows, counts_E.shape[0], hidden, ffn) == "grouped_mm"
        g_rows, g_ids = (grad_TH.index_select(0, token_ids_N), None) if gather else (grad_TH, token_ids_N)
        dh1, dh3, a_w, grad_w_N = swiglu_down_bwd(g_rows, g_ids, w2, h1, h3, row_w_N, counts_E, reuse)
        if reuse:
            _mark_overwritten(h1, h3)
        # 2. dW2_e = (w * a)_e^T grad_out[token]_e
        dw2 = grouped_wgrad(a_w, None, g_rows, None, g_ids, counts_E)[0]
        del g_rows
        if reuse:  # a_w is h1's storage, which ctx holds until the backward returns: free it now, before dx
            a_w.untyped_storage().resize_(0)
        del a_w
        # 3. dx = dh1 w1^T + dh3 w3^T summed per token (k in order, no atomics), one column chunk at a time
        dx_TH = _chunked_mm_combine(
            dh1, w1.transpose(1, 2), dh3, w3.transpose(1, 2), counts_E, row_of_slot_TK, None, x_TH.shape[0]
        )
        # 4. dW1_e, dW3_e = x[token]_e^T (dh1_e, dh3_e): one pass over x's rows read by token id, or gathered
        x_rows, x_ids = (x_TH.index_select(0, token_ids_N), None) if gather else (x_TH, token_ids_N)
        dw1, dw3 = grouped_wgrad(x_rows, x_ids, dh1, dh3, None, counts_E)
        del x_rows, dh1, dh3
        # 5. weight gradient: one slot per kept row, dropped slots stay 0
        grad_w = torch.zeros(weights_TK.numel(), dtype=weights_TK.dtype, device=weights_TK.device)
        grad_w[slot_ids_N] = grad_w_N.to(grad_w.dtype)  # slots are unique: a permutation, no accumulation
        return dx_TH, grad_w.view_as(weights_TK), None, None, None, None, dw1, dw3, dw2


def moe_experts(x_TH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK, tokens_per_expert_E, w1_EHF, w3_EHF, w2_EFH):
    """Routed SwiGLU experts with gather and combine fused in: out[t] = sum_k w[t,k] * expert_{e(t,k)}(x[t])."""
    return MoEExpertsFn.apply(
        x_TH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK, tokens_per_expert_E, w1_EHF, w3_EHF, w2_EFH
    )


class GroupedSwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NH, w1_EHF, w3_EHF, w2_EFH, tokens_per_expert_E):
        h1, h3, a = swiglu_up_fwd(x_NH, None, w1_EHF, w3_EHF, tokens_per_expert_E, any(ctx.needs_input_grad))
        y_NH = grouped_mm(a, w2_EFH, None, None, tokens_per_expert_E)
        ctx.save_for_backward(x_NH, w1_EHF, w3_EHF, w2_EFH, tokens_per_expert_E, h1, h3)
        return y_NH

    @staticmethod
    def backward(ctx, grad_NH):
        x_NH, w1_EHF, w3_EHF, w2_EFH, counts_E, h1, h3 = ctx.saved_tensors
        reuse = can_reuse_saved()
        dh1, dh3, a, _ = swiglu_down_bwd(grad_NH, None, w2_EFH, h1, h3, None, counts_E, reuse)
        if reuse:
            _mark_overwritten(h1, h3)
        dx = grouped_mm(dh1, w1_EHF.transpose(1, 2), dh3, w3_EHF.transpose(1, 2), counts_E)
        dw2 = grouped_wgrad(a, None, grad_NH, None, None, counts_E)[0]
        del a
        dw1, dw3 = grouped_wgrad(x_NH, None, dh1, dh3, None, counts_E)
        return dx, dw1, dw3, dw2, None


def grouped_swiglu(x_NH, w1_EHF, w3_EHF, w2_EFH, tokens_per_expert_E):
    return GroupedSwiGLUFn.apply(x_NH, w1_EHF, w3_EHF, w2_EFH, tokens_per_expert_E)
