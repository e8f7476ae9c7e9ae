"""The Triton kernels of the routed experts' FP8 grouped GEMMs with fine-grained scales, forward and input
gradients (the ops that launch them are in fp8_gemm.py).

# T tokens, H hidden, F expert ffn, E experts, N rows (expert-major); G = 128 (fp8_quant.GROUP)

Per expert e, with x, g (the output gradient) in 1 x G groups and the weights in G x G blocks (fp8_quant.py):
  _fp8_up_fwd_kernel      h1, h3 = x[tok] w1_e, x[tok] w3_e (one pass over x); a = silu(h1) * h3 quantised in the
                          epilogue, one 1 x G group per row of the tile (BLOCK_N = G); h1, h3 kept for backward in
                          the activations' dtype
  _fp8_grouped_mm_kernel  c = a1 b1_e (+ a2 b2_e), out in the activations' dtype: y = a w2, da = g[tok] w2^T,
                          dx = dh1 w1^T + dh3 w3^T
  _fp8_swiglu_bwd_kernel  the SwiGLU backward pass of grouped_gemm_kernels.py (dh1, dh3, w * a, the combine-weight
                          gradient), also writing dh1, dh3 quantised for the dx GEMM (its producer: no pass of its own)

Scaling: each BLOCK_K step's product runs into a fresh fp32 accumulator and is added, times A's row scale and B's
block scale, into the fp32 result (BLOCK_K divides G, so a step never straddles two scale groups): the promotion
DeepSeek-V3 makes every 128 products, which also bounds the reduced-precision accumulation inside Hopper's FP8
instructions. B is read K-major (its reduction dimension contiguous), the only layout Hopper's FP8 matrix
instructions take; quantize_expert_weights keeps each weight in both layouts for that. Tile scheduling, row
gathers and the absence of atomics are those of grouped_gemm_kernels.py. In _fp8_grouped_mm_kernel the operands
whose rows are not gathered (the weights; a when expert-major) can come as tensor descriptors (A_TMA, B_TMA: on
Hopper, TMA copies that take no registers or address arithmetic from the warps doing the products); the up
kernel loads through pointers (with descriptors its 16-warp tile spills and ran slower at the medium shape).
"""

from __future__ import annotations

import triton
import triton.language as tl

from xmoe.kernels.fp8_quant import _group_scale, _store_fp8
from xmoe.kernels.grouped_gemm_kernels import _row_tile


