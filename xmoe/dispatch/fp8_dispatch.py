"""FP8 dispatch (``moe.dispatch_dtype = "fp8"``): routed rows cross the expert-parallel all-to-all as e4m3 values
with one fp32 scale per 1 x 128 group, DeepSeek-V3's choice, quantised once before the network.

# N rows sent, M received, H hidden, G = ceil(H / 128) scale groups a row

A row travels as H + 4G bytes (the values, then the scales' bytes), 2H + 0 in bf16: 0.516x at H = 2048. On arrival the
rows are dequantised for bf16 experts, or handed to FP8 experts as they are (``Fp8Rows``: values, scales and a
zero-stride stand-in through which the input gradient flows), so they are quantised once, before the network, not
again by the experts. The combine and every gradient travel in the activations' dtype (quantisation's gradient is
taken as the identity). The format is the one the device's FP8 matrix instructions take when the experts run in
FP8 (e4m3fnuz on AMD gfx942), else e4m3fn; on CPUs the same bytes are made by plain torch (kernels/fp8_rows.py), so
every test and the emulated cluster run it.
"""

from __future__ import annotations

from typing import Any

import torch

from xmoe.dispatch.comm import Encoding, bytes_as
from xmoe.kernels.fp8_rows import Fp8Rows, dequantize_rows, quantize_rows, stand_in_rows

GROUP = 128


def wire_width(hidden: int) -> int:
    """Bytes one FP8-dispatched row takes: H values and ceil(H / 128) fp32 scales."""
    return hidden + 4 * -(-hidden // GROUP)


def _format(device: torch.device, to_experts: bool) -> str:
    if to_experts:
        from xmoe.kernels.fp8_formats import fp8_format

        return fp8_format(device).name
    return "e4m3fn"


def fp8_encoding(to_experts: bool) -> Encoding:
    """The Encoding of FP8 dispatch; ``to_experts``: the received rows go to FP8 experts as ``Fp8Rows`` (the
    decode's extra output is then (q, scale), and its rows a zero-stride stand-in), else they are dequantised."""
    state: dict[str, Any] = {}

    def encode(x_NH: torch.Tensor) -> torch.Tensor:
        fmt = state.setdefault("fmt", _format(x_NH.device, to_experts))
        q, scale = quantize_rows(x_NH.detach(), fmt)
        return torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=1)

    def decode(payload: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, Any]:
        hidden = like.shape[1]
        fp8_dtype = _fp8_dtype(state["fmt"])
        q = bytes_as(payload[:, :hidden], fp8_dtype)
        scale = bytes_as(payload[:, hidden:], torch.float32)
        if to_experts:
            return stand_in_rows(q, like.dtype), (q, scale)
        return dequantize_rows(q, scale, like.dtype), None

    return Encoding(encode, decode)


def _fp8_dtype(fmt: str) -> torch.dtype:
    from xmoe.kernels.fp8_formats import FORMATS

    return FORMATS[fmt].dtype


class PermuteStandIn(torch.autograd.Function):
    """The zero-stride stand-in of rows permuted by ``index_M``: a new stand-in forward (nothing to move), the
    gradient gathered by the inverse permutation backward."""

    @staticmethod
    def forward(ctx, stand_in_MH, index_M, inverse_M):
        ctx.save_for_backward(inverse_M)
        return torch.zeros((), dtype=stand_in_MH.dtype, device=stand_in_MH.device).expand(stand_in_MH.shape)

    @staticmethod
    def backward(ctx, grad_MH):
        (inverse_M,) = ctx.saved_tensors
        return grad_MH[inverse_M], None, None


def arrived_rows(stand_in_MH: torch.Tensor, extra: tuple[torch.Tensor, torch.Tensor], index_M, inverse_M) -> Fp8Rows:
    """The FP8 rows as the experts take them, regrouped by ``index_M`` (None: as received)."""
    q, scale = extra
    if index_M is not None:
        q, scale = q[index_M], scale[index_M]
        stand_in_MH = PermuteStandIn.apply(stand_in_MH, index_M, inverse_M)
    return Fp8Rows(q, scale, stand_in_MH)
