"""Where one training step's GPU time goes: torch.profiler over the real trainer's steps on one GPU.

    python benchmarks/profile_step.py --layers 8 --batch-size 64 --micro-batch-size 8 --compile on
    python benchmarks/profile_step.py --results benchmarks/results/train --tag moe8_b64_compiled ...

Builds `xmoe train`'s Trainer from the same flags (small preset shape, seq 2048), runs warm-up steps (compilation
included), then profiles ``--steps`` optimizer steps. Kernels are grouped by name into GEMM, attention, MoE kernels
(xmoe's Triton grouped GEMMs, router, gather/combine), optimizer, copies / casts, elementwise and reductions, other;
"idle" is the step's wall time that no kernel covers (the host or a sync sets the pace there; the profiler's own
cost per op slows the host, so check a gap with host_lead.py, which runs without it). Prints the table, the top
kernels and the gaps between kernels (the short ones, a launch's latency, in one sum; the longer ones, host work the
GPU waited for, by the kernels on either side); with --results writes profile_<tag>.json / .md. Skips without a GPU."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without PYTHONPATH

CATEGORIES = [  # first match wins; lower-case substrings of kernel names
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    (
        "moe kernels",
        (
            "_grouped",
            "swiglu",
            "_wgrad",
            "router_topk",
            "_gather",
            "_combine",
            "permute",
            "_mm_kernel",
            "_fp8_",
            "_quant_",
        ),
    ),
    ("optimizer", ("adam", "multi_tensor", "foreach", "l2norm", "norm_kernel")),
    ("gemm", ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas", "matmul", "sgemm", "xmma")),
    ("copies / casts", ("copy", "cast", "memcpy", "convert", "to_copy")),
    (
        "elementwise + reductions",
        (
            "triton_",
            "elementwise",
            "reduce",
            "vectorized",
            "unrolled",
            "softmax",
            "cross_entropy",
            "index",
            "scatter",
            "gather",
            "sort",
            "cumsum",
            "fill",
            "mul",
            "add",
            "silu",
            "rsqrt",
        ),
    ),
]


def categorize(name: str) -> str:
    low = name.lower()
    for category, keys in CATEGORIES:
        if any(k in low for k in keys):
            return category
    return "other"


LONG_GAP_MS = 0.05  # a gap past this is host work the GPU waited for, not one launch's latency


def main() -> None:
    from benchmarks.harness import host_ops_in_longest_gap, kernel_gaps, parse_trainer_args, write_step_report
    from xmoe.train.cli import build_run_config
    from xmoe.train.trainer import Trainer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--warmup-steps", type=int, default=3, help="steps before profiling (compilation happens here)")
    p.add_argument("--profile-steps", type=int, default=2, help="optimizer steps profiled")
    p.add_argument("--tag", default="step", help="results file name: profile_<tag>")
    p.add_argument("--host", action="store_true", help="also list the host's ops during the longest GPU gap")
    p.add_argument("--results", help="directory for profile_<tag>.json / .md (default: print only)")
    args = parse_trainer_args(p, sys.argv[1:])
    if not torch.cuda.is_available():
        print("profile_step: skipped, no CUDA GPU")
        return
    args.steps = args.warmup_steps + args.profile_steps + 2
    run = build_run_config(args)
    with tempfile.TemporaryDirectory() as out:
        # --fit auto (the default here): a batch this GPU cannot hold at once is profiled in micro-batches that fit
        trainer = Trainer(run, out, device="cuda", fit=args.fit)
        if trainer.memory_line:
            print(trainer.memory_line)
        accum = trainer.accumulation_steps()
        for _ in range(args.warmup_steps):
            trainer.train_step(accum)
        torch.cuda.synchronize()
        # host synchronisations inside a (non-logging) step: CUDA's sync debug mode warns on each one
        import warnings

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                trainer.train_step(accum)
                torch.cuda.synchronize()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        # the mode's own notice ("... is a prototype feature ...") is not a synchronisation
        syncs = [
            str(w.message).splitlines()[0][:120]
            for w in caught
            if "synchroniz" in str(w.message).lower() and "prototype" not in str(w.message)
        ]
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            for _ in range(args.profile_steps):
                trainer.train_step(accum)
            torch.cuda.synchronize()
            wall_ms = (time.perf_counter() - start) * 1e3 / args.profile_steps
        gaps = kernel_gaps(prof)
        if args.host:  # one more step, the host's ops recorded too (slower: not in the tables)
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU], with_stack=True) as host_prof:
                trainer.train_step(accum)
                torch.cuda.synchronize()
            longest, host_ops = host_ops_in_longest_gap(host_prof)
    totals: dict[str, float] = {}
    kernels: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            ms = e.device_time_total / 1e3 / args.profile_steps
            totals[categorize(e.name)] = totals.get(categorize(e.name), 0.0) + ms
            kernels[e.name] = kernels.get(e.name, 0.0) + ms
    busy = sum(totals.values())
    totals["idle"] = max(0.0, wall_ms - busy)
    # where the GPU waits: gaps between kernels, short ones (launch latency) apart from long ones (host work)
    short_ms = sum(g for g, _ in gaps if g < LONG_GAP_MS) / args.profile_steps
    short_count = sum(g < LONG_GAP_MS for g, _ in gaps) // args.profile_steps
    by_place: dict[str, list[float]] = {}
    for g, where in gaps:
        if g >= LONG_GAP_MS:
            by_place.setdefault(where, []).append(g)
    long_gaps = [
        {"where": w, "count": len(v) // args.profile_steps or 1, "ms": sum(v) / args.profile_steps}
        for w, v in sorted(by_place.items(), key=lambda kv: -sum(kv[1]))[:12]
    ]
    rows = [
        {"category": c, "ms": ms, "pct": 100 * ms / wall_ms} for c, ms in sorted(totals.items(), key=lambda kv: -kv[1])
    ]
    top = [
        {"kernel": k[:90], "ms": ms, "category": categorize(k)}
        for k, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    ]
    lines = [
        f"step wall {wall_ms:.1f} ms, GPU busy {busy:.1f} ms ({args.tag}: {args.layers} layers, batch "
        f"{run.train.global_batch_size}, micro {run.train.micro_batch_size}, compile {run.train.compile}, "
        f"recompute {run.train.recompute})",
        "",
        "| category | ms per step | % of wall |",
        "|---|---|---|",
    ]
    lines += [f"| {r['category']} | {r['ms']:.1f} | {r['pct']:.1f} |" for r in rows]
    lines += ["", "| top kernels | ms per step | category |", "|---|---|---|"]
    lines += [f"| `{t['kernel']}` | {t['ms']:.2f} | {t['category']} |" for t in top]
    lines += [
        "",
        f"GPU idle between kernels: {sum(g for g, _ in gaps) / args.profile_steps:.1f} ms per step, of which "
        f"{short_ms:.1f} ms in gaps under {LONG_GAP_MS * 1e3:.0f} us ({short_count} per step); longer ones by place:",
        "",
        "| after -> before | gaps per step | ms per step |",
        "|---|---|---|",
    ]
    lines += [f"| `{g['where']}` | {g['count']} | {g['ms']:.2f} |" for g in long_gaps]
    if args.host:
        lines += ["", f"host ops during the longest gap ({longest:.2f} ms, a step recorded with the host's ops):"]
        lines += [f"  {ms:8.2f} ms  {name}" for ms, name in host_ops]
    lines += ["", f"host synchronisations in one non-logging step: {len(syncs)}"] + [f"  {m}" for m in syncs[:10]]
    text = "\n".join(lines)
    print(text)
    if args.results:
        payload = {
            "wall_ms": wall_ms,
            "categories": rows,
            "top": top,
            "short_gaps_ms": short_ms,
            "long_gaps": long_gaps,
            "syncs": syncs,
        }
        write_step_report(args.results, f"profile_{args.tag}", f"profile {args.tag}", text, payload)


if __name__ == "__main__":
    main()
