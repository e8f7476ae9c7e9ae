"""The Triton kernels of the routed experts' weight gradients, dW_e = A_e^T B_e over expert e's rows (the op that
launches them, and the choice of engine, are in grouped_wgrad.py).

# T tokens, H hidden, F expert ffn, E experts, N rows (expert-major: expert e owns tokens_per_expert_E[e] rows)

  _grouped_wgrad_kernel       tile group 1: one program per (expert, output tile), experts longest first
  _grouped_wgrad_flat_kernel  tile group G > 1: one program per (G consecutive experts, output tile), one flat loop
                              over their row tiles that stores and resets the accumulators at each expert's end
Both sum each expert's rows in order into fp32 accumulators and write every output element from one program:
deterministic, no atomics.

The epilogue (``_store_tile``) writes the result in c's dtype, or with ACCUMULATE adds it into an fp32 c that
already holds a gradient: the parameter's .grad itself, so no bf16 result is written, read back and added by a
pass of its own. Whether c holds one is a device flag (``flags[flag]`` nonzero), read by every program, so the
first micro-batch of a step stores and the later ones add without the host knowing which is which.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _store_tile_desc(c_desc, e, m0, n0, acc, flags_ptr, flag, ACCUMULATE: tl.constexpr):
    value = acc.reshape(1, acc.shape[0], acc.shape[1])
    if ACCUMULATE:
        if tl.load(flags_ptr + flag) != 0:
            c_desc.atomic_add([e, m0, n0], value)
            return
    c_desc.store([e, m0, n0], value.to(c_desc.dtype))


@triton.jit
def _store_tile_load(c_ptr, offs, acc, mask, flags_ptr, flag, EVEN: tl.constexpr, ACCUMULATE: tl.constexpr):
    if ACCUMULATE:
        keep = (tl.zeros_like(offs) + tl.load(flags_ptr + flag)) != 0
        if EVEN:
            acc += tl.load(c_ptr + offs, mask=keep, other=0.0)
        else:
            acc += tl.load(c_ptr + offs, mask=mask & keep, other=0.0)
    if EVEN:
        tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty))
    else:
        tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_tile(c_ptr, offs, acc, mask, flags_ptr, flag, EVEN: tl.constexpr, ACCUMULATE: tl.constexpr):
    """c[offs] = acc (masked unless EVEN); with ACCUMULATE, c[offs] += acc where flags[flag] is set (c's old
    values are read only then: an uninitialised target is fine). The add is an atomic one: c's old tile never
    enters registers (loaded beside a 128 x 128 fp32 accumulator it spilled on sm_90), and each element has one
    program adding into it, so the sum is deterministic (one fp32 add, as a load, add and store would make)."""
    if ACCUMULATE:
        if tl.load(flags_ptr + flag) != 0:
            if EVEN:
                tl.atomic_add(c_ptr + offs, acc, sem="relaxed")
            else:
                tl.atomic_add(c_ptr + offs, acc, mask=mask, sem="relaxed")
            return
    if EVEN:
        tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty))
    else:
        tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)


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


@triton.jit(do_not_specialize=["flag1", "flag2"])  # one compile whichever flag a launch reads
def _grouped_wgrad_kernel(
    a_ptr,  # (T or N, M) fp, row stride stride_a, unit column stride; row n read at a_idx[n] when A_GATHER
    a_idx_ptr,  # (N,) int32/int64 (A_GATHER and B_GATHER are exclusive)
    b1_ptr,
    b2_ptr,  # (T or N, NC) dtype of a, row stride stride_b; b2 read when HAS_SECOND
    b_idx_ptr,  # (N,) int32/int64 (read when B_GATHER)
    c1_ptr,
    c2_ptr,  # (E, M, NC) dtype of a (fp32 with ACCUMULATE), contiguous: c[e] = A_e^T B_e
    flags_ptr,  # int32: flags[flag1], flags[flag2] nonzero where c1, c2 already hold a gradient (ACCUMULATE)
    flag1,
    flag2,
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
    ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    MODE: tl.constexpr = 1,
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
    mask = (offs_m < M)[:, None] & (offs_n < NC)[None, :]
    even: tl.constexpr = EVEN_M and EVEN_N
    if MODE == 3:
        num_pid_n = (NC + BLOCK_N - 1) // BLOCK_N
        pid_mn = tl.program_id(0) % (((M + BLOCK_M - 1) // BLOCK_M) * num_pid_n)
        m0 = (pid_mn // num_pid_n) * BLOCK_M
        n0 = (pid_mn % num_pid_n) * BLOCK_N
        _store_tile_desc(c1_ptr, e, m0, n0, acc1, flags_ptr, flag1, ACCUMULATE)
        if HAS_SECOND:
            _store_tile_desc(c2_ptr, e, m0, n0, acc2, flags_ptr, flag2, ACCUMULATE)
    elif MODE == 2:
        _store_tile_load(c1_ptr, c_offs, acc1, mask, flags_ptr, flag1, even, ACCUMULATE)
        if HAS_SECOND:
            _store_tile_load(c2_ptr, c_offs, acc2, mask, flags_ptr, flag2, even, ACCUMULATE)
    else:
        _store_tile(c1_ptr, c_offs, acc1, mask, flags_ptr, flag1, even, ACCUMULATE)
        if HAS_SECOND:
            _store_tile(c2_ptr, c_offs, acc2, mask, flags_ptr, flag2, even, ACCUMULATE)


@triton.jit(do_not_specialize=["flag1", "flag2"])
def _grouped_wgrad_flat_kernel(
    a_ptr,
    a_idx_ptr,
    b1_ptr,
    b2_ptr,
    b_idx_ptr,
    c1_ptr,
    c2_ptr,
    flags_ptr,
    flag1,
    flag2,  # as in _grouped_wgrad_kernel
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
    ACCUMULATE: tl.constexpr,
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
        c_e = e.to(tl.int64) * M * NC + c_offs
        _store_tile(c1_ptr, c_e, acc1, c_mask, flags_ptr, flag1, False, ACCUMULATE)
        if HAS_SECOND:
            _store_tile(c2_ptr, c_e, acc2, c_mask, flags_ptr, flag2, False, ACCUMULATE)
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
        _store_tile(c1_ptr, c_e, acc1, c_mask, flags_ptr, flag1, False, ACCUMULATE)
        acc1 = tl.where(last, 0.0, acc1)
        if HAS_SECOND:
            _store_tile(c2_ptr, c_e, acc2, c_mask, flags_ptr, flag2, False, ACCUMULATE)
            acc2 = tl.where(last, 0.0, acc2)
        e_cur = e_nxt
