"""The Triton backend of xmoe's MoE ops (same signatures and semantics as reference.py), plus the fused path.

# T tokens, H hidden, F expert ffn, E experts, K top-k, N kept rows (expert-major)

  gather_rows(x_TH, token_ids_N, row_of_slot_TK) -> x_NH                              permute.py
  combine_rows(y_NH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK) -> out_TH   combine.py
  grouped_swiglu(x_NH, w1_EHF, w3_EHF, w2_EFH, tokens_per_expert_E) -> y_NH           grouped_gemm.py
  moe_experts(x_TH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK, tokens_per_expert_E,
              w1_EHF, w3_EHF, w2_EFH) -> out_TH
      == combine_rows(grouped_swiglu(gather_rows(x_TH, ...), ...), weights_TK, ...), fused:
      forward  the up GEMM reads x_TH rows by token id (no (N, H) dispatch buffer), the down GEMM writes y_NH,
               the deterministic per-token sum applies the combine weights;
      backward the down-dgrad GEMM reads grad_out rows by token id; the SwiGLU-backward pass applies the combine
               weight and yields its gradient as <grad_out w2^T, a> (y is never saved); the wgrad of w1/w3 reads
               x_TH rows by token id; dx rows are summed per token in k order. Saved: h1, h3 (2*N*F elements).

Every op is a torch.autograd.Function over torch.library custom ops, so torch.compile treats the kernels as
opaque calls and traces the code around them.
"""

from __future__ import annotations

import torch

from xmoe.kernels.combine import combine_fwd, combine_rows
from xmoe.kernels.grouped_gemm import grouped_mm, grouped_swiglu, grouped_wgrad, swiglu_down_bwd, swiglu_up_fwd
from xmoe.kernels.permute import gather_rows
from xmoe.kernels.router_topk import router_topk, router_topk_supports

__all__ = ["gather_rows", "combine_rows", "grouped_swiglu", "moe_experts", "router_topk", "router_topk_supports"]


class MoEExpertsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK, tokens_per_expert_E,
                w1_EHF, w3_EHF, w2_EFH):
        if token_ids_N.shape != slot_ids_N.shape:
            raise ValueError(f"token_ids_N {tuple(token_ids_N.shape)} and slot_ids_N {tuple(slot_ids_N.shape)} "
                             "must have one shape")
        store_h = any(ctx.needs_input_grad)
        h1, h3, a = swiglu_up_fwd(x_TH, token_ids_N, w1_EHF, w3_EHF, tokens_per_expert_E, store_h)
        y_NH = grouped_mm(a, w2_EFH, None, None, tokens_per_expert_E)
        del a
        ctx.save_for_backward(x_TH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK, tokens_per_expert_E,
                              w1_EHF, w3_EHF, w2_EFH, h1, h3)
        return combine_fwd(y_NH, row_of_slot_TK, weights_TK)

    @staticmethod
    def backward(ctx, grad_TH):
        x_TH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK, counts_E, w1, w3, w2, h1, h3 = ctx.saved_tensors
        grad_TH = grad_TH.contiguous()
        row_w_N = weights_TK.reshape(-1)[slot_ids_N].float()
        # 1. da = w_n * (grad_out[token] w2^T) -> dh1, dh3; a_w = w_n * a; grad_w_n = <grad_out[token] w2^T, a_n>
        dh1, dh3, a_w, grad_w_N = swiglu_down_bwd(grad_TH, token_ids_N, w2, h1, h3, row_w_N, counts_E)
        # 2. dx first, so that its (N, H) rows are summed per token (k in order, no atomics) and freed before the
        #    (E, H, F) weight gradients exist: the peak holds one of the two, not both
        dx_NH = grouped_mm(dh1, w1.transpose(1, 2), dh3, w3.transpose(1, 2), counts_E)
        dx_TH = combine_fwd(dx_NH, row_of_slot_TK, None)
        del dx_NH
        # 3. dW2_e = (w * a)_e^T grad_out[token]_e
        dw2 = grouped_wgrad(a_w, None, grad_TH, None, token_ids_N, counts_E)[0]
        del a_w
        # 4. dW1_e, dW3_e = x[token]_e^T (dh1_e, dh3_e) in one pass over x
        dw1, dw3 = grouped_wgrad(x_TH, token_ids_N, dh1, dh3, None, counts_E)
        del dh1, dh3
        # 5. weight gradient: one slot per kept row, dropped slots stay 0
        grad_w = torch.zeros(weights_TK.numel(), dtype=weights_TK.dtype, device=weights_TK.device)
        grad_w[slot_ids_N] = grad_w_N.to(grad_w.dtype)  # slots are unique: a permutation, no accumulation
        return dx_TH, grad_w.view_as(weights_TK), None, None, None, None, dw1, dw3, dw2


def moe_experts(x_TH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK, tokens_per_expert_E, w1_EHF, w3_EHF,
                w2_EFH):
    """Routed SwiGLU experts with gather and combine fused in: out[t] = sum_k w[t,k] * expert_{e(t,k)}(x[t])."""
    return MoEExpertsFn.apply(x_TH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK, tokens_per_expert_E,
                              w1_EHF, w3_EHF, w2_EFH)
