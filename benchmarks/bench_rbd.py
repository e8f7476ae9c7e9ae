"""RBD vs flat all-to-all on GPUs (NCCL): time of dispatch + combine, rows moved, and the traffic model's prediction,
without and with node-limited routing.

# T tokens per rank, H hidden, E experts, K top-k, P = EP ranks (= world size here), M max nodes per token

    torchrun --nproc-per-node 2 benchmarks/bench_rbd.py                 # each GPU stands for one node
    torchrun --nproc-per-node 4 benchmarks/bench_rbd.py --gpus-per-node 2 --tokens 8192 --max-nodes-per-token 0 1

Skips (exit 0, with the reason) without CUDA GPUs or with fewer than 2 ranks. ``--cpu`` runs the same code on CPU
processes over gloo (host timers, a tiny shape): a smoke test of the script, not a measurement. Takes < 2 minutes.

For each layer shape (small: H 2048, E 64, K 6; medium: H 5120, E 128, K 6) and node limit M (0: none), bf16,
experts replaced by the identity so that only the dispatch and combine are timed. Routing: every token's K experts
the top-K of uniform random scores (a uniform K-subset: the traffic model's assumption), or with M > 0 by the
node-limited rule on the same scores (``moe.max_nodes_per_token``'s rule as the planner models it,
xmoe/plan/node_limit.py: the M nodes whose experts' top ceil(K / M) scores sum highest, then top-K among them):
  1. check: RBD's output and input / weight gradients against flat's (relative, bf16: RBD rounds partial sums
     per GPU and per node), host syncs seen by torch.cuda.set_sync_debug_mode in dispatch and in combine;
  2. rows: rows each rank sends inter-node per dispatch, flat vs RBD, measured (dispatcher counters), exact for
     this routing (xmoe.plan.comm.count_rows) and predicted (xmoe.plan.comm.estimate_comm: uniform closed form, or
     Monte Carlo of the node-limited rule);
  3. time: dispatch + combine, forward and forward + backward, CUDA events around a FIXED number of iterations
     (every rank must run the same collectives), median of trials; the model's predicted time of one dispatch for
     the same topology with its default network (25 GB/s per GPU between nodes) and with "nodes" joined by the
     intra-node link, which is what GPUs of one host standing in for nodes really have (then RBD's saving is
     bookkeeping-bound: it removes rows but adds a stage); and the planner's time of the timed exchanges
     themselves on that link (benchmarks/ep_planner.py: count exchange, dispatch, combine, their backward, RBD's
     ids and weights included), pred_*_ms, against which the measured times are compared (target: within 15%).
Results: rank 0 writes bench_rbd.json / bench_rbd.md under $XMOE_RESULTS_DIR or benchmarks/results/rbd/.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without PYTHONPATH

from benchmarks.harness import collective_time_ms, distributed_skip_reason, init_distributed, rel_err
from xmoe.bench import LAYER_SHAPES, layer_shape

TIMED = ("flat_fwd", "flat_fwd_bwd", "rbd_fwd", "rbd_fwd_bwd")


def _count_syncs(fn, device: torch.device) -> int:
    """Synchronising CUDA calls fn makes (torch's sync debug mode warns on each); -1 where it cannot tell."""
    if device.type != "cuda":
        fn()
        return -1
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in seen)


def route(scores_TE: torch.Tensor, top_k: int, max_nodes: int, expert_to_rank, rank_to_node) -> torch.Tensor:
    """(T, K) expert ids: the top-K of the scores, or with ``max_nodes`` > 0 the node-limited rule's choice."""
    if not max_nodes:
        return scores_TE.topk(top_k, dim=-1).indices
    from xmoe.plan.node_limit import experts_by_node, select_node_limited

    nodes_NE = experts_by_node(expert_to_rank, rank_to_node, max_nodes, top_k)
    ids = select_node_limited(scores_TE.double().cpu().numpy(), nodes_NE, top_k, max_nodes)
    return torch.from_numpy(ids).to(scores_TE.device)


