"""Router top-k in fp32: the Triton kernel (xmoe/kernels/router_topk.py) against the torch router path.

# T tokens, E experts, K top-k

    PYTHONPATH=. python benchmarks/bench_router.py                  # exits 1 on a failed check; skips without CUDA
    PYTHONPATH=. python benchmarks/bench_router.py --configs large
    PYTHONPATH=. python benchmarks/bench_router.py --bwd-warps 4,8     # the backward kernel at each warp count too

Methods, both from the same fp32 logits (T, E) and a nonzero expert_bias:
  triton   router_topk: scores, biased top-k and weights in one kernel; backward in one kernel
  torch    softmax | sigmoid -> topk(scores + bias) -> gather -> (/ sum) -> * scale, as xmoe/moe/router.py's
           torch branch
Correctness first (the check that decides the exit status), logits ~ N(0, 1):
  ids      equal to torch's, in the same order, except on near-tie rows: where the choice values (scores +
           bias, by torch) at the kernel's ids match those at torch's slot by slot within rtol 2e-6. The two
           compute the scores with different exp/div roundings (~1e-7), enough to swap a few of 10^5 rows'
           neighbours; those rows are counted (near_ties), not failed.
  weights, scores_TK and grad(logits) (backward of a random grad_weights): rel err vs the torch path taken at
           the kernel's ids (so near-tie rows compare like for like), ||got - ref|| / ||ref|| < 1e-5.
Then the median time (harness.time_ms) of the forward alone and forward+backward; speedup = torch / triton.
--bwd-warps: for each warp count (router_topk.BWD_NUM_WARPS, forced for every tile), the check again, the kernel's
forward+backward (columns triton_bwd_w<N>_fwd_bwd_ms, ok_bwd_w<N>) and the backward kernel's GPU time alone
(graph_us: triton_bwd_w<N>_kernel_us; triton_bwd_kernel_us at the default warps), in the same run.
fwd_gbs: the kernel forward's effective bandwidth, reading logits and writing weights, ids and scores.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without PYTHONPATH

from benchmarks.harness import environment, markdown_table, time_ms, write_results

TOLERANCE, TIE_RTOL = 1e-5, 2e-6
# name: (E, K, score_func, norm_topk_prob, routed_scaling_factor)
CONFIGS = {
    "small": (64, 6, "softmax", False, 1.0),
    "medium": (128, 6, "softmax", False, 1.0),
    "large": (256, 8, "sigmoid", True, 2.5),
}
CASES = [("small", 16384), ("medium", 16384), ("medium", 65536), ("large", 16384)]
COLUMNS = [
    "config",
    "T",
    "E",
    "K",
    "score_func",
    "norm",
    "ok",
    "near_ties",
    "id_mismatch",
    "weights_err",
    "grad_err",
    "triton_fwd_ms",
    "torch_fwd_ms",
    "fwd_speedup",
    "triton_fwd_bwd_ms",
    "torch_fwd_bwd_ms",
    "fwd_bwd_speedup",
    "fwd_gbs",
    "triton_bwd_kernel_us",
    "error",
]
NOTES = (
    f"ok: ids equal to the torch path's but for near_ties (ids differ, choice values within rtol {TIE_RTOL}; "
    f"other differing rows: id_mismatch); weights, scores_TK and grad(logits) rel err < {TOLERANCE}. "
    "*_ms: median; speedup = torch / triton (>1: the kernel is faster); fwd_gbs: the kernel forward's bytes "
    "(logits in, weights, ids and scores out) per second; *_kernel_us: the backward kernel alone, GPU time per "
    "launch replayed from a CUDA graph (the *_ms columns include the host's launch cost)."
)


def torch_router(logits_TE, bias_E, top_k, score_func, norm, scale, ids_TK=None):
    """(weights_TK, ids_TK, scores_TK, choice_TE) of router.py's torch branch; ``ids_TK`` given: skip selection."""
    scores_TE = torch.softmax(logits_TE, dim=-1) if score_func == "softmax" else torch.sigmoid(logits_TE)
    choice_TE = scores_TE.detach() + bias_E
    if ids_TK is None:
        ids_TK = choice_TE.topk(top_k, dim=-1).indices
    scores_TK = scores_TE.gather(1, ids_TK)
    weights_TK = scores_TK / (scores_TK.sum(-1, keepdim=True) + 1e-20) if norm else scores_TK
    return weights_TK * scale, ids_TK, scores_TK, choice_TE


def _rel(got, ref):
    got, ref = got.detach().double(), ref.detach().double()
    return float((got - ref).norm() / ref.norm().clamp_min(1e-30)) if torch.isfinite(got).all() else float("nan")


def check(logits, bias, grad_w, K, *args):
    """Correctness of router_topk against the torch path: (ok, {near_ties, id_mismatch, *_err or error})."""
    from xmoe.kernels.router_topk import router_topk

    x = logits.clone().requires_grad_()
    weights, ids, scores = router_topk(x, bias, K, *args)
    (grad,) = torch.autograd.grad(weights, x, grad_w)
    _, ids_ref, _, choice = torch_router(logits, bias, K, *args)
    if not (((ids >= 0) & (ids < logits.shape[1])).all() and (ids.sort(1).values.diff(1) != 0).all()):
        return False, {"error": "ids out of range or repeated within a row"}
    differ = (ids != ids_ref).any(1)
    tied = torch.isclose(choice.gather(1, ids), choice.gather(1, ids_ref), rtol=TIE_RTOL, atol=0).all(1)
    x_ref = logits.clone().requires_grad_()
    w_ref, _, s_ref, _ = torch_router(x_ref, bias, K, *args, ids_TK=ids)
    (grad_ref,) = torch.autograd.grad(w_ref, x_ref, grad_w)
    info = {
        "near_ties": int((differ & tied).sum()),
        "id_mismatch": int((differ & ~tied).sum()),
        "weights_err": _rel(weights, w_ref),
        "scores_err": _rel(scores, s_ref),
        "grad_err": _rel(grad, grad_ref),
    }
    ok = info["id_mismatch"] == 0 and all(info[k] < TOLERANCE for k in ("weights_err", "scores_err", "grad_err"))
    return ok, info  # a NaN error fails too


