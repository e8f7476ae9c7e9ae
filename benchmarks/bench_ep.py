"""Expert parallelism on GPUs (NCCL): a correctness check, then the routed layer's time, the all-to-all time that
overlap hides and FP8 dispatch saves, beside the same layer on one GPU and the planner's prediction.

# T tokens per rank, H hidden, F expert ffn, E experts, K top-k, P = EP ranks (= world size here), n chunks

    torchrun --nproc-per-node 2 benchmarks/bench_ep.py             # small and medium, T = 8192 and 16384
    torchrun --nproc-per-node 8 benchmarks/bench_ep.py --shapes small --tokens 16384 --modes off chunks
    torchrun --nproc-per-node 2 benchmarks/bench_ep.py --cpu       # gloo smoke test of the script, tiny shape

Skips (exit 0, with the reason) without CUDA GPUs or when not launched on >= 2 ranks. ``--cpu`` runs the same code
on CPU processes over gloo (host timers, fp32, tiny shape): a smoke test of the script, not a measurement. A token
count whose layers do not fit the GPU's free memory is skipped with a note (xmoe.bench.memory_need).

The layer: the preset's MoE layer (H, F, E, K) with one shared expert of width F, its experts sharded over the P
ranks and the flat all-to-all dispatcher installed as xmoe/parallel/expert_parallel.py's ``shard_experts`` does it,
``parallel.ep_overlap`` (off / shared / chunks, n = --chunks) and ``moe.dispatch_dtype`` (bf16 / fp8) per case.

1. Check (fp32, TF32 off), every overlap mode: the EP layer vs the same weights on one GPU with the local
   dispatcher, for uniform, skewed and degenerate routing (every token to rank 0's experts, so the other ranks
   receive nothing): output, input gradient, router gradient and the local experts' gradients.
2. Timing (bf16; CPU: fp32), forward + backward, CUDA events around a FIXED number of calls (every rank must run the
   same collectives, so do_bench's adaptive repeat count cannot be used), median of trials. Per shape and T:
     local_ms      the same layer with all E experts on one GPU and no communication: the same T K routed rows,
                   over E experts instead of E / P
     sync_ms       the count exchange and the layer call's one host sync, alone
     experts_ms    the routed experts on the rows this rank received, forward + backward, alone (experts_fwd_ms:
                   forward alone, the planner's input)
     shared_ms     the shared expert on the T tokens, forward + backward, alone
   Per dispatch dtype and overlap mode ("off" always runs: it is the baseline):
     layer_ms      the EP layer
     nocomm_ms     the same layer with each row all-to-all replaced by a local copy of the same shape
                   (benchmarks/ep_exchanges.py): its compute-only counterpart (count exchange and host sync kept)
     exposed_ms    layer_ms - nocomm_ms: the all-to-all time that no compute hid (the definition used here;
                   measurable with CUDA events, no profiler)
     comm_ms       the layer call's row all-to-alls (forward and backward, 4 n of them with chunks), replayed
                   alone with their real splits and payloads: the all-to-all time with nothing to hide it
     dispatch_ms   the forward dispatch's all-to-all alone (the one exchange FP8 dispatch shrinks)
     hidden        (comm_ms - exposed_ms) / min(comm_ms, overlapped compute): the share of the all-to-all time
                   the mode can cover that it hid; the overlapped compute is shared_ms with "shared", experts_ms +
                   shared_ms with "chunks" (what the mode places beside the exchanges)
     chunk_cost    nocomm_ms / nocomm_ms of "off" - 1: what the mode's compute costs (chunked GEMMs are smaller)
     pred_ms, pred_exposed_ms, pred_comm_ms, pred_err   the planner (benchmarks/ep_planner.py: predict_step,
                   compute_model, estimate_comm; default network) given nocomm_ms of "off" less sync_ms as the
                   compute and experts_fwd_ms; pred_err = layer_ms / pred_ms - 1
Targets printed and written (on NVLink): hidden >= 60% (shared, chunks); dispatch_ms fp8 / bf16 <= 0.6; |pred_err|
<= 15%. Results: rank 0 writes bench_ep_ep<P>.json / .md under $XMOE_RESULTS_DIR or benchmarks/results/ep/.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without PYTHONPATH

from benchmarks.harness import collective_time_ms, distributed_skip_reason, init_distributed, rel_err
from xmoe.bench import LAYER_SHAPES, layer_shape

DEVICE = torch.device("cuda")  # set in main()
MODES = ("off", "shared", "chunks")
DTYPES = ("bf16", "fp8")
TARGET_HIDDEN, TARGET_FP8 = 0.60, 0.6


def _local(shape: str, dtype, bias: torch.Tensor | None = None, seed: int = 0):
    """The preset's MoE layer with one shared expert, all experts here, the local dispatcher."""
    from xmoe.config import MoEConfig
    from xmoe.moe.layer import MoELayer

    hidden, ffn, experts, top_k = layer_shape(shape)
    torch.manual_seed(seed)  # every rank the same weights (CUDA's generator too: initialised on the device)
    cfg = MoEConfig(hidden_size=hidden, ffn_hidden_size=ffn, num_experts=experts, top_k=top_k, num_shared_experts=1)
    with torch.device(DEVICE):  # medium's 3B expert weights initialised on the GPU, not on the host
        local = MoELayer(cfg).to(dtype)
    if bias is not None:
        local.router.expert_bias.copy_(bias)
    return local


