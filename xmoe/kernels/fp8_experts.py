"""FP8 routed experts: triton_ops.py's fused path and its grouped SwiGLU, with the GEMMs of fp8_gemm.py.

# T tokens, H hidden, F expert ffn, E experts, K top-k, N kept rows (expert-major); G = 128 (fp8_quant.GROUP)

  moe_experts_fp8(x_TH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK, tokens_per_expert_E,
                  w1_EHF, w3_EHF, w2_EFH, qw, fmt) -> out_TH        == triton_ops.moe_experts, FP8 GEMMs
  grouped_swiglu_fp8(x_NH, w1_EHF, w3_EHF, w2_EFH, tokens_per_expert_E, qw, fmt) -> y_NH
                                                                     == triton_ops.grouped_swiglu, FP8 GEMMs
qw: fp8_quant.Fp8ExpertWeights, the FP8 copies of w1, w3, w2 (quantize_expert_weights). w1, w3, w2 are what the
weight gradients are returned for; their values are not read (any float dtype, or a zero-stride stand-in of their
shape: moe/experts.py). fmt: the FP8 format's name (fp8_formats.fp8_format(device).name).

Both are experts_fn.ExpertsFn with the FP8 GEMM set (fp8_gemm_set.Fp8Gemms, which says where each operand is
quantised): x and grad_out quantised once per token (fused) or per row (grouped), a and dh1 | dh3 in the epilogues
of the passes that make them; the weight gradients in the activations' dtype, or in FP8 with kernels.wgrad = "fp8".
Saved between forward and backward: h1, h3 in the activations' dtype, as in bf16 (the FP8 weights are held by
their maker, once per step). As in bf16: w a (in h1's storage) is freed after dW2, dx is summed per token one
column chunk at a time; the FP8 dh1 | dh3 are dropped after dx, before dW1 and dW3.
"""

from __future__ import annotations

from xmoe.kernels.experts_fn import experts
from xmoe.kernels.fp8_quant import Fp8ExpertWeights

__all__ = ["grouped_swiglu_fp8", "moe_experts_fp8"]


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
    return experts(
        fmt, x_TH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK, tokens_per_expert_E, w1_EHF, w3_EHF, w2_EFH,
        qw,
    )  # fmt: skip


def grouped_swiglu_fp8(x_NH, w1_EHF, w3_EHF, w2_EFH, tokens_per_expert_E, qw: Fp8ExpertWeights, fmt: str):
    """Per expert e: (silu(x w1_e) * (x w3_e)) w2_e over its rows, with FP8 GEMMs."""
    return experts(fmt, x_NH, None, None, None, None, tokens_per_expert_E, w1_EHF, w3_EHF, w2_EFH, qw)
