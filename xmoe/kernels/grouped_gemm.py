"""SwiGLU experts as grouped GEMMs over uneven, contiguous row groups, forward and backward, in Triton.

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

import torch
import triton
import triton.language as tl

from xmoe.kernels import tiles
from xmoe.kernels._common import cdiv, check_device, check_float, check_index, interpreting, kernel_op, next_pow2
from xmoe.kernels.tiles import TileConfig


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


def _dot_precision(dtype: torch.dtype) -> str | None:
    # fp32 stays exact; 16-bit dots ignore the setting, so they take the backend's default (HIP on gfx90a refuses
    # to compile a dot that names "tf32", whatever its inputs)
    return "ieee" if dtype == torch.float32 else None


def _launch_kwargs(cfg: TileConfig, dtype: torch.dtype) -> dict:
    return dict(
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        DOT_PRECISION=_dot_precision(dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def tile_map(counts_E: torch.Tensor, num_rows: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(map (3, num_tiles), bounds (3, E)) int32 for row-grouped launches, built on device (no host sync).

    num_tiles = cdiv(num_rows, block_m) + E bounds sum_e cdiv(n_e, block_m); the programs past the real tiles
    read expert E and exit at once."""
    num_experts = counts_E.shape[0]
    num_tiles = cdiv(num_rows, block_m) + num_experts
    map_3T = torch.empty(3, num_tiles, dtype=torch.int32, device=counts_E.device)
    bounds_3E = torch.empty(3, num_experts, dtype=torch.int32, device=counts_E.device)
    block_t = 64
    _tile_map_kernel[(cdiv(num_tiles, block_t),)](
        counts_E,
        map_3T,
        bounds_3E,
        num_experts,
        num_tiles,
        BLOCK_M=block_m,
        BLOCK_E=next_pow2(max(num_experts, 1)),
        BLOCK_T=block_t,
        num_warps=4,
    )
    return map_3T, bounds_3E


def _check_experts(x: torch.Tensor, counts_E: torch.Tensor, *weights: torch.Tensor) -> None:
    check_index("tokens_per_expert_E", counts_E, 1)
    check_device(x, counts_E, *weights)
    for w in weights:
        if w.dtype != x.dtype:
            raise ValueError(f"expert weights ({w.dtype}) and activations ({x.dtype}) must share one dtype")
        if w.shape[0] != counts_E.shape[0]:
            raise ValueError(f"weights hold {w.shape[0]} experts but tokens_per_expert_E has {counts_E.shape[0]}")