def _sharded(local, dims, dispatch_dtype: str = "bf16", mode: str = "off", chunks: int = 2):
    """A copy of ``local`` with its experts sharded over "ep" by shard_experts, rows travelling in dispatch_dtype."""
    from xmoe.parallel.expert_parallel import shard_experts

    layer = copy.deepcopy(local)
    layer.cfg = dataclasses.replace(layer.cfg, dispatch_dtype=dispatch_dtype)
    return shard_experts(layer, dims, mode, chunks)


def check(shape: str, num_tokens: int, dims, modes, chunks: int) -> list[dict]:
    torch.backends.cuda.matmul.allow_tf32 = False
    rank, world = dist.get_rank(), dist.get_world_size()
    hidden, _, experts, _ = layer_shape(shape)
    local_e = experts // world
    mine = slice(rank * local_e, (rank + 1) * local_e)
    skew = torch.linspace(0.02, 0.0, experts)  # popular low-numbered experts (rank 0's)
    to_rank0 = torch.zeros(experts)
    to_rank0[:local_e] = 10.0
    rows = []
    for name, bias in [("uniform", None), ("skewed", skew), ("all_to_rank0", to_rank0)]:
        ref = _local(shape, torch.float32, bias.to(DEVICE) if bias is not None else None)
        ep_layer = _sharded(ref, dims, chunks=chunks)
        gen = torch.Generator(device=DEVICE).manual_seed(1)
        x_R = torch.randn(world, num_tokens, hidden, device=DEVICE, generator=gen)
        g_R = torch.randn(x_R.shape, device=DEVICE, generator=gen)
        ref_x, ref_router, ref_experts = [], [], None
        for r in range(world):
            ref.zero_grad()
            x = x_R[r].clone().requires_grad_(True)
            ref(x).backward(g_R[r])
            ref_x.append(x.grad)
            ref_router.append(ref.router.weight.grad.clone())
            w = torch.stack([ref.experts.w1.grad[mine], ref.experts.w3.grad[mine]])
            ref_experts = w if ref_experts is None else ref_experts + w
        with torch.no_grad():
            ref_out = ref(x_R[rank])
        for mode in modes:
            ep_layer.set_overlap(mode, chunks)
            ep_layer.zero_grad(set_to_none=True)
            x = x_R[rank].clone().requires_grad_(True)
            out = ep_layer(x)
            out.backward(g_R[rank])
            got_experts = torch.stack([ep_layer.experts.w1.grad.to_local(), ep_layer.experts.w3.grad.to_local()])
            errs = {
                "out": rel_err(out, ref_out),
                "x_grad": rel_err(x.grad, ref_x[rank]),
                "router_grad": rel_err(ep_layer.router.weight.grad, ref_router[rank]),
                "expert_grads": rel_err(got_experts * world, ref_experts),  # EP scales expert grads by 1 / ep
            }
            worst = torch.tensor(max(errs.values()), device=DEVICE)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            rows.append({"check": name, "mode": mode, **errs, "worst_all_ranks": worst.item()})
            rows[-1]["ok"] = rows[-1]["worst_all_ranks"] < 1e-4
    return rows


def fit_note(shape: str, num_tokens: int, world: int) -> str | None:
    """Why the layers of this case may not fit the GPU's free memory (the least over ranks), or None: the one-GPU
    layer's weights and gradients, the EP layer's 1/P of them, and four times a lower bound of one call's
    activations (forward and backward, EP and local layers)."""
    if DEVICE.type != "cuda":
        return None
    from xmoe.bench import memory_need

    weights, acts = memory_need(shape, num_tokens, torch.bfloat16)
    need = weights * (1 + 1 / world) + 4 * acts
    torch.cuda.empty_cache()  # what the check's fp32 layers left cached counts as free
    free = torch.tensor(float(torch.cuda.mem_get_info(DEVICE)[0]), device=DEVICE)
    dist.all_reduce(free, op=dist.ReduceOp.MIN)
    if need <= 0.9 * free.item():
        return None
    return f"skipped: needs about {need / 2**30:.1f} GiB, more than 90% of the {free.item() / 2**30:.1f} GiB free"


