"""Routed SwiGLU experts, forward and forward+backward, bf16: xmoe's Triton kernels against peers and a ceiling.

# T tokens, H hidden, F expert ffn, E experts, K top-k

    PYTHONPATH=. python benchmarks/bench_experts.py                 # all configs, T = 8192 and 16384
    PYTHONPATH=. python benchmarks/bench_experts.py --sweep         # time every tile candidate per kernel first
    PYTHONPATH=. python benchmarks/bench_experts.py --profile       # and GPU time per kernel of the fused path
    PYTHONPATH=. python benchmarks/bench_experts.py --per-gemm      # and each GEMM alone vs torch._grouped_mm
    PYTHONPATH=. python benchmarks/bench_experts.py --check         # check_gpu.py's bf16 checks first
    PYTHONPATH=. XMOE_AUTOTUNE=1 python benchmarks/bench_experts.py --check --out DIR \
        --methods triton_fused,triton_fused_triton_wgrad,grouped_mm_pipe,dense_equiv   # tuned, both engines

Methods, all including their routing bookkeeping (plan / sort) inside the timed region:
  triton_fused      build_plan + triton_ops.moe_experts (gather into the up GEMM, weights into the down dgrad),
                    tiles per shape class (autotuned under XMOE_AUTOTUNE=1, kernels.autotune's default), lean
                    backward, weight gradients by the engine kernels.wgrad's default picks (XMOE_WGRAD, else
                    auto: the Hopper torch._grouped_mm path where xmoe.kernels.grouped_wgrad.wgrad_engine picks it)
  triton_fused_triton_wgrad  triton_fused with its weight gradients always by the Triton kernels (the op's
                    wgrad="triton")
(triton_fused_legacy, the one hand-picked tile table with the backward's buffers of before, was timed beside these
until the legacy path was removed after commit c30d1c7; its numbers stay in
results/archive/layer/bench_experts_tiles.md, 0-3% slower than the tuned tiles with 1.2-1.3x their backward transient,
and results/layer/bench_experts_wgrad.md.)
  triton_fp8        build_plan + fp8_experts.moe_experts_fp8 (moe.fp8 = "experts": FP8 GEMMs with 1x128 / 128x128
                    scales, bf16 weight gradients); the weights' FP8 copies are made once per optimizer step in
                    training, so outside the timed region (their time is the row's weight_quant_ms)
  triton_fp8_pointers  triton_fp8 with every operand loaded through pointers (fp8_gemm.forced_tma(False)): what the
                    FP8 kernels do on GPUs without TMA, and the baseline of its tensor-descriptor loads on Hopper
  triton_fp8_wgrad  triton_fp8 with its weight gradients in FP8 too (kernels.wgrad = "fp8": fp8_wgrad.py)
  triton_ops        build_plan + gather_rows -> grouped_swiglu -> combine_rows, Triton backend
  torch_backend     build_plan + reference.py (torch._grouped_mm on CUDA bf16, k-ordered combine)
  grouped_mm_pipe   argsort + gather + 3 x torch._grouped_mm + index_add (the common torch MoE path)
  scaled_grouped_mm_pipe  the same pipeline in FP8 through torch._scaled_grouped_mm (e4m3, rowwise scales:
                    one per row of the activations and per output column of each expert's weight; forward and
                    input-gradient GEMMs), weight gradients by torch._grouped_mm in bf16 as in triton_fp8; weight
                    copies made outside the timed region likewise
  gshard_padded     xmoe/dispatch/padded.py at capacity factor 1.25 + bmm experts (drops tokens; a baseline)
  dense_equiv       one dense SwiGLU over T*K rows, same FLOPs, no routing: the ceiling
  bmm_ceiling       every expert's SwiGLU over exactly T*K/E rows by torch.bmm (cuBLAS batched GEMMs), no
                    routing, gather or combine: the grouped ceiling (each expert's weights are read and its
                    gradients written over only its own rows, which a dense GEMM never pays)
TFLOP/s counts 2*T*K*H*3F per forward and 3x that for forward+backward. Memory, from max_memory_allocated:
  peak_gib        peak over one forward+backward minus what was allocated before (inputs and weights excluded,
                  weight gradients included)
  held_gib        allocated after the forward minus before it, less the output: what a layer keeps for backward
  bwd_transient_gib  peak_gib less the weight gradients (dW1, dW3, dW2): the peak extra memory a layer's
                  forward+backward needs besides its weight gradients (held activations, the backward's
                  buffers and input gradients)
Routing: uniform (K distinct experts per token at random); skewed (expert 0 receives 4x the mean rows, 1/8 of
the experts receive none, the rest uniform); zipf (expert popularity ~ rank^-1.2).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without PYTHONPATH

from benchmarks.harness import RESULTS_ENV, environment, kernel_gaps, peak_extra_bytes, time_ms, write_results

CONFIGS = {"small": (2048, 1408, 64, 6), "medium": (5120, 1536, 128, 6), "large": (7168, 2048, 256, 8)}
FP8_METHODS = ("triton_fp8", "triton_fp8_pointers", "triton_fp8_wgrad")
METHODS = [
    "triton_fused",
    "triton_fp8",
    "triton_fp8_pointers",
    "triton_fp8_wgrad",
    "triton_fused_triton_wgrad",
    "triton_ops",
    "torch_backend",
    "grouped_mm_pipe",
    "scaled_grouped_mm_pipe",
    "gshard_padded",
    "dense_equiv",
    "bmm_ceiling",
]


def make_inputs(H, Fd, E, K, T, routing, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev, bf = "cuda", torch.bfloat16
    if routing == "uniform":
        ids = torch.rand(T, E, device=dev, generator=gen).topk(K, dim=-1).indices
    elif routing == "skewed":
        ids = skewed_ids(T, E, K, gen)
    elif routing == "zipf":  # Zipf(1.2) expert popularity, K distinct experts per token
        p = torch.arange(1, E + 1, device=dev, dtype=torch.float32) ** -1.2
        ids = torch.multinomial(p.expand(T, E), K, replacement=False, generator=gen)
    else:
        raise ValueError(f"routing {routing!r} must be uniform, skewed or zipf")
    inp = {
        "ids": ids,
        "scores": torch.rand(T, K, device=dev, generator=gen),
        "x": torch.randn(T, H, device=dev, dtype=bf, generator=gen).requires_grad_(),
        "w": torch.softmax(torch.randn(T, K, device=dev, generator=gen), -1).requires_grad_(),
        "w1": (torch.randn(E, H, Fd, device=dev, dtype=bf, generator=gen) / H**0.5).requires_grad_(),
        "w3": (torch.randn(E, H, Fd, device=dev, dtype=bf, generator=gen) / H**0.5).requires_grad_(),
        "w2": (torch.randn(E, Fd, H, device=dev, dtype=bf, generator=gen) / Fd**0.5).requires_grad_(),
        "grad": torch.randn(T, H, device=dev, dtype=bf, generator=gen),
    }
    return inp


def skewed_ids(T, E, K, gen):
    """(T, K) distinct expert ids: expert 0 in 4*T*K/E tokens (4x the mean), experts E-E/8..E-1 in none, the
    other slots uniform over experts 1..E-E/8-1."""
    num_empty = E // 8
    hot = min(T, round(4 * T * K / E))
    scores = torch.rand(T, E, device="cuda", generator=gen)
    scores[:, 0] = -1
    scores[:, E - num_empty :] = -2
    ids = scores.topk(K, dim=-1).indices
    hot_tokens = torch.randperm(T, device="cuda", generator=gen)[:hot]
    ids[hot_tokens, K - 1] = 0  # 0 was excluded above, so a token's K experts stay distinct
    return ids


# the methods that run an xmoe op under a kernels.wgrad of their own (the others: the environment's default)
OWN_WGRAD = {"triton_fused_triton_wgrad": "triton", "triton_fp8_wgrad": "fp8"}


def kernel_choice(method, options):
    """The keyword arguments (wgrad, autotune) of ``method``'s xmoe op under the kernels section ``options``."""
    return {"wgrad": OWN_WGRAD.get(method, options.wgrad), "autotune": options.autotune}


