"""Rows in FP8 with 1 x 128 scales, as they travel when dispatched in FP8: the quantiser and its inverse in plain
torch (no Triton: CPU, gloo and the emulation of FP8 dispatch everywhere), and ``Fp8Rows``, the form in which the
FP8 experts take rows that arrive quantised (fp8_experts.grouped_swiglu_fp8).

# N rows, H hidden; R x C a matrix's rows and columns; G = 128 (GROUP)

  quantize_rows(x_RC, fmt) -> (q_RC, scale_RG)   q in the format's FP8 dtype (1 byte a value: an all-to-all moves
                                                 q.view(torch.uint8)), scale fp32 (R, cdiv(C, G)), one per row and
                                                 G columns; x ~ q * scale[:, c // G]
  dequantize_rows(q_RC, scale_RG, dtype) -> x    q * scale in fp32, rounded once to dtype
The format's rules are fp8_quant.py's (DeepSeek-V3's scaling): a group's scale is amax / max and its values
x * (max / amax) rounded to nearest-even on the format's grid, both quotients correctly rounded fp32, amax floored
at 1e-30 (NaNs left out of it), non-finite values kept non-finite; e4m3fn (max 448) and e4m3fnuz (max 240, no
negative zero). The bytes and scales are bitwise those of fp8_quant.quantize_rows as Triton's interpreter computes
it (values that round to zero are stored as +0; an FP8 GPU's conversion keeps their sign, an equal value). GPU
tensors, where Triton imports, are quantised by that kernel.
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import NamedTuple

import torch

from xmoe.kernels._common import cdiv
from xmoe.kernels.fp8_formats import _format

GROUP = 128  # columns per scale (fp8_quant.GROUP)


class Fp8Rows(NamedTuple):
    """Expert-major rows that arrive quantised (FP8 dispatch), taken by the FP8 experts in place of x_NH: they skip
    their own quantisation of the rows.

    q: (N, H) values in the FP8 format's dtype (quantize_rows' or fp8_quant.quantize_rows'; under
    TRITON_INTERPRET=1 also float32 holding them, as fp8_quant stores them there); scale: (N, cdiv(H, 128)) fp32;
    stand_in: (N, H) in the activations' dtype, standing for the dequantised rows: the experts' output takes its
    dtype, and their input gradient is returned for it (straight through the quantisation). Its values are never
    read: a zero-stride tensor serves (``stand_in_rows``), made requiring grad by whatever sent the rows."""

    q: torch.Tensor
    scale: torch.Tensor
    stand_in: torch.Tensor


def stand_in_rows(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of q's shape in ``dtype`` holding one element (zero strides): Fp8Rows.stand_in without memory."""
    return torch.zeros((), dtype=dtype, device=q.device).expand(q.shape)


@functools.cache
def _triton_quantize_rows():
    try:
        return importlib.import_module("xmoe.kernels.fp8_quant").quantize_rows
    except ImportError:  # no Triton: plain torch on every device
        return None


def quantize_rows(x_RC: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): x_RC in 1 x 128 groups of format ``fmt`` (module docstring); q in the format's dtype."""
    if x_RC.dim() != 2 or not x_RC.is_floating_point():
        raise ValueError(f"x_RC must be a 2-D float tensor, got shape {tuple(x_RC.shape)} and dtype {x_RC.dtype}")
    form = _format(fmt)
    if x_RC.is_cuda and _triton_quantize_rows() is not None:
        return _triton_quantize_rows()(x_RC, fmt)
    rows, cols = x_RC.shape
    groups = cdiv(cols, GROUP)
    v = x_RC.float()
    if cols % GROUP:  # a partial last group: zeros do not change its amax
        v = torch.nn.functional.pad(v, (0, groups * GROUP - cols))
    v = v.contiguous().view(rows, groups, GROUP)
    # NaN is no group's largest magnitude, as in the kernel's max (infinities stay what they are)
    mag = v.abs().nan_to_num_(nan=0.0, posinf=math.inf)
    amax = (mag.amax(dim=2) if v.numel() else v.new_zeros(rows, groups)).clamp(min=1e-30)
    del mag
    fmax = torch.full_like(amax, form.max)
    scale = torch.div(amax, fmax)  # tensor by tensor: correctly rounded quotients (a scalar divisor may not be)
    q = (v * torch.div(fmax, amax)[:, :, None]).to(form.dtype).view(rows, groups * GROUP)
    if form.dtype == torch.float8_e4m3fn:  # +0 for everything that rounds to zero, as the interpreter stores
        bits = q.view(torch.uint8)  # (e4m3fnuz has no negative zero: 0x80 is its NaN)
        bits.masked_fill_(bits == 0x80, 0)
    return (q if cols % GROUP == 0 else q[:, :cols].contiguous()), scale


def dequantize_rows(q_RC: torch.Tensor, scale_RG: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * scale[:, c // 128] computed in fp32, written once rounded to ``dtype`` (R, C): the rows quantize_rows
    was given, up to the quantisation."""
    if q_RC.dim() != 2 or scale_RG.shape != (q_RC.shape[0], cdiv(q_RC.shape[1], GROUP)):
        raise ValueError(
            f"FP8 rows {tuple(q_RC.shape)} need scales of shape ({q_RC.shape[0]}, {cdiv(q_RC.shape[1], GROUP)}), "
            f"got {tuple(scale_RG.shape)}"
        )
    rows, cols = q_RC.shape
    out = torch.empty(rows, cols, dtype=dtype, device=q_RC.device)
    if out.numel() == 0:
        return out
    vals = q_RC.to(dtype)  # exact: every e4m3 value is a bf16, fp16 and fp32 value
    whole = cols // GROUP
    full = whole * GROUP
    if whole:  # the products in fp32 (the scale's dtype), each rounded once into out
        shape = (rows, whole, GROUP)
        torch.mul(vals[:, :full].view(shape), scale_RG[:, :whole, None], out=out[:, :full].view(shape))
    if cols % GROUP:
        torch.mul(vals[:, full:], scale_RG[:, whole:], out=out[:, full:])
    return out