def bench(shape: str, num_tokens: int, dims, args) -> list[dict]:
    from benchmarks.ep_exchanges import local_copies, recording, replay
    from benchmarks.ep_planner import predict_layer
    from xmoe.dispatch.comm import exchange_counts, splits_to_host
    from xmoe.dispatch.routing import build_plan

    hidden, _ffn, experts, _top_k = layer_shape(shape)
    world, group = dist.get_world_size(), dims.group("ep")
    head = {"shape": shape, "tokens_per_rank": num_tokens, "ep": world}
    note = fit_note(shape, num_tokens, world)
    if note:
        return [{**head, "note": note}]
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    local = _local(shape, dtype)
    gen = torch.Generator(device=DEVICE).manual_seed(dist.get_rank())
    x = torch.randn(num_tokens, hidden, device=DEVICE, dtype=dtype, generator=gen).requires_grad_(True)
    g = torch.randn(num_tokens, hidden, device=DEVICE, dtype=dtype, generator=gen)

    def timed(fn) -> float:
        return collective_time_ms(fn, DEVICE, args.iters, trials=args.trials)

    def step(layer):
        def fn():
            layer.zero_grad(set_to_none=True)
            x.grad = None
            layer(x).backward(g)

        return fn

    base = dict(head, local_ms=timed(step(local)))
    # the parts alone, with this rank's real routing
    layers = {"bf16": _sharded(local, dims, "bf16", chunks=args.chunks)}
    ep_layer = layers["bf16"]
    route = ep_layer.router(x.detach())
    plan = build_plan(route.expert_ids_TK, route.scores_TK, experts)
    send_PE = plan.tokens_per_expert_E.view(world, -1)
    recv_PE = exchange_counts(send_PE, group)
    _, out_splits = splits_to_host(send_PE, recv_PE)
    rows_MH = torch.randn(sum(out_splits), hidden, device=DEVICE, dtype=dtype).requires_grad_(True)
    grad_MH = torch.randn(sum(out_splits), hidden, device=DEVICE, dtype=dtype)
    counts_local = recv_PE.sum(0)

    def run_experts():
        ep_layer.experts(rows_MH, counts_local).backward(grad_MH)

    def experts_forward():
        with torch.no_grad():
            ep_layer.experts(rows_MH, counts_local)

    def run_shared():
        x.grad = None
        ep_layer.shared_experts(x).backward(g)

    base.update(
        sync_ms=timed(lambda: splits_to_host(send_PE, exchange_counts(send_PE, group))),
        experts_ms=timed(run_experts),
        experts_fwd_ms=timed(experts_forward),
        shared_ms=timed(run_shared),
    )
    rows = []
    for dispatch_dtype in args.dtypes:
        layer = layers.get(dispatch_dtype) or _sharded(local, dims, dispatch_dtype, chunks=args.chunks)
        layer.set_overlap("off")
        log: list = []
        with recording(log):  # an unchunked call posts its forward dispatch first
            step(layer)()
        dispatch_ms = timed(replay(log[:1], group, DEVICE))
        for mode in args.modes:
            layer.set_overlap(mode, args.chunks)
            log = []
            with recording(log):
                step(layer)()
            row = dict(base, dtype=dispatch_dtype, mode=mode, layer_ms=timed(step(layer)))
            with local_copies():
                row["nocomm_ms"] = timed(step(layer))
            row.update(comm_ms=timed(replay(log, group, DEVICE)), dispatch_ms=dispatch_ms)
            row["comm_mb"] = sum(r.bytes_sent for r in log) / 2**20
            rows.append(row)
        layers.pop(dispatch_dtype, None)
        del layer
    for row in rows:
        _derive(row, rows, args, predict_layer, local.cfg)
    return rows


