"""Weight gradients of grouped GEMMs over uneven, contiguous row groups: dW_e = A_e^T B_e over expert e's rows.

# T tokens, H hidden, F expert ffn, E experts, N rows (expert-major: expert e owns tokens_per_expert_E[e] rows)

In the fused path: dW2_e = (w a)_e^T g[tok]_e (rows of g gathered by token id) and dW1_e, dW3_e = x[tok]_e^T
(dh1_e, dh3_e) in one pass over the gathered x rows (two accumulators). Two kernels, chosen per launch by the
tile config's ``group`` (xmoe/kernels/tiles.py):
  _grouped_wgrad_kernel       group 1: one program per (expert, output tile), experts longest first
  _grouped_wgrad_flat_kernel  group G > 1: one program per (G consecutive experts, output tile), one flat loop
                              over their row tiles that stores and resets the accumulators at each expert's end
Both sum each expert's rows in order into fp32 accumulators and write every output element from one program:
deterministic, no atomics. Split-K over the rows was not taken: at these shapes there are 10^4-10^5 output tiles
per launch (E * H/128 * F/128), so splitting adds fp32 partial buffers the size of the gradients (~15 GB per
weight on the large shape) to shorten reductions that are already short.

The Hopper path (``wgrad_engine``): on sm_90 the same products can run as ``torch._grouped_mm`` over row-gathered
operands (PyTorch's grouped GEMM, a TMA-fed, warp-specialised kernel with no split-K), at the cost of one
transient (N, H) gathered buffer. On an H200 it is faster at every model shape, but the gathered buffer is worth
its memory only where experts are many and short (E >= 128, at most 1024 rows each); docs/kernels-log.md has the
measurements (benchmarks/results/layer/per_gemm.md, bench_experts_wgrad.md, bench_experts_small_grouped_mm.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xmoe.kernels import launches, tiles
from xmoe.kernels._common import cdiv, check_device, check_index, kernel_op
from xmoe.kernels.grouped_gemm import _launch_kwargs, tile_map
from xmoe.kernels.tiles import TileConfig


@triton.jit
def _wgrad_dots(
    acc1,
    acc2,
    a_ptr,
    b1_ptr,
    b2_ptr,
    src_a,
    src_b,
    in_group,
    offs_m,
    offs_n,
    M,
    NC,
    stride_a,
    stride_b,
    HAS_SECOND: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One reduction step of both wgrad kernels: acc1 += A^T B1 (and acc2 += A^T B2) over BLOCK_K rows whose
    source rows are src_a / src_b; rows past the group load a real row (finite) and are zeroed in A^T alone."""
    if EVEN_M:
        at = tl.load(a_ptr + src_a[None, :] * stride_a + offs_m[:, None], mask=in_group[None, :], other=0.0)
    else:
        at = tl.load(
            a_ptr + src_a[None, :] * stride_a + offs_m[:, None],
            mask=in_group[None, :] & (offs_m < M)[:, None],
            other=0.0,
        )
    if EVEN_N:
        b1 = tl.load(b1_ptr + src_b[:, None] * stride_b + offs_n[None, :])
    else:
        b1 = tl.load(b1_ptr + src_b[:, None] * stride_b + offs_n[None, :], mask=(offs_n < NC)[None, :], other=0.0)
    acc1 = tl.dot(at, b1, acc1, input_precision=DOT_PRECISION)
    if HAS_SECOND:
        if EVEN_N:
            b2 = tl.load(b2_ptr + src_b[:, None] * stride_b + offs_n[None, :])
        else:
            b2 = tl.load(b2_ptr + src_b[:, None] * stride_b + offs_n[None, :], mask=(offs_n < NC)[None, :], other=0.0)
        acc2 = tl.dot(at, b2, acc2, input_precision=DOT_PRECISION)
    return acc1, acc2