def forward_fn(method, inp, E, options):
    """A zero-argument forward returning (output, leaves) for one method, its xmoe ops under the kernels section
    ``options`` (a KernelConfig)."""
    from xmoe.dispatch.padded import PaddedDispatcher
    from xmoe.dispatch.routing import build_plan
    from xmoe.kernels import reference, triton_ops

    x, w, w1, w3, w2, ids = inp["x"], inp["w"], inp["w1"], inp["w3"], inp["w2"], inp["ids"]
    T, K = ids.shape
    leaves = [x, w, w1, w3, w2]
    choice = kernel_choice(method, options)
    if method in ("triton_fused", "triton_fused_triton_wgrad"):

        def fwd():
            p = build_plan(ids, inp["scores"], E)
            return triton_ops.moe_experts(
                x, w, p.token_ids_N, p.slot_ids_N, p.row_of_slot_TK, p.tokens_per_expert_E, w1, w3, w2, **choice
            )
    elif method in FP8_METHODS:
        from xmoe.kernels.fp8_experts import moe_experts_fp8

        fmt, qw = _fp8_weights(inp)

        def fwd():
            p = build_plan(ids, inp["scores"], E)
            return moe_experts_fp8(
                x, w, p.token_ids_N, p.slot_ids_N, p.row_of_slot_TK, p.tokens_per_expert_E, w1, w3, w2, qw, fmt,
                **choice,
            )  # fmt: skip
    elif method == "scaled_grouped_mm_pipe":
        qw = _rowwise_weights(w1, w3, w2)

        def fwd():
            return ScaledGroupedMMPipe.apply(x, w, w1, w3, w2, ids, qw)
    elif method in ("triton_ops", "torch_backend"):
        ops = triton_ops if method == "triton_ops" else reference

        def fwd():
            p = build_plan(ids, inp["scores"], E)
            x_NH = ops.gather_rows(x, p.token_ids_N, p.row_of_slot_TK)
            y_NH = ops.grouped_swiglu(x_NH, w1, w3, w2, p.tokens_per_expert_E, **choice)
            return ops.combine_rows(y_NH, w, p.token_ids_N, p.slot_ids_N, p.row_of_slot_TK)
    elif method == "grouped_mm_pipe":

        def fwd():
            flat = ids.reshape(-1)
            order = torch.argsort(flat, stable=True)
            offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
            tok = order // K
            x_NH = x[tok]
            h = F.silu(torch._grouped_mm(x_NH, w1, offs=offs)) * torch._grouped_mm(x_NH, w3, offs=offs)
            y = torch._grouped_mm(h, w2, offs=offs) * w.reshape(-1)[order, None].to(x.dtype)
            return torch.zeros_like(x).index_add(0, tok, y)
    elif method == "gshard_padded":
        capacity = math.ceil(1.25 * T * K / E)
        disp = PaddedDispatcher()

        def fwd():
            p = build_plan(ids, inp["scores"], E, capacity)
            x_ECH, _, ctx = disp.dispatch(x, p)
            h = F.silu(torch.bmm(x_ECH, w1)) * torch.bmm(x_ECH, w3)
            return disp.combine(torch.bmm(h, w2), w, p, ctx)
    elif method == "dense_equiv":
        H = w1.shape[1]
        xd = inp.setdefault("x_dense", torch.randn(T * K, H, device="cuda", dtype=x.dtype).requires_grad_())
        inp.setdefault("grad_dense", torch.randn(T * K, H, device="cuda", dtype=x.dtype))
        wd = [t[0].detach().clone().requires_grad_() for t in (w1, w3, w2)]
        leaves = [xd] + wd

        def fwd():
            return (F.silu(xd @ wd[0]) * (xd @ wd[1])) @ wd[2]
    elif method == "bmm_ceiling":
        E_, H, _Fd = w1.shape
        rows = T * K // E_
        xb = inp.setdefault("x_bmm", torch.randn(E_, rows, H, device="cuda", dtype=x.dtype).requires_grad_())
        inp.setdefault("grad_bmm", torch.randn(E_, rows, H, device="cuda", dtype=x.dtype))
        leaves = [xb, w1, w3, w2]

        def fwd():
            return torch.bmm(F.silu(torch.bmm(xb, w1)) * torch.bmm(xb, w3), w2)
    else:
        raise ValueError(f"unknown method {method!r}")
    return fwd, leaves