def _derive(row: dict, rows: list[dict], args, predict_layer, moe_cfg) -> None:
    """The columns computed from the measured ones (module docstring)."""
    off = next(r for r in rows if r["dtype"] == row["dtype"] and r["mode"] == "off")
    row["exposed_ms"] = row["layer_ms"] - row["nocomm_ms"]
    row["chunk_cost"] = row["nocomm_ms"] / off["nocomm_ms"] - 1
    row["vs_local"] = row["layer_ms"] / row["local_ms"]
    row["tokens_per_s"] = row["ep"] * row["tokens_per_rank"] / (row["layer_ms"] / 1e3)
    overlapped = {"off": 0.0, "shared": row["shared_ms"], "chunks": row["experts_ms"] + row["shared_ms"]}[row["mode"]]
    row["coverable_ms"] = min(row["comm_ms"], overlapped)
    hideable = row["coverable_ms"] > 0
    row["hidden"] = (row["comm_ms"] - row["exposed_ms"]) / row["coverable_ms"] if hideable else None
    moe = dataclasses.replace(moe_cfg, dispatch_dtype=row["dtype"])
    pred = predict_layer(
        moe,
        row["tokens_per_rank"],
        ep=row["ep"],
        gpus_per_node=row["ep"],
        mode=row["mode"],
        chunks=args.chunks,
        compute_ms=off["nocomm_ms"] - row["sync_ms"],
        experts_fwd_ms=row["experts_fwd_ms"],
    )
    row.update(pred)
    if "pred_ms" in pred:
        row["pred_err"] = row["layer_ms"] / pred["pred_ms"] - 1


def targets(rows: list[dict]) -> list[str]:
    """One line per comparison with the targets: overlap's hidden share, FP8 dispatch's all-to-all, the planner."""
    from benchmarks.ep_planner import TARGET_ERROR

    def verdict(ok: bool) -> str:
        return "meets" if ok else "MISSES"

    lines = []
    timed = [r for r in rows if "layer_ms" in r]
    for r in timed:
        case = f"{r['shape']} T={r['tokens_per_rank']} EP={r['ep']} {r['dtype']} {r['mode']}"
        if r["hidden"] is not None:
            lines.append(
                f"overlap, {case}: hides {100 * r['hidden']:.0f}% of the {r['coverable_ms']:.3g} ms of "
                f"all-to-all it can cover ({verdict(r['hidden'] >= TARGET_HIDDEN)} >= {100 * TARGET_HIDDEN:.0f}%)"
            )
        if "pred_err" in r:
            lines.append(
                f"planner, {case}: measured {r['layer_ms']:.3g} ms, predicted {r['pred_ms']:.3g} ms "
                f"({100 * r['pred_err']:+.0f}%; {verdict(abs(r['pred_err']) <= TARGET_ERROR)} within "
                f"{100 * TARGET_ERROR:.0f}%)"
            )
        elif "pred_note" in r:
            lines.append(f"planner, {case}: no prediction: {r['pred_note']}")
    for r in timed:
        if r["dtype"] == "fp8" and r["mode"] == "off":
            bf16 = next(
                (
                    b
                    for b in timed
                    if b["dtype"] == "bf16"
                    and b["mode"] == "off"
                    and b["shape"] == r["shape"]
                    and b["tokens_per_rank"] == r["tokens_per_rank"]
                ),
                None,
            )
            if bf16:
                ratio = r["dispatch_ms"] / bf16["dispatch_ms"]
                lines.append(
                    f"FP8 dispatch, {r['shape']} T={r['tokens_per_rank']} EP={r['ep']}: dispatch all-to-all "
                    f"{r['dispatch_ms']:.3g} ms vs bf16 {bf16['dispatch_ms']:.3g} ms = {ratio:.2f}x "
                    f"({verdict(ratio <= TARGET_FP8)} <= {TARGET_FP8}x)"
                )
    return lines