@triton.jit
def _output_tile(order_ptr, M, NC, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(entry of order_ptr this program works for, its output rows, its output columns): programs run
    order-major, then over the (M, NC) output tiles row by row."""
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M
    num_pid_n = (NC + BLOCK_N - 1) // BLOCK_N
    pid = tl.program_id(0)
    item = tl.load(order_ptr + pid // (num_pid_m * num_pid_n)).to(tl.int32)
    pid_mn = pid % (num_pid_m * num_pid_n)
    offs_m = (pid_mn // num_pid_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (pid_mn % num_pid_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    return item, offs_m, offs_n


@triton.jit
def _grouped_wgrad_kernel(
    a_ptr,  # (T or N, M) fp, row stride stride_a, unit column stride; row n read at a_idx[n] when A_GATHER
    a_idx_ptr,  # (N,) int32/int64 (A_GATHER and B_GATHER are exclusive)
    b1_ptr,
    b2_ptr,  # (T or N, NC) dtype of a, row stride stride_b; b2 read when HAS_SECOND
    b_idx_ptr,  # (N,) int32/int64 (read when B_GATHER)
    c1_ptr,
    c2_ptr,  # (E, M, NC) dtype of a, contiguous: c[e] = A_e^T B_e
    bounds_ptr,  # (3, E) int32 from _tile_map_kernel: first row and end row of each expert (third row unused)
    order_ptr,  # (E,) int64: experts by decreasing row count, so the longest reductions start first
    E,
    M,
    NC,
    stride_a,
    stride_b,
    A_GATHER: tl.constexpr,
    B_GATHER: tl.constexpr,
    HAS_SECOND: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    e, offs_m, offs_n = _output_tile(order_ptr, M, NC, BLOCK_M, BLOCK_N)
    row_start = tl.load(bounds_ptr + e)
    row_end = tl.load(bounds_ptr + E + e)
    offs_k = tl.arange(0, BLOCK_K)
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # gathered rows: the row ids of block i+1 are loaded during block i, so the tile loads of the pipelined loop
    # depend on a loop-carried value, not on a load of the same iteration. With the ids loaded in-iteration the
    # sm_90 TTGIR waits for all copies every step (async_wait num=0: one tile in flight) and uses half the shared
    # memory; carried, the full depth comes back (num=6 for dW1+dW3). H200, medium T=16384, 128x128x64, 3 stages:
    # dW1+dW3 9.33 -> 7.57 ms, dW2 4.24 -> 4.18 ms.
    idx_ptr = a_idx_ptr if A_GATHER else b_idx_ptr
    if A_GATHER or B_GATHER:
        src_next = tl.load(idx_ptr + row_start + offs_k, mask=row_start + offs_k < row_end, other=0)
    else:
        src_next = offs_k
    for r0 in range(row_start, row_end, BLOCK_K):  # the reduction runs over the expert's rows, in order
        rows = r0 + offs_k
        in_group = rows < row_end
        rows = tl.minimum(rows, row_end - 1)
        src = src_next.to(tl.int64)
        if A_GATHER or B_GATHER:
            src_next = tl.load(idx_ptr + tl.minimum(rows + BLOCK_K, row_end - 1))
        src_a = src if A_GATHER else rows.to(tl.int64)
        src_b = src if B_GATHER else rows.to(tl.int64)
        acc1, acc2 = _wgrad_dots(
            acc1,
            acc2,
            a_ptr,
            b1_ptr,
            b2_ptr,
            src_a,
            src_b,
            in_group,
            offs_m,
            offs_n,
            M,
            NC,
            stride_a,
            stride_b,
            HAS_SECOND,
            EVEN_M,
            EVEN_N,
            DOT_PRECISION,
        )
    c_offs = e.to(tl.int64) * M * NC + offs_m.to(tl.int64)[:, None] * NC + offs_n[None, :]
    if EVEN_M and EVEN_N:
        tl.store(c1_ptr + c_offs, acc1.to(c1_ptr.dtype.element_ty))
        if HAS_SECOND:
            tl.store(c2_ptr + c_offs, acc2.to(c2_ptr.dtype.element_ty))
    else:
        mask = (offs_m < M)[:, None] & (offs_n < NC)[None, :]
        tl.store(c1_ptr + c_offs, acc1.to(c1_ptr.dtype.element_ty), mask=mask)
        if HAS_SECOND:
            tl.store(c2_ptr + c_offs, acc2.to(c2_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grouped_wgrad_flat_kernel(
    a_ptr,
    a_idx_ptr,
    b1_ptr,
    b2_ptr,
    b_idx_ptr,
    c1_ptr,
    c2_ptr,  # as in _grouped_wgrad_kernel
    map_ptr,  # (3, map_width) int32 tile map with BLOCK_K-row tiles: expert, first row, end row of each tile
    bounds_ptr,  # (3, E) int32 of the same map: first row, end row, first row tile of each expert
    order_ptr,  # (cdiv(E, GROUP),) int64: groups of GROUP consecutive experts, by decreasing row count
    E,
    map_width,
    M,
    NC,
    stride_a,
    stride_b,
    GROUP: tl.constexpr,
    A_GATHER: tl.constexpr,
    B_GATHER: tl.constexpr,
    HAS_SECOND: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # One (m, n) output tile for GROUP consecutive experts, whose rows are consecutive too: one flat loop over
    # their row tiles, so the copy pipeline runs on across expert boundaries instead of refilling for each expert
    # (E = 256 at ~512 rows each: 16 row blocks per output tile). At an expert's last row tile the accumulators
    # are stored and reset. Each expert's rows are still summed in order, as in _grouped_wgrad_kernel.
    group, offs_m, offs_n = _output_tile(order_ptr, M, NC, BLOCK_M, BLOCK_N)
    e0 = group * GROUP
    offs_k = tl.arange(0, BLOCK_K)
    c_offs = offs_m.to(tl.int64)[:, None] * NC + offs_n[None, :]
    # a store happens under a scalar condition through its row bound (M or 0): one mask expression, no branch
    in_n = (offs_n < NC)[None, :]
    e_last = tl.minimum(e0 + GROUP, E) - 1
    acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in tl.static_range(GROUP):  # an expert with no rows owns no row tile: its gradient is written as 0 here
        e = tl.minimum(e0 + j, e_last)
        empty = (e0 + j <= e_last) & (tl.load(bounds_ptr + e) == tl.load(bounds_ptr + E + e))
        c_mask = (offs_m < tl.where(empty, M, 0))[:, None] & in_n
        tl.store(c1_ptr + e.to(tl.int64) * M * NC + c_offs, acc1.to(c1_ptr.dtype.element_ty), mask=c_mask)
        if HAS_SECOND:
            tl.store(c2_ptr + e.to(tl.int64) * M * NC + c_offs, acc2.to(c2_ptr.dtype.element_ty), mask=c_mask)
    t0 = tl.load(bounds_ptr + 2 * E + e0)
    t1 = (
        tl.load(bounds_ptr + 2 * E + e_last)
        + (tl.load(bounds_ptr + E + e_last) - tl.load(bounds_ptr + e_last) + BLOCK_K - 1) // BLOCK_K
    )
    # tile t's expert, rows and row ids are loaded one tile ahead and carried (loads that depend on a load of
    # the same iteration stall the copy pipeline, see _grouped_wgrad_kernel); clamped to a real tile
    tc = tl.maximum(tl.minimum(t0, t1 - 1), 0)
    e_cur = tl.load(map_ptr + tc)
    r0 = tl.load(map_ptr + map_width + tc)
    r_end = tl.load(map_ptr + 2 * map_width + tc)
    idx_ptr = a_idx_ptr if A_GATHER else b_idx_ptr
    if A_GATHER or B_GATHER:
        src_next = tl.load(idx_ptr + tl.minimum(r0 + offs_k, r_end - 1))
    else:
        src_next = offs_k
    for t in range(t0, t1):
        rows = r0 + offs_k
        in_group = rows < r_end
        rows = tl.minimum(rows, r_end - 1)
        src = src_next.to(tl.int64)
        tn = tl.minimum(t + 1, t1 - 1)
        e_nxt = tl.load(map_ptr + tn)
        r0 = tl.load(map_ptr + map_width + tn)
        r_end = tl.load(map_ptr + 2 * map_width + tn)
        if A_GATHER or B_GATHER:
            src_next = tl.load(idx_ptr + tl.minimum(r0 + offs_k, r_end - 1))
        src_a = src if A_GATHER else rows.to(tl.int64)
        src_b = src if B_GATHER else rows.to(tl.int64)
        acc1, acc2 = _wgrad_dots(
            acc1,
            acc2,
            a_ptr,
            b1_ptr,
            b2_ptr,
            src_a,
            src_b,
            in_group,
            offs_m,
            offs_n,
            M,
            NC,
            stride_a,
            stride_b,
            HAS_SECOND,
            EVEN_M,
            EVEN_N,
            DOT_PRECISION,
        )
        last = (t + 1 == t1) | (e_nxt != e_cur)  # this expert's last row tile: store, then start the next one
        c_e = e_cur.to(tl.int64) * M * NC + c_offs
        c_mask = (offs_m < tl.where(last, M, 0))[:, None] & in_n
        tl.store(c1_ptr + c_e, acc1.to(c1_ptr.dtype.element_ty), mask=c_mask)
        acc1 = tl.where(last, 0.0, acc1)
        if HAS_SECOND:
            tl.store(c2_ptr + c_e, acc2.to(c2_ptr.dtype.element_ty), mask=c_mask)
            acc2 = tl.where(last, 0.0, acc2)
        e_cur = e_nxt


@kernel_op("grouped_wgrad")
def grouped_wgrad(
    a: torch.Tensor,
    a_idx_N: torch.Tensor | None,
    b1: torch.Tensor,
    b2: torch.Tensor | None,
    b_idx_N: torch.Tensor | None,
    tokens_per_expert_E: torch.Tensor,
    wgrad: str = "auto",
    autotune: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(c1, c2): c[e] = A_e^T B_e over expert e's rows, A rows = a[a_idx_N] (or a), B rows = b[b_idx_N] (or b).
    c2 is empty when b2 is None. Without row ids, where ``wgrad_engine`` says so for ``wgrad`` (the caller's
    kernels.wgrad), by torch._grouped_mm; else by the Triton kernels, their tiles tuned with ``autotune``."""
    if a_idx_N is not None and b_idx_N is not None:
        raise ValueError("grouped_wgrad gathers the rows of a or of b, not both")
    a, b1 = a.contiguous(), b1.contiguous()
    b2 = b2.contiguous() if b2 is not None else None
    check_index("tokens_per_expert_E", tokens_per_expert_E, 1)
    check_device(a, b1, tokens_per_expert_E)
    if b1.dtype != a.dtype or (b2 is not None and b2.dtype != a.dtype):
        raise ValueError(f"wgrad operands must share one dtype, got {a.dtype} and {b1.dtype}")
    num_experts = tokens_per_expert_E.shape[0]
    width_a, width_b = a.shape[1], b1.shape[1]
    num_rows = a_idx_N.shape[0] if a_idx_N is not None else a.shape[0]
    engine = "triton"
    if a_idx_N is None and b_idx_N is None and num_experts > 0:
        engine = wgrad_engine(a, num_rows, num_experts, width_a, width_b, wgrad)
    launches.count("wgrad", engine, 1 if b2 is None else 2)
    if engine == "grouped_mm":
        offs_E = torch.cumsum(tokens_per_expert_E, 0, dtype=torch.int32)
        return (
            grouped_mm_wgrad(a, b1, offs_E),
            grouped_mm_wgrad(a, b2, offs_E) if b2 is not None else a.new_empty(0, width_a, width_b),
        )
    c1 = a.new_empty(num_experts, width_a, width_b)
    c2 = a.new_empty(num_experts if b2 is not None else 0, width_a, width_b)
    if num_rows == 0 or num_experts == 0:
        return c1.zero_(), c2.zero_()
    if width_a == 0 or width_b == 0:
        return c1, c2
    kernel = "wgrad2" if b2 is not None else "wgrad"
    operands = (a, a_idx_N, b1, b2, b_idx_N, c1, c2)

    def launch(cfg: TileConfig) -> None:
        _launch_wgrad(cfg, tokens_per_expert_E, num_rows, *operands)

    launch(tiles.pick(kernel, a.dtype, a.device, width_a, width_b, num_rows, num_experts, launch, autotune))
    return c1, c2


def _launch_wgrad(cfg, counts_E, num_rows, a, a_idx_N, b1, b2, b_idx_N, c1, c2) -> None:
    num_experts, width_a, width_b = c1.shape
    # operands past the flags: a launch reads a_idx / b_idx / b2 / c2 only when its flag says so
    common = (
        a,
        a_idx_N if a_idx_N is not None else counts_E,
        b1,
        b2 if b2 is not None else b1,
        b_idx_N if b_idx_N is not None else counts_E,
        c1,
        c2 if b2 is not None else c1,
    )
    flags = dict(
        A_GATHER=a_idx_N is not None,
        B_GATHER=b_idx_N is not None,
        HAS_SECOND=b2 is not None,
        EVEN_M=width_a % cfg.block_m == 0,
        EVEN_N=width_b % cfg.block_n == 0,
        **_launch_kwargs(cfg, a.dtype),
    )
    tiles_mn = cdiv(width_a, cfg.block_m) * cdiv(width_b, cfg.block_n)
    if cfg.group == 1:
        _, bounds_3E = tile_map(counts_E, num_rows, cfg.block_m)
        order_E = torch.argsort(counts_E, descending=True)  # longest-first: shorter tail when skewed
        _grouped_wgrad_kernel[(num_experts * tiles_mn,)](
            *common, bounds_3E, order_E, num_experts, width_a, width_b, a.stride(0), b1.stride(0), **flags
        )
        return
    # row tiles of block_k rows (the reduction step), so that no tile straddles two experts
    map_3T, bounds_3E = tile_map(counts_E, num_rows, cfg.block_k)
    num_groups = cdiv(num_experts, cfg.group)
    group_of_e = torch.arange(num_experts, device=counts_E.device) // cfg.group
    group_rows = torch.zeros(num_groups, dtype=counts_E.dtype, device=counts_E.device).index_add_(
        0, group_of_e, counts_E
    )
    order_G = torch.argsort(group_rows, descending=True)  # longest groups first, as for single experts
    _grouped_wgrad_flat_kernel[(num_groups * tiles_mn,)](
        *common,
        map_3T,
        bounds_3E,
        order_G,
        num_experts,
        map_3T.shape[1],
        width_a,
        width_b,
        a.stride(0),
        b1.stride(0),
        GROUP=cfg.group,
        **flags,
    )


@grouped_wgrad.register_fake
def _(a, a_idx_N, b1, b2, b_idx_N, tokens_per_expert_E, wgrad="auto", autotune=False):
    num_experts = tokens_per_expert_E.shape[0]
    return (
        a.new_empty(num_experts, a.shape[1], b1.shape[1]),
        a.new_empty(num_experts if b2 is not None else 0, a.shape[1], b1.shape[1]),
    )


# Where "auto" takes the Hopper path (module docstring): many experts with short reductions.
GROUPED_MM_MIN_EXPERTS = 128
GROUPED_MM_MAX_ROWS_PER_EXPERT = 1024


def _is_sm90(device_index: int) -> bool:
    # not functools.cache'd: dynamo traces this from the autograd Function's backward (and warns about caches);
    # torch keeps the device properties behind get_device_capability
    return torch.version.cuda is not None and torch.cuda.get_device_capability(device_index) == (9, 0)


def wgrad_engine(x: torch.Tensor, num_rows: int, num_experts: int, hidden: int, ffn: int, mode: str) -> str:
    """ "grouped_mm" or "triton": what computes the weight gradients for these operands (grouped_wgrad without row
    ids; the fused backward gathers its rows first when this says "grouped_mm"). hidden, ffn: the two widths.

    ``mode`` (the caller's ``kernels.wgrad``, from the Kernels value its layer was built with: choice.py):
    "triton" always the kernels above; "grouped_mm" torch._grouped_mm wherever it runs (bf16; on CPU also fp32 in
    builds with its CPU kernel; tests use this on CPU); "auto" grouped_mm on sm_90 in bf16 with at least
    GROUPED_MM_MIN_EXPERTS experts averaging at most GROUPED_MM_MAX_ROWS_PER_EXPERT rows; "fp8" (FP8 weight
    gradients, fp8_wgrad.py) as "auto" for the bf16 ones it does not concern. Either way H and F must be multiples
    of 8 (its 16-byte stride rule) and there must be rows; otherwise "triton"."""
    usable = (
        hasattr(torch, "_grouped_mm")
        and hidden % 8 == 0
        and ffn % 8 == 0
        and num_rows > 0
        # its GPU kernels and torch.compile's shape function take bf16 only; the CPU kernel fp32 too
        and (
            x.dtype == torch.bfloat16
            or (x.dtype == torch.float32 and x.device.type == "cpu" and not torch.compiler.is_compiling())
        )
    )
    if mode == "triton" or not usable:
        return "triton"
    if mode == "grouped_mm":
        return "grouped_mm"
    return (
        "grouped_mm"
        if (
            x.is_cuda
            and x.dtype == torch.bfloat16
            and _is_sm90(x.device.index or 0)
            and num_experts >= GROUPED_MM_MIN_EXPERTS
            and num_rows <= GROUPED_MM_MAX_ROWS_PER_EXPERT * num_experts
        )
        else "triton"
    )


def grouped_mm_wgrad(a_NM: torch.Tensor, b_NK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """c[e] = a_e^T b_e over the contiguous row groups ending at offs_E (int32 cumulative counts), by
    torch._grouped_mm; a and b are (N, M) and (N, K) rows already in expert order."""
    return torch._grouped_mm(a_NM.t(), b_NK, offs=offs_E)  # (E, M, K)
