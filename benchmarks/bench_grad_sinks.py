"""Weight gradients added straight into the fp32 .grad (moe/step.py's gradient targets) on one GPU: checked, then
timed against the path they replace, in one run.

    PYTHONPATH=. python benchmarks/bench_grad_sinks.py --out DIR [--tokens 32768]     # skips without a GPU

# T tokens, H hidden, F expert ffn, E experts, K top-k, N = T K rows

Shape: the small preset's MoE layer (H 2048, F 1408, E 64, K 6) at T tokens per micro-batch (32768: the 8-layer
model's micro-batch of 16 sequences of 2048), uniform routing, bf16 activations.

Checks (exit 1 on a failure): three backwards of the fused op, bf16 and FP8 (where the GPU has FP8 matrix
instructions), with targets that start uninitialised (NaN-filled) against the weight gradients the same op
returns, summed in fp32 (||got - want|| / ||want|| < 1e-2: the targets skip the bf16 rounding of each result);
the same three backwards under torch.compile (inductor) against eager, and the compiled backward's peak memory
beside eager's (a copy of the targets would show as their size).

Timings (median of CUDA-event runs, harness.time_ms): per weight, the bf16 result written by grouped_wgrad and
added into fp32 by accumulate_grad (the path before) against grouped_wgrad_into adding in its epilogue, for dW2
and for dW1 + dW3, and for the first micro-batch of a step (store) and a later one (add).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without PYTHONPATH

from benchmarks.harness import RESULTS_ENV, environment, rel_err, time_ms, write_results

H, FFN, E, K = 2048, 1408, 64, 6
TOLERANCE = 1e-2


def _layer(tokens: int, seed: int = 0):
    from xmoe.dispatch.routing import build_plan

    g = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand(tokens, E, device="cuda", generator=g)
    top = scores.topk(K, dim=1)
    plan = build_plan(top.indices, torch.softmax(top.values, dim=1), E)
    x = torch.randn(tokens, H, device="cuda", generator=g).bfloat16()
    w = torch.softmax(torch.randn(tokens, K, device="cuda", generator=g), dim=1).bfloat16()
    ws = [torch.randn(E, *shape, device="cuda", generator=g) * 0.02 for shape in ((H, FFN), (H, FFN), (FFN, H))]
    grads = [torch.randn(tokens, H, device="cuda", generator=g).bfloat16() for _ in range(3)]
    return plan, x, w, ws, grads


def _op(fp8: bool, plan, ws):
    """f(x, w, w1, w3, w2, sinks) -> out: the fused bf16 or FP8 op on this layer's plan."""
    from xmoe.kernels import triton_ops

    args = (plan.token_ids_N, plan.slot_ids_N, plan.row_of_slot_TK, plan.tokens_per_expert_E)
    if not fp8:
        return lambda x, w, w1, w3, w2, sinks: triton_ops.moe_experts(x, w, *args, w1, w3, w2, sinks=sinks)
    from xmoe.kernels.fp8_experts import moe_experts_fp8
    from xmoe.kernels.fp8_quant import fp8_format, quantize_expert_weights

    fmt = fp8_format(torch.device("cuda")).name
    qw = quantize_expert_weights(*ws, fmt)
    return lambda x, w, w1, w3, w2, sinks: moe_experts_fp8(x, w, *args, w1, w3, w2, qw, fmt, sinks=sinks)


def _backwards(fn, x, w, ws, grads, sinks):
    """Three backwards through fn; the weight gradients fn returns (bf16 copies as leaves), summed in fp32, or None
    with sinks; and the peak memory of the last backward above what was held before it."""
    total, peak = None, 0
    receivers = [t.bfloat16().requires_grad_() for t in ws]
    for g in grads:
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(xl, wl, *receivers, sinks)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out.backward(g)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        if sinks is None:
            got = [r.grad.float() for r in receivers]
            total = got if total is None else [a + b for a, b in zip(total, got, strict=True)]
            for r in receivers:
                r.grad = None
    return total, peak