@kernel_op("swiglu_up_fwd")
def swiglu_up_fwd(
    x: torch.Tensor,
    token_ids_N: torch.Tensor | None,
    w1_EHF: torch.Tensor,
    w3_EHF: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    store_h: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h1, h3, a) of shape (N, F); rows are x[token_ids_N] when token_ids_N is given, else x. h1/h3 are (0, F)
    unless store_h."""
    check_float("x", x, 2)
    check_float("w1_EHF", w1_EHF, 3)
    _check_experts(x, tokens_per_expert_E, w1_EHF, w3_EHF)
    if w1_EHF.stride() != w3_EHF.stride() or w1_EHF.shape != w3_EHF.shape:
        w1_EHF, w3_EHF = w1_EHF.contiguous(), w3_EHF.contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_experts, hidden, ffn = w1_EHF.shape
    if x.shape[1] != hidden:
        raise ValueError(f"x has {x.shape[1]} columns but w1_EHF expects hidden size {hidden}")
    num_rows = token_ids_N.shape[0] if token_ids_N is not None else x.shape[0]
    a = x.new_empty(num_rows, ffn)
    h1 = x.new_empty(num_rows if store_h else 0, ffn)
    h3 = x.new_empty(num_rows if store_h else 0, ffn)
    if num_rows == 0 or ffn == 0:
        return h1, h3, a

    def launch(cfg: TileConfig) -> None:
        map_3T, _ = tile_map(tokens_per_expert_E, num_rows, cfg.block_m)
        _swiglu_up_fwd_kernel[(map_3T.shape[1] * cdiv(ffn, cfg.block_n),)](
            x,
            token_ids_N if token_ids_N is not None else map_3T,
            w1_EHF,
            w3_EHF,
            h1,
            h3,
            a,
            map_3T,
            num_experts,
            map_3T.shape[1],
            hidden,
            ffn,
            x.stride(0),
            *w1_EHF.stride(),
            GATHER=token_ids_N is not None,
            STORE_H=store_h,
            EVEN_K=hidden % cfg.block_k == 0,
            EVEN_N=ffn % cfg.block_n == 0,
            **_launch_kwargs(cfg, x.dtype),
        )

    launch(tiles.pick("up_fwd", x.dtype, x.device, hidden, ffn, num_rows, num_experts, launch))
    return h1, h3, a


@swiglu_up_fwd.register_fake
def _(x, token_ids_N, w1_EHF, w3_EHF, tokens_per_expert_E, store_h):
    num_rows = token_ids_N.shape[0] if token_ids_N is not None else x.shape[0]
    ffn = w1_EHF.shape[2]
    h_rows = num_rows if store_h else 0
    return x.new_empty(h_rows, ffn), x.new_empty(h_rows, ffn), x.new_empty(num_rows, ffn)


def _grouped_mm(a1, b1_EKN, a2, b2_EKN, tokens_per_expert_E, idx_N, kernel: str) -> torch.Tensor:
    check_float("a1", a1, 2)
    check_float("b1_EKN", b1_EKN, 3)
    _check_experts(a1, tokens_per_expert_E, b1_EKN, *([b2_EKN] if a2 is not None else []))
    if a2 is not None and (a2.shape != a1.shape or b2_EKN.shape != b1_EKN.shape or idx_N is not None):
        raise ValueError("the second (a, b) pair must match the first one's shapes, and rows are not gathered")
    a1, a2 = [a if a is None or a.stride(-1) == 1 else a.contiguous() for a in (a1, a2)]
    if a2 is not None and (b2_EKN.stride() != b1_EKN.stride() or a2.stride() != a1.stride()):
        a1, a2, b1_EKN, b2_EKN = a1.contiguous(), a2.contiguous(), b1_EKN.contiguous(), b2_EKN.contiguous()
    num_experts, depth, width = b1_EKN.shape
    num_rows = idx_N.shape[0] if idx_N is not None else a1.shape[0]
    c = a1.new_empty(num_rows, width)
    if num_rows == 0 or width == 0:
        return c
    if depth == 0:
        return c.zero_()

    def launch(cfg: TileConfig) -> None:
        map_3T, _ = tile_map(tokens_per_expert_E, num_rows, cfg.block_m)
        _grouped_mm_kernel[(map_3T.shape[1] * cdiv(width, cfg.block_n),)](
            a1,
            a2 if a2 is not None else a1,
            idx_N if idx_N is not None else map_3T,
            b1_EKN,
            b2_EKN if b2_EKN is not None else b1_EKN,
            c,
            map_3T,
            num_experts,
            map_3T.shape[1],
            depth,
            width,
            a1.stride(0),
            *b1_EKN.stride(),
            GATHER=idx_N is not None,
            HAS_SECOND=a2 is not None,
            EVEN_K=depth % cfg.block_k == 0,
            EVEN_N=width % cfg.block_n == 0,
            **_launch_kwargs(cfg, a1.dtype),
        )

    launch(tiles.pick(kernel, a1.dtype, a1.device, depth, width, num_rows, num_experts, launch))
    return c


@kernel_op("grouped_mm")
def grouped_mm(
    a1: torch.Tensor,
    b1_EKN: torch.Tensor,
    a2: torch.Tensor | None,
    b2_EKN: torch.Tensor | None,
    tokens_per_expert_E: torch.Tensor,
) -> torch.Tensor:
    """c[rows of e] = a1[rows of e] @ b1_EKN[e] (+ a2[rows of e] @ b2_EKN[e]); b may be a strided view (a
    transpose, a column slice)."""
    return _grouped_mm(a1, b1_EKN, a2, b2_EKN, tokens_per_expert_E, None, "mm" if a2 is None else "dx")


@grouped_mm.register_fake
def _(a1, b1_EKN, a2, b2_EKN, tokens_per_expert_E):
    return a1.new_empty(a1.shape[0], b1_EKN.shape[2])


@kernel_op("swiglu_down_bwd")
def swiglu_down_bwd(
    g: torch.Tensor,
    token_ids_N: torch.Tensor | None,
    w2_EFH: torch.Tensor,
    h1_NF: torch.Tensor,
    h3_NF: torch.Tensor,
    row_weights_N: torch.Tensor | None,
    tokens_per_expert_E: torch.Tensor,
    reuse_h: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dh1, dh3, a_scaled, grad_row_weights) given the gradient g of y = (row_weights *) (silu(h1) * h3) w2.

    1. da = g[token_ids_N] w2_e^T (grouped GEMM reading g rows by token id when token_ids_N is given);
    2. one elementwise pass: a = silu(h1) * h3 recomputed, dh1, dh3 and a_scaled = row_weights * a (the wgrad
       operand of w2), and grad_row_weights[n] = <da_n, a_n> (fp32; empty when row_weights_N is None).
    dh1 is written over da (one (N, F) buffer less). With reuse_h, a_scaled is written over h1 and dh3 over h3:
    the backward then allocates one (N, F) buffer instead of four, and h1/h3 hold gradients afterwards (the
    caller bumps their version, so a second backward through the same graph fails loudly)."""
    if reuse_h and not (h1_NF.is_contiguous() and h3_NF.is_contiguous()):
        raise ValueError("reuse_h writes over h1_NF and h3_NF, which must then be contiguous")
    h1_NF, h3_NF = h1_NF.contiguous(), h3_NF.contiguous()
    num_rows, ffn = h1_NF.shape
    has_w = row_weights_N is not None
    da = _grouped_mm(g, w2_EFH.transpose(1, 2), None, None, tokens_per_expert_E, token_ids_N, "down_bwd")
    dh1 = da  # the elementwise pass writes dh1 over da
    dh3, a = (h3_NF, h1_NF) if reuse_h else (torch.empty_like(h1_NF), torch.empty_like(h1_NF))
    grad_w = torch.empty(num_rows if has_w else 0, dtype=torch.float32, device=h1_NF.device)
    if num_rows == 0 or ffn == 0:
        return dh1, dh3, a, grad_w.zero_()
    block_r, block_f = (16, 32) if interpreting() else (8, min(512, next_pow2(ffn)))
    # every element is read (da, h1, h3) and then written (dh1, dh3, a) by the same program in one step, so
    # the outputs may alias the inputs
    _swiglu_bwd_kernel[(cdiv(num_rows, block_r),)](
        da,
        h1_NF,
        h3_NF,
        row_weights_N.float().contiguous() if row_weights_N is not None else da,
        dh1,
        dh3,
        a,
        grad_w if has_w else da,
        num_rows,
        ffn,
        HAS_W=has_w,
        BLOCK_R=block_r,
        BLOCK_F=block_f,
        num_warps=4,
    )
    return dh1, dh3, a, grad_w


@swiglu_down_bwd.register_fake
def _(g, token_ids_N, w2_EFH, h1_NF, h3_NF, row_weights_N, tokens_per_expert_E, reuse_h):
    num_w = h1_NF.shape[0] if row_weights_N is not None else 0
    return (
        torch.empty_like(h1_NF),
        torch.empty_like(h1_NF),
        torch.empty_like(h1_NF),
        h1_NF.new_empty(num_w, dtype=torch.float32),
    )


def can_reuse_saved() -> bool:
    """Whether a backward may write gradients over its saved h1/h3: not under torch.compile (the ops declare no
    mutation)."""
    return not torch.compiler.is_compiling()
