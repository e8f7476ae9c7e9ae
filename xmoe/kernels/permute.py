"""gather_rows in Triton: x_NH[n] = x_TH[token_ids_N[n]] (the padding-free dispatch into expert-major rows).

# T tokens, H hidden, K top-k, N kept rows (expert-major)

The backward is a per-token sum of the token's K row gradients, k in order: exactly combine's forward without
weights (combine.py), so no floating-point atomics are involved. When the experts run through the fused
``moe_experts`` (triton_ops.py) this op is skipped: the first GEMM reads x_TH rows by token id directly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xmoe.kernels._common import cdiv, check_device, check_float, check_index, interpreting, kernel_op, next_pow2
from xmoe.kernels.combine import combine_fwd


@triton.jit
def _gather_rows_fwd_kernel(
    x_ptr,  # (T, H) fp, row stride stride_x, unit column stride
    token_ids_ptr,  # (N,) int32/int64
    out_ptr,  # (N, H) dtype of x, contiguous
    N,
    H,
    stride_x,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_n = offs_n < N
    mask = mask_n[:, None] & (offs_h < H)[None, :]
    token = tl.load(token_ids_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)
    vals = tl.load(x_ptr + token[:, None] * stride_x + offs_h[None, :], mask=mask)
    tl.store(out_ptr + offs_n.to(tl.int64)[:, None] * H + offs_h[None, :], vals, mask=mask)


@kernel_op("gather_rows_fwd")
def gather_rows_fwd(x_TH: torch.Tensor, token_ids_N: torch.Tensor) -> torch.Tensor:
    check_float("x_TH", x_TH, 2)
    check_index("token_ids_N", token_ids_N, 1)
    check_device(x_TH, token_ids_N)
    if x_TH.stride(-1) != 1:
        x_TH = x_TH.contiguous()
    num_rows, hidden = token_ids_N.shape[0], x_TH.shape[1]
    out_NH = torch.empty(num_rows, hidden, dtype=x_TH.dtype, device=x_TH.device)
    if num_rows == 0 or hidden == 0:
        return out_NH
    block_n = 4
    block_h = 32 if interpreting() else min(1024, next_pow2(hidden))
    grid = (cdiv(num_rows, block_n), cdiv(hidden, block_h))
    _gather_rows_fwd_kernel[grid](
        x_TH,
        token_ids_N.contiguous(),
        out_NH,
        num_rows,
        hidden,
        x_TH.stride(0),
        BLOCK_N=block_n,
        BLOCK_H=block_h,
        num_warps=4,
    )
    return out_NH


@gather_rows_fwd.register_fake
def _(x_TH, token_ids_N):
    return x_TH.new_empty(token_ids_N.shape[0], x_TH.shape[1])


class GatherRowsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, token_ids_N, row_of_slot_TK):
        ctx.save_for_backward(row_of_slot_TK)
        return gather_rows_fwd(x_TH, token_ids_N)

    @staticmethod
    def backward(ctx, grad_NH):
        (row_of_slot_TK,) = ctx.saved_tensors
        return combine_fwd(grad_NH, row_of_slot_TK, None), None, None


def gather_rows(x_TH, token_ids_N, row_of_slot_TK):
    return GatherRowsFn.apply(x_TH, token_ids_N, row_of_slot_TK)