@triton.jit
def _fp8_dot(
    acc_lo,
    acc_hi,
    a_ptr,
    sa_ptr,
    b_ptr,
    sb_ptr,
    src,
    row0,
    n0,
    e,
    offs_n,
    KA,
    NC,
    stride_a,
    stride_sa,
    stride_be,
    stride_bn,
    stride_sbe,
    stride_sbn,
    stride_sbk,
    A_TMA: tl.constexpr,
    B_TMA: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    HALVES: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """(acc_lo, acc_hi) + the sum over BLOCK_K steps of (a[src] b[e]^T over the step) * sa[src, group] *
    sb[e, n // G, group], for the HALF columns offs_n (n0 the first) and, when HALVES, the HALF columns after them.
    Each step loads its a tile once for both halves and runs each half's product into a fresh accumulator of HALF
    columns, scaled and added before the other half's starts, so a tile twice as wide holds one fresh accumulator
    of the narrow tile's size (a 128 x 256 tile at 8 warps: 128 + 64 fp32 registers per thread, not 256); without
    HALVES acc_hi is returned as it came. A_TMA: a_ptr is a (rows, KA) tensor descriptor read from row0 (rows not
    gathered); B_TMA: b_ptr is an (E, NC, KA) one. Descriptors fill what lies past their shape with zeros: their
    loads need no masks."""
    e64 = e.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_hi = offs_n + HALF
    a_offs = src[:, None] * stride_a + offs_k[None, :]
    b_lo_offs = e64 * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None]
    b_hi_offs = b_lo_offs + HALF * stride_bn
    sa_offs = src * stride_sa
    sb_lo_offs = e64 * stride_sbe + (offs_n // GROUP) * stride_sbn
    sb_hi_offs = e64 * stride_sbe + (offs_hi // GROUP) * stride_sbn
    for k in range((KA + BLOCK_K - 1) // BLOCK_K):
        grp = (k * BLOCK_K) // GROUP
        k_left = KA - k * BLOCK_K
        if A_TMA:
            a = a_ptr.load([row0, k * BLOCK_K])
        elif EVEN_K:
            a = tl.load(a_ptr + a_offs)
        else:
            a = tl.load(a_ptr + a_offs, mask=offs_k[None, :] < k_left, other=0.0)
        sa = tl.load(sa_ptr + sa_offs + grp)
        if B_TMA:
            b = b_ptr.load([e, n0, k * BLOCK_K]).reshape(HALF, BLOCK_K).T
        elif EVEN_K and EVEN_N:
            b = tl.load(b_ptr + b_lo_offs)
        else:
            b = tl.load(b_ptr + b_lo_offs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < NC), other=0.0)
        if EVEN_N:
            sb = tl.load(sb_ptr + sb_lo_offs + grp * stride_sbk)
        else:
            sb = tl.load(sb_ptr + sb_lo_offs + grp * stride_sbk, mask=offs_n < NC, other=0.0)
        acc_lo += tl.dot(a, b, input_precision=DOT_PRECISION) * (sa[:, None] * sb[None, :])
        if HALVES:
            if B_TMA:
                b = b_ptr.load([e, n0 + HALF, k * BLOCK_K]).reshape(HALF, BLOCK_K).T
            elif EVEN_K and EVEN_N:
                b = tl.load(b_ptr + b_hi_offs)
            else:
                mask = (offs_k[:, None] < k_left) & (offs_hi[None, :] < NC)
                b = tl.load(b_ptr + b_hi_offs, mask=mask, other=0.0)
            if EVEN_N:
                sb = tl.load(sb_ptr + sb_hi_offs + grp * stride_sbk)
            else:
                sb = tl.load(sb_ptr + sb_hi_offs + grp * stride_sbk, mask=offs_hi < NC, other=0.0)
            acc_hi += tl.dot(a, b, input_precision=DOT_PRECISION) * (sa[:, None] * sb[None, :])
        a_offs += BLOCK_K
        b_lo_offs += BLOCK_K
        b_hi_offs += BLOCK_K
    return acc_lo, acc_hi


@triton.jit
def _fp8_up_fwd_kernel(
    x_ptr,  # (T, H) when GATHER else (N, H): FP8, row stride stride_x, unit column stride
    sx_ptr,  # scales of x: (rows of x, cdiv(H, G)) fp32, row stride stride_sx
    token_ids_ptr,  # (N,) int32/int64: source row in x of each row (read when GATHER)
    w1_ptr,
    w3_ptr,  # (E, F, H) FP8, K-major: strides (stride_we, stride_wn, unit), shared
    s1_ptr,
    s3_ptr,  # block scales, [e, f // G, h // G] at strides (stride_se, stride_sn, stride_sk), shared
    h1_ptr,
    h3_ptr,  # (N, F) activations' dtype, contiguous; written when STORE_H
    aq_ptr,  # (N, F) FP8, contiguous: a = silu(h1) * h3 quantised
    sa_ptr,  # (N, cdiv(F, G)) fp32, contiguous: its scales
    map_ptr,  # (3, num_tiles) int32 from grouped_gemm_kernels._tile_map_kernel
    E,
    num_tiles,
    H,
    F,
    stride_x,
    stride_sx,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_sk,
    GATHER: tl.constexpr,
    STORE_H: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_EXP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # BLOCK_N == GROUP: the tile's columns are one scale group of a, and one block column of the weights
    num_pid_n = (F + BLOCK_N - 1) // BLOCK_N
    pid_m = tl.program_id(0) // num_pid_n
    pid_n = tl.program_id(0) % num_pid_n
    e = tl.load(map_ptr + pid_m)
    if e >= E:  # past the last tile of the last expert: the launch covers an upper bound of tiles
        return
    row_end, offs_m, src = _row_tile(map_ptr, token_ids_ptr, num_tiles, pid_m, GATHER, BLOCK_M)
    e64 = e.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_offs = src[:, None] * stride_x + offs_k[None, :]
    w_offs = e64 * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    sx_ptrs = sx_ptr + src * stride_sx
    s_offs = e64 * stride_se + pid_n * stride_sn
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range((H + BLOCK_K - 1) // BLOCK_K):
        grp = (k * BLOCK_K) // GROUP
        if EVEN_K and EVEN_N:
            x = tl.load(x_ptr + x_offs)
            w1 = tl.load(w1_ptr + w_offs)
            w3 = tl.load(w3_ptr + w_offs)
        else:
            k_left = H - k * BLOCK_K
            x = tl.load(x_ptr + x_offs, mask=offs_k[None, :] < k_left, other=0.0)
            w_mask = (offs_k[:, None] < k_left) & (offs_n[None, :] < F)
            w1 = tl.load(w1_ptr + w_offs, mask=w_mask, other=0.0)
            w3 = tl.load(w3_ptr + w_offs, mask=w_mask, other=0.0)
        sx = tl.load(sx_ptrs + grp)
        acc1 += (
            tl.dot(x, w1, input_precision=DOT_PRECISION) * (sx * tl.load(s1_ptr + s_offs + grp * stride_sk))[:, None]
        )
        acc3 += (
            tl.dot(x, w3, input_precision=DOT_PRECISION) * (sx * tl.load(s3_ptr + s_offs + grp * stride_sk))[:, None]
        )
        x_offs += BLOCK_K
        w_offs += BLOCK_K
    a = acc1 / (1.0 + tl.exp(-acc1)) * acc3  # silu(h1) * h3; columns past F are 0 (masked loads)
    rows = offs_m.to(tl.int64)
    out_offs = rows[:, None] * F + offs_n[None, :]
    in_rows = offs_m < row_end
    mask = in_rows[:, None] if EVEN_N else in_rows[:, None] & (offs_n < F)[None, :]
    if STORE_H:
        tl.store(h1_ptr + out_offs, acc1.to(h1_ptr.dtype.element_ty), mask=mask)
        tl.store(h3_ptr + out_offs, acc3.to(h3_ptr.dtype.element_ty), mask=mask)
    scale, inv = _group_scale(tl.max(tl.abs(a), axis=1), FP8_MAX)
    _store_fp8(aq_ptr + out_offs, a * inv[:, None], mask, MIN_EXP)
    tl.store(sa_ptr + rows * num_pid_n + pid_n, scale, mask=in_rows)


@triton.jit
def _fp8_grouped_mm_kernel(
    a1_ptr,
    a2_ptr,  # (N, KA) FP8, row stride stride_a, unit column stride; a1 is (T, KA) read at idx[n] when
    #                  GATHER; a2 read when HAS_SECOND; (N, KA) tensor descriptors when A_TMA
    sa1_ptr,
    sa2_ptr,  # their scales: (rows, cdiv(KA, G)) fp32, row stride stride_sa
    idx_ptr,  # (N,) int32/int64 source row of each row (read when GATHER)
    b1_ptr,
    b2_ptr,  # (E, NC, KA) FP8, K-major: strides (stride_be, stride_bn, unit), shared; (E, NC, KA) tensor
    #                  descriptors when B_TMA
    sb1_ptr,
    sb2_ptr,  # block scales, [e, n // G, k // G] at strides (stride_sbe, stride_sbn, stride_sbk), shared
    c_ptr,  # (N, NC) activations' dtype, contiguous
    map_ptr,  # (3, num_tiles) int32 from grouped_gemm_kernels._tile_map_kernel
    E,
    num_tiles,
    KA,
    NC,
    stride_a,
    stride_sa,
    stride_be,
    stride_bn,
    stride_sbe,
    stride_sbn,
    stride_sbk,
    GATHER: tl.constexpr,
    HAS_SECOND: tl.constexpr,
    A_TMA: tl.constexpr,
    B_TMA: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    HALVES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    num_pid_n = (NC + BLOCK_N - 1) // BLOCK_N
    pid_m = tl.program_id(0) // num_pid_n
    pid_n = tl.program_id(0) % num_pid_n
    e = tl.load(map_ptr + pid_m)
    if e >= E:
        return
    row_end, offs_m, src = _row_tile(map_ptr, idx_ptr, num_tiles, pid_m, GATHER, BLOCK_M)
    row0 = tl.load(map_ptr + num_tiles + pid_m)
    HALF: tl.constexpr = BLOCK_N // 2 if HALVES else BLOCK_N  # HALVES: two accumulators of half the columns
    offs_n = pid_n * BLOCK_N + tl.arange(0, HALF)
    acc = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
    acc_hi = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
    for pair in tl.static_range(2 if HAS_SECOND else 1):  # dx = dh1 w1^T + dh3 w3^T into one accumulator
        acc, acc_hi = _fp8_dot(
            acc,
            acc_hi,
            a1_ptr if pair == 0 else a2_ptr,
            sa1_ptr if pair == 0 else sa2_ptr,
            b1_ptr if pair == 0 else b2_ptr,
            sb1_ptr if pair == 0 else sb2_ptr,
            src,
            row0,
            pid_n * BLOCK_N,
            e,
            offs_n,
            KA,
            NC,
            stride_a,
            stride_sa,
            stride_be,
            stride_bn,
            stride_sbe,
            stride_sbn,
            stride_sbk,
            A_TMA,
            B_TMA,
            EVEN_K,
            EVEN_N,
            HALVES,
            HALF,
            BLOCK_K,
            GROUP,
            DOT_PRECISION,
        )
    if HALVES:
        offs_hi = offs_n + HALF
        in_rows = (offs_m < row_end)[:, None]
        hi_mask = in_rows if EVEN_N else in_rows & (offs_hi < NC)[None, :]
        tl.store(
            c_ptr + offs_m.to(tl.int64)[:, None] * NC + offs_hi[None, :],
            acc_hi.to(c_ptr.dtype.element_ty),
            mask=hi_mask,
        )
    mask = (offs_m < row_end)[:, None] if EVEN_N else (offs_m < row_end)[:, None] & (offs_n < NC)[None, :]
    tl.store(c_ptr + offs_m.to(tl.int64)[:, None] * NC + offs_n[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_swiglu_bwd_kernel(
    da_ptr,  # (N, F) activations' dtype: g w2^T per row (before the combine weight), contiguous
    h1_ptr,
    h3_ptr,  # (N, F) dtype of da, contiguous
    row_w_ptr,  # (N,) fp32 combine weight of each row (read when HAS_W)
    dh1_ptr,
    dh3_ptr,
    a_ptr,  # (N, F) dtype of da, contiguous out; a_ptr gets w * a (HAS_W) or a
    grad_w_ptr,  # (N,) fp32 out: <da_n, a_n> (HAS_W)
    q_ptr,  # (N, 2F) FP8 out: dh1, dh3 quantised, side by side (columns F.. are dh3's)
    s_ptr,  # (N, 2 cdiv(F, G)) fp32 out: their scales, side by side
    N,
    F,
    HAS_W: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_EXP: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GROUP: tl.constexpr,
):
    # grouped_gemm_kernels._swiglu_bwd_kernel, one scale group per step over F (it says why a pass of its own)
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < N
    rows = offs_r.to(tl.int64)
    num_groups = (F + GROUP - 1) // GROUP
    if HAS_W:
        row_w = tl.load(row_w_ptr + offs_r, mask=mask_r, other=0.0)
        gw = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for grp in range(num_groups):  # fixed order over F: the weight gradient is deterministic
        offs_f = grp * GROUP + tl.arange(0, GROUP)
        mask = mask_r[:, None] & (offs_f < F)[None, :]
        offs = rows[:, None] * F + offs_f[None, :]
        da = tl.load(da_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        h1 = tl.load(h1_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        h3 = tl.load(h3_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-h1))
        silu = h1 * sig
        a = silu * h3
        if HAS_W:
            gw += tl.sum(da * a, axis=1)
            da = da * row_w[:, None]
            a = a * row_w[:, None]
        dh1 = da * h3 * sig * (1.0 + h1 * (1.0 - sig))
        dh3 = da * silu
        tl.store(a_ptr + offs, a.to(a_ptr.dtype.element_ty), mask=mask)
        tl.store(dh1_ptr + offs, dh1.to(dh1_ptr.dtype.element_ty), mask=mask)
        tl.store(dh3_ptr + offs, dh3.to(dh3_ptr.dtype.element_ty), mask=mask)
        scale1, inv1 = _group_scale(tl.max(tl.abs(dh1), axis=1), FP8_MAX)
        scale3, inv3 = _group_scale(tl.max(tl.abs(dh3), axis=1), FP8_MAX)
        offs_q = rows[:, None] * (2 * F) + offs_f[None, :]
        _store_fp8(q_ptr + offs_q, dh1 * inv1[:, None], mask, MIN_EXP)
        _store_fp8(q_ptr + offs_q + F, dh3 * inv3[:, None], mask, MIN_EXP)
        tl.store(s_ptr + rows * (2 * num_groups) + grp, scale1, mask=mask_r)
        tl.store(s_ptr + rows * (2 * num_groups) + num_groups + grp, scale3, mask=mask_r)
    if HAS_W:
        tl.store(grad_w_ptr + offs_r, gw, mask=mask_r)