def check(fp8: bool, tokens: int) -> tuple[bool, dict]:
    plan, x, w, ws, grads = _layer(tokens)
    fn = _op(fp8, plan, ws)
    want, _ = _backwards(fn, x, w, ws, grads, None)
    _, compiled_returned_peak = _backwards(torch.compile(fn), x, w, ws, grads, None)
    results = {}
    for mode in ("eager", "compiled"):
        call = fn if mode == "eager" else torch.compile(fn)
        sinks = (*(torch.full_like(t, float("nan")) for t in ws), torch.zeros(3, dtype=torch.int32, device="cuda"))
        _, peak = _backwards(call, x, w, ws, grads, sinks)
        results[mode] = (sinks, peak)
    row = {"path": "FP8" if fp8 else "bf16", "target_GB": round(sum(t.numel() for t in ws) * 4 / 1e9, 3)}
    ok = True
    for i, name in enumerate(("dw1", "dw3", "dw2")):
        err = rel_err(results["eager"][0][i], want[i])
        vs_eager = rel_err(results["compiled"][0][i], results["eager"][0][i])
        row[f"{name} vs returned"], row[f"{name} compiled vs eager"] = err, vs_eager
        ok &= err < TOLERANCE and vs_eager < TOLERANCE
    row["backward peak GB eager"] = round(results["eager"][1] / 1e9, 3)
    row["backward peak GB compiled"] = round(results["compiled"][1] / 1e9, 3)
    row["backward peak GB compiled, gradients returned"] = round(compiled_returned_peak / 1e9, 3)
    ok &= all(f.tolist() == [1, 1, 1] for f in (results["eager"][0][3], results["compiled"][0][3]))
    row["ok"] = ok
    return ok, row


def timings(tokens: int) -> list[dict]:
    from xmoe.kernels.accumulate import accumulate_grad
    from xmoe.kernels.grouped_wgrad import grouped_wgrad, grouped_wgrad_into

    plan, x, _, _, _ = _layer(tokens)
    gen = torch.Generator(device="cuda").manual_seed(1)
    rows_N = plan.token_ids_N.shape[0]
    a_w, dh1, dh3 = (torch.randn(rows_N, FFN, device="cuda", generator=gen).bfloat16() for _ in range(3))
    g = torch.randn(tokens, H, device="cuda", generator=gen).bfloat16()
    counts, tok = plan.tokens_per_expert_E, plan.token_ids_N
    grad2, grad1, grad3 = (torch.zeros(E, *s, device="cuda") for s in ((FFN, H), (H, FFN), (H, FFN)))
    rows = []
    for state, flag in (("store (first micro-batch)", 0), ("add (later micro-batches)", 1)):
        flags = torch.full((3,), flag, dtype=torch.int32, device="cuda")
        held = (lambda t: t) if flag else (lambda t: None)

        def into(a, a_idx, b1, b2, b_idx, c1, c2, f1, f2, flags=flags, flag=flag):
            flags.fill_(flag)
            grouped_wgrad_into(a, a_idx, b1, b2, b_idx, counts, c1, c2, flags, f1, f2)

        cases = {
            "dW2": (
                lambda held=held: accumulate_grad(
                    held(grad2), grouped_wgrad(a_w, None, g, None, tok, counts)[0], torch.float32
                ),
                lambda into=into: into(a_w, None, g, None, tok, grad2, None, 2, 2),
            ),
            "dW1 + dW3": (
                lambda held=held: [
                    accumulate_grad(held(target), dw, torch.float32)
                    for target, dw in zip((grad1, grad3), grouped_wgrad(x, tok, dh1, dh3, None, counts), strict=True)
                ],
                lambda into=into: into(x, tok, dh1, dh3, None, grad1, grad3, 0, 1),
            ),
        }
        for name, (before, after) in cases.items():
            t_before, t_after = time_ms(before), time_ms(after)
            rows.append(
                {
                    "weights": name,
                    "step": state,
                    "bf16 result + accumulate_grad ms": t_before,
                    "epilogue into .grad ms": t_after,
                    "saved ms": t_before - t_after,
                }
            )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help=f"results directory (default ${RESULTS_ENV} or benchmarks/results)")
    p.add_argument("--tokens", type=int, default=32768, help="tokens per micro-batch (default 32768)")
    p.add_argument("--stem", default="bench_grad_sinks", help="results file name without extension")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_grad_sinks: no GPU, skipped")
        return 0
    if args.out:
        import os

        os.environ[RESULTS_ENV] = args.out
    from xmoe.kernels.fp8_quant import fp8_format

    checks = [check(False, args.tokens)]
    try:
        fp8_format(torch.device("cuda"))
        checks.append(check(True, args.tokens))
    except ValueError as exc:  # no FP8 matrix instructions: the bf16 path alone
        print(f"bench_grad_sinks: FP8 skipped ({exc})")
    for _, row in checks:
        print(row)
    rows = timings(args.tokens)
    for row in rows:
        print(row)
    meta = {**environment(), "tokens": args.tokens, "shape": {"H": H, "F": FFN, "E": E, "K": K}}
    check_cols = list(checks[0][1].keys())
    write_results(args.stem + "_check", [r for _, r in checks], check_cols, meta, "gradient targets: checks")
    write_results(args.stem, rows, list(rows[0].keys()), meta, f"weight gradients into .grad, T={args.tokens}")
    return 0 if all(ok for ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