def bench_shape(shape: str, num_tokens: int, dims, device, dtype, iters: int, max_nodes: int = 0) -> dict:
    from benchmarks.ep_planner import predict_exchanges
    from xmoe.dispatch.alltoall import AllToAllDispatcher
    from xmoe.dispatch.routing import build_plan
    from xmoe.kernels.choice import resolve_kernels
    from xmoe.model.presets import get_preset
    from xmoe.parallel.expert_parallel import rbd_dispatcher
    from xmoe.plan.comm import Network, count_rows, estimate_comm

    hidden, _, num_experts, top_k = layer_shape(shape)
    world, rank = dist.get_world_size(), dist.get_rank()
    node_of_rank = [dims.node_of(r) for r in dims.group_ranks("ep")]
    local = num_experts // world
    gen = torch.Generator(device=device).manual_seed(1000 + rank)
    scores_TE = torch.rand(num_tokens, num_experts, device=device, generator=gen)
    ids_TK = route(scores_TE, top_k, max_nodes, [e // local for e in range(num_experts)], node_of_rank)
    plan = build_plan(ids_TK, torch.ones(ids_TK.shape, device=device), num_experts)
    x = torch.randn(num_tokens, hidden, device=device, dtype=dtype, generator=gen).requires_grad_(True)
    w = torch.rand(num_tokens, top_k, device=device, generator=gen).requires_grad_(True)  # fp32, as the router's
    g = torch.randn(num_tokens, hidden, device=device, dtype=dtype, generator=gen)
    kernels = resolve_kernels("auto", device=device)  # gather and combine as a layer on this device runs them
    flat = AllToAllDispatcher(dims.group("ep"), num_experts, kernels)
    rbd = rbd_dispatcher(dims, num_experts, kernels)

    def layer(disp):  # identity experts: the dispatch -> combine round trip alone
        rows, _, ctx = disp.dispatch(x, plan)
        return disp.combine(rows, w, plan, ctx)

    def fwd(disp):
        return lambda: layer(disp)

    def fwd_bwd(disp):
        def fn():
            x.grad = w.grad = None
            layer(disp).backward(g)

        return fn

    # 1. check against flat; host syncs of dispatch and of combine
    outs = {}
    for name, disp in (("flat", flat), ("rbd", rbd)):
        x.grad = w.grad = None
        out = layer(disp)
        out.backward(g)
        outs[name] = (out.detach(), x.grad.clone(), w.grad.clone())
        disp.stats.reset()
    errs = [rel_err(a, b) for a, b in zip(outs["rbd"], outs["flat"], strict=False)]
    syncs = {}
    for name, disp in (("flat", flat), ("rbd", rbd)):
        holder = {}
        syncs[f"{name}_dispatch"] = _count_syncs(
            lambda holder=holder, disp=disp: holder.update(r=disp.dispatch(x.detach(), plan)), device
        )
        rows, _, ctx = holder["r"]
        syncs[f"{name}_combine"] = _count_syncs(
            lambda disp=disp, rows=rows, ctx=ctx: disp.combine(rows, w.detach(), plan, ctx), device
        )

    # 2. rows this rank sends across nodes: measured, exact for this routing, and the model's expectation
    flat.stats.reset()
    rbd.stats.reset()
    with torch.no_grad():
        layer(flat)
        layer(rbd)
    exact = count_rows(ids_TK, torch.arange(num_experts) // local, torch.tensor(node_of_rank), dims.coord("ep"))
    cfg = get_preset(shape)  # the model reads H, E and K from the preset of the same name
    where = dict(gpus_per_node=dims.node_size, ep=world, tokens_per_gpu=num_tokens, max_nodes_per_token=max_nodes)
    model = estimate_comm(cfg, world, **where)
    net = Network()
    nvlink = Network(inter_bw=net.intra_bw, inter_lat=net.intra_lat)
    linked = estimate_comm(cfg, world, network=nvlink, **where)
    pred = {
        name: predict_exchanges(
            cfg.moe,
            num_tokens,
            ep=world,
            gpus_per_node=dims.node_size,
            dispatcher=disp,
            max_nodes=max_nodes,
            network=nvlink,
        )
        for name, disp in (("flat", "pft"), ("rbd", "rbd"))
    }
    flat_inter = flat.stats.rows_sent - exact.flat_intra  # flat's counters do not split intra / inter
    s = rbd.stats.as_dict()  # one call's counters, before the timing loops add to them

    # 3. time
    t = {
        f"{name}_{kind}_ms": collective_time_ms(make(disp), device, iters)
        for name, disp in (("flat", flat), ("rbd", rbd))
        for kind, make in (("fwd", fwd), ("fwd_bwd", fwd_bwd))
    }
    pred_t = {f"pred_{n}_{k}_ms": pred[n][i] for n in pred for i, k in enumerate(("fwd", "fwd_bwd"))}
    return {
        "shape": shape,
        "node_limit": max_nodes,
        "hidden": hidden,
        "experts": num_experts,
        "top_k": top_k,
        "tokens_per_rank": num_tokens,
        "ranks": world,
        "gpus_per_node": dims.node_size,
        **t,
        "speedup_fwd": t["flat_fwd_ms"] / t["rbd_fwd_ms"],
        "speedup_fwd_bwd": t["flat_fwd_bwd_ms"] / t["rbd_fwd_bwd_ms"],
        **pred_t,
        **{f"{name}_err": t[f"{name}_ms"] / pred_t[f"pred_{name}_ms"] - 1 for name in TIMED},
        "flat_inter_rows": flat_inter,
        "rbd_inter_rows": s["rows_inter"],
        "rbd_replica_rows": s["rows_replica"],
        "exact_flat_inter": exact.flat_inter,
        "exact_rbd_inter": exact.rbd_inter,
        "model_flat_inter": model.rows.flat_inter,
        "model_rbd_inter": model.rows.rbd_inter,
        "R": s["redundancy_rate"],
        "model_R": model.rows.redundancy_rate,
        "model_flat_us": model.flat_us,
        "model_rbd_us": model.rbd_us,
        "model_speedup": model.speedup,
        "model_nvlink_flat_us": linked.flat_us,
        "model_nvlink_rbd_us": linked.rbd_us,
        "err_out": errs[0],
        "err_x_grad": errs[1],
        "err_w_grad": errs[2],
        **{f"syncs_{k}": v for k, v in syncs.items()},
        "counters": s,
    }


TIME_COLS = [
    "shape",
    "node_limit",
    "tokens_per_rank",
    "ranks",
    "gpus_per_node",
    "flat_fwd_ms",
    "rbd_fwd_ms",
    "speedup_fwd",
    "flat_fwd_bwd_ms",
    "rbd_fwd_bwd_ms",
    "speedup_fwd_bwd",
    "model_flat_us",
    "model_rbd_us",
    "model_speedup",
    "model_nvlink_flat_us",
    "model_nvlink_rbd_us",
]
ROW_COLS = [
    "shape",
    "node_limit",
    "flat_inter_rows",
    "exact_flat_inter",
    "model_flat_inter",
    "rbd_inter_rows",
    "exact_rbd_inter",
    "model_rbd_inter",
    "rbd_replica_rows",
    "R",
    "model_R",
]
CHECK_COLS = [
    "shape",
    "node_limit",
    "err_out",
    "err_x_grad",
    "err_w_grad",
    "syncs_flat_dispatch",
    "syncs_flat_combine",
    "syncs_rbd_dispatch",
    "syncs_rbd_combine",
]
PRED_COLS = ["shape", "node_limit"] + [c for name in TIMED for c in (f"{name}_ms", f"pred_{name}_ms", f"{name}_err")]


def targets(rows: list[dict]) -> list[str]:
    """The planner against each measured time (target: within 15%), and what the node limit changed."""
    from benchmarks.ep_planner import TARGET_ERROR

    lines = []
    for r in rows:
        case = f"{r['shape']} T={r['tokens_per_rank']} {r['ranks']} ranks, nodes of {r['gpus_per_node']}, " + (
            f"node limit M={r['node_limit']}" if r["node_limit"] else "no node limit"
        )
        for name in TIMED:
            err = r[f"{name}_err"]
            verdict = "meets" if abs(err) <= TARGET_ERROR else "MISSES"
            lines.append(
                f"planner, {case}, {name.replace('_', ' ')}: measured {r[f'{name}_ms']:.3g} ms, predicted "
                f"{r[f'pred_{name}_ms']:.3g} ms ({100 * err:+.0f}%; {verdict} within {100 * TARGET_ERROR:.0f}%)"
            )
        limited = [o for o in rows if o["shape"] == r["shape"] and o["node_limit"]] if not r["node_limit"] else []
        for o in limited:
            lines.append(
                f"node limit M={o['node_limit']}, {r['shape']}: RBD's inter-node rows {r['rbd_inter_rows']} -> "
                f"{o['rbd_inter_rows']}, RBD forward + backward {r['rbd_fwd_bwd_ms']:.3g} -> "
                f"{o['rbd_fwd_bwd_ms']:.3g} ms (flat {r['flat_fwd_bwd_ms']:.3g} -> {o['flat_fwd_bwd_ms']:.3g} ms)"
            )
    return lines


def report(rows: list[dict], done: bool) -> None:
    """Rank 0: bench_rbd.json / .md with what ran so far (rewritten after every case: a run stopped by its time cap
    keeps them), and on ``done`` the tables and the target lines printed."""
    from benchmarks.harness import environment, markdown_table, write_results

    lines = targets(rows)
    notes = (
        "Identity experts, routing uniform (node_limit 0) or node-limited (M), rank 0. Rows each rank sends to other "
        "(virtual) nodes per dispatch: measured, exact (count_rows), model (estimate_comm):\n\n"
        + markdown_table(rows, ROW_COLS)
        + "\n\nRBD vs flat (bf16 relative error) and host syncs (sync debug mode; -1 = not on CUDA):\n\n"
        + markdown_table(rows, CHECK_COLS)
        + "\n\nThe planner's time of the timed exchanges on the link the virtual nodes really have (ms; err = "
        "measured / predicted - 1):\n\n"
        + markdown_table(rows, PRED_COLS)
        + "\n\nAgainst the targets:\n\n"
        + "\n".join(f"- {line}" for line in lines)
        + ("" if done else "\n\n(incomplete: written after every case, the run did not finish)")
        + "\n\nTime (ms per layer call; model: us per dispatch, 25 GB/s network / NVLink-joined):"
    )
    title = f"RBD vs flat all-to-all ({dist.get_backend()})"
    write_results("bench_rbd", rows, TIME_COLS, {**environment(), "targets": lines}, title, notes, topic="rbd")
    if done:
        for cols in (ROW_COLS, CHECK_COLS, PRED_COLS, TIME_COLS):
            print(markdown_table(rows, cols) + "\n")
        print("\n".join(lines), flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--shapes", nargs="+", choices=LAYER_SHAPES, default=None, help="default: small medium (tiny with --cpu)"
    )
    parser.add_argument("--tokens", type=int, default=None, help="per rank; default 4096 (256 with --cpu)")
    parser.add_argument("--gpus-per-node", type=int, default=1, help="ranks per (virtual) node; default 1")
    parser.add_argument(
        "--max-nodes-per-token",
        type=int,
        nargs="+",
        default=[0],
        metavar="M",
        help="node limits to run, 0 for none (default 0); e.g. 0 1 with two virtual nodes",
    )
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--cpu", action="store_true", help="gloo smoke test of this script on CPU processes")
    args = parser.parse_args(argv)
    if any(m < 0 for m in args.max_nodes_per_token):
        parser.error(f"--max-nodes-per-token ({args.max_nodes_per_token}) takes counts >= 0 (0: no limit)")
    args.shapes = args.shapes or (["tiny"] if args.cpu else ["small", "medium"])
    args.tokens = args.tokens or (256 if args.cpu else 4096)
    reason = None if dist.is_initialized() else distributed_skip_reason("benchmarks/bench_rbd.py", args.cpu)
    if reason:
        print(f"bench_rbd: skipped: {reason}")
        return
    device = init_distributed(args.cpu)
    dtype = torch.float32 if args.cpu else torch.bfloat16
    from xmoe.config import ParallelConfig
    from xmoe.parallel.dims import ParallelDims

    world = dist.get_world_size()
    cfg = ParallelConfig(ep=world, gpus_per_node=args.gpus_per_node)
    dims = ParallelDims.from_config(cfg, world).build_mesh(device.type)
    rows: list[dict] = []
    for shape in args.shapes:
        for max_nodes in args.max_nodes_per_token:
            rows.append(bench_shape(shape, args.tokens, dims, device, dtype, args.iters, max_nodes))
            if dist.get_rank() == 0:
                report(rows, done=False)
    if dist.get_rank() == 0:
        report(rows, done=True)
    bad = [(r["shape"], r["node_limit"]) for r in rows if max(r["err_out"], r["err_x_grad"], r["err_w_grad"]) > 2e-2]
    dist.destroy_process_group()
    if bad:
        raise SystemExit(f"bench_rbd: RBD differs from flat beyond bf16 rounding for {bad}")


if __name__ == "__main__":
    main()
