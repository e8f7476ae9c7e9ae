"""Where an FP8 GEMM with fine-grained scales loses its time on Hopper: the per-step promotion, several ways, side by
side on dense GEMMs of the routed experts' sizes (C = A B^T, A in 1 x 128 groups, B in 128 x 128 blocks).

    python benchmarks/bench_fp8_promotion.py --out benchmarks/results/fp8

* ``triton fresh``: what xmoe's FP8 kernels do (fp8_gemm_kernels.py): each 128-deep step's product in a fresh
  accumulator, scaled and added; Triton waits for every product before its scaling (``pendings = 0``).
* ``gluon overlap``: the same arithmetic in Gluon (Triton's lower-level dialect) with the waits written out: step
  k's wgmma is issued before step k-1's product is waited for (``warpgroup_mma_wait(num_outstanding=1)``) and
  promoted, so one product is always in flight; TMA loads into a ring of stages. ``_gluon(..., overlap=False)``
  waits for each product at once (the overlap's own baseline, no longer in the list: it ran level with it).
* ``gluon ws``: a persistent warp-specialised Gluon kernel: one producer warp issues the TMA loads into a ring of
  stages (ready / empty mbarriers), two consumer warpgroups each own a 64-row half of the 128 x 128 tile and take
  turns at the tensor cores, so one half's scaling runs while the other's product is computed.
* ``cublas blockwise``: ``torch._scaled_mm`` with the same 1 x 128 / 128 x 128 scales (cuBLASLt's block scaling;
  refused or wrong where this torch's layout rules are not met: recorded per row).
* ``triton fresh, 256-deep groups``: the shipped loop with scales per 1 x 256 / 128 x 256 (every other 128-deep
  scale of the same data), so 256-deep steps and half the promotions; refused where K is not a multiple of 256.
* ``triton in-place``: one accumulator, no scales (128 or 256 deep), and ``cublas rowwise``: one scale per row
  (neither is the FP8 recipe: ceilings for these tiles and for the library).

128 x 128 x 128 tiles, tiles taken column-fastest (as xmoe's grouped FP8 kernels do), 3 or 4 stages. Each scaled
result is first checked against a float64 product of the dequantised inputs. Writes bench_fp8_promotion.json / .md
into --out; ``--variants`` picks variants by name. Needs a Hopper GPU and Triton's Gluon (Triton 3.6 or newer);
skips otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without PYTHONPATH

from benchmarks.harness import RESULTS_ENV, environment, results_dir, time_ms, write_results

G = 128  # scale group

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared  # renamed after Triton 3.6
except ImportError:  # no Gluon in this Triton
    gluon = None


if gluon is not None:

    @gluon.jit
    def _gluon_fp8_gemm(
        a_desc,
        b_desc,
        c_ptr,
        sa_ptr,
        sb_ptr,
        M,
        N,
        K,
        STAGES: gl.constexpr,
        OVERLAP: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        BM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        BN: gl.constexpr = b_desc.block_type.shape[0]
        pid_m = gl.program_id(0) // (N // BN)  # columns fastest: the programs running at once share rows of a
        pid_n = gl.program_id(0) % (N // BN)
        off_m = pid_m * BM
        off_n = pid_n * BN
        KG = K // BK
        a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
        b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
        for i in gl.static_range(STAGES):  # the ring filled: steps 0 .. STAGES-1
            mbarrier.init(bars.index(i), count=1)
            mbarrier.expect(bars.index(i), nbytes)
            tma_load(a_desc, [off_m, i * BK], bars.index(i), a_smem.index(i))
            tma_load(b_desc, [off_n, i * BK], bars.index(i), b_smem.index(i))
        mma: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 32]
        )
        offs_m = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, mma))
        sa_ptrs = sa_ptr + offs_m * KG
        sb_ptrs = sb_ptr + pid_n * KG
        zero = gl.zeros((BM, BN), dtype=gl.float32, layout=mma)
        acc = gl.zeros((BM, BN), dtype=gl.float32, layout=mma)
        mbarrier.wait(bars.index(0), 0)
        p = warpgroup_mma(a_smem.index(0), b_smem.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
        if not OVERLAP:
            p = warpgroup_mma_wait(num_outstanding=0, deps=(p,))
        for k in range(1, KG):
            s = k % STAGES
            mbarrier.wait(bars.index(s), (k // STAGES) & 1)
            q = warpgroup_mma(a_smem.index(s), b_smem.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)
            if OVERLAP:
                p = warpgroup_mma_wait(num_outstanding=1, deps=(p,))  # step k-1 done, step k in flight
            else:
                q = warpgroup_mma_wait(num_outstanding=0, deps=(q,))
            acc = acc + p * (gl.load(sa_ptrs + (k - 1)) * gl.load(sb_ptrs + (k - 1)))[:, None]
            if k - 1 + STAGES < KG:  # step k-1's stage is free: step k-1+STAGES goes there
                free = (k - 1) % STAGES
                mbarrier.expect(bars.index(free), nbytes)
                tma_load(a_desc, [off_m, (k - 1 + STAGES) * BK], bars.index(free), a_smem.index(free))
                tma_load(b_desc, [off_n, (k - 1 + STAGES) * BK], bars.index(free), b_smem.index(free))
            p = q
        p = warpgroup_mma_wait(num_outstanding=0, deps=(p,))
        acc = acc + p * (gl.load(sa_ptrs + (KG - 1)) * gl.load(sb_ptrs + (KG - 1)))[:, None]
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))
        offs_n = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
        gl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(gl.bfloat16))

    @gluon.jit
    def _ws_loader(a_desc, b_desc, a_smem, b_smem, ready, empty, M, N, K):
        """Producer warp: TMA loads of every step of every tile this program owns into the ring of stages (a in
        two 64-row halves, one per consumer), each stage reused once both consumers have released it."""
        HM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        BN: gl.constexpr = b_desc.block_type.shape[0]
        STAGES: gl.constexpr = b_smem.type.shape[0]
        nbytes: gl.constexpr = 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes
        num_n = N // BN
        KG = K // BK
        it = 0
        for tile in range(gl.program_id(0), (M // (2 * HM)) * num_n, gl.num_programs(0)):
            off_m = (tile // num_n) * 2 * HM
            off_n = (tile % num_n) * BN
            for k in range(KG):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), nbytes)
                tma_load(a_desc, [off_m, k * BK], ready.index(s), a_smem.index(2 * s))
                tma_load(a_desc, [off_m + HM, k * BK], ready.index(s), a_smem.index(2 * s + 1))
                tma_load(b_desc, [off_n, k * BK], ready.index(s), b_smem.index(s))
                it += 1

    @gluon.jit
    def _ws_math(a_desc, b_desc, a_smem, b_smem, ready, empty, c_ptr, sa_ptr, sb_ptr, M, N, K, HALF: gl.constexpr):
        """One consumer warpgroup: the 64 rows HALF of each 128 x BN tile. Each step's product in a fresh
        accumulator, waited for, its stage released, then scaled and added: the two consumers run apart, so one's
        scaling can overlap the other's product on the tensor cores."""
        HM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        BN: gl.constexpr = b_desc.block_type.shape[0]
        STAGES: gl.constexpr = b_smem.type.shape[0]
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
        num_n = N // BN
        KG = K // BK
        it = 0
        for tile in range(gl.program_id(0), (M // (2 * HM)) * num_n, gl.num_programs(0)):
            off_m = (tile // num_n) * 2 * HM + HALF * HM
            off_n = (tile % num_n) * BN
            offs_m = off_m + gl.arange(0, HM, layout=gl.SliceLayout(1, mma))
            acc = gl.zeros((HM, BN), dtype=gl.float32, layout=mma)
            zero = gl.zeros((HM, BN), dtype=gl.float32, layout=mma)
            sa_ptrs = sa_ptr + offs_m * KG
            sb_ptrs = sb_ptr + (tile % num_n) * KG
            sa_next = gl.load(sa_ptrs)
            sb_next = gl.load(sb_ptrs)
            for k in range(KG):
                s = it % STAGES
                sa = sa_next
                sb = sb_next
                nk = gl.minimum(k + 1, KG - 1)  # the next step's scales, loaded while this step runs
                sa_next = gl.load(sa_ptrs + nk)
                sb_next = gl.load(sb_ptrs + nk)
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                p = warpgroup_mma(a_smem.index(2 * s + HALF), b_smem.index(s).permute((1, 0)), zero,
                                  use_acc=False, is_async=True)  # fmt: skip
                p = warpgroup_mma_wait(num_outstanding=0, deps=(p,))
                mbarrier.arrive(empty.index(s), count=1)
                acc = acc + p * (sa * sb)[:, None]
                it += 1
            offs_n = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
            gl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(gl.bfloat16))

    @gluon.jit
    def _ws_math_high(a_desc, b_desc, a_smem, b_smem, ready, empty, c_ptr, sa_ptr, sb_ptr, M, N, K):
        _ws_math(a_desc, b_desc, a_smem, b_smem, ready, empty, c_ptr, sa_ptr, sb_ptr, M, N, K, 1)  # no constexpr args

    @gluon.jit
    def _gluon_ws_fp8_gemm(a_desc, b_desc, c_ptr, sa_ptr, sb_ptr, M, N, K, STAGES: gl.constexpr,
                           num_warps: gl.constexpr):  # fmt: skip
        """Persistent, warp-specialised: a producer warp and two consumer warpgroups (the default partition and a
        worker), tiles in row-major order (each program's consecutive tiles share rows of a)."""
        HM: gl.constexpr = a_desc.block_type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        BN: gl.constexpr = b_desc.block_type.shape[0]
        a_smem = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES, HM, BK], a_desc.layout)
        b_smem = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # both consumers release a stage
        fence_async_shared()
        common = (a_desc, b_desc, a_smem, b_smem, ready, empty)
        gl.warp_specialize(
            [
                (_ws_math, common + (c_ptr, sa_ptr, sb_ptr, M, N, K, gl.constexpr(0))),
                (_ws_math_high, common + (c_ptr, sa_ptr, sb_ptr, M, N, K)),
                (_ws_loader, common + (M, N, K)),
            ],
            [4, 1],
            [232, 40],
        )


