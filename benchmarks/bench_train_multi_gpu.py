"""Whole-model training throughput on several GPUs: the X-MoE paper's 8-GPU table (Small preset and reduced
variants, xmoe vs the padded baseline) and SSMB under TP=2 x EP.

    torchrun --nproc-per-node 8 benchmarks/bench_train_multi_gpu.py                    # the table: xmoe vs padded
    torchrun --nproc-per-node 8 benchmarks/bench_train_multi_gpu.py --mode ssmb        # TP=2 x EP=4, SSMB on / off
    torchrun --nproc-per-node 8 benchmarks/bench_train_multi_gpu.py --mode overlap     # EP=8, overlap off vs auto
    torchrun --nproc-per-node 4 benchmarks/bench_train_multi_gpu.py --cpu --variants 32x2  # gloo smoke test, tiny

# W world size, mb micro-batch (sequences per rank per step), SEQxLAYERS a variant of the base preset ("SEQxfit":
# the most layers, at most the preset's, whose micro-batch 1 the planner predicts fits 70% of the free GPU memory,
# xmoe.plan.fit.predict_train_peak, least over ranks)

Skips (exit 0, with the reason) without CUDA GPUs or with fewer than 2 ranks. The model is built from the trainer's
own construction pipeline (xmoe.parallel.build: meta build, TP / SSMB, then EP + FSDP2, each rank's shards
initialised from one seed), fp32 master weights, bf16 FSDP2 mixed precision under autocast, fused AdamW, clipping: one
step here is one optimizer step of `xmoe train` with one micro-batch, on uniform random tokens (routing from the
random init is near uniform, as in the paper's throughput runs).
Methods (every rank runs the same steps, so all collectives match):
  xmoe         PFT dispatcher + Triton kernels, EP = W (dense weights FSDP2 over all W ranks)
  padded       GShard / DeepSpeed-MoE capacity buffers, capacity factor 1.25, EP = W: every rank's (E, C, H)
               buffer moves by one equal-split all-to-all, padding included (PaddedAllToAllDispatcher)
  padded-dp    the same buffers at EP = 1, DP = W, everything FSDP2-sharded (ZeRO-3; not in the default)
  xmoe-dp      PFT at EP = 1, DP = W (ZeRO-3): separates the dispatcher's effect from the layout (not in the default)
  tp2-ssmb / tp2-nossmb   TP = 2 x EP = W/2, with and without SSMB (the trainer always applies SSMB at TP > 1)
  xmoe-auto    xmoe with parallel.ep_overlap = "auto": the mode xmoe/train/run_config.py's resolve_ep_overlap picks
               for the layout and micro-batch (the planner's choice, as `xmoe train` resolves it; column overlap);
               xmoe-shared / xmoe-chunks: that mode (xmoe itself runs "off"). Mode overlap: xmoe vs xmoe-auto, the
               small preset at EP = W, tokens/s per GPU, and the planner's step for the mode auto chose, from the
               measured "off" step of the same micro-batch (benchmarks/ep_planner.py: predict_model; pred_err =
               measured / predicted - 1, target within 15%)
Micro-batch search: mb = 1, 2, 4, ... until torch.OutOfMemoryError, a time cap, or --micro-batches' end. OOM is caught
per rank and all ranks all-reduce the flag (MAX) before deciding, so they stop together; the model is then dropped and
memory freed. Caveat: a rank that runs out of memory alone INSIDE a collective leaves its peers waiting in that
collective; the process group timeout (--pg-timeout-s) then ends the run, and the rows written so far (results are
rewritten after every size) survive. Timing: CUDA events around a fixed number of steps after warm-up on every rank;
rank 0's ms/step, the max over ranks too, and peak allocated / reserved memory as the max over ranks.
TFLOP/s per GPU: xmoe's formula (xmoe.model.flops.train_flops, with the routed rows actually kept: padded drops)
and the paper's (paper_train_flops), both over global sequences per step / (time x W).
Results: rank 0 writes train_multi_gpu_<mode>.json / .md under $XMOE_RESULTS_DIR or benchmarks/results/multi_gpu/
after every micro-batch. docs/benchmarks-multi-gpu.md describes the whole multi-GPU run (benchmarks/run_multi_gpu.sh).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without PYTHONPATH

from benchmarks.harness import collective_time_ms, distributed_skip_reason, init_distributed

GIB = 2**30
METHODS = {  # name -> (dispatcher, capacity factor, ep is the world (else 1), tp, ssmb, ep_overlap)
    "xmoe": ("pft", None, True, 1, False, "off"),
    "padded": ("padded", 1.25, True, 1, False, "off"),
    "padded-dp": ("padded", 1.25, False, 1, False, "off"),
    "xmoe-dp": ("pft", None, False, 1, False, "off"),
    "tp2-ssmb": ("pft", None, True, 2, True, "off"),
    "tp2-nossmb": ("pft", None, True, 2, False, "off"),
    "xmoe-auto": ("pft", None, True, 1, False, "auto"),
    "xmoe-shared": ("pft", None, True, 1, False, "shared"),
    "xmoe-chunks": ("pft", None, True, 1, False, "chunks"),
}
MODES = {  # mode -> default (variants, methods); table variants: the paper's Small, then its two reductions
    "table": (["2048x28", "1024x28", "2048x14"], ["xmoe", "padded"]),
    "ssmb": (["2048x28"], ["tp2-ssmb", "tp2-nossmb"]),
    "overlap": (["2048xfit"], ["xmoe", "xmoe-auto"]),
}
COLUMNS = [
    "variant",
    "method",
    "ep",
    "tp",
    "dp",
    "micro_batch",
    "status",
    "ms_step",
    "ms_step_max",
    "tflops",
    "paper_tflops",
    "tokens_per_s",
    "peak_alloc_gib",
    "peak_reserved_gib",
    "kept_rows_frac",
    "loss",
]
OVERLAP_COLUMNS = ["overlap", "tokens_per_s_gpu", "pred_ms", "pred_err"]  # added in mode overlap


def model_config(base: str, variant: str, dispatcher: str, capacity):
    """The base preset with seq and layers from 'SEQxLAYERS' and the method's dispatcher."""
    from xmoe.model.presets import get_preset

    seq, layers = (int(v) for v in variant.split("x"))
    cfg = get_preset(base)
    moe = dataclasses.replace(cfg.moe, dispatcher=dispatcher, capacity_factor=capacity)
    first_dense = min(cfg.first_k_dense, layers - 1)
    return dataclasses.replace(cfg, max_seq_len=seq, num_layers=layers, first_k_dense=first_dense, moe=moe), seq