def _fp8_weights(inp):
    """(format, the FP8 copies of inp's expert weights): what an optimizer step (MoEStep) makes once."""
    from xmoe.kernels.fp8_quant import fp8_format, quantize_expert_weights

    fmt = fp8_format(inp["x"].device).name
    return fmt, quantize_expert_weights(inp["w1"].detach(), inp["w3"].detach(), inp["w2"].detach(), fmt)


def _rowwise(t_RC):
    """(e4m3 values, fp32 scale per row): one scale per row, amax / 448."""
    scale = t_RC.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / 448.0
    return (t_RC.float() / scale).to(torch.float8_e4m3fn), scale.squeeze(-1)


def _rowwise_weight(w_EKN):
    """w (E, K, N) as _scaled_grouped_mm's right operand: e4m3 in (E, N, K) memory (K contiguous), viewed (E, K, N),
    and the fp32 scale of each output column (E, N)."""
    q, scale = _rowwise(w_EKN.transpose(1, 2))
    return q.contiguous().transpose(1, 2), scale


def _rowwise_weights(w1, w3, w2):
    """{name: (values, scales)} for the forward (reduction over H, then F) and the input gradients."""
    with torch.no_grad():
        return {
            "w1": _rowwise_weight(w1),
            "w3": _rowwise_weight(w3),
            "w2": _rowwise_weight(w2),
            "w1t": _rowwise_weight(w1.transpose(1, 2)),
            "w3t": _rowwise_weight(w3.transpose(1, 2)),
            "w2t": _rowwise_weight(w2.transpose(1, 2)),
        }


def _sgmm(a_NK, weight, offs):
    aq, sa = _rowwise(a_NK)
    bq, sb = weight
    return torch._scaled_grouped_mm(aq, bq, sa, sb, offs=offs, out_dtype=torch.bfloat16)