@triton.jit
def _triton_fp8_gemm(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, M, N, K, FRESH: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    pid_m = tl.program_id(0) // (N // BN)  # columns fastest, as in xmoe's kernels
    pid_n = tl.program_id(0) % (N // BN)
    om = pid_m * BM + tl.arange(0, BM)
    on = pid_n * BN + tl.arange(0, BN)
    ok = tl.arange(0, BK)
    a_ptrs = a_ptr + om[:, None] * K + ok[None, :]
    b_ptrs = b_ptr + on[None, :] * K + ok[:, None]
    KG = K // BK
    acc = tl.zeros((BM, BN), tl.float32)
    for k in range(KG):
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
        if FRESH:
            scale = tl.load(sa_ptr + om * KG + k) * tl.load(sb_ptr + pid_n * KG + k)
            acc += tl.dot(a, b) * scale[:, None]
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BK
        b_ptrs += BK
    tl.store(c_ptr + om[:, None] * N + on[None, :], acc.to(tl.bfloat16))


def _gluon(A, B, sa, sb, C, stages, overlap, block_m=128, warps=8):
    M, K = A.shape
    N = B.shape[0]
    a_layout = gl.NVMMASharedLayout.get_default_for([block_m, G], gl.float8e4nv)
    b_layout = gl.NVMMASharedLayout.get_default_for([G, G], gl.float8e4nv)
    a_desc = TensorDescriptor.from_tensor(A, [block_m, G], a_layout)
    b_desc = TensorDescriptor.from_tensor(B, [G, G], b_layout)
    grid = ((M // block_m) * (N // G),)
    _gluon_fp8_gemm[grid](a_desc, b_desc, C, sa, sb, M, N, K, STAGES=stages, OVERLAP=overlap, num_warps=warps)


def _triton(A, B, sa, sb, C, fresh, stages, depth=G):
    """``depth``: the K extent of one step and one scale group (256: scales per 1 x 256 / 128 x 256, a product
    promoted every 256 instead of every 128)."""
    M, K = A.shape
    N = B.shape[0]
    if K % depth:
        raise ValueError(f"K = {K} is not a multiple of {depth}")
    grid = ((M // G) * (N // G),)
    _triton_fp8_gemm[grid](A, sa, B, sb, C, M, N, K, FRESH=fresh, BM=G, BN=G, BK=depth, num_warps=8,
                           num_stages=stages)  # fmt: skip


def _operands(M, N, K, gen):
    A = (torch.randn(M, K, device="cuda", generator=gen) * 4).to(torch.float8_e4m3fn)
    B = (torch.randn(N, K, device="cuda", generator=gen) * 4).to(torch.float8_e4m3fn)
    sa = torch.rand(M, K // G, device="cuda", generator=gen) + 0.5
    sb = torch.rand(N // G, K // G, device="cuda", generator=gen) + 0.5
    return A, B, sa, sb


def _gluon_ws(A, B, sa, sb, C, stages):
    M, K = A.shape
    N = B.shape[0]
    a_desc = TensorDescriptor.from_tensor(
        A, [G // 2, G], gl.NVMMASharedLayout.get_default_for([G // 2, G], gl.float8e4nv)
    )
    b_desc = TensorDescriptor.from_tensor(B, [G, G], gl.NVMMASharedLayout.get_default_for([G, G], gl.float8e4nv))
    programs = min(torch.cuda.get_device_properties(A.device).multi_processor_count, (M // G) * (N // G))
    # 4 warps per partition: 12 warps at 168 registers at launch, redistributed to 232 / 232 / 40 (setmaxnreg)
    _gluon_ws_fp8_gemm[(programs,)](a_desc, b_desc, C, sa, sb, M, N, K, STAGES=stages, num_warps=4,
                                    maxnreg=168)  # fmt: skip


def _cublas_scales(sa, sb):
    """The scale layouts cuBLASLt's block scaling takes: A's (M, K/128) column-major, B's (N/128, K/128) with its K
    blocks padded to a multiple of 4 and transposed. Made once, outside the timing."""
    sb_pad = torch.nn.functional.pad(sb, (0, -sb.shape[1] % 4), value=1.0)
    return sa.t().contiguous().t(), sb_pad.t()


def _cublas_blockwise(A, B, sa_cm, sb_t, C):
    """torch._scaled_mm with 1 x 128 scales of A and 128 x 128 of B (cuBLASLt's block scaling, CUDA 12.9+)."""
    C.copy_(torch._scaled_mm(A, B.t(), scale_a=sa_cm, scale_b=sb_t, out_dtype=torch.bfloat16))


def _cublas_rowwise(A, B, ra, rb, C):
    """torch._scaled_mm with one scale per row of A and per row of B (not the recipe: the library's FP8 rate)."""
    C.copy_(torch._scaled_mm(A, B.t(), scale_a=ra, scale_b=rb, out_dtype=torch.bfloat16))


def _variants(A, B, sa, sb, C):
    """(name, run, (A's scales, B's scales, their K group) for the float64 check, or None: not the recipe)."""
    ra = torch.ones(A.shape[0], 1, device=A.device)
    rb = torch.ones(1, B.shape[0], device=A.device)
    sa_cm, sb_t = _cublas_scales(sa, sb)
    sa2, sb2 = sa[:, ::2].contiguous(), sb[:, ::2].contiguous()  # 256-deep groups (K a multiple of 256)
    base, deep = (sa, sb, G), (sa2, sb2, 2 * G)
    return [
        ("triton fresh, 4 stages", lambda: _triton(A, B, sa, sb, C, True, 4), base),
        ("gluon overlap, 4 stages", lambda: _gluon(A, B, sa, sb, C, 4, True), base),
        ("gluon ws, 3 stages", lambda: _gluon_ws(A, B, sa, sb, C, 3), base),
        ("gluon ws, 4 stages", lambda: _gluon_ws(A, B, sa, sb, C, 4), base),
        ("cublas blockwise (torch._scaled_mm)", lambda: _cublas_blockwise(A, B, sa_cm, sb_t, C), base),
        ("triton fresh, 256-deep groups, 3 stages", lambda: _triton(A, B, sa2, sb2, C, True, 3, 2 * G), deep),
        ("triton in-place, no scales, 3 stages", lambda: _triton(A, B, sa, sb, C, False, 3), None),
        ("triton in-place, no scales, 256 deep, 3 stages", lambda: _triton(A, B, sa, sb, C, False, 3, 2 * G), None),
        ("cublas rowwise, no block scales", lambda: _cublas_rowwise(A, B, ra, rb, C), None),
    ]


def _reference(A, B, scales, check):
    """float64 product of the first rows of the dequantised operands."""
    sa, sb, group = scales
    a = A[check].double() * sa[check].double().repeat_interleave(group, 1)
    return a @ (B.double() * sb.double().repeat_interleave(G, 0).repeat_interleave(group, 1)).T


def _one_line(exc: Exception) -> str:
    """An exception as one table cell: its type and first line."""
    first = (str(exc).splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first}"[:160].replace("|", "/")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=98304, help="M: routed rows (default 98304 = 16384 tokens x top-6)")
    p.add_argument("--variants", default="", help="comma-separated substrings: only the variants whose names hold one")
    p.add_argument("--out", default=str(results_dir("fp8")), help="results directory (default benchmarks/results/fp8)")
    args = p.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0) or gluon is None:
        print("bench_fp8_promotion: skipped, needs a Hopper GPU and Triton's Gluon")
        return
    os.environ[RESULTS_ENV] = args.out
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for M, N, K in [(args.rows, 2048, 1408), (args.rows, 1408, 2048), (args.rows, 2048, 2048)]:
        A, B, sa, sb = _operands(M, N, K, gen)
        C = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        check = slice(0, 2048)  # the first rows against float64, every scaled variant
        wanted = [w for w in args.variants.split(",") if w]
        refs: dict[int, torch.Tensor] = {}  # one float64 product per set of scales (id), not per variant
        for name, fn, scales in _variants(A, B, sa, sb, C):
            if wanted and not any(w in name for w in wanted):
                continue
            C.zero_()
            try:
                fn()
                torch.cuda.synchronize()
            except Exception as exc:  # a variant this torch or GPU cannot run: recorded, the others go on
                rows.append({"M x N x K": f"{M} x {N} x {K}", "variant": name, "error": _one_line(exc)})
                print(f"{M} x {N} x {K} {name}: {rows[-1]['error']}", flush=True)
                continue
            err = None
            if scales is not None:
                if id(scales) not in refs:
                    refs[id(scales)] = _reference(A, B, scales, check)
                ref = refs[id(scales)]
                err = ((C[check].double() - ref).norm() / ref.norm()).item()
            ms = time_ms(fn, warmup_ms=50, rep_ms=300)
            row = {"M x N x K": f"{M} x {N} x {K}", "variant": name, "ms": ms, "tflops": 2 * M * N * K / ms / 1e9}
            rows.append({**row, "rel_err_vs_float64": err})
            print(f"{row['M x N x K']:22s} {name:48s} {ms:7.3f} ms {row['tflops']:6.0f} TFLOP/s err {err}", flush=True)
    meta = {**environment(), "rows": args.rows}
    write_results(
        "bench_fp8_promotion",
        rows,
        ["M x N x K", "variant", "ms", "tflops", "rel_err_vs_float64", "error"],
        meta,
        "FP8 GEMM promotion on Hopper: Triton fresh accumulator, Gluon overlap and warp-specialised, cuBLAS, ceilings",
        topic="fp8",
    )


if __name__ == "__main__":
    main()
