"""FP8 routed experts: triton_ops.py's fused path and its grouped SwiGLU, with the GEMMs of fp8_gemm.py.

# T tokens, H hidden, F expert ffn, E experts, K top-k, N kept rows (expert-major); G = 128 (fp8_quant.GROUP)

  moe_experts_fp8(x_TH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK, tokens_per_expert_E,
                  w1_EHF, w3_EHF, w2_EFH, qw, fmt, *, wgrad, autotune) -> out_TH
                                                                     == triton_ops.moe_experts, FP8 GEMMs
  grouped_swiglu_fp8(x_NH, w1_EHF, w3_EHF, w2_EFH, tokens_per_expert_E, qw, fmt, *, wgrad, autotune) -> y_NH
                                                                     == triton_ops.grouped_swiglu, FP8 GEMMs
wgrad, autotune: the kernels section's kernels.wgrad ("fp8": the weight gradients in FP8 too) and kernels.autotune,
as triton_ops' ops take them.
qw: fp8_quant.Fp8ExpertWeights, the FP8 copies of w1, w3, w2 (quantize_expert_weights). w1, w3, w2 are what the
weight gradients are returned for; their values are not read (any float dtype, or a zero-stride stand-in of their
shape: moe/experts.py). fmt: the FP8 format's name (fp8_formats.fp8_format(device).name).

Both are experts_fn.ExpertsFn with the FP8 GEMM set (fp8_gemm_set.Fp8Gemms, which says where each operand is
quantised): x and grad_out quantised once per token (fused) or per row (grouped), a and dh1 | dh3 in the epilogues
of the passes that make them; the weight gradients in the activations' dtype, or in FP8 with kernels.wgrad = "fp8".
Saved between forward and backward: h1, h3 in the activations' dtype, as in bf16 (the FP8 weights are held by
their maker, once per step). As in bf16: w a (in h1's storage) is freed after dW2, dx is summed per token one
column chunk at a time; the FP8 dh1 | dh3 are dropped after dx, before dW1 and dW3.

Rows that arrive quantised (FP8 dispatch): grouped_swiglu_fp8 takes an ``fp8_rows.Fp8Rows(q, scale, stand_in)``
in place of x_NH (q, scale as quantize_rows makes them, in this format). The experts then skip their own
quantisation of the rows (the forward is the one they give the dequantised rows, which quantise back to the same
bytes), keep q and scale for the backward instead of x, and there compute dW1, dW3 from the rows dequantised into
the activations' dtype (with kernels.wgrad = "fp8": those quantised down their columns); the input gradient is
returned for ``stand_in``, as the gradient of the dequantised rows (straight through the quantisation).
"""

from __future__ import annotations

import torch

from xmoe.kernels._common import FLOAT_DTYPES, cdiv, interpreting
from xmoe.kernels.experts_fn import experts
from xmoe.kernels.fp8_quant import FORMATS, GROUP, Fp8ExpertWeights
from xmoe.kernels.fp8_rows import Fp8Rows

__all__ = ["Fp8Rows", "grouped_swiglu_fp8", "moe_experts_fp8"]


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
    *,
    wgrad: str = "auto",
    autotune: bool = False,
):
    """out[t] = sum_k w[t,k] * expert_{e(t,k)}(x[t]) with FP8 expert GEMMs; gradients for x, the weights and the
    routing weights as moe_experts gives them."""
    return experts(
        fmt, wgrad, autotune, x_TH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK, tokens_per_expert_E, w1_EHF,
        w3_EHF, w2_EFH, qw, None,
    )  # fmt: skip


def grouped_swiglu_fp8(
    x_NH: torch.Tensor | Fp8Rows,
    w1_EHF,
    w3_EHF,
    w2_EFH,
    tokens_per_expert_E,
    qw: Fp8ExpertWeights,
    fmt: str,
    *,
    wgrad: str = "auto",
    autotune: bool = False,
):
    """Per expert e: (silu(x w1_e) * (x w3_e)) w2_e over its rows, with FP8 GEMMs; x_NH rows, or Fp8Rows that
    arrive quantised (module docstring)."""
    if isinstance(x_NH, Fp8Rows):
        q, scale = _checked_rows(x_NH, fmt)
        x_q: tuple[torch.Tensor, torch.Tensor] | None = (q, scale)
        x_NH = x_NH.stand_in
    else:
        x_q = None
    return experts(
        fmt, wgrad, autotune, x_NH, None, None, None, None, tokens_per_expert_E, w1_EHF, w3_EHF, w2_EFH, qw, x_q
    )


def _checked_rows(rows: Fp8Rows, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) of rows in the layout the FP8 kernels read, after checking them against ``fmt``: ValueError
    naming what is off. Under the interpreter FP8 values are held in float32: q in the FP8 dtype is converted
    (exactly)."""
    q, scale, stand_in = rows
    form = FORMATS[fmt]
    if q.dim() != 2 or q.dtype not in (form.dtype, form.storage()):
        raise ValueError(
            f"Fp8Rows.q is {tuple(q.shape)} {q.dtype}; FP8 experts in format {fmt} take (N, H) {form.dtype} values "
            "(fp8_rows.quantize_rows makes them)"
        )
    groups = cdiv(q.shape[1], GROUP)
    if scale.shape != (q.shape[0], groups) or scale.dtype != torch.float32:
        raise ValueError(
            f"Fp8Rows.scale is {tuple(scale.shape)} {scale.dtype}; rows {tuple(q.shape)} need ({q.shape[0]}, "
            f"{groups}) float32 scales, one per row and 128 columns"
        )
    if stand_in.shape != q.shape or stand_in.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"Fp8Rows.stand_in is {tuple(stand_in.shape)} {stand_in.dtype}; it stands for the dequantised rows: "
            f"{tuple(q.shape)} in the activations' dtype (fp8_rows.stand_in_rows makes one without memory)"
        )
    if q.device != scale.device or q.device != stand_in.device:
        raise ValueError(f"Fp8Rows' tensors must be on one device, got {q.device}, {scale.device}, {stand_in.device}")
    if q.dtype != form.storage() and interpreting():
        q = q.float()  # every e4m3 value is a float32 value
    return q, scale.contiguous()
