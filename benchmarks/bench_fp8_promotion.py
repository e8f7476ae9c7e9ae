"""Where an FP8 GEMM with fine-grained scales loses its time on Hopper: the per-step promotion, three ways, side by
side on dense GEMMs of the routed experts' sizes (C = A B^T, A in 1 x 128 groups, B in 128 x 128 blocks).

    python benchmarks/bench_fp8_promotion.py --out results/

* ``triton fresh``: what xmoe's FP8 kernels do (fp8_gemm_kernels.py): each 128-deep step's product in a fresh
  accumulator, scaled and added; Triton waits for every product before its scaling (``pendings = 0``).
* ``gluon overlap``: the same arithmetic in Gluon (Triton's lower-level dialect) with the waits written out: step
  k's wgmma is issued before step k-1's product is waited for (``warpgroup_mma_wait(num_outstanding=1)``) and
  promoted, so one product is always in flight; TMA loads into a ring of stages. ``gluon wait0``: the same kernel
  waiting for each product at once (the overlap's own baseline).
* ``triton in-place``: one accumulator, no scales (not the FP8 recipe: a ceiling for these tiles, what the
  tensor cores give a plain Triton loop when nothing waits).

128 x 128 x 128 tiles, 8 warps (one 64 x 128 variant), 3 or 4 stages. Each result is first checked against a float64
product of the dequantised inputs. Writes bench_fp8_promotion.json / .md into --out. Needs a Hopper GPU and
Triton's Gluon (Triton 3.6 or newer); skips otherwise.
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

from benchmarks.harness import RESULTS_ENV, environment, time_ms, write_results

G = 128  # scale group

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
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
        off_m = gl.program_id(0) * BM
        off_n = gl.program_id(1) * BN
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
        sb_ptrs = sb_ptr + gl.program_id(1) * KG
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


@triton.jit
def _triton_fp8_gemm(a_ptr, sa_ptr, b_ptr, sb_ptr, c_ptr, M, N, K, FRESH: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    om = tl.program_id(0) * BM + tl.arange(0, BM)
    on = tl.program_id(1) * BN + tl.arange(0, BN)
    ok = tl.arange(0, BK)
    a_ptrs = a_ptr + om[:, None] * K + ok[None, :]
    b_ptrs = b_ptr + on[None, :] * K + ok[:, None]
    KG = K // BK
    acc = tl.zeros((BM, BN), tl.float32)
    for k in range(KG):
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
        if FRESH:
            scale = tl.load(sa_ptr + om * KG + k) * tl.load(sb_ptr + tl.program_id(1) * KG + k)
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
    grid = (M // block_m, N // G)
    _gluon_fp8_gemm[grid](a_desc, b_desc, C, sa, sb, M, N, K, STAGES=stages, OVERLAP=overlap, num_warps=warps)


def _triton(A, B, sa, sb, C, fresh, stages):
    M, K = A.shape
    N = B.shape[0]
    grid = (M // G, N // G)
    _triton_fp8_gemm[grid](A, sa, B, sb, C, M, N, K, FRESH=fresh, BM=G, BN=G, BK=G, num_warps=8, num_stages=stages)


def _operands(M, N, K, gen):
    A = (torch.randn(M, K, device="cuda", generator=gen) * 4).to(torch.float8_e4m3fn)
    B = (torch.randn(N, K, device="cuda", generator=gen) * 4).to(torch.float8_e4m3fn)
    sa = torch.rand(M, K // G, device="cuda", generator=gen) + 0.5
    sb = torch.rand(N // G, K // G, device="cuda", generator=gen) + 0.5
    return A, B, sa, sb


def _variants(A, B, sa, sb, C):
    out = []
    for stages in (3, 4):
        out += [
            (f"gluon overlap, {stages} stages", lambda s=stages: _gluon(A, B, sa, sb, C, s, True)),
            (f"gluon wait0, {stages} stages", lambda s=stages: _gluon(A, B, sa, sb, C, s, False)),
            (f"triton fresh, {stages} stages", lambda s=stages: _triton(A, B, sa, sb, C, True, s)),
        ]
    out.append(("gluon overlap, 4 stages, 64 x 128 tile, 4 warps", lambda: _gluon(A, B, sa, sb, C, 4, True, 64, 4)))
    for stages in (3, 4):
        out.append(
            (f"triton in-place, no scales, {stages} stages", lambda s=stages: _triton(A, B, sa, sb, C, False, s))
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=98304, help="M: routed rows (default 98304 = 16384 tokens x top-6)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"), help="results directory")
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
        check = slice(0, 2048)  # the first rows against float64, every variant
        ref = (A[check].double() * sa[check].double().repeat_interleave(G, 1)) @ (
            B.double() * sb.double().repeat_interleave(G, 0).repeat_interleave(G, 1)
        ).T
        for name, fn in _variants(A, B, sa, sb, C):
            C.zero_()
            fn()
            err = None if "no scales" in name else ((C[check].double() - ref).norm() / ref.norm()).item()
            ms = time_ms(fn, warmup_ms=50, rep_ms=300)
            row = {"M x N x K": f"{M} x {N} x {K}", "variant": name, "ms": ms, "tflops": 2 * M * N * K / ms / 1e9}
            rows.append({**row, "rel_err_vs_float64": err})
            print(f"{row['M x N x K']:22s} {name:48s} {ms:7.3f} ms {row['tflops']:6.0f} TFLOP/s err {err}", flush=True)
    meta = {**environment(), "rows": args.rows}
    write_results(
        "bench_fp8_promotion",
        rows,
        ["M x N x K", "variant", "ms", "tflops", "rel_err_vs_float64"],
        meta,
        "FP8 GEMM promotion on Hopper: Triton fresh accumulator, Gluon with one product in flight, in-place ceiling",
    )


if __name__ == "__main__":
    main()