def graph_us(fn, launches=20) -> float:
    """Microseconds of GPU time per call of fn, replayed from a CUDA graph of ``launches`` calls: the kernel alone,
    without the host's launch cost (which the *_ms columns include, and which is most of them at these sizes)."""
    fn()  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    return time_ms(graph.replay) * 1000 / launches


def run_case(name, T, seed=0, bwd_warps=()):
    from xmoe.kernels import router_topk as rt
    from xmoe.kernels.router_topk import router_topk

    E, K, score_func, norm, scale = CONFIGS[name]
    args = (score_func, norm, scale)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(T, E, device="cuda", generator=gen)
    bias = 0.01 * torch.randn(E, device="cuda", generator=gen)  # about the scale the balancing updates reach
    grad_w = torch.randn(T, K, device="cuda", generator=gen)
    row = {"config": name, "T": T, "E": E, "K": K, "score_func": score_func, "norm": norm}
    row["ok"], info = check(logits, bias, grad_w, K, *args)
    row.update(info)
    x = logits.clone().requires_grad_()
    for method, fn in (
        ("triton", lambda t: router_topk(t, bias, K, *args)[0]),
        ("torch", lambda t: torch_router(t, bias, K, *args)[0]),
    ):
        with torch.no_grad():
            row[f"{method}_fwd_ms"] = time_ms(lambda fn=fn: fn(logits))
        row[f"{method}_fwd_bwd_ms"] = time_ms(lambda fn=fn: torch.autograd.grad(fn(x), x, grad_w))
    for phase in ("fwd", "fwd_bwd"):
        row[f"{phase}_speedup"] = row[f"torch_{phase}_ms"] / row[f"triton_{phase}_ms"]
    ids = router_topk(logits, bias, K, *args)[1]
    row["triton_bwd_kernel_us"] = graph_us(lambda: rt.router_topk_bwd(grad_w, logits, ids, *args))
    default = rt.BWD_NUM_WARPS
    for warps in bwd_warps:
        rt.BWD_NUM_WARPS = warps
        try:
            row[f"ok_bwd_w{warps}"] = check(logits, bias, grad_w, K, *args)[0]
            row[f"triton_bwd_w{warps}_fwd_bwd_ms"] = time_ms(
                lambda: torch.autograd.grad(router_topk(x, bias, K, *args)[0], x, grad_w)
            )
            row[f"triton_bwd_w{warps}_kernel_us"] = graph_us(lambda: rt.router_topk_bwd(grad_w, logits, ids, *args))
        finally:
            rt.BWD_NUM_WARPS = default
        row["ok"] = row["ok"] and row[f"ok_bwd_w{warps}"]
    row["fwd_gbs"] = (T * E * 4 + T * K * (4 + 8 + 4)) / row["triton_fwd_ms"] * 1e-6
    return row


def profile(name="medium", T=16384, iters=20):
    """Host and GPU time of the kernel's forward+backward, op by op (torch.profiler)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from xmoe.kernels.router_topk import router_topk

    E, K, score_func, norm, scale = CONFIGS[name]
    x = torch.randn(T, E, device="cuda").requires_grad_()
    bias, grad_w = torch.zeros(E, device="cuda"), torch.randn(T, K, device="cuda")
    for _ in range(3):
        torch.autograd.grad(router_topk(x, bias, K, score_func, norm, scale)[0], x, grad_w)
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            torch.autograd.grad(router_topk(x, bias, K, score_func, norm, scale)[0], x, grad_w)
        torch.cuda.synchronize()
    events = prof.key_averages()
    print(events.table(sort_by="self_device_time_total", row_limit=10))
    print(events.table(sort_by="self_cpu_time_total", row_limit=10))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--profile", action="store_true", help="also print torch.profiler tables of one case")
    parser.add_argument("--bwd-warps", default="", help="backward kernel warp counts to time too, e.g. 4,8")
    args = parser.parse_args()
    bwd_warps = tuple(int(w) for w in args.bwd_warps.split(",") if w)
    columns = COLUMNS + [
        c for w in bwd_warps for c in (f"ok_bwd_w{w}", f"triton_bwd_w{w}_fwd_bwd_ms", f"triton_bwd_w{w}_kernel_us")
    ]
    if not torch.cuda.is_available():
        print("bench_router: skipped, no CUDA device (CPU coverage: tests/test_router_kernel.py)")
        return 0
    meta = environment()
    rows = []
    for name, T in CASES:
        if name not in args.configs.split(","):
            continue
        try:
            row = run_case(name, T, bwd_warps=bwd_warps)
        except Exception as exc:  # record and go on, then fail
            row = {"config": name, "T": T, "ok": False, "error": f"{type(exc).__name__}: {str(exc)[:160]}"}
        rows.append(row)
        print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        gc.collect()
        torch.cuda.empty_cache()
        write_results(
            "bench_router", rows, columns, meta, "Router top-k, fp32: Triton kernel vs torch path", NOTES, topic="layer"
        )
    if args.profile:
        profile()
    print()
    print(markdown_table(rows, columns))
    all_ok = bool(rows) and all(r["ok"] for r in rows)
    print("bench_router:", "PASS" if all_ok else "FAIL")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
