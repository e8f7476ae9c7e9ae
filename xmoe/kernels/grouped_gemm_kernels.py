"""The Triton kernels of the SwiGLU experts' grouped GEMMs over uneven, contiguous row groups, forward and backward
(the ops that launch them are in grouped_gemm.py).

# T tokens, H hidden, F expert ffn, E experts, N rows (expert-major: expert e owns tokens_per_expert_E[e] rows)

Per expert e:  h1 = x w1_e, h3 = x w3_e, a = silu(h1) * h3, y = a w2_e.   Kernels:
  _tile_map_kernel         row tile -> (expert, first row, end row), on device from tokens_per_expert_E
  _swiglu_up_fwd_kernel    h1, h3 (both weights in one pass over x) and a = silu(h1)*h3 in the epilogue
  _grouped_mm_kernel       c = a1 b1_e (+ a2 b2_e): y = a w2_e, da = g w2_e^T, dx = dh1 w1_e^T + dh3 w3_e^T
  _swiglu_bwd_kernel       elementwise: a recomputed from (h1, h3); dh1, dh3, a (times the combine weight when
                           fused) and the combine-weight gradient <da, a> per row, written over da, h3 and h1
The weight gradients dW_e = A_e^T B_e are in grouped_wgrad.py; tile configs per shape class in tiles.py.
Saved for backward: x (or x_TH when fused), h1 and h3 (2*N*F elements); a is recomputed in the backward rather
than stored (an elementwise pass that reads h1, h3 anyway), y is not kept at all.

Tile scheduling with no host sync: a row-grouped launch has cdiv(N, BLOCK_M) + E row tiles (an upper bound of
sum_e cdiv(n_e, BLOCK_M)); one small kernel writes each tile's (expert, first row, end row) from the per-expert
counts, the GEMM programs read their three ints and those past the last real tile return at once. Optional row
gathers (``token_ids``) let the GEMMs read x_TH / grad_out rows directly, so the (N, H) dispatch buffer is never
written; the wgrad kernels gather the same way. No atomics
anywhere: every output element is written by one program, and each program sums its reduction in a fixed order.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile_map_kernel(
    counts_ptr,  # (E,) int32/int64 rows per expert
    map_ptr,  # (3, num_tiles) int32 out: expert (E past the last tile), first row, end row of the expert
    bounds_ptr,  # (3, E) int32 out: first row, end row and first row tile of each expert
    E,
    num_tiles,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    counts = tl.load(counts_ptr + offs_e, mask=mask_e, other=0).to(tl.int32)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, axis=0)
    row_end = tl.cumsum(counts, axis=0)
    if tl.program_id(0) == 0:
        tl.store(bounds_ptr + offs_e, row_end - counts, mask=mask_e)
        tl.store(bounds_ptr + E + offs_e, row_end, mask=mask_e)
        tl.store(bounds_ptr + 2 * E + offs_e, tile_end - tiles, mask=mask_e)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    # expert of tile t = number of experts whose tiles all end at or before t (empty experts included)
    before = (tile_end[None, :] <= offs_t[:, None]) & mask_e[None, :]
    e = tl.sum(before.to(tl.int32), axis=1)
    sel = offs_e[None, :] == e[:, None]
    tile_start_e = tl.sum(tl.where(sel, tile_end - tiles, 0), axis=1)
    row_end_e = tl.sum(tl.where(sel, row_end, 0), axis=1)
    row_start_e = tl.sum(tl.where(sel, row_end - counts, 0), axis=1)
    mask_t = offs_t < num_tiles
    tl.store(map_ptr + offs_t, e, mask=mask_t)
    tl.store(map_ptr + num_tiles + offs_t, row_start_e + (offs_t - tile_start_e) * BLOCK_M, mask=mask_t)
    tl.store(map_ptr + 2 * num_tiles + offs_t, row_end_e, mask=mask_t)


@triton.jit
def _row_tile(map_ptr, idx_ptr, num_tiles, pid_m, GATHER: tl.constexpr, BLOCK_M: tl.constexpr):
    """(end row, row offsets, source rows) of row tile pid_m of a tile map; its expert was read by the caller.
    Rows past the group are clamped to its last row: they load real data and their results are never stored."""
    row0 = tl.load(map_ptr + num_tiles + pid_m)
    row_end = tl.load(map_ptr + 2 * num_tiles + pid_m)
    offs_m = row0 + tl.arange(0, BLOCK_M)
    rows = tl.minimum(offs_m, row_end - 1)
    if GATHER:
        src = tl.load(idx_ptr + rows).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    return row_end, offs_m, src


@triton.jit
def _grouped_dot(
    acc,
    a_ptr,
    b_ptr,
    src,
    e,
    offs_n,
    KA,
    NC,
    stride_a,
    stride_be,
    stride_bk,
    stride_bn,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """acc + a[src] @ b[e][:, offs_n] over the KA columns of a (masked when KA or NC leave partial blocks)."""
    offs_k = tl.arange(0, BLOCK_K)
    a_offs = src[:, None] * stride_a + offs_k[None, :]
    b_offs = e.to(tl.int64) * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    for k in range((KA + BLOCK_K - 1) // BLOCK_K):
        if EVEN_K and EVEN_N:
            a = tl.load(a_ptr + a_offs)
            b = tl.load(b_ptr + b_offs)
        else:  # masks, not clamped indices: a mask keeps 16-byte vector loads where a clamp would not
            k_left = KA - k * BLOCK_K
            a = tl.load(a_ptr + a_offs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptr + b_offs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < NC), other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_offs += BLOCK_K
        b_offs += BLOCK_K * stride_bk
    return acc


@triton.jit
def _swiglu_up_fwd_kernel(
    x_ptr,  # (T, H) when GATHER else (N, H); fp32/bf16/fp16, row stride stride_x, unit column stride
    token_ids_ptr,  # (N,) int32/int64: source row in x of each row (read when GATHER)
    w1_ptr,
    w3_ptr,  # (E, H, F) dtype of x, strides (stride_we, stride_wh, stride_wf), shared
    h1_ptr,
    h3_ptr,
    a_ptr,  # (N, F) dtype of x, contiguous; h1/h3 written when STORE_H
    map_ptr,  # (3, num_tiles) int32 from _tile_map_kernel: expert, first row, end row of each row tile
    E,
    num_tiles,
    H,
    F,
    stride_x,
    stride_we,
    stride_wh,
    stride_wf,
    GATHER: tl.constexpr,
    STORE_H: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # n fastest: consecutive programs share the x row tile (read once into L2) and the expert's weights
    num_pid_n = (F + BLOCK_N - 1) // BLOCK_N
    pid_m = tl.program_id(0) // num_pid_n
    pid_n = tl.program_id(0) % num_pid_n
    e = tl.load(map_ptr + pid_m)
    if e >= E:  # past the last tile of the last expert: the launch covers an upper bound of tiles
        return
    row_end, offs_m, src = _row_tile(map_ptr, token_ids_ptr, num_tiles, pid_m, GATHER, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + src[:, None] * stride_x + offs_k[None, :]
    w_offs = e.to(tl.int64) * stride_we + offs_k[:, None] * stride_wh + offs_n[None, :] * stride_wf
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range((H + BLOCK_K - 1) // BLOCK_K):
        if EVEN_K and EVEN_N:
            x = tl.load(x_ptrs)
            w1 = tl.load(w1_ptr + w_offs)
            w3 = tl.load(w3_ptr + w_offs)
        else:  # masks, not clamped indices: a mask keeps 16-byte vector loads where a clamp would not
            k_left = H - k * BLOCK_K
            x = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            w_mask = (offs_k[:, None] < k_left) & (offs_n[None, :] < F)
            w1 = tl.load(w1_ptr + w_offs, mask=w_mask, other=0.0)
            w3 = tl.load(w3_ptr + w_offs, mask=w_mask, other=0.0)
        acc1 = tl.dot(x, w1, acc1, input_precision=DOT_PRECISION)
        acc3 = tl.dot(x, w3, acc3, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_offs += BLOCK_K * stride_wh
    a = acc1 / (1.0 + tl.exp(-acc1)) * acc3  # silu(h1) * h3
    out_offs = offs_m.to(tl.int64)[:, None] * F + offs_n[None, :]
    mask = (offs_m < row_end)[:, None] if EVEN_N else (offs_m < row_end)[:, None] & (offs_n < F)[None, :]
    tl.store(a_ptr + out_offs, a.to(a_ptr.dtype.element_ty), mask=mask)
    if STORE_H:
        tl.store(h1_ptr + out_offs, acc1.to(h1_ptr.dtype.element_ty), mask=mask)
        tl.store(h3_ptr + out_offs, acc3.to(h3_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grouped_mm_kernel(
    a1_ptr,
    a2_ptr,  # (N, KA) fp, row stride stride_a, unit column stride; a2 read when HAS_SECOND;
    #                  a1 is (T, KA) read at rows idx[n] when GATHER
    idx_ptr,  # (N,) int32/int64 source row of each row (read when GATHER)
    b1_ptr,
    b2_ptr,  # (E, KA, NC) dtype of a, strides (stride_be, stride_bk, stride_bn), shared
    c_ptr,  # (N, NC) dtype of a, contiguous
    map_ptr,  # (3, num_tiles) int32 from _tile_map_kernel
    E,
    num_tiles,
    KA,
    NC,
    stride_a,
    stride_be,
    stride_bk,
    stride_bn,
    GATHER: tl.constexpr,
    HAS_SECOND: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    num_pid_n = (NC + BLOCK_N - 1) // BLOCK_N
    pid_m = tl.program_id(0) // num_pid_n
    pid_n = tl.program_id(0) % num_pid_n
    e = tl.load(map_ptr + pid_m)
    if e >= E:  # past the last tile of the last expert: the launch covers an upper bound of tiles
        return
    row_end, offs_m, src = _row_tile(map_ptr, idx_ptr, num_tiles, pid_m, GATHER, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _grouped_dot(
        acc,
        a1_ptr,
        b1_ptr,
        src,
        e,
        offs_n,
        KA,
        NC,
        stride_a,
        stride_be,
        stride_bk,
        stride_bn,
        EVEN_K,
        EVEN_N,
        BLOCK_K,
        DOT_PRECISION,
    )
    if HAS_SECOND:  # second (a, b) pair over the same KA: dx = dh1 w1^T + dh3 w3^T in one accumulator
        acc = _grouped_dot(
            acc,
            a2_ptr,
            b2_ptr,
            src,
            e,
            offs_n,
            KA,
            NC,
            stride_a,
            stride_be,
            stride_bk,
            stride_bn,
            EVEN_K,
            EVEN_N,
            BLOCK_K,
            DOT_PRECISION,
        )
    mask = (offs_m < row_end)[:, None] if EVEN_N else (offs_m < row_end)[:, None] & (offs_n < NC)[None, :]
    tl.store(c_ptr + offs_m.to(tl.int64)[:, None] * NC + offs_n[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    da_ptr,  # (N, F) fp: g w2^T per row (before the combine weight), contiguous
    h1_ptr,
    h3_ptr,  # (N, F) dtype of da, contiguous
    row_w_ptr,  # (N,) fp32 combine weight of each row (read when HAS_W)
    dh1_ptr,
    dh3_ptr,
    a_ptr,  # (N, F) dtype of da, contiguous out; a_ptr gets w * a (HAS_W) or a
    grad_w_ptr,  # (N,) fp32 out: <da_n, a_n> = d<g, y_n>/dw_n (HAS_W)
    N,
    F,
    HAS_W: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    # A separate pass rather than the dgrad GEMM's epilogue: there, h1/h3 tiles next to the fp32 accumulator
    # spilled (255 registers + 0.1-2.6 KB stack per thread) and only 64 x 128 tiles fit. H200, medium T=16384:
    # fused epilogue 5.62 ms (275 TFLOP/s); plain 128 x 256 GEMM + this pass 3.14 ms, of which the pass ~0.5 ms.
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < N
    if HAS_W:
        row_w = tl.load(row_w_ptr + offs_r, mask=mask_r, other=0.0)
        gw = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):  # fixed order over F: the weight gradient is deterministic
        offs_f = f0 + tl.arange(0, BLOCK_F)
        mask = mask_r[:, None] & (offs_f < F)[None, :]
        offs = offs_r.to(tl.int64)[:, None] * F + offs_f[None, :]
        da = tl.load(da_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        h1 = tl.load(h1_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        h3 = tl.load(h3_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-h1))
        silu = h1 * sig
        a = silu * h3
        if HAS_W:  # fused combine: y_n = w_n (a_n w2), so d<g, y_n>/dw_n = <g w2^T, a_n>: y need not be kept
            gw += tl.sum(da * a, axis=1)
            da = da * row_w[:, None]
            a = a * row_w[:, None]
        tl.store(a_ptr + offs, a.to(a_ptr.dtype.element_ty), mask=mask)
        tl.store(dh1_ptr + offs, (da * h3 * sig * (1.0 + h1 * (1.0 - sig))).to(dh1_ptr.dtype.element_ty), mask=mask)
        tl.store(dh3_ptr + offs, (da * silu).to(dh3_ptr.dtype.element_ty), mask=mask)
    if HAS_W:
        tl.store(grad_w_ptr + offs_r, gw, mask=mask_r)