class ScaledGroupedMMPipe(torch.autograd.Function):
    """grouped_mm_pipe with its forward and input-gradient GEMMs in FP8 (torch._scaled_grouped_mm, rowwise)."""

    @staticmethod
    def forward(ctx, x, w, w1, w3, w2, ids, qw):
        T, K = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        offs = torch.cumsum(torch.bincount(flat, minlength=w1.shape[0]), 0).to(torch.int32)
        tok = order // K
        x_NH = x[tok]
        h1, h3 = _sgmm(x_NH, qw["w1"], offs), _sgmm(x_NH, qw["w3"], offs)
        a = F.silu(h1) * h3
        y = _sgmm(a, qw["w2"], offs)
        w_N = w.reshape(-1)[order, None]
        ctx.save_for_backward(x_NH, h1, h3, y, w_N, order, offs, tok)
        ctx.qw, ctx.num_tokens = qw, T
        return torch.zeros_like(x).index_add(0, tok, y * w_N.to(x.dtype))

    @staticmethod
    def backward(ctx, g):
        x_NH, h1, h3, y, w_N, order, offs, tok = ctx.saved_tensors
        qw = ctx.qw
        g_rows = g[tok]
        grad_w = torch.zeros(order.numel(), dtype=w_N.dtype, device=g.device)
        grad_w[order] = (g_rows.float() * y.float()).sum(-1)
        g_NH = g_rows * w_N.to(g.dtype)
        da = _sgmm(g_NH, qw["w2t"], offs).float()
        sig = torch.sigmoid(h1.float())
        a = (h1.float() * sig * h3.float()).to(g.dtype)
        dh1 = (da * h3.float() * sig * (1 + h1.float() * (1 - sig))).to(g.dtype)
        dh3 = (da * h1.float() * sig).to(g.dtype)
        dx_NH = _sgmm(dh1, qw["w1t"], offs) + _sgmm(dh3, qw["w3t"], offs)
        dx = torch.zeros(ctx.num_tokens, x_NH.shape[1], dtype=g.dtype, device=g.device).index_add(0, tok, dx_NH)
        gm = torch._grouped_mm
        dw2 = gm(a.t(), g_NH, offs=offs)
        dw1, dw3 = gm(x_NH.t(), dh1, offs=offs), gm(x_NH.t(), dh3, offs=offs)
        return dx, grad_w.view(ctx.num_tokens, -1), dw1, dw3, dw2, None, None


def memory_split(fwd, leaves, grad):
    """(held, backward transient) bytes of one forward+backward; see the module docstring."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fwd()
    torch.cuda.synchronize()
    after_fwd = torch.cuda.memory_allocated()
    grads = torch.autograd.grad(out, leaves, grad)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    weight_grads = sum(g.numel() * g.element_size() for g in grads[-3:])
    held = after_fwd - base - out.numel() * out.element_size()
    del out, grads
    return held, peak - base - weight_grads


def measure(method, inp, E, flops_fwd, options):
    fwd, leaves = forward_fn(method, inp, E, options)
    grad = {"dense_equiv": inp.get("grad_dense"), "bmm_ceiling": inp.get("grad_bmm")}.get(method, inp["grad"])
    mode = pointer_loads if method == "triton_fp8_pointers" else contextlib.nullcontext

    def fwd_only():
        with mode(), torch.no_grad():
            return fwd()

    def fwd_bwd():
        with mode():
            return torch.autograd.grad(fwd(), leaves, grad)

    row = {"method": method}
    try:
        fwd_bwd()  # compiles, and under XMOE_AUTOTUNE=1 tunes this shape class, before anything is measured
        row["fwd_ms"] = time_ms(fwd_only)
        row["fwd_bwd_ms"] = time_ms(fwd_bwd)
        row["peak_gib"] = peak_extra_bytes(fwd_bwd) / 2**30
        with mode():
            held, transient = memory_split(fwd, leaves, grad)
        row["held_gib"], row["bwd_transient_gib"] = held / 2**30, transient / 2**30
        row["fwd_tflops"] = flops_fwd / row["fwd_ms"] * 1e-9
        row["tflops"] = 3 * flops_fwd / row["fwd_bwd_ms"] * 1e-9
        if method in FP8_METHODS:
            row["weight_quant_ms"] = time_ms(lambda: _fp8_weights(inp))
    except torch.OutOfMemoryError as exc:
        row["error"] = "OOM: " + str(exc).split("\n")[0][:120]
    except Exception as exc:  # record and go on: one failing peer must not lose the run
        row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    gc.collect()
    torch.cuda.empty_cache()
    return row


def pointer_loads():
    """The FP8 GEMMs' operands through pointers, even where TMA is there (the triton_fp8_pointers method)."""
    from xmoe.kernels import fp8_gemm

    return fp8_gemm.forced_tma(False)


def _kernel_calls(H, Fd, E, K, T, routing="uniform", with_grouped_mm=False, autotune=False):
    """One zero-argument call per tiled kernel, each in its fused-path use (full width, no column chunks), on
    fresh inputs of one config, tiles tuned with ``autotune``; with_grouped_mm: {kernel: (products, xmoe call,
    torch._grouped_mm call on rows gathered beforehand)} and the gather itself under "gather"."""
    from xmoe.dispatch.routing import build_plan
    from xmoe.kernels import grouped_gemm as gg
    from xmoe.kernels.grouped_wgrad import grouped_wgrad

    inp = make_inputs(H, Fd, E, K, T, routing)
    p = build_plan(inp["ids"], inp["scores"], E)
    x, g, counts, tok = inp["x"].detach(), inp["grad"], p.tokens_per_expert_E, p.token_ids_N
    w1, w3, w2 = (inp[k].detach() for k in ("w1", "w3", "w2"))
    h1, h3, a = gg.swiglu_up_fwd(x, tok, w1, w3, counts, True, autotune)
    tune = autotune
    ours = {
        "up_fwd": lambda: gg.swiglu_up_fwd(x, tok, w1, w3, counts, True, tune),
        "mm": lambda: gg.grouped_mm(a, w2, None, None, counts, tune),
        "dx": lambda: gg.grouped_mm(h1, w1.transpose(1, 2), h3, w3.transpose(1, 2), counts, tune),
        "down_bwd": lambda: gg._grouped_mm(g, w2.transpose(1, 2), None, None, counts, tok, "down_bwd", tune),
        "wgrad": lambda: grouped_wgrad(a, None, g, None, tok, counts, "triton", tune),
        "wgrad2": lambda: grouped_wgrad(x, tok, h1, h3, None, counts, "triton", tune),
    }
    if not with_grouped_mm:
        return ours
    x_g, g_g = x[tok], g[tok]
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    gm = torch._grouped_mm
    theirs = {
        "up_fwd": (2, lambda: (gm(x_g, w1, offs=offs), gm(x_g, w3, offs=offs))),
        "mm": (1, lambda: gm(a, w2, offs=offs)),
        "dx": (2, lambda: gm(h1, w1.transpose(1, 2), offs=offs) + gm(h3, w3.transpose(1, 2), offs=offs)),
        "down_bwd": (1, lambda: gm(g_g, w2.transpose(1, 2), offs=offs)),
        "wgrad": (1, lambda: gm(a.t(), g_g, offs=offs)),
        "wgrad2": (2, lambda: (gm(x_g.t(), h1, offs=offs), gm(x_g.t(), h3, offs=offs))),
    }
    calls = {k: (n, ours[k], fn) for k, (n, fn) in theirs.items()}
    calls["gather"] = (0, None, lambda: x[tok])
    return calls


