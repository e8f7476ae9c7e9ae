"""Expert parallelism on GPUs (NCCL): a correctness check, then the MoE layer's time split into its parts.

# T tokens per rank, H hidden, F expert ffn, E experts, K top-k, P = EP ranks (= world size here)

    torchrun --nproc-per-node 2 benchmarks/bench_ep.py            # check + time the "small" layer, T = 8192
    torchrun --nproc-per-node 2 benchmarks/bench_ep.py --shape medium --tokens 4096 16384

Skips (exit 0, with the reason) without CUDA GPUs or when not launched on >= 2 ranks. ``--cpu`` runs the same code
on CPU processes over gloo (host timers, tiny shape by default): a smoke test of the script, not a measurement.

1. Check (fp32, TF32 off): MoELayer under EP (shard_experts + AllToAllDispatcher) vs the same weights on one GPU
   with the local dispatcher, for uniform, skewed and degenerate routing (every token to rank 0's experts, so the
   other ranks receive nothing): output, input gradient, router gradient and the local experts' gradients.
2. Timing (bf16, uniform routing), forward + backward, CUDA events around a FIXED number of iterations (every
   rank must run the same collectives, so do_bench's adaptive repeat count cannot be used), median of trials:
     layer_ms      the EP MoELayer
     local_ms      the same layer with all E experts on one GPU and no communication (a peer: P times the
                   expert work of one EP rank, no all-to-all)
     a2a_ms        the four row all-to-alls of one layer call (dispatch and combine, forward and backward) with
                   this call's real split sizes, run alone
     sync_ms       counts exchange + the one host sync for split sizes, alone
     experts_ms    grouped experts on the rows this rank received, forward + backward, alone
   plus tokens/s over all ranks, MB sent + received per rank per layer call (forward; backward moves as much
   again) and the all-to-all's achieved GB/s per rank.
Results: rank 0 writes bench_ep.json / bench_ep.md under $XMOE_RESULTS_DIR or benchmarks/results/ep/.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without PYTHONPATH

from benchmarks.harness import collective_time_ms, distributed_skip_reason, init_distributed, rel_err
from xmoe.bench import LAYER_SHAPES, layer_shape

DEVICE = torch.device("cuda")  # set in main()


def _layer(shape: str, dims, bias: torch.Tensor | None, dtype, seed: int = 0):
    """(EP layer, single-GPU layer with the same weights)."""
    from xmoe.config import MoEConfig
    from xmoe.moe.layer import MoELayer
    from xmoe.parallel.expert_parallel import shard_experts

    hidden, ffn, experts, top_k = layer_shape(shape)
    torch.manual_seed(seed)
    cfg = MoEConfig(hidden_size=hidden, ffn_hidden_size=ffn, num_experts=experts, top_k=top_k, num_shared_experts=1)
    local = MoELayer(cfg).to(DEVICE, dtype)
    if bias is not None:
        local.router.expert_bias.copy_(bias)
    return shard_experts(copy.deepcopy(local), dims), local


def check(shape: str, num_tokens: int, dims) -> list[dict]:
    torch.backends.cuda.matmul.allow_tf32 = False
    rank, world = dist.get_rank(), dist.get_world_size()
    experts = layer_shape(shape)[2]
    local_e = experts // world
    mine = slice(rank * local_e, (rank + 1) * local_e)
    skew = torch.linspace(0.02, 0.0, experts)  # popular low-numbered experts (rank 0's)
    to_rank0 = torch.zeros(experts)
    to_rank0[:local_e] = 10.0
    rows = []
    for name, bias in [("uniform", None), ("skewed", skew), ("all_to_rank0", to_rank0)]:
        ep_layer, ref = _layer(shape, dims, bias.to(DEVICE) if bias is not None else None, torch.float32)
        gen = torch.Generator(device=DEVICE).manual_seed(1)
        x_R = torch.randn(world, num_tokens, layer_shape(shape)[0], device=DEVICE, generator=gen)
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
        rows.append({"check": name, **errs, "worst_all_ranks": worst.item(), "ok": worst.item() < 1e-4})
    return rows


def bench(shape: str, num_tokens: int, dims, iters: int) -> dict:
    from xmoe.dispatch.comm import all_to_all_rows, exchange_counts, splits_to_host
    from xmoe.dispatch.routing import build_plan

    hidden, _ffn, experts, _top_k = layer_shape(shape)
    world = dist.get_world_size()
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    ep_layer, local = _layer(shape, dims, None, dtype)
    gen = torch.Generator(device=DEVICE).manual_seed(dist.get_rank())
    x = torch.randn(num_tokens, hidden, device=DEVICE, dtype=dtype, generator=gen).requires_grad_(True)
    g = torch.randn(num_tokens, hidden, device=DEVICE, dtype=dtype, generator=gen)

    def step(layer):
        def fn():
            layer.zero_grad(set_to_none=True)
            x.grad = None
            layer(x).backward(g)

        return fn

    dispatcher = ep_layer.dispatcher
    dispatcher.stats.reset()
    step(ep_layer)()
    stats = dispatcher.stats.as_dict()
    layer_ms = collective_time_ms(step(ep_layer), DEVICE, iters)
    local_ms = collective_time_ms(step(local), DEVICE, iters)

    # the parts, alone, with this rank's real routing
    route = ep_layer.router(x.detach())
    plan = build_plan(route.expert_ids_TK, route.scores_TK, experts)
    send_PE = plan.tokens_per_expert_E.view(world, -1)
    recv_PE = exchange_counts(send_PE, dispatcher.group)
    in_splits, out_splits = splits_to_host(send_PE, recv_PE)
    rows_NH = torch.randn(sum(in_splits), hidden, device=DEVICE, dtype=dtype).requires_grad_(True)
    grad_MH = torch.randn(sum(out_splits), hidden, device=DEVICE, dtype=dtype)

    def a2a():  # one all-to-all forward + its backward (the reverse exchange); a layer does this twice
        all_to_all_rows(rows_NH, out_splits, in_splits, dispatcher.group).backward(grad_MH)

    def sync():
        splits_to_host(send_PE, exchange_counts(send_PE, dispatcher.group))

    rows_MH = torch.randn(sum(out_splits), hidden, device=DEVICE, dtype=dtype).requires_grad_(True)
    counts_local = recv_PE.sum(0)

    def run_experts():
        ep_layer.experts(rows_MH, counts_local).backward(grad_MH)

    a2a_ms = 2 * collective_time_ms(a2a, DEVICE, iters)
    sync_ms = collective_time_ms(sync, DEVICE, iters)
    experts_ms = collective_time_ms(run_experts, DEVICE, iters)
    moved = stats["bytes_sent"] + stats["bytes_received"]
    remote_rows = (stats["rows_sent"] + stats["rows_received"]) // 2
    return {
        "shape": shape,
        "tokens_per_rank": num_tokens,
        "ep": world,
        "layer_ms": layer_ms,
        "local_ms": local_ms,
        "a2a_ms": a2a_ms,
        "sync_ms": sync_ms,
        "experts_ms": experts_ms,
        "tokens_per_s": world * num_tokens / (layer_ms / 1e3),
        "mb_per_layer": moved / 2**20,
        # 4 exchanges of ~remote_rows rows each way; GB/s per rank and direction
        "a2a_gb_s": 4 * remote_rows * hidden * x.element_size() / (a2a_ms / 1e3) / 1e9,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--shape", choices=LAYER_SHAPES, default=None, help="a preset's MoE layer; default: small (tiny with --cpu)"
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="per rank; default 8192 (256 with --cpu)")
    parser.add_argument("--check-tokens", type=int, default=512)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--cpu", action="store_true", help="gloo smoke test of this script on CPU processes")
    args = parser.parse_args(argv)
    args.shape = args.shape or ("tiny" if args.cpu else "small")
    args.tokens = args.tokens or ([256] if args.cpu else [8192])
    reason = distributed_skip_reason("benchmarks/bench_ep.py", args.cpu)
    if reason:
        print(f"bench_ep: skipped: {reason}")
        return
    global DEVICE
    DEVICE = init_distributed(args.cpu)
    from benchmarks.harness import environment, markdown_table, write_results
    from xmoe.config import ParallelConfig
    from xmoe.parallel.dims import ParallelDims

    world = dist.get_world_size()
    dims = ParallelDims.from_config(ParallelConfig(ep=world), world).build_mesh(DEVICE.type)
    checks = check(args.shape, args.check_tokens, dims)
    timings = [bench(args.shape, t, dims, args.iters) for t in args.tokens]
    if dist.get_rank() == 0:
        check_cols = ["check", "out", "x_grad", "router_grad", "expert_grads", "worst_all_ranks", "ok"]
        time_cols = [
            "shape",
            "tokens_per_rank",
            "ep",
            "layer_ms",
            "local_ms",
            "a2a_ms",
            "sync_ms",
            "experts_ms",
            "tokens_per_s",
            "mb_per_layer",
            "a2a_gb_s",
        ]
        meta = environment()
        notes = "Correctness (fp32, rank 0's errors; worst over ranks in worst_all_ranks):\n\n"
        notes += markdown_table(checks, check_cols) + "\n\nTiming (bf16, forward + backward, rank 0):"
        write_results(
            "bench_ep", timings, time_cols, {**meta, "checks": checks}, "Expert parallelism (NCCL)", notes, topic="ep"
        )
        print(markdown_table(checks, check_cols))
        print(markdown_table(timings, time_cols))
    ok = all(row["ok"] for row in checks)
    dist.destroy_process_group()
    if not ok:
        raise SystemExit("bench_ep: EP results differ from the single-GPU layer (see the check table)")


if __name__ == "__main__":
    main()
