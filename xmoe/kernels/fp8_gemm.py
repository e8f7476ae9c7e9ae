"""FP8 grouped GEMMs of the routed experts with fine-grained scales: forward and input gradients, in Triton.

# T tokens, H hidden, F expert ffn, E experts, N rows (expert-major); G = 128 (fp8_quant.GROUP)

Per expert e, with x, g (the output gradient) in 1 x G groups and the weights in G x G blocks (fp8_quant.py):
  _fp8_up_fwd_kernel      h1, h3 = x[tok] w1_e, x[tok] w3_e (one pass over x); a = silu(h1) * h3 quantised in the
                          epilogue, one 1 x G group per row of the tile (BLOCK_N = G); h1, h3 kept for backward in
                          the activations' dtype
  _fp8_grouped_mm_kernel  c = a1 b1_e (+ a2 b2_e), out in the activations' dtype: y = a w2, da = g[tok] w2^T,
                          dx = dh1 w1^T + dh3 w3^T
  _fp8_swiglu_bwd_kernel  grouped_gemm.py's SwiGLU backward pass (dh1, dh3, w * a, the combine-weight gradient),
                          also writing dh1, dh3 quantised for the dx GEMM (its producer: no pass of its own)
The weight gradients stay in bf16 (grouped_wgrad.py): their reduction runs over each expert's rows, so FP8 operands
would need 128 x 1 groups down the columns of gathered rows, i.e. another quantised copy of x[tok] and g[tok]
that no producer here writes (docs/kernels.md, "FP8 experts").

Scaling: each BLOCK_K step's product runs into a fresh fp32 accumulator and is added, times A's row scale and B's
block scale, into the fp32 result (BLOCK_K divides G, so a step never straddles two scale groups): the promotion
DeepSeek-V3 makes every 128 products, which also bounds the reduced-precision accumulation inside Hopper's FP8
instructions. B is read K-major (its reduction dimension contiguous), the only layout Hopper's FP8 matrix
instructions take; quantize_expert_weights keeps each weight in both layouts for that. Tile scheduling, row
gathers and the absence of atomics are those of grouped_gemm.py.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from xmoe.kernels import tiles
from xmoe.kernels._common import cdiv, check_device, check_index, interpreting, kernel_op
from xmoe.kernels.fp8_quant import FORMATS, GROUP, _group_scale, _store_fp8, format_constexprs
from xmoe.kernels.grouped_gemm import _launch_kwargs, _row_tile, tile_map
from xmoe.kernels.tiles import TileConfig

FP8_DTYPES = tuple(f.dtype for f in FORMATS.values())


@triton.jit
def _fp8_dot(
    acc,
    a_ptr,
    sa_ptr,
    b_ptr,
    sb_ptr,
    src,
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
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """acc + sum over BLOCK_K steps of (a[src] b[e]^T over the step) * sa[src, group] * sb[e, n // G, group]."""
    e64 = e.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_offs = src[:, None] * stride_a + offs_k[None, :]
    b_offs = e64 * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None]
    sa_ptrs = sa_ptr + src * stride_sa
    sb_ptrs = sb_ptr + e64 * stride_sbe + (offs_n // GROUP) * stride_sbn
    for k in range((KA + BLOCK_K - 1) // BLOCK_K):
        grp = (k * BLOCK_K) // GROUP
        if EVEN_K and EVEN_N:
            a = tl.load(a_ptr + a_offs)
            b = tl.load(b_ptr + b_offs)
            sb = tl.load(sb_ptrs + grp * stride_sbk)
        else:
            k_left = KA - k * BLOCK_K
            a = tl.load(a_ptr + a_offs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptr + b_offs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < NC), other=0.0)
            sb = tl.load(sb_ptrs + grp * stride_sbk, mask=offs_n < NC, other=0.0)
        sa = tl.load(sa_ptrs + grp)
        acc += tl.dot(a, b, input_precision=DOT_PRECISION) * (sa[:, None] * sb[None, :])
        a_offs += BLOCK_K
        b_offs += BLOCK_K
    return acc


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
    map_ptr,  # (3, num_tiles) int32 from grouped_gemm._tile_map_kernel
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
    x_ptrs = x_ptr + src[:, None] * stride_x + offs_k[None, :]
    w_offs = e64 * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    sx_ptrs = sx_ptr + src * stride_sx
    s_offs = e64 * stride_se + pid_n * stride_sn
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range((H + BLOCK_K - 1) // BLOCK_K):
        grp = (k * BLOCK_K) // GROUP
        if EVEN_K and EVEN_N:
            x = tl.load(x_ptrs)
            w1 = tl.load(w1_ptr + w_offs)
            w3 = tl.load(w3_ptr + w_offs)
        else:
            k_left = H - k * BLOCK_K
            x = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
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
        x_ptrs += BLOCK_K
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
    #                  GATHER; a2 read when HAS_SECOND
    sa1_ptr,
    sa2_ptr,  # their scales: (rows, cdiv(KA, G)) fp32, row stride stride_sa
    idx_ptr,  # (N,) int32/int64 source row of each row (read when GATHER)
    b1_ptr,
    b2_ptr,  # (E, NC, KA) FP8, K-major: strides (stride_be, stride_bn, unit), shared
    sb1_ptr,
    sb2_ptr,  # block scales, [e, n // G, k // G] at strides (stride_sbe, stride_sbn, stride_sbk), shared
    c_ptr,  # (N, NC) activations' dtype, contiguous
    map_ptr,  # (3, num_tiles) int32 from grouped_gemm._tile_map_kernel
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
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
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
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _fp8_dot(
        acc,
        a1_ptr,
        sa1_ptr,
        b1_ptr,
        sb1_ptr,
        src,
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
        EVEN_K,
        EVEN_N,
        BLOCK_K,
        GROUP,
        DOT_PRECISION,
    )
    if HAS_SECOND:  # dx = dh1 w1^T + dh3 w3^T into one accumulator
        acc = _fp8_dot(
            acc,
            a2_ptr,
            sa2_ptr,
            b2_ptr,
            sb2_ptr,
            src,
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
            EVEN_K,
            EVEN_N,
            BLOCK_K,
            GROUP,
            DOT_PRECISION,
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
    q1_ptr,
    q3_ptr,  # (N, F) FP8 out: dh1, dh3 quantised
    s1_ptr,
    s3_ptr,  # (N, cdiv(F, G)) fp32 out: their scales
    N,
    F,
    HAS_W: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_EXP: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GROUP: tl.constexpr,
):
    # grouped_gemm._swiglu_bwd_kernel with one scale group per step over F (it says why this is a pass of its own)
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
        _store_fp8(q1_ptr + offs, dh1 * inv1[:, None], mask, MIN_EXP)
        _store_fp8(q3_ptr + offs, dh3 * inv3[:, None], mask, MIN_EXP)
        tl.store(s1_ptr + rows * num_groups + grp, scale1, mask=mask_r)
        tl.store(s3_ptr + rows * num_groups + grp, scale3, mask=mask_r)
    if HAS_W:
        tl.store(grad_w_ptr + offs_r, gw, mask=mask_r)


def _format_of(q: torch.Tensor, fmt: str) -> dict:
    """The kernels' format constexprs, after checking that q is held the way quantize_rows stores ``fmt``."""
    form = FORMATS[fmt]
    if q.dtype != form.storage():
        raise ValueError(f"FP8 operand of dtype {q.dtype}; format {fmt} is held as {form.storage()} here")
    return format_constexprs(form)


def _check_fp8(name: str, q: torch.Tensor, ndim: int) -> None:
    if q.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(q.shape)}")
    if q.dtype not in FP8_DTYPES and not (interpreting() and q.dtype == torch.float32):
        raise ValueError(
            f"{name} has dtype {q.dtype}; the FP8 kernels take {FP8_DTYPES} (float32 holding FP8 "
            "values under TRITON_INTERPRET=1)"
        )
    if q.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit stride in its last (reduction) dimension")


def _check_groups(counts_E: torch.Tensor, *weights: torch.Tensor) -> None:
    check_index("tokens_per_expert_E", counts_E, 1)
    for w in weights:
        if w.shape[0] != counts_E.shape[0]:
            raise ValueError(f"weights hold {w.shape[0]} experts but tokens_per_expert_E has {counts_E.shape[0]}")


def _launch(cfg: TileConfig, dtype: torch.dtype) -> dict:
    return dict(_launch_kwargs(cfg, dtype), GROUP=GROUP)


@kernel_op("fp8_swiglu_up_fwd")
def fp8_swiglu_up_fwd(
    xq: torch.Tensor,
    scale_x: torch.Tensor,
    token_ids_N: torch.Tensor | None,
    w1_EFH: torch.Tensor,
    w3_EFH: torch.Tensor,
    scale1_EFH: torch.Tensor,
    scale3_EFH: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    store_h: bool,
    fmt: str,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h1, h3, aq, scale_a): h1, h3 (N, F) in out_dtype ((0, F) unless store_h) and a = silu(h1) * h3 quantised
    in 1 x G groups. Rows are xq[token_ids_N] when token_ids_N is given, else xq. scale*_EFH: block scales
    indexed [e, f // G, h // G] (a transposed view of quantize_blocks' scale)."""
    for name, q in (("xq", xq), ("w1_EFH", w1_EFH), ("w3_EFH", w3_EFH)):
        _check_fp8(name, q, 3 if name != "xq" else 2)
    _check_groups(tokens_per_expert_E, w1_EFH, w3_EFH)
    check_device(xq, scale_x, w1_EFH, w3_EFH, scale1_EFH, scale3_EFH, tokens_per_expert_E)
    if w1_EFH.stride() != w3_EFH.stride() or scale1_EFH.stride() != scale3_EFH.stride():
        raise ValueError("w1_EFH and w3_EFH (and their scales) must share one layout")
    num_experts, ffn, hidden = w1_EFH.shape
    if xq.shape[1] != hidden:
        raise ValueError(f"xq has {xq.shape[1]} columns but w1_EFH expects hidden size {hidden}")
    num_rows = token_ids_N.shape[0] if token_ids_N is not None else xq.shape[0]
    consts = _format_of(xq, fmt)
    h1 = torch.empty(num_rows if store_h else 0, ffn, dtype=out_dtype, device=xq.device)
    h3 = torch.empty_like(h1)
    aq = torch.empty(num_rows, ffn, dtype=xq.dtype, device=xq.device)
    scale_a = torch.empty(num_rows, cdiv(ffn, GROUP), dtype=torch.float32, device=xq.device)
    if num_rows == 0 or ffn == 0:
        return h1, h3, aq, scale_a

    def launch(cfg: TileConfig) -> None:
        cfg = replace(cfg, block_n=GROUP)  # the epilogue quantises one group of a per row
        map_3T, _ = tile_map(tokens_per_expert_E, num_rows, cfg.block_m)
        _fp8_up_fwd_kernel[(map_3T.shape[1] * cdiv(ffn, GROUP),)](
            xq,
            scale_x,
            token_ids_N if token_ids_N is not None else map_3T,
            w1_EFH,
            w3_EFH,
            scale1_EFH,
            scale3_EFH,
            h1,
            h3,
            aq,
            scale_a,
            map_3T,
            num_experts,
            map_3T.shape[1],
            hidden,
            ffn,
            xq.stride(0),
            scale_x.stride(0),
            w1_EFH.stride(0),
            w1_EFH.stride(1),
            *scale1_EFH.stride(),
            GATHER=token_ids_N is not None,
            STORE_H=store_h,
            EVEN_K=hidden % cfg.block_k == 0,
            EVEN_N=ffn % GROUP == 0,
            **consts,
            **_launch(cfg, xq.dtype),
        )

    launch(tiles.pick("fp8_up", xq.dtype, xq.device, hidden, ffn, num_rows, num_experts, launch))
    return h1, h3, aq, scale_a


@fp8_swiglu_up_fwd.register_fake
def _(xq, scale_x, token_ids_N, w1_EFH, w3_EFH, scale1_EFH, scale3_EFH, tokens_per_expert_E, store_h, fmt, out_dtype):
    num_rows = token_ids_N.shape[0] if token_ids_N is not None else xq.shape[0]
    ffn = w1_EFH.shape[1]
    h = xq.new_empty(num_rows if store_h else 0, ffn, dtype=out_dtype)
    return (
        h,
        torch.empty_like(h),
        xq.new_empty(num_rows, ffn),
        xq.new_empty(num_rows, cdiv(ffn, GROUP), dtype=torch.float32),
    )


def _fp8_mm(a1, sa1, b1_ENK, sb1, a2, sa2, b2_ENK, sb2, counts_E, idx_N, out_dtype, kernel) -> torch.Tensor:
    _check_fp8("a1", a1, 2)
    _check_fp8("b1_ENK", b1_ENK, 3)
    _check_groups(counts_E, b1_ENK)
    check_device(a1, sa1, b1_ENK, sb1, counts_E)
    if a2 is not None and (
        a2.shape != a1.shape
        or b2_ENK.shape != b1_ENK.shape
        or idx_N is not None
        or a2.stride() != a1.stride()
        or sa2.stride() != sa1.stride()
        or b2_ENK.stride() != b1_ENK.stride()
        or sb2.stride() != sb1.stride()
    ):
        raise ValueError(
            "the second (a, b) pair must match the first one's shapes and layouts, and rows are not gathered"
        )
    num_experts, width, depth = b1_ENK.shape
    if a1.shape[1] != depth:
        raise ValueError(f"a1 has {a1.shape[1]} columns but b1_ENK reduces over {depth}")
    num_rows = idx_N.shape[0] if idx_N is not None else a1.shape[0]
    c = torch.empty(num_rows, width, dtype=out_dtype, device=a1.device)
    if num_rows == 0 or width == 0:
        return c
    if depth == 0:
        return c.zero_()

    def launch(cfg: TileConfig) -> None:
        map_3T, _ = tile_map(counts_E, num_rows, cfg.block_m)
        _fp8_grouped_mm_kernel[(map_3T.shape[1] * cdiv(width, cfg.block_n),)](
            a1,
            a2 if a2 is not None else a1,
            sa1,
            sa2 if a2 is not None else sa1,
            idx_N if idx_N is not None else map_3T,
            b1_ENK,
            b2_ENK if a2 is not None else b1_ENK,
            sb1,
            sb2 if a2 is not None else sb1,
            c,
            map_3T,
            num_experts,
            map_3T.shape[1],
            depth,
            width,
            a1.stride(0),
            sa1.stride(0),
            b1_ENK.stride(0),
            b1_ENK.stride(1),
            *sb1.stride(),
            GATHER=idx_N is not None,
            HAS_SECOND=a2 is not None,
            EVEN_K=depth % cfg.block_k == 0,
            EVEN_N=width % cfg.block_n == 0,
            **_launch(cfg, a1.dtype),
        )

    launch(tiles.pick(kernel, a1.dtype, a1.device, depth, width, num_rows, num_experts, launch))
    return c


@kernel_op("fp8_grouped_mm")
def fp8_grouped_mm(
    a1: torch.Tensor,
    scale_a1: torch.Tensor,
    b1_ENK: torch.Tensor,
    scale_b1: torch.Tensor,
    a2: torch.Tensor | None,
    scale_a2: torch.Tensor | None,
    b2_ENK: torch.Tensor | None,
    scale_b2: torch.Tensor | None,
    tokens_per_expert_E: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """c[rows of e] = a1[rows of e] @ b1_ENK[e]^T (+ the same for a2, b2), out_dtype; the a's FP8 in 1 x G groups
    (scale_a: (rows, cdiv(K, G))), the b's FP8 in G x G blocks, K-major (a column slice of N is a view), scale_b
    indexed [e, n // G, k // G]."""
    return _fp8_mm(
        a1,
        scale_a1,
        b1_ENK,
        scale_b1,
        a2,
        scale_a2,
        b2_ENK,
        scale_b2,
        tokens_per_expert_E,
        None,
        out_dtype,
        "fp8_mm" if a2 is None else "fp8_dx",
    )


@fp8_grouped_mm.register_fake
def _(a1, scale_a1, b1_ENK, scale_b1, a2, scale_a2, b2_ENK, scale_b2, tokens_per_expert_E, out_dtype):
    return a1.new_empty(a1.shape[0], b1_ENK.shape[1], dtype=out_dtype)


@kernel_op("fp8_swiglu_down_bwd")
def fp8_swiglu_down_bwd(
    gq: torch.Tensor,
    scale_g: torch.Tensor,
    token_ids_N: torch.Tensor | None,
    w2_EFH: torch.Tensor,
    scale2_EFH: torch.Tensor,
    h1_NF: torch.Tensor,
    h3_NF: torch.Tensor,
    row_weights_N: torch.Tensor | None,
    tokens_per_expert_E: torch.Tensor,
    reuse_h: bool,
    fmt: str,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]:
    """(dh1, dh3, a_scaled, grad_row_weights, dh1q, scale_dh1, dh3q, scale_dh3): grouped_gemm.swiglu_down_bwd
    with FP8 inputs (gq in 1 x G groups, read at rows token_ids_N when given; w2_EFH, the FP8 w2 in its own
    layout, with scale2_EFH indexed [e, f // G, h // G]) and, besides the results in h1's dtype (for the weight
    gradients), dh1 and dh3 quantised in 1 x G groups (for the input gradient). reuse_h: as there."""
    if reuse_h and not (h1_NF.is_contiguous() and h3_NF.is_contiguous()):
        raise ValueError("reuse_h writes over h1_NF and h3_NF, which must then be contiguous")
    h1_NF, h3_NF = h1_NF.contiguous(), h3_NF.contiguous()
    num_rows, ffn = h1_NF.shape
    consts = _format_of(gq, fmt)
    has_w = row_weights_N is not None
    da = _fp8_mm(
        gq,
        scale_g,
        w2_EFH,
        scale2_EFH,
        None,
        None,
        None,
        None,
        tokens_per_expert_E,
        token_ids_N,
        h1_NF.dtype,
        "fp8_down_bwd",
    )
    dh3, a = (h3_NF, h1_NF) if reuse_h else (torch.empty_like(h1_NF), torch.empty_like(h1_NF))
    grad_w = torch.empty(num_rows if has_w else 0, dtype=torch.float32, device=h1_NF.device)
    q1, q3 = (torch.empty(num_rows, ffn, dtype=gq.dtype, device=gq.device) for _ in range(2))
    s1, s3 = (torch.empty(num_rows, cdiv(ffn, GROUP), dtype=torch.float32, device=gq.device) for _ in range(2))
    if num_rows == 0 or ffn == 0:
        return da, dh3, a, grad_w.zero_(), q1, s1, q3, s3
    block_r = 16 if interpreting() else 8
    # dh1 is written over da: every element is read and then written by the same program in one step
    _fp8_swiglu_bwd_kernel[(cdiv(num_rows, block_r),)](
        da,
        h1_NF,
        h3_NF,
        row_weights_N.float().contiguous() if row_weights_N is not None else da,
        da,
        dh3,
        a,
        grad_w if has_w else da,
        q1,
        q3,
        s1,
        s3,
        num_rows,
        ffn,
        HAS_W=has_w,
        **consts,
        BLOCK_R=block_r,
        GROUP=GROUP,
        num_warps=4,
    )
    return da, dh3, a, grad_w, q1, s1, q3, s3


@fp8_swiglu_down_bwd.register_fake
def _(gq, scale_g, token_ids_N, w2_EFH, scale2_EFH, h1_NF, h3_NF, row_weights_N, tokens_per_expert_E, reuse_h, fmt):
    num_rows, ffn = h1_NF.shape
    num_w = num_rows if row_weights_N is not None else 0
    q = gq.new_empty(num_rows, ffn)
    s = gq.new_empty(num_rows, cdiv(ffn, GROUP), dtype=torch.float32)
    return (
        torch.empty_like(h1_NF),
        torch.empty_like(h1_NF),
        torch.empty_like(h1_NF),
        h1_NF.new_empty(num_w, dtype=torch.float32),
        q,
        s,
        torch.empty_like(q),
        torch.empty_like(s),
    )