# what each tiled kernel computes in the fused path (per_gemm's rows)
GEMM_NAMES = {
    "up_fwd": "up: h1, h3 = x[tok] w1, w3",
    "mm": "down: y = a w2",
    "down_bwd": "down dgrad: da = g[tok] w2^T",
    "dx": "up dgrad: dx = dh1 w1^T + dh3 w3^T",
    "wgrad": "down wgrad: dW2 = a^T g[tok]",
    "wgrad2": "up wgrad: dW1, dW3 = x[tok]^T (dh1, dh3)",
    "gather": "gather x[tok] (N, H)",
}


def per_gemm(configs=("small", "medium", "large"), tokens=(16384,), routings=("uniform",), autotune=False):
    """Each GEMM of the fused path timed alone (its kernel as the fused path calls it, full width) beside
    torch._grouped_mm on the same operands with the gathered rows made first, plus the gathers and a batched
    (torch.bmm) weight gradient over equal groups: TFLOP/s per GEMM."""
    rows = []
    for name, T, routing in ((n, t, r) for n in configs for t in tokens for r in routings):
        cell = _per_gemm_cell(name, T, routing, autotune)  # its tensors are freed when it returns
        for r in cell:
            print(
                "per-gemm",
                " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()),
                flush=True,
            )
        rows += cell
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def _per_gemm_cell(name, T, routing, autotune):
    H, Fd, E, K = CONFIGS[name]
    flops = 2.0 * T * K * H * Fd  # one (N, H) x (H, F) product, N = T * K rows (no drops)
    rows = []
    for kernel, (n, ours, theirs) in _kernel_calls(H, Fd, E, K, T, routing, True, autotune).items():
        row = {"config": name, "T": T, "routing": routing, "gemm": GEMM_NAMES[kernel]}
        for col, fn in (("xmoe", ours), ("grouped_mm", theirs)):
            if fn is not None:
                row[f"{col}_ms"] = time_ms(fn, warmup_ms=10, rep_ms=40)
                if n:
                    row[f"{col}_tflops"] = n * flops / row[f"{col}_ms"] * 1e-9
        rows.append(row)
    if (T * K) % E == 0 and routing == "uniform":
        xb = torch.randn(E, T * K // E, H, device="cuda", dtype=torch.bfloat16)
        hb = torch.randn(E, T * K // E, Fd, device="cuda", dtype=torch.bfloat16)
        ms = time_ms(lambda: torch.bmm(xb.transpose(1, 2), hb), warmup_ms=10, rep_ms=40)
        rows.append(
            {
                "config": name,
                "T": T,
                "routing": routing,
                "gemm": f"bmm wgrad over {T * K // E} rows per expert",
                "grouped_mm_ms": ms,
                "grouped_mm_tflops": flops / ms * 1e-9,
            }
        )
    return rows


def _fp8_kernel_calls(H, Fd, E, K, T, routing="uniform"):
    """{kernel: (products, call)} for each FP8 kernel in its fused-path use (full width), plus the (T, H)
    quantisation of x (no products), on fresh inputs of one config."""
    from xmoe.dispatch.routing import build_plan
    from xmoe.kernels.fp8_gemm import _fp8_mm, fp8_grouped_mm, fp8_swiglu_up_fwd, input_grad_operands
    from xmoe.kernels.fp8_quant import quantize_rows
    from xmoe.kernels.fp8_wgrad import column_groups, fp8_wgrad, quantize_cols

    inp = make_inputs(H, Fd, E, K, T, routing)
    p = build_plan(inp["ids"], inp["scores"], E)
    counts, tok, bf = p.tokens_per_expert_E, p.token_ids_N, torch.bfloat16
    fmt, qw = _fp8_weights(inp)
    x, g = inp["x"].detach(), inp["grad"]
    xq, sx = quantize_rows(x, fmt)
    gq, sg = quantize_rows(g, fmt)
    up = (
        xq,
        sx,
        tok,
        qw.w1_EFH,
        qw.w3_EFH,
        qw.scale1.transpose(1, 2),
        qw.scale3.transpose(1, 2),
        counts,
        True,
        fmt,
        bf,
    )
    h1, _, aq, sa = fp8_swiglu_up_fwd(*up)
    dq, ds = quantize_rows(h1, fmt)  # stands in for dh1, dh3 (same shape and scales' layout), side by side:
    dx_operands = input_grad_operands(torch.cat([dq, dq], 1), torch.cat([ds, ds], 1), qw.w13_EHF, qw.scale13)
    groups = column_groups(counts, tok.shape[0])
    xq_t, sx_t = quantize_cols(x, tok, *groups, fmt)
    hq_t, sh_t = quantize_cols(h1, None, *groups, fmt)  # stands in for dh1
    return {
        "fp8_up": (2, lambda: fp8_swiglu_up_fwd(*up)),
        "fp8_mm": (
            1,
            lambda: fp8_grouped_mm(
                aq, sa, qw.w2_EHF, qw.scale2.transpose(1, 2), None, None, None, None, counts, bf, False
            ),
        ),
        "fp8_dx": (2, lambda: fp8_grouped_mm(*dx_operands, counts, bf, True)),
        "fp8_down_bwd": (
            1,
            lambda: _fp8_mm(
                gq, sg, qw.w2_EFH, qw.scale2, None, None, None, None, counts, tok, bf, "fp8_down_bwd", False
            ),
        ),
        "fp8_wgrad": (1, lambda: fp8_wgrad(xq_t, sx_t, hq_t, sh_t, groups.bounds_3E, fmt, bf)),  # dW1 = x[tok]^T dh1
        "quantize_x": (0, lambda: quantize_rows(x, fmt)),
        "quantize_cols_x": (0, lambda: quantize_cols(x, tok, *groups, fmt)),  # x[tok] down its columns, for dW1
    }


def sweep(configs=("small", "medium", "large"), T=16384, fp8=False, only=None):
    """Time every tile candidate of every kernel (tiles.CANDIDATES) in its fused-path use, per config: the bf16
    kernels, or with fp8 the FP8 ones (with TFLOP/s, 2*T*K*H*F per product); ``only``: those kernels alone."""
    from xmoe.kernels import tiles

    rows = []
    for name in configs:
        H, Fd, E, K = CONFIGS[name]
        if fp8:
            calls = _fp8_kernel_calls(H, Fd, E, K, T)
        else:
            calls = {k: (0, fn) for k, fn in _kernel_calls(H, Fd, E, K, T).items()}
        for kernel, (products, call) in calls.items():
            if only and kernel not in only:
                continue
            for cand in tiles.CANDIDATES.get(kernel, [None]):
                row = {"config": name, "kernel": kernel, "tile": str(tuple(vars(cand).values())) if cand else ""}
                try:
                    with tiles.force({kernel: cand} if cand else {}):
                        row["ms"] = time_ms(call, warmup_ms=10, rep_ms=40)
                    if products:
                        row["tflops"] = products * 2.0 * T * K * H * Fd / row["ms"] * 1e-9
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {str(exc)[:100]}"
                rows.append(row)
                print(
                    f"sweep {name} {kernel:12s} {row['tile']}: {row.get('ms', float('nan')):.3f} ms "
                    f"{row.get('tflops', float('nan')):.0f} TFLOP/s " + row.get("error", ""),
                    flush=True,
                )
        del calls
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def profile(configs=("small", "medium"), T=16384, iters=3, method="triton_fused", options=None):
    """Where the fused path's (or ``method``'s) forward+backward time goes: GPU time per kernel (torch.profiler)
    against the wall time of one call; the difference is launch gaps and host time."""
    import time

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    rows = []
    for name in configs:
        H, Fd, E, K = CONFIGS[name]
        inp = make_inputs(H, Fd, E, K, T, "uniform")
        fwd, leaves = forward_fn(method, inp, E, options)

        def fwd_bwd(fwd=fwd, leaves=leaves, grad=inp["grad"]):
            return torch.autograd.grad(fwd(), leaves, grad)

        for _ in range(3):
            fwd_bwd()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fwd_bwd()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3 / iters
        torch.cuda.set_sync_debug_mode("warn")  # any host sync inside the layer prints a warning
        try:
            with torch_profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                for _ in range(iters):
                    fwd_bwd()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        # GPU kernels only: the custom-op rows (xmoe::...) repeat their kernels' time
        gaps = kernel_gaps(prof)
        timed = [e for e in prof.key_averages() if e.self_device_time_total > 0]
        kernels = [e for e in timed if e.device_type.name == "CUDA"] or timed
        gpu_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / iters
        print(f"profile {name} T={T}: wall {wall_ms:.2f} ms per fwd+bwd, GPU kernels {gpu_ms:.2f} ms")
        for e in sorted(kernels, key=lambda e: -e.self_device_time_total):
            ms = e.self_device_time_total / 1e3 / iters
            rows.append({"config": name, "method": method, "kernel": e.key[:90], "calls": e.count // iters, "ms": ms})
            print(f"  {ms:8.3f} ms  x{e.count // iters:<3d} {e.key[:100]}")
        idle_ms = sum(g for g, _ in gaps) / iters
        print(f"  GPU idle between kernels: {idle_ms:.3f} ms per call; largest gaps (ms, after -> before):")
        for g, where in sorted(gaps, reverse=True)[:8]:
            print(f"  {g:8.3f}  {where}")
        rows.append({"config": name, "kernel": "(sum of GPU kernels)", "calls": None, "ms": gpu_ms})
        rows.append({"config": name, "kernel": "(GPU idle between kernels)", "calls": None, "ms": idle_ms})
        rows.append({"config": name, "kernel": "(wall time of one call)", "calls": None, "ms": wall_ms})
        del inp, fwd, leaves, fwd_bwd
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    with contextlib.ExitStack() as stack:
        return _main(stack)


def _main(stack: contextlib.ExitStack) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="small,medium,large")
    parser.add_argument("--tokens", default="8192,16384")
    parser.add_argument("--routing", default="uniform,skewed")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--sweep", action="store_true", help="time every tile candidate per kernel first")
    parser.add_argument("--profile", action="store_true", help="then profile the fused path's kernels")
    parser.add_argument("--profile-method", default="triton_fused", help="the method --profile profiles")
    parser.add_argument(
        "--sweep-fp8",
        action="store_true",
        help="time every tile candidate of the FP8 kernels first (at the last of --tokens)",
    )
    parser.add_argument(
        "--sweep-kernels",
        help="with --sweep-fp8: only these kernels (comma-separated, e.g. fp8_wgrad,quantize_cols_x)",
    )
    parser.add_argument(
        "--per-gemm",
        action="store_true",
        help="time each GEMM of the fused path alone beside torch._grouped_mm (T=16384) first",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="run benchmarks/check_gpu.py's bf16 checks (every tile candidate) first; stop on failure",
    )
    parser.add_argument(
        "--fp8-pointers",
        action="store_true",
        help="load every FP8 GEMM operand through pointers, also where TMA is there (a baseline for --sweep-fp8)",
    )
    parser.add_argument("--out", help="write results (and, unless XMOE_CACHE_DIR is set, the tuned tiles) here")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no new (config, T, routing) cell after this many seconds of the whole run",
    )
    args = parser.parse_args()
    if args.fp8_pointers:  # for the whole run
        stack.enter_context(pointer_loads())
    start = time.perf_counter()
    if args.out:
        os.environ[RESULTS_ENV] = args.out  # harness.out_dir: this script's and check_gpu's files go there
        os.environ.setdefault("XMOE_CACHE_DIR", os.path.join(args.out, "tile_cache"))
    if not torch.cuda.is_available():
        print("bench_experts: skipped, no CUDA device")
        return 0
    from xmoe.config import KernelConfig
    from xmoe.kernels import tiles

    options = KernelConfig()  # the kernels section every method runs under: the environment's defaults
    topic = "fp8" if "fp8" in args.methods or args.sweep_fp8 else "layer"  # benchmarks/results/<topic> by default
    meta = environment()
    meta["autotune"] = options.autotune
    meta["tile_candidates"] = {k: [list(vars(c).values()) for c in v] for k, v in tiles.CANDIDATES.items()}
    meta["wgrad"] = options.wgrad
    meta["base_tiles"] = {k: list(vars(v).values()) for k, v in tiles.BASE.items()}
    if args.check:
        from benchmarks import check_gpu

        if check_gpu.main(["--fp8"] if "triton_fp8" in args.methods.split(",") else []) != 0:
            print("bench_experts: stopped, the GPU check failed")
            return 1
        meta["checked"] = "check_gpu.py passed (every tile candidate on the three model shapes)"
    if args.sweep:
        write_results(
            "sweep_tiles",
            sweep(),
            ["config", "kernel", "tile", "ms", "error"],
            meta,
            "Tile candidates of the Triton grouped-GEMM kernels, each in its fused-path use (T=16384)",
            topic=topic,
        )
    if args.sweep_fp8:
        write_results(
            "sweep_tiles_fp8",
            sweep(
                args.configs.split(","),
                T=int(args.tokens.split(",")[-1]),
                fp8=True,
                only=args.sweep_kernels.split(",") if args.sweep_kernels else None,
            ),
            ["config", "kernel", "tile", "ms", "tflops", "error"],
            meta,
            f"Tile candidates of the FP8 kernels, each in its fused-path use (T={args.tokens.split(',')[-1]})",
            notes="tflops: 2*T*K*H*F per product (two for fp8_up and fp8_dx); quantize_x: the (T, H) "
            "quantisation of x, for scale.",
            topic=topic,
        )
    if args.per_gemm:
        columns = ["config", "T", "routing", "gemm", "xmoe_ms", "xmoe_tflops", "grouped_mm_ms", "grouped_mm_tflops"]
        write_results(
            "per_gemm",
            per_gemm(args.configs.split(","), routings=args.routing.split(","), autotune=options.autotune),
            columns,
            meta,
            "Each GEMM of the fused path alone: xmoe's kernel vs torch._grouped_mm on pre-gathered rows",
            notes="TFLOP/s = 2*N*H*F per product (two products for up, dx and dW1/dW3); the grouped_mm "
            "column excludes making the gathered rows (its own row); bmm: equal groups, no "
            "routing.",
            topic=topic,
        )
    if args.profile:
        stem = "profile_experts" if args.profile_method == "triton_fused" else f"profile_experts_{args.profile_method}"
        write_results(
            stem,
            profile(args.configs.split(","), method=args.profile_method, options=options),
            ["config", "method", "kernel", "calls", "ms"],
            meta,
            f"GPU time per kernel of {args.profile_method}'s forward+backward (T=16384, uniform)",
            topic=topic,
        )
    rows = []
    columns = [
        "config",
        "T",
        "routing",
        "method",
        "fwd_ms",
        "fwd_tflops",
        "fwd_bwd_ms",
        "tflops",
        "peak_gib",
        "held_gib",
        "bwd_transient_gib",
        "vs_grouped_mm",
        "vs_triton_fused",
        "vs_scaled_grouped_mm",
        "vs_dense",
        "vs_bmm",
        "transient_vs_grouped_mm",
        "weight_quant_ms",
        "error",
    ]
    for cfg in args.configs.split(","):
        H, Fd, E, K = CONFIGS[cfg]
        for T in map(int, args.tokens.split(",")):
            for routing in args.routing.split(","):
                if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
                    print(f"bench_experts: budget of {args.budget_s:.0f} s spent, skipped {cfg} T={T} {routing}")
                    continue
                inp = make_inputs(H, Fd, E, K, T, routing)
                flops_fwd = 2 * T * K * H * 3 * Fd
                cell = []
                for method in args.methods.split(","):
                    if method in ("dense_equiv", "bmm_ceiling") and routing != "uniform":
                        continue  # no routing: identical to the uniform cell
                    row = {"config": cfg, "T": T, "routing": routing, **measure(method, inp, E, flops_fwd, options)}
                    cell.append(row)
                    print(
                        f"[{time.perf_counter() - start:.0f} s] "
                        + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                        flush=True,
                    )
                by_method = {r["method"]: r for r in cell}
                ref = by_method.get("grouped_mm_pipe", {})
                dense = next(
                    (
                        r.get("fwd_bwd_ms")
                        for r in rows + cell
                        if r["config"] == cfg and r["T"] == T and r["method"] == "dense_equiv"
                    ),
                    None,
                )
                bmm = next(
                    (
                        r.get("fwd_bwd_ms")
                        for r in rows + cell
                        if r["config"] == cfg and r["T"] == T and r["method"] == "bmm_ceiling"
                    ),
                    None,
                )
                for r in cell:
                    if r.get("fwd_bwd_ms") and bmm:
                        r["vs_bmm"] = bmm / r["fwd_bwd_ms"]
                    if r.get("fwd_bwd_ms") and ref.get("fwd_bwd_ms"):
                        r["vs_grouped_mm"] = ref["fwd_bwd_ms"] / r["fwd_bwd_ms"]
                    for peer in ("triton_fused", "scaled_grouped_mm"):
                        peer_ms = by_method.get(peer if peer == "triton_fused" else f"{peer}_pipe", {}).get(
                            "fwd_bwd_ms"
                        )
                        if r.get("fwd_bwd_ms") and peer_ms:
                            r[f"vs_{peer}"] = peer_ms / r["fwd_bwd_ms"]
                    if r.get("fwd_bwd_ms") and dense:
                        r["vs_dense"] = dense / r["fwd_bwd_ms"]
                    if r.get("bwd_transient_gib") is not None and ref.get("bwd_transient_gib"):
                        r["transient_vs_grouped_mm"] = r["bwd_transient_gib"] / ref["bwd_transient_gib"]
                rows += cell
                del inp
                gc.collect()
                torch.cuda.empty_cache()
                write_results(
                    "bench_experts",
                    rows,
                    columns,
                    meta,
                    "Routed SwiGLU experts (bf16; triton_fp8 and scaled_grouped_mm_pipe: FP8)",
                    notes="fwd_bwd_ms: median forward+backward; tflops = 3*2*T*K*H*3F / fwd_bwd time; "
                    "vs_*: speed relative to that method (>1 = faster); held_gib, "
                    "bwd_transient_gib: see the script's docstring; transient_vs_grouped_mm: "
                    "backward transient relative to the pipeline's (<1 = less).",
                    topic=topic,
                )
    print()
    from benchmarks.harness import markdown_table

    print(
        markdown_table(
            [
                r
                for r in rows
                if r["method"]
                in (
                    "triton_fused",
                    "triton_fp8",
                    "triton_fp8_pointers",
                    "triton_fp8_wgrad",
                    "triton_fused_triton_wgrad",
                    "grouped_mm_pipe",
                    "scaled_grouped_mm_pipe",
                    "dense_equiv",
                    "bmm_ceiling",
                )
            ],
            columns,
        )
    )
    if options.autotune:
        print("tuned tiles:", os.environ.get("XMOE_CACHE_DIR") or "~/.cache/xmoe")
    return 0


if __name__ == "__main__":
    sys.exit(main())
