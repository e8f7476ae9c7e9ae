"""combine_rows in Triton: out[t] = sum_k w[t,k] * y[row[t,k]], summed k = 0..K-1 in order (deterministic).

# T tokens, H hidden, K top-k, N kept rows (expert-major)

Forward (``combine_fwd``) is a per-token loop over the K slots that reads each kept row once and accumulates in
fp32; the same kernel without weights is gather_rows' backward (permute.py) and the fused experts' dx sum.
``combine_into`` writes it into a column slice of a wider output: the fused experts sum y and dx one column
chunk of H at a time (# C columns of the chunk).
Backward (``combine_bwd``) walks the kept rows: grad_y[n] = w[slot[n]] * grad_out[token[n]] and
grad_w[slot[n]] = <grad_out[token[n]], y[n]>; every slot is written by at most one row, so there are no
atomics, and dropped slots keep the zero they were allocated with.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xmoe.kernels._common import cdiv, check_device, check_float, check_index, interpreting, kernel_op, next_pow2


@triton.jit
def _combine_fwd_kernel(
    rows_ptr,  # (N, H) fp32/bf16/fp16, row stride stride_rows, unit column stride
    row_of_slot_ptr,  # (T, K) int32/int64 contiguous: row of slot (t, k), -1 when dropped
    weights_ptr,  # (T, K) fp contiguous, read only when HAS_WEIGHTS
    out_ptr,  # (T, H) dtype of rows, row stride stride_out, unit column stride
    T,
    H,
    K,
    stride_rows,
    stride_out,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_t = offs_t < T
    mask_h = offs_h < H
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for k in range(K):  # fixed order: the sum is bitwise reproducible
        row = tl.load(row_of_slot_ptr + offs_t.to(tl.int64) * K + k, mask=mask_t, other=-1)
        kept = row >= 0
        vals = tl.load(
            rows_ptr + row.to(tl.int64)[:, None] * stride_rows + offs_h[None, :],
            mask=kept[:, None] & mask_h[None, :],
            other=0.0,
        ).to(tl.float32)
        if HAS_WEIGHTS:
            w = tl.load(weights_ptr + offs_t.to(tl.int64) * K + k, mask=mask_t & kept, other=0.0).to(tl.float32)
            vals = vals * w[:, None]
        acc += vals
    out_ptrs = out_ptr + offs_t.to(tl.int64)[:, None] * stride_out + offs_h[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_t[:, None] & mask_h[None, :])


@triton.jit
def _combine_bwd_kernel(
    grad_out_ptr,  # (T, H) fp contiguous
    y_ptr,  # (N, H) fp contiguous
    weights_ptr,  # (T*K,) fp contiguous (flattened weights_TK)
    token_ids_ptr,  # (N,) int32/int64
    slot_ids_ptr,  # (N,) int32/int64: t*K + k of each row
    grad_y_ptr,  # (N, H) dtype of y, contiguous
    grad_w_ptr,  # (T*K,) dtype of weights, zero-initialised (dropped slots stay 0)
    N,
    H,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    token = tl.load(token_ids_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)
    slot = tl.load(slot_ids_ptr + offs_n, mask=mask_n, other=0).to(tl.int64)
    w = tl.load(weights_ptr + slot, mask=mask_n, other=0.0).to(tl.float32)
    dot = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask = mask_n[:, None] & (offs_h < H)[None, :]
        g = tl.load(grad_out_ptr + token[:, None] * H + offs_h[None, :], mask=mask, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + offs_n.to(tl.int64)[:, None] * H + offs_h[None, :], mask=mask, other=0.0)
        dot += tl.sum(g * y.to(tl.float32), axis=1)
        tl.store(
            grad_y_ptr + offs_n.to(tl.int64)[:, None] * H + offs_h[None, :],
            (g * w[:, None]).to(grad_y_ptr.dtype.element_ty),
            mask=mask,
        )
    tl.store(grad_w_ptr + slot, dot.to(grad_w_ptr.dtype.element_ty), mask=mask_n)


def _block_h(hidden: int) -> int:
    # 2 KiB of bf16 per row chunk keeps 16-byte vector loads with few masked lanes; the interpreter wants small
    return 32 if interpreting() else min(1024, next_pow2(max(hidden, 16)))


@kernel_op("combine_fwd")
def combine_fwd(rows_NH: torch.Tensor, row_of_slot_TK: torch.Tensor, weights_TK: torch.Tensor | None) -> torch.Tensor:
    """out[t] = sum_k (weights[t,k] or 1) * rows[row_of_slot[t,k]], k in order, fp32 accumulation."""
    check_float("rows_NH", rows_NH, 2)
    out_TH = rows_NH.new_empty(row_of_slot_TK.shape[0], rows_NH.shape[1])
    _combine(rows_NH, row_of_slot_TK, weights_TK, out_TH)
    return out_TH


@combine_fwd.register_fake
def _(rows_NH, row_of_slot_TK, weights_TK):
    return rows_NH.new_empty(row_of_slot_TK.shape[0], rows_NH.shape[1])


@kernel_op("combine_into", mutates_args=("out_TC",))
def combine_into(
    rows_NC: torch.Tensor, row_of_slot_TK: torch.Tensor, weights_TK: torch.Tensor | None, out_TC: torch.Tensor
) -> None:
    """combine_fwd written into out_TC, which may be a column slice of a wider (T, H) tensor: an (N, H) result
    computed a column chunk at a time never exists whole."""
    if out_TC.dim() != 2 or out_TC.shape != (row_of_slot_TK.shape[0], rows_NC.shape[-1]) or out_TC.stride(-1) != 1:
        raise ValueError(
            f"out_TC {tuple(out_TC.shape)} must be ({row_of_slot_TK.shape[0]}, {rows_NC.shape[-1]}) "
            "with unit column stride"
        )
    if out_TC.dtype != rows_NC.dtype:
        raise ValueError(f"out_TC ({out_TC.dtype}) and rows_NC ({rows_NC.dtype}) must share one dtype")
    _combine(rows_NC, row_of_slot_TK, weights_TK, out_TC)


@combine_into.register_fake
def _(rows_NC, row_of_slot_TK, weights_TK, out_TC):
    return None


def _combine(
    rows_NH: torch.Tensor, row_of_slot_TK: torch.Tensor, weights_TK: torch.Tensor | None, out_TH: torch.Tensor
) -> None:
    check_float("rows_NH", rows_NH, 2)
    check_index("row_of_slot_TK", row_of_slot_TK, 2)
    check_device(rows_NH, row_of_slot_TK, out_TH)
    if rows_NH.stride(-1) != 1:
        rows_NH = rows_NH.contiguous()
    num_tokens, top_k = row_of_slot_TK.shape
    hidden = rows_NH.shape[1]
    if num_tokens == 0 or hidden == 0:
        return
    if weights_TK is not None:
        if weights_TK.shape != row_of_slot_TK.shape:
            raise ValueError(
                f"weights_TK shape {tuple(weights_TK.shape)} must match row_of_slot_TK's {tuple(row_of_slot_TK.shape)}"
            )
        weights_TK = weights_TK.contiguous()
    block_t, block_h = 4, _block_h(hidden)
    grid = (cdiv(num_tokens, block_t), cdiv(hidden, block_h))
    _combine_fwd_kernel[grid](
        rows_NH,
        row_of_slot_TK.contiguous(),
        weights_TK if weights_TK is not None else rows_NH,
        out_TH,
        num_tokens,
        hidden,
        top_k,
        rows_NH.stride(0),
        out_TH.stride(0),
        HAS_WEIGHTS=weights_TK is not None,
        BLOCK_T=block_t,
        BLOCK_H=block_h,
        num_warps=4,
    )


@kernel_op("combine_bwd")
def combine_bwd(
    grad_TH: torch.Tensor,
    y_NH: torch.Tensor,
    weights_TK: torch.Tensor,
    token_ids_N: torch.Tensor,
    slot_ids_N: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_y_NH, grad_weights_TK) of combine_fwd; dropped slots get a zero weight gradient."""
    grad_TH, y_NH = grad_TH.contiguous(), y_NH.contiguous()
    num_rows, hidden = y_NH.shape
    grad_y = torch.empty_like(y_NH)
    grad_w = torch.zeros(weights_TK.numel(), dtype=weights_TK.dtype, device=weights_TK.device)
    if num_rows > 0 and hidden > 0:
        block_n = 4 if interpreting() else 8
        block_h = _block_h(hidden)
        _combine_bwd_kernel[(cdiv(num_rows, block_n),)](
            grad_TH,
            y_NH,
            weights_TK.contiguous().view(-1),
            token_ids_N,
            slot_ids_N,
            grad_y,
            grad_w,
            num_rows,
            hidden,
            BLOCK_N=block_n,
            BLOCK_H=block_h,
            num_warps=4,
        )
    return grad_y, grad_w.view_as(weights_TK)


@combine_bwd.register_fake
def _(grad_TH, y_NH, weights_TK, token_ids_N, slot_ids_N):
    return torch.empty_like(y_NH), torch.empty_like(weights_TK)


class CombineRowsFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_NH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK):
        ctx.save_for_backward(y_NH, weights_TK, token_ids_N, slot_ids_N)
        return combine_fwd(y_NH, row_of_slot_TK, weights_TK)

    @staticmethod
    def backward(ctx, grad_TH):
        y_NH, weights_TK, token_ids_N, slot_ids_N = ctx.saved_tensors
        grad_y, grad_w = combine_bwd(grad_TH, y_NH, weights_TK, token_ids_N, slot_ids_N)
        return grad_y, grad_w, None, None, None


def combine_rows(y_NH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK):
    return CombineRowsFn.apply(y_NH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK)