def layout(method: str, world: int) -> tuple[int, int, int]:
    """(dp, ep, tp) of a method in a world of W ranks."""
    _, _, ep_world, tp, _, _ = METHODS[method]
    ep = world // tp if ep_world else 1
    return world // (ep * tp), ep, tp


def build(cfg, method: str, device: torch.device, world: int):
    """The trainer's construction (xmoe.parallel.build: meta build, TP (+ SSMB) -> EP + FSDP2 in bf16 mixed precision,
    local shards initialised from one seed), FSDP2 also at EP = TP = 1 where the trainer would use DDP: the padded
    baseline's full expert set (15.5B parameters for small) cannot be replicated on every GPU with its AdamW state.
    Returns (model, optimizer, (dp, ep, tp), ParallelDims)."""
    from xmoe.config import ParallelConfig
    from xmoe.parallel.build import build_model
    from xmoe.parallel.dims import ParallelDims
    from xmoe.train.optim import param_groups

    dp, ep, tp = layout(method, world)
    par = ParallelConfig(dp=dp, ep=ep, tp=tp)
    dims = ParallelDims.from_config(par, world, rank=dist.get_rank()).build_mesh(device.type)
    model = build_model(
        cfg,
        device,
        dims,
        seed=0,
        ssmb=METHODS[method][4],
        fsdp=True,
        param_dtype=torch.bfloat16 if device.type == "cuda" else None,
    ).model
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-4, fused=device.type == "cuda")
    return model, opt, (dp, ep, tp), dims


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _agree(values: list[float], device, op=dist.ReduceOp.MAX) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def measure(model, opt, dims, cfg, seq: int, mb: int, warmup: int, args, device) -> dict:
    """Warm-up then timed optimizer steps at micro-batch mb; OOM -> {'status': 'OOM'} agreed by all ranks."""
    from xmoe.moe.step import MoEStep
    from xmoe.parallel.expert_parallel import clip_grad_norm_

    rank, cuda = dist.get_rank(), device.type == "cuda"
    params = [p for p in model.parameters() if p.requires_grad]
    out, oom = {}, False
    rows = torch.zeros((), dtype=torch.float64, device=device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        gen = torch.Generator(device=device).manual_seed(1000 + rank)
        tokens = torch.randint(0, cfg.vocab_size, (mb, seq + 1), device=device, generator=gen)

        def step(count_rows: bool):
            moe = MoEStep(model, 1, device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda), moe:
                loss = model(tokens[:, :-1], tokens[:, 1:])
                loss.backward()
                if count_rows:
                    moe.end_micro_batch()
            if count_rows:  # routed rows kept (dropped slots excluded), as the trainer counts them
                rows.add_(moe.finish(update_bias=False).rows)
            clip_grad_norm_(params, 1.0, dims=dims)  # as the trainer clips
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.detach()

        t0 = time.perf_counter()
        for _ in range(warmup):
            loss = step(False)
        if cuda:
            torch.cuda.synchronize()
        warm_s = (time.perf_counter() - t0) / warmup
        # every rank must run the same number of steps: agree on the slowest rank's warm-up time
        warm_s = _agree([warm_s], device)[0]
        iters = max(2, min(args.iters, int(args.target_s / max(warm_s, 1e-6))))
        losses = []
        ms = collective_time_ms(lambda: losses.append(step(True)), device, iters, trials=1, warmup=False)
        loss = losses[-1]
        if args.fake_oom and args.fake_oom == (rank, mb):  # test hook: one rank alone, after the step's collectives
            raise torch.OutOfMemoryError("fake OOM (--fake-oom)")
        out = {"ms": ms, "iters": iters, "loss": loss.float().item()}
    except torch.OutOfMemoryError:
        oom = True
    # outside the except block: the traceback (and the activations its frames hold) is gone before freeing
    tokens = step = None
    if oom:
        opt.zero_grad(set_to_none=True)
        _free(device)
    alloc = torch.cuda.max_memory_allocated() / GIB if cuda else 0.0
    reserved = torch.cuda.max_memory_reserved() / GIB if cuda else 0.0
    flag, ms_max, alloc, reserved = _agree([float(oom), out.get("ms", 0.0), alloc, reserved], device)
    if flag:
        return {"status": "OOM", "peak_reserved_gib": reserved or None}
    rows_total = _agree([rows.item() / out["iters"]], device, dist.ReduceOp.SUM)[0]
    return {
        "status": "ok",
        "ms_step": out["ms"],
        "ms_step_max": ms_max,
        "iters": out["iters"],
        "loss": out["loss"],
        "peak_alloc_gib": alloc if cuda else None,
        "peak_reserved_gib": reserved if cuda else None,
        "rows": rows_total,
        "warm_s": warm_s,
    }


def run_case(variant: str, method: str, args, device):
    """One (variant, method): build once, then the micro-batch search. Yields one row per size tried."""
    from xmoe.model.flops import FlopDims, paper_train_flops, train_flops

    world = dist.get_world_size()
    from benchmarks.multi_gpu_overlap import resolve, set_overlap

    dispatcher, capacity, _, _, _, overlap = METHODS[method]
    cfg, seq = model_config(args.base, variant, dispatcher, capacity)
    flop_dims = FlopDims.from_model_config(cfg, seq)
    t_case = time.perf_counter()
    model, opt, (dp, ep, tp), dims = build(cfg, method, device, world)
    _free(device)
    head = {"variant": variant, "method": method, "ep": ep, "tp": tp, "dp": dp}
    data_ranks = dp * ep  # TP peers share tokens (under SSMB each runs the MoE on its slice)
    for i, mb in enumerate(args.micro_batches):
        mode = resolve(cfg, overlap, (dp, ep, tp), mb, seq, device.type)  # "auto": per micro-batch, as the trainer
        if overlap != "off":
            set_overlap(model, mode)
        r = measure(model, opt, dims, cfg, seq, mb, args.warmup if i == 0 else 1, args, device)
        row = {
            **head,
            "micro_batch": mb,
            "overlap": mode,
            **{k: v for k, v in r.items() if k not in ("rows", "warm_s")},
        }
        if r["status"] == "ok":
            sequences, sec = mb * data_ranks, r["ms_step"] / 1e3
            dropless = sequences * seq * flop_dims.num_moe_layers * flop_dims.top_k
            routed = int(r["rows"]) // tp if tp > 1 and not METHODS[method][4] else int(r["rows"])
            row.update(
                tflops=train_flops(flop_dims, sequences, routed_rows=routed) / sec / world / 1e12,
                paper_tflops=paper_train_flops(flop_dims, sequences) / sec / world / 1e12,
                tokens_per_s=sequences * seq / sec,
                kept_rows_frac=routed / dropless if dropless else None,
            )
        yield row
        if r["status"] != "ok":
            break
        # the next size costs about twice this one's (1 warm-up + timed) steps. Estimated from the timed step, not
        # the first warm-up (which holds Triton compilation: on 2 H200s it predicted 86 s for a ~3 s size)
        elapsed = _agree([time.perf_counter() - t_case], device)[0]
        next_s = 2 * (r["ms_step"] / 1e3) * (1 + args.iters)
        if i + 1 < len(args.micro_batches) and elapsed + next_s > args.case_budget_s:
            yield {
                **head,
                "micro_batch": args.micro_batches[i + 1],
                "status": f"not run: time cap ({elapsed:.0f} s used, next ~{next_s:.0f} s)",
            }
            break
    model = opt = None
    _free(device)


def best_rows(rows: list[dict]) -> list[dict]:
    """Per (variant, method): the largest micro-batch that ran, or the first failure when none did."""
    best: dict = {}
    for r in rows:
        key = (r["variant"], r["method"])
        if key not in best or r["status"] == "ok":  # sizes come in increasing order
            best[key] = r
    return list(best.values())


def write(rows: list[dict], args, meta: dict, done: bool) -> None:
    from benchmarks.harness import markdown_table, write_results

    paper = {
        "table": "Paper, 8 x A100 40GB (DeepSpeed-MoE / Tutel / X-MoE): Small s=2048 L=28: OOM / OOM / 46.87; "
        "seq 1024: 27.08 / 28.26 / 27.33; 14 layers: 52.15 / 64.00 / 62.51 TFLOP/s per GPU (paper formula).",
        "ssmb": "Paper (its own model and setting): peak memory at TP=2 29.9 -> 25.7 GB with SSMB.",
        "overlap": "Targets: the planner within 15% of each measured step.",
    }[args.mode]
    columns, lines = COLUMNS, []
    if args.mode == "overlap":
        from benchmarks.multi_gpu_overlap import predictions

        columns = COLUMNS[:7] + OVERLAP_COLUMNS + COLUMNS[7:]
        world = meta["world_size"]
        lines = predictions(rows, lambda v: model_config(args.base, v, "pft", None), world, meta["device_type"])
    notes = (
        "Largest micro-batch that ran per (variant, method); OOM / not run where no size fitted. "
        + paper
        + "\n\n"
        + markdown_table(best_rows(rows), columns)
        + ("\n\nAgainst the targets:\n\n" + "\n".join(f"- {line}" for line in lines) if lines else "")
        + ("" if done else "\n\n(incomplete: written after every micro-batch, the run did not finish)")
        + "\n\nEvery size tried:"
    )
    title = {
        "table": "X-MoE 8-GPU table: xmoe vs padded baseline, whole model",
        "ssmb": "SSMB at TP=2 x EP, whole model",
        "overlap": "Expert-parallel overlap, whole model: off vs the planner's choice",
    }[args.mode]
    meta = {**meta, "args": vars(args) | {"fake_oom": None}, "targets": lines}
    write_results(f"train_multi_gpu_{args.mode}", rows, columns, meta, title, notes, topic="multi_gpu")
    if done:
        print(markdown_table(best_rows(rows), columns) + "\n\n" + "\n".join(lines), flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=list(MODES), default="table")
    p.add_argument("--base", default=None, help="base preset (default small; tiny with --cpu)")
    p.add_argument("--variants", nargs="+", default=None, help="SEQxLAYERS of the base preset (default: per mode)")
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=None, help="default: per mode")
    p.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps at the first size (1 at later sizes)")
    p.add_argument("--iters", type=int, default=4, help="most timed steps per size")
    p.add_argument("--target-s", type=float, default=3.0, help="timed steps per size ~ this many seconds (>= 2)")
    p.add_argument("--case-budget-s", type=float, default=45.0, help="seconds per (variant, method), build included")
    p.add_argument("--pg-timeout-s", type=float, default=120.0, help="collective timeout (see the OOM caveat)")
    p.add_argument(
        "--fake-oom",
        type=int,
        nargs=2,
        default=None,
        metavar=("RANK", "MB"),
        help="testing: raise OutOfMemoryError on RANK alone at micro-batch MB",
    )
    p.add_argument("--cpu", action="store_true", help="gloo smoke test of this script on CPU processes")
    args = p.parse_args(argv)
    variants, methods = MODES[args.mode]
    args.base = args.base or ("tiny" if args.cpu else "small")
    args.variants = args.variants or (["32x2"] if args.cpu else variants)
    args.methods = args.methods or methods
    args.fake_oom = tuple(args.fake_oom) if args.fake_oom else None
    return args


def main(argv=None) -> list[dict] | None:
    args = parse_args(argv)
    reason = None if dist.is_initialized() else distributed_skip_reason("benchmarks/bench_train_multi_gpu.py", args.cpu)
    if reason:
        print(f"bench_train_multi_gpu: skipped: {reason}")
        return None
    device = init_distributed(args.cpu, args.pg_timeout_s)
    from benchmarks.harness import environment
    from benchmarks.multi_gpu_overlap import fit_variant

    world, rank = dist.get_world_size(), dist.get_rank()
    meta = {**environment(), "world_size": world, "device_type": device.type}
    rows: list[dict] = []
    for variant in args.variants:
        variant = fit_variant(variant, args.base, layout(args.methods[0], world), device)
        for method in args.methods:
            if method.startswith("tp2") and world % 2:
                continue
            for row in run_case(variant, method, args, device):
                rows.append(row)
                if rank == 0:  # rewritten after every size: a later hang or kill keeps what ran
                    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
                    write(rows, args, meta, done=False)
    if rank == 0:
        write(rows, args, meta, done=True)
    return rows


if __name__ == "__main__":
    main()
    if dist.is_initialized():
        dist.destroy_process_group()