CHECK_COLS = ["check", "mode", "out", "x_grad", "router_grad", "expert_grads", "worst_all_ranks", "ok"]
TIME_COLS = [
    "shape",
    "tokens_per_rank",
    "ep",
    "dtype",
    "mode",
    "layer_ms",
    "nocomm_ms",
    "exposed_ms",
    "comm_ms",
    "hidden",
    "dispatch_ms",
    "chunk_cost",
    "local_ms",
    "vs_local",
    "pred_ms",
    "pred_err",
    "pred_exposed_ms",
    "pred_comm_ms",
    "tokens_per_s",
    "note",
]
PART_COLS = ["shape", "tokens_per_rank", "ep", "local_ms", "sync_ms", "experts_ms", "experts_fwd_ms", "shared_ms"]
DEFINITIONS = (
    "Definitions (benchmarks/bench_ep.py's docstring): exposed_ms = layer_ms - nocomm_ms, nocomm_ms being the same "
    "layer with each row all-to-all replaced by a local copy of the same shape; comm_ms = the layer call's row "
    "all-to-alls replayed alone; hidden = (comm_ms - exposed_ms) / min(comm_ms, overlapped compute), overlapped "
    "compute = shared_ms (shared) or experts_ms + shared_ms (chunks); dispatch_ms = the forward dispatch's "
    "all-to-all alone; pred_* = the planner given nocomm_ms (off) - sync_ms as the compute and its default network."
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--shapes", nargs="+", choices=LAYER_SHAPES, default=None, help="default: small medium (tiny with --cpu)"
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="per rank; default 8192 16384 (256 --cpu)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="overlap modes (off always)")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES), help="dispatch dtypes")
    parser.add_argument("--chunks", type=int, default=2, help="chunks of the 'chunks' mode (default 2)")
    parser.add_argument("--check-tokens", type=int, default=512)
    parser.add_argument("--iters", type=int, default=None, help="calls per timed trial (default 5; 2 with --cpu)")
    parser.add_argument("--trials", type=int, default=None, help="timed trials, median (default 3; 1 with --cpu)")
    parser.add_argument("--cpu", action="store_true", help="gloo smoke test of this script on CPU processes")
    args = parser.parse_args(argv)
    args.shapes = args.shapes or (["tiny"] if args.cpu else ["small", "medium"])
    args.tokens = args.tokens or ([256] if args.cpu else [8192, 16384])
    args.modes = ["off"] + [m for m in dict.fromkeys(args.modes) if m != "off"]
    args.iters = args.iters or (2 if args.cpu else 5)
    args.trials = args.trials or (1 if args.cpu else 3)
    if args.chunks < 2:
        parser.error(f"--chunks ({args.chunks}) must be >= 2")
    return args


def report(rows: list[dict], checks: list[dict], args, done: bool) -> None:
    """Rank 0: bench_ep_ep<P>.json / .md with what ran so far (rewritten after every case: a run stopped by its
    time cap keeps them), and on ``done`` the tables and the target lines printed."""
    from benchmarks.harness import environment, markdown_table, write_results

    world = dist.get_world_size()
    lines = targets(rows)
    parts = [r for r in rows if r.get("mode") == "off" and r.get("dtype") == args.dtypes[0]]
    notes = (
        "Correctness (fp32, rank 0's errors; worst over ranks in worst_all_ranks):\n\n"
        + markdown_table(checks, CHECK_COLS)
        + "\n\nThe parts alone (ms, forward + backward; experts_fwd_ms forward only):\n\n"
        + markdown_table(parts, PART_COLS)
        + "\n\nAgainst the targets:\n\n"
        + "\n".join(f"- {line}" for line in lines)
        + ("" if done else "\n\n(incomplete: written after every case, the run did not finish)")
        + f"\n\n{DEFINITIONS}\n\nTiming ({'bf16' if DEVICE.type == 'cuda' else 'fp32'}, ms, rank 0):"
    )
    meta = {**environment(), "checks": checks, "targets": lines, "definitions": DEFINITIONS, "args": vars(args)}
    title = f"Expert-parallel layer: overlap and FP8 dispatch ({dist.get_backend()}, EP={world})"
    write_results(f"bench_ep_ep{world}", rows, TIME_COLS, meta, title, notes, topic="ep")
    if done:
        print(markdown_table(checks, CHECK_COLS) + "\n")
        print(markdown_table(rows, TIME_COLS) + "\n")
        print("\n".join(lines), flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    reason = None if dist.is_initialized() else distributed_skip_reason("benchmarks/bench_ep.py", args.cpu)
    if reason:
        print(f"bench_ep: skipped: {reason}")
        return
    global DEVICE
    DEVICE = init_distributed(args.cpu)
    from xmoe.config import ParallelConfig
    from xmoe.parallel.dims import ParallelDims

    world, rank = dist.get_world_size(), dist.get_rank()
    dims = ParallelDims.from_config(ParallelConfig(ep=world), world).build_mesh(DEVICE.type)
    checks = [row for shape in args.shapes for row in check(shape, args.check_tokens, dims, args.modes, args.chunks)]
    rows: list[dict] = []
    for shape in args.shapes:
        for num_tokens in args.tokens:
            rows += bench(shape, num_tokens, dims, args)
            if rank == 0:
                report(rows, checks, args, done=False)
            if DEVICE.type == "cuda":
                torch.cuda.empty_cache()  # the next shape's layers in memory the last one's left
    if rank == 0:
        report(rows, checks, args, done=True)
    if not all(row["ok"] for row in checks):
        raise SystemExit("bench_ep: EP results differ from the single-GPU layer (see the check table)")


if __name__ == "__main__":
    try:
        main()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
