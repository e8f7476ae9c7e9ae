"""FP8 weight gradients of the routed experts: dW_e = A_e^T B_e over expert e's rows, with both operands quantised
in 128 x 1 groups down their columns (DeepSeek-V3's scaling for these GEMMs: the groups run along the reduction,
which here is the expert's rows).

# T tokens, H hidden, F expert ffn, E experts, N rows (expert-major); G = 128 (fp8_quant.GROUP); J column groups

Hopper's FP8 matrix instructions take both operands K-major, so the quantised operands are written transposed:
  quantize_cols(x, idx_N, groups) -> (q_CP, scale_JC)   column c of the rows x[idx_N] (or x), expert by expert, in
                                   groups of G rows: q[c, j * G + i] is row i of group j, scaled by scale[j, c]
  fp8_wgrad(aq, sa, bq, sb, groups, out_dtype) -> (E, M, NC)   c[e] = A_e^T B_e from two such operands
Each expert's rows start a new group (``column_groups``: a group never holds two experts' rows), so the padded
column axis P = J * G holds at most G - 1 zero columns per expert past its rows; J is bounded on the host without
reading the counts (cdiv(N, G) + E), and the groups past the last expert's are never written nor read.

In the fused backward (fp8_experts.py, kernels.wgrad = "fp8"): dW2 from w * a and g[tok], dW1, dW3 from x[tok] and
dh1, dh3; x[tok] and g[tok] are quantised straight from x and grad_out by token id (the gathers the Hopper bf16 path
makes in bf16 anyway), w * a, dh1 and dh3 from the SwiGLU backward pass's bf16 outputs (a pass of their own).
_fp8_wgrad_kernel: one program per (expert, output tile), experts with most rows first; each group's product in a
fresh fp32 accumulator, times the two column scales, added into the result (the promotion of fp8_gemm_kernels.py);
tiles wider than G columns run as two halves as there. Operands by tensor descriptor where fp8_gemm.uses_tma.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from xmoe.kernels import launches, tiles
from xmoe.kernels._common import cdiv, check_device, check_index, interpreting, kernel_op
from xmoe.kernels.fp8_gemm import _check_fp8, _descriptors, _format_of, _launch, uses_tma
from xmoe.kernels.fp8_quant import FORMATS, GROUP, _group_scale, _store_fp8, format_constexprs
from xmoe.kernels.tiles import TileConfig


class ColumnGroups(NamedTuple):
    """How an expert-major (N, C) operand's rows fall into G-row groups: bounds_3E (int32) row start, row end and
    first group of each expert; expert_J (int32) each group's expert (E past the last expert's groups)."""

    bounds_3E: torch.Tensor
    expert_J: torch.Tensor


def column_groups(counts_E: torch.Tensor, num_rows: int) -> ColumnGroups:
    """The groups of rows counted by counts_E (N = num_rows in all), computed on the device: no host sync."""
    check_index("tokens_per_expert_E", counts_E, 1)
    counts = counts_E.to(torch.int64)
    groups_E = (counts + GROUP - 1) // GROUP
    row_end, group_end = torch.cumsum(counts, 0), torch.cumsum(groups_E, 0)
    slots = torch.arange(cdiv(num_rows, GROUP) + counts_E.shape[0], device=counts_E.device)
    bounds = torch.stack([row_end - counts, row_end, group_end - groups_E]).to(torch.int32)
    return ColumnGroups(bounds, torch.searchsorted(group_end, slots, right=True).to(torch.int32))


@triton.jit
def _quant_cols_kernel(
    x_ptr,  # (T or N, C) fp32/bf16/fp16, row stride stride_x, unit column stride; row n read at idx[n] when GATHER
    idx_ptr,  # (N,) int32/int64 (read when GATHER)
    q_ptr,  # (C, P) FP8 (float32 under the interpreter), contiguous
    s_ptr,  # (J, C) fp32, contiguous
    bounds_ptr,  # (3, E) int32: row start, row end, first group of each expert
    expert_ptr,  # (J,) int32: each group's expert
    E,
    C,
    P,
    stride_x,
    GATHER: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_EXP: tl.constexpr,
    BLOCK_C: tl.constexpr,
    GROUP: tl.constexpr,
):
    j = tl.program_id(0)
    e = tl.load(expert_ptr + j)
    if e >= E:  # past the last expert's groups
        return
    row0 = tl.load(bounds_ptr + e) + (j - tl.load(bounds_ptr + 2 * E + e)) * GROUP
    offs_i = tl.arange(0, GROUP)
    rows = row0 + offs_i
    in_e = rows < tl.load(bounds_ptr + E + e)
    src = tl.load(idx_ptr + rows, mask=in_e, other=0).to(tl.int64) if GATHER else rows.to(tl.int64)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_c = offs_c < C
    # loaded in transposed order (columns down, rows across), so the compiler lays the tile out for the stores
    v = tl.load(x_ptr + src[None, :] * stride_x + offs_c[:, None], mask=in_c[:, None] & in_e[None, :], other=0.0)
    v = v.to(tl.float32)
    scale, inv = _group_scale(tl.max(tl.abs(v), axis=1), FP8_MAX)
    cols = (j * GROUP + offs_i).to(tl.int64)  # a group's rows past its expert's end are written as zeros
    _store_fp8(q_ptr + offs_c.to(tl.int64)[:, None] * P + cols[None, :], v * inv[:, None], in_c[:, None], MIN_EXP)
    tl.store(s_ptr + j * C + offs_c, scale, mask=in_c)


@kernel_op("fp8_quantize_cols")
def quantize_cols(
    x: torch.Tensor, idx_N: torch.Tensor | None, bounds_3E: torch.Tensor, expert_J: torch.Tensor, fmt: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_CP, scale_JC): the rows x[idx_N] (or x, expert-major) in G x 1 groups of format ``fmt``, transposed and
    grouped as ``column_groups`` (bounds_3E, expert_J) says: row i of group j, column c is about
    q[c, j*G + i] * scale[j, c]."""
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x must be a 2-D float tensor, got shape {tuple(x.shape)} and dtype {x.dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if idx_N is not None:
        check_index("idx_N", idx_N, 1)
    check_device(x, bounds_3E, expert_J)
    form = FORMATS[fmt]
    slots, cols, experts = expert_J.shape[0], x.shape[1], bounds_3E.shape[1]
    num_rows = idx_N.shape[0] if idx_N is not None else x.shape[0]
    if slots != cdiv(num_rows, GROUP) + experts:
        raise ValueError(
            f"the column groups ({slots} slots for {experts} experts) are not column_groups' of {num_rows} rows "
            f"({'idx_N' if idx_N is not None else 'x'}'s length)"
        )
    q = torch.empty(cols, slots * GROUP, dtype=form.storage(), device=x.device)
    scale = torch.empty(slots, cols, dtype=torch.float32, device=x.device)
    if slots == 0 or cols == 0 or experts == 0:
        return q, scale
    block_c = 32 if interpreting() else 64
    _quant_cols_kernel[(slots, cdiv(cols, block_c))](
        x,
        idx_N if idx_N is not None else expert_J,
        q,
        scale,
        bounds_3E,
        expert_J,
        experts,
        cols,
        slots * GROUP,
        x.stride(0),
        GATHER=idx_N is not None,
        **format_constexprs(form),
        BLOCK_C=block_c,
        GROUP=GROUP,
        num_warps=4,
    )
    return q, scale


@quantize_cols.register_fake
def _(x, idx_N, bounds_3E, expert_J, fmt):
    slots = expert_J.shape[0]
    return (
        x.new_empty(x.shape[1], slots * GROUP, dtype=FORMATS[fmt].storage()),
        x.new_empty(slots, x.shape[1], dtype=torch.float32),
    )


@triton.jit
def _wgrad_step(
    acc, a, b_ptr, sb_ptr, sa, k0, j, n0, NC, P, B_TMA: tl.constexpr, EVEN_N: tl.constexpr, WIDTH: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """acc + (a b^T over one BLOCK_K step from column k0) * sa[:, None] * sb[j, n]: b's rows n0 .. n0 + WIDTH of a
    (NC, P) operand, K-major."""
    offs_n = n0 + tl.arange(0, WIDTH)
    if B_TMA:
        b = b_ptr.load([n0, k0]).T
    else:
        ptrs = b_ptr + offs_n.to(tl.int64)[None, :] * P + (k0 + tl.arange(0, BLOCK_K))[:, None]
        b = tl.load(ptrs) if EVEN_N else tl.load(ptrs, mask=(offs_n < NC)[None, :], other=0.0)
    sb = tl.load(sb_ptr + j * NC + offs_n, mask=offs_n < NC, other=0.0)
    return acc + tl.dot(a, b, input_precision=DOT_PRECISION) * (sa[:, None] * sb[None, :])


@triton.jit
def _fp8_wgrad_kernel(
    a_ptr,  # (M, P) FP8, contiguous (or its tensor descriptor when A_TMA): quantize_cols of A
    sa_ptr,  # (J, M) fp32
    b_ptr,  # (NC, P) FP8, contiguous (or its tensor descriptor when B_TMA): quantize_cols of B
    sb_ptr,  # (J, NC) fp32
    c_ptr,  # (E, M, NC) out dtype, contiguous: c[e] = A_e^T B_e
    bounds_ptr,  # (3, E) int32: row start, row end, first group of each expert
    order_ptr,  # (E,) int64: experts by decreasing row count
    E,
    M,
    NC,
    P,
    A_TMA: tl.constexpr,
    B_TMA: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    HALVES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # programs expert-major (longest first), then over the (M, NC) output tiles row by row
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M
    num_pid_n = (NC + BLOCK_N - 1) // BLOCK_N
    pid = tl.program_id(0)
    e = tl.load(order_ptr + pid // (num_pid_m * num_pid_n)).to(tl.int32)
    m0 = (pid % (num_pid_m * num_pid_n)) // num_pid_n * BLOCK_M
    n0 = (pid % num_pid_n) * BLOCK_N
    n_e = tl.load(bounds_ptr + E + e) - tl.load(bounds_ptr + e)
    g0 = tl.load(bounds_ptr + 2 * E + e)
    HALF: tl.constexpr = BLOCK_N // 2 if HALVES else BLOCK_N
    offs_m = m0 + tl.arange(0, BLOCK_M)
    if not A_TMA:
        a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * P + tl.arange(0, BLOCK_K)[None, :]
    acc_lo = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
    acc_hi = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
    for step in range(((n_e + GROUP - 1) // GROUP) * (GROUP // BLOCK_K)):
        j = g0 + step // (GROUP // BLOCK_K)
        k0 = g0 * GROUP + step * BLOCK_K
        if A_TMA:
            a = a_ptr.load([m0, k0])
        elif EVEN_M:
            a = tl.load(a_ptrs + k0)
        else:
            a = tl.load(a_ptrs + k0, mask=(offs_m < M)[:, None], other=0.0)
        sa = tl.load(sa_ptr + j * M + offs_m, mask=offs_m < M, other=0.0)
        acc_lo = _wgrad_step(
            acc_lo, a, b_ptr, sb_ptr, sa, k0, j, n0, NC, P, B_TMA, EVEN_N, HALF, BLOCK_K, DOT_PRECISION
        )
        if HALVES:
            acc_hi = _wgrad_step(
                acc_hi, a, b_ptr, sb_ptr, sa, k0, j, n0 + HALF, NC, P, B_TMA, EVEN_N, HALF, BLOCK_K, DOT_PRECISION
            )
    c_ptrs = c_ptr + e.to(tl.int64) * M * NC + offs_m.to(tl.int64)[:, None] * NC
    in_m = (offs_m < M)[:, None]
    offs_lo = n0 + tl.arange(0, HALF)
    tl.store(c_ptrs + offs_lo[None, :], acc_lo.to(c_ptr.dtype.element_ty), mask=in_m & (offs_lo < NC)[None, :])
    if HALVES:
        offs_hi = offs_lo + HALF
        tl.store(c_ptrs + offs_hi[None, :], acc_hi.to(c_ptr.dtype.element_ty), mask=in_m & (offs_hi < NC)[None, :])


@kernel_op("fp8_wgrad")
def fp8_wgrad(
    aq_MP: torch.Tensor,
    scale_a: torch.Tensor,
    bq_NP: torch.Tensor,
    scale_b: torch.Tensor,
    bounds_3E: torch.Tensor,
    fmt: str,
    out_dtype: torch.dtype,
    autotune: bool = False,
) -> torch.Tensor:
    """c (E, M, NC) in out_dtype: c[e] = A_e^T B_e from aq_MP, bq_NP = quantize_cols of A (N, M) and B (N, NC) over
    the same column_groups (bounds_3E), scale_a (J, M) and scale_b (J, NC) their scales. ``autotune``: the
    caller's kernels.autotune (tiles.pick)."""
    _check_fp8("aq_MP", aq_MP, 2)
    _check_fp8("bq_NP", bq_NP, 2)
    check_index("bounds_3E", bounds_3E, 2)
    check_device(aq_MP, scale_a, bq_NP, scale_b, bounds_3E)
    if aq_MP.shape[1] != bq_NP.shape[1] or scale_a.shape[0] != scale_b.shape[0]:
        raise ValueError(
            f"aq_MP {tuple(aq_MP.shape)} and bq_NP {tuple(bq_NP.shape)} must come from one column_groups layout"
        )
    consts = _format_of(aq_MP, fmt)
    del consts  # checked: the kernel takes FP8 values as they are
    launches.count("wgrad", "fp8")
    (width_a, cols), width_b, experts = aq_MP.shape, bq_NP.shape[0], bounds_3E.shape[1]
    aq_MP, bq_NP = aq_MP.contiguous(), bq_NP.contiguous()
    c = torch.empty(experts, width_a, width_b, dtype=out_dtype, device=aq_MP.device)
    if experts == 0 or width_a == 0 or width_b == 0:
        return c
    if cols == 0:
        return c.zero_()
    counts_E = bounds_3E[1] - bounds_3E[0]
    order_E = torch.argsort(counts_E, descending=True)  # longest reductions first: a shorter tail when skewed
    tma = uses_tma(aq_MP.device)

    def launch(cfg: TileConfig) -> None:
        halves = cfg.block_n > GROUP
        (a,), a_tma = _descriptors((aq_MP,), [cfg.block_m, cfg.block_k], tma)
        (b,), b_tma = _descriptors((bq_NP,), [cfg.block_n // 2 if halves else cfg.block_n, cfg.block_k], tma)
        grid = (experts * cdiv(width_a, cfg.block_m) * cdiv(width_b, cfg.block_n),)
        _fp8_wgrad_kernel[grid](
            a,
            scale_a,
            b,
            scale_b,
            c,
            bounds_3E,
            order_E,
            experts,
            width_a,
            width_b,
            cols,
            A_TMA=a_tma,
            B_TMA=b_tma,
            EVEN_M=width_a % cfg.block_m == 0,
            EVEN_N=width_b % cfg.block_n == 0,
            HALVES=halves,
            **_launch(cfg, aq_MP.dtype),
        )

    launch(tiles.pick("fp8_wgrad", aq_MP.dtype, aq_MP.device, width_a, width_b, cols, experts, launch, autotune))
    return c


@fp8_wgrad.register_fake
def _(aq_MP, scale_a, bq_NP, scale_b, bounds_3E, fmt, out_dtype, autotune=False):
    return aq_MP.new_empty(bounds_3E.shape[1], aq_MP.shape[0], bq_NP.shape[0], dtype=out_dtype)
