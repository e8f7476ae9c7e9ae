"""Expert parallelism across nodes on the emulated cluster: step time and exposed all-to-all time of a small MoE
model trained at EP = every rank, for flat / RBD x overlap off / shared / chunks x dispatch bf16 / fp8 (x node limit
where given), each beside the planner's prediction for the measured link and the compute measured with overlap off.

    sudo python benchmarks/bench_ep_cluster.py --out benchmarks/results/ep --nodes 2 4 --ranks-per-node 2

The defaults size the model so that its flat all-to-alls take about as long as its compute on a 2-core machine
running 4 ranks (the link 0.3 Gbit/s each way per node), with few dense weights: FSDP2's all-gathers and reduce-
scatters of the dense weights (attention, embedding, shared experts, routers) cross the same shaped link, and their
bytes grow with the width squared and the vocabulary while the all-to-alls' grow with the width and the tokens, so a
small width and vocabulary keep the link for the all-to-alls. Needs root (benchmarks/emulated_cluster.py). Each node
count is one emulated cluster and one torchrun per node, in which every rank runs this script's rank mode over the
whole grid (the model is built again for each case; the first steps of each are warm-up). The CPU ranks compute
under bf16 autocast, so rows travel as on GPUs (2 bytes a value; FP8 dispatch 1 byte plus the scales). Measured per
case: the step's wall time (the slowest rank; median of the timed steps) and the host time blocked in the
expert-parallel exchanges (dispatch/comm.py's WaitTimer: the posted all-to-alls' waits, the blocking exchanges, the
count exchange and its host sync; the mean over ranks), which on CPUs is the communication no compute hid. The
planner (xmoe/plan/step_time.py) predicts every case from the rate a node's link delivers to the case's all-to-alls
over every rank, measured before the cases (alltoall_rate: one at a time, or two in flight as `chunks` runs them;
shared by the node's ranks), a collective's fixed cost measured on the cluster's ranks (collective_latency: amid
compute where the ranks outnumber the cores and take turns on them, else back to back), the compute of the
overlap-off case of the same dispatcher and dtype, and the routed and shared experts' forward times measured in it.
That compute is the case's step less the exposed time of its least-waiting rank: the rank the others wait for, whose
compute sets the step (the mean rank's would count the others' waits for it, the ranks' skew, as communication); for
flat `chunks` with a core per rank, whose two exchanges in flight absorb that skew, the ranks' mean
(_waits_behind_compute).
Results: OUT/bench_ep_cluster.json and .md (date, machine, commit, command); --repredict remakes a saved report's
predictions with this code.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import itertools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = ("off", "shared", "chunks")
DISPATCHERS = ("pft", "rbd")
DTYPES = ("bf16", "fp8")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--out", default="benchmarks/results/ep", help="folder of the results (default benchmarks/results/ep)"
    )
    p.add_argument(
        "--repredict",
        metavar="JSON",
        help="run no cluster: the planner's predictions of a saved report's measured rows again, with this code, "
        "written beside it as NAME_repredicted.json and .md",
    )
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 4], help="node counts, one cluster each (default 2 4)")
    p.add_argument("--ranks-per-node", type=int, default=2, help="ranks per node (default 2)")
    p.add_argument("--inter-gbit", type=float, default=0.3, help="each node's link, Gbit/s each way (default 0.3)")
    p.add_argument("--vocab", type=int, default=256, help="vocabulary (default 256)")
    p.add_argument("--hidden", type=int, default=256, help="model width (default 256)")
    p.add_argument("--ffn", type=int, default=256, help="routed expert width (default 256)")
    p.add_argument("--experts-per-rank", type=int, default=2, help="routed experts per rank (default 2)")
    p.add_argument("--top-k", type=int, default=4, help="routed experts per token (default 4)")
    p.add_argument("--shared", type=int, default=1, help="shared experts, each as wide as a routed one (default 1)")
    p.add_argument("--layers", type=int, default=2, help="MoE layers (default 2)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step (default 8)")
    p.add_argument("--seq", type=int, default=256, help="sequence length (default 256)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per case (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps per case (default 2)")
    p.add_argument("--chunks", type=int, default=2, help="chunks of the 'chunks' overlap (default 2)")
    p.add_argument("--node-limits", type=int, nargs="+", default=[0], help="max nodes per token to try (0: off)")
    p.add_argument("--dispatchers", nargs="+", default=list(DISPATCHERS), choices=DISPATCHERS)
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument(
        "--cases",
        nargs="+",
        type=_case_arg,
        metavar="D:T:M:O",
        help="exactly these cases instead of the grid, e.g. rbd:fp8:1:chunks (dispatcher pft|rbd, dtype, node limit, "
        "overlap); today's path (pft:bf16:0:off) is measured first where not named; a case's prediction needs its "
        "group's overlap-off case (its compute) in the list",
    )
    p.add_argument(
        "--sync-segment-ms",
        type=float,
        default=150.0,
        help="compute between collectives when measuring a collective's fixed cost amid compute (default 150: about "
        "a default step's compute over its collectives)",
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per cluster run (default 1800)")
    p.add_argument("--rank-mode", action="store_true", help=argparse.SUPPRESS)  # what torchrun runs on every rank
    p.add_argument("--raw", help=argparse.SUPPRESS)
    return p


# ------------------------------------------------------------------------------------------------ rank mode


def _case_arg(text: str) -> dict:
    """--cases' D:T:M:O, checked."""
    parts = text.split(":")
    if len(parts) != 4 or parts[0] not in ("pft", "rbd") or parts[1] not in DTYPES or parts[3] not in MODES:
        raise argparse.ArgumentTypeError(f"{text!r}: expected pft|rbd:{'|'.join(DTYPES)}:M:{'|'.join(MODES)}")
    if not parts[2].isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: the node limit ({parts[2]!r}) must be 0 (off) or a count")
    return dict(dispatcher=parts[0], dtype=parts[1], node_limit=int(parts[2]), mode=parts[3])


def _cases(args, nodes: int) -> list[dict]:
    """The grid (or --cases, today's path first); a node limit of the cluster's node count or more binds nothing
    and is left out."""
    if args.cases:
        today = dict(dispatcher="pft", dtype="bf16", node_limit=0, mode="off")
        return [c for c in ([today] if today not in args.cases else []) + args.cases if c["node_limit"] < nodes]
    limits = [m for m in args.node_limits if m < nodes]
    grid = itertools.product(args.dispatchers, args.dtypes, limits, args.modes)
    return [dict(dispatcher=d, dtype=t, node_limit=m, mode=o) for d, t, m, o in grid]


def _model_config(args, world: int, case: dict):
    from xmoe.config import ModelConfig, MoEConfig

    extra = {"max_nodes_per_token": case["node_limit"]} if case["node_limit"] else {}
    moe = MoEConfig(
        hidden_size=args.hidden,
        ffn_hidden_size=args.ffn,
        num_experts=args.experts_per_rank * world,
        top_k=args.top_k,
        num_shared_experts=args.shared,
        kernel_backend="torch",
        dispatcher=case["dispatcher"],
        dispatch_dtype=case["dtype"],
        **extra,
    )
    heads = max(1, args.hidden // 64)
    return ModelConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=heads,
        moe=moe,
        max_seq_len=args.seq,
    )


def _run_case(args, dims, world: int, rank: int, case: dict) -> dict:
    import torch
    import torch.distributed as dist

    from xmoe.dispatch.base import add_counters
    from xmoe.dispatch.comm import WaitTimer
    from xmoe.parallel.build import build_model

    cfg = _model_config(args, world, case)
    built = build_model(cfg, "cpu", dims, seed=0, ep_overlap=case["mode"], ep_chunks=args.chunks)
    model = built.wrapped
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1000 + rank)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=gen)
    timed = {"experts": 0.0, "shared": 0.0, "calls": 0}
    layers = [m for m in built.model.modules() if type(m).__name__ == "MoELayer"]
    _time_experts(layers, timed)
    steps, exposed, kinds, events = [], [], [], []
    loss = torch.zeros(())
    for step in range(args.warmup + args.steps):
        dist.barrier()
        WaitTimer.enabled, _ = True, WaitTimer.reset()
        WaitTimer.events = []
        timed.update(experts=0.0, shared=0.0, calls=0)
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
        by_kind = WaitTimer.by_kind  # reset() starts a new dict: this one stays the step's
        waited, WaitTimer.enabled = WaitTimer.reset(), False
        if step >= args.warmup:
            steps.append(elapsed)
            exposed.append(waited)
            kinds.append(by_kind)
            events.append(WaitTimer.events)
        elif step == args.warmup - 1:
            _reset_counters(layers)  # the traffic of the timed steps only
        WaitTimer.events = None
    # the slowest rank's step, the ranks' mean exposed time, this rank's traffic per timed step
    per_rank = [None] * world
    traffic: dict = {}
    for layer in layers:
        stats = layer.dispatcher.stats
        add_counters(traffic, stats.as_dict() if stats is not None else {})  # max_* counters: their maximum
    traffic = {k: v if k.startswith("max_") else v / args.steps for k, v in traffic.items()}
    mine = dict(
        steps=steps,
        exposed=exposed,
        kinds={k: statistics.median(s.get(k, 0.0) for s in kinds) for k in ("posted", "blocking", "counts")},
        experts=timed["experts"],
        shared=timed["shared"],
        traffic=traffic,
        events=events,
    )
    dist.all_gather_object(per_rank, mine)
    step_s = [max(r["steps"][i] for r in per_rank) for i in range(args.steps)]
    return dict(
        case,
        step_ms=1e3 * statistics.median(step_s),
        exposed_ms=1e3 * statistics.mean(statistics.median(r["exposed"]) for r in per_rank),
        # the rank that waits least is the one the others wait for: its step less this is the critical compute
        least_exposed_ms=1e3 * min(statistics.median(r["exposed"]) for r in per_rank),
        # the exposed time by kind (comm.WaitTimer.by_kind): each rank's median over the timed steps, their mean
        exposed_by_kind_ms={k: 1e3 * statistics.mean(r["kinds"][k] for r in per_rank) for k in per_rank[0]["kinds"]},
        **_arrivals([r["events"] for r in per_rank]),
        **_flights([r["events"] for r in per_rank]),
        experts_fwd_ms=1e3 * statistics.mean(r["experts"] for r in per_rank) / max(1, args.layers),
        shared_fwd_ms=1e3 * statistics.mean(r["shared"] for r in per_rank) / max(1, args.layers),
        traffic={k: _over_ranks(k, [r["traffic"].get(k, 0) for r in per_rank]) for k in per_rank[0]["traffic"]},
        loss=float(loss.detach()),
    )


def _aligned(events_R: list[list[list[tuple]]], keep: Callable[[tuple], bool]) -> list[list[list[tuple]]] | None:
    """Each rank's events of each step that ``keep`` accepts, or None where the ranks kept different numbers in a
    step (not one program order: nothing to match)."""
    kept = [[[e for e in evs if keep(e)] for evs in steps] for steps in events_R]
    if any(len(steps[i]) != len(kept[0][i]) for steps in kept for i in range(len(steps))):
        return None
    return kept


def _arrivals(events_R: list[list[list[tuple]]]) -> dict:
    """The collectives waited in place (blocking exchanges and count exchanges: events with their group's ranks),
    each rank's wait split into waiting for the group's last member to arrive and the exchange after that, per step
    (the median over timed steps, the mean over ranks). The i-th such event of every rank is the same program point
    (every rank runs one program); perf_counter is one clock for every process of a machine."""
    if not events_R or not events_R[0]:
        return {}
    in_place = _aligned(events_R, lambda e: e[3] is not None)
    if in_place is None:
        return {}
    arrive, after = [], []
    for steps in in_place:
        mine_a, mine_b = [], []
        for step, own in enumerate(steps):
            a = b = 0.0
            for i, (_, start, end, ranks) in enumerate(own):
                last = max(in_place[r][step][i][1] for r in ranks)
                a += max(0.0, last - start)
                b += end - max(start, last)
            mine_a.append(a)
            mine_b.append(b)
        arrive.append(statistics.median(mine_a))
        after.append(statistics.median(mine_b))
    return dict(in_place_arrival_ms=1e3 * statistics.mean(arrive), in_place_exchange_ms=1e3 * statistics.mean(after))


def _flights(events_R: list[list[list[tuple]]]) -> dict:
    """The posted exchanges' time on the network (comm.WaitTimer's "flight" events), per step: the union of each
    rank's intervals from its own post to completion (``posted_flight_ms``), and from the last rank's post of the
    same exchange to completion (``posted_transfer_ms``: what it took once every rank had posted it), the median
    over timed steps, the mean over ranks; overlapping exchanges (``chunks``) count once. The i-th flight event of
    every rank is the same exchange, as in _arrivals."""
    flights = _aligned(events_R, lambda e: e[0] == "flight") if events_R else None
    if flights is None:
        return {}

    def union(intervals: list[tuple[float, float]]) -> float:
        total, reach = 0.0, float("-inf")
        for a, b in sorted(intervals):
            if b > reach:
                total += b - max(a, reach)
                reach = b
        return total

    # the last rank's post of each step's i-th exchange (every rank times the same steps)
    last_post = [
        [max(e[1] for e in events) for events in zip(*step_R, strict=True)] for step_R in zip(*flights, strict=True)
    ]
    own, transfer = [], []
    for steps in flights:
        own.append(statistics.median(union([(e[1], e[2]) for e in step]) for step in steps))
        transfer.append(
            statistics.median(
                union([(last, e[2]) for last, e in zip(last_post[s], step, strict=True)])
                for s, step in enumerate(steps)
            )
        )
    return dict(posted_flight_ms=1e3 * statistics.mean(own), posted_transfer_ms=1e3 * statistics.mean(transfer))


def _over_ranks(key: str, values: list) -> float:
    """A counter over the ranks: the largest of a ``max_*`` one, else the mean per rank."""
    return max(values) if key.startswith("max_") else sum(values) / len(values)


def _reset_counters(layers) -> None:
    for layer in layers:
        if layer.dispatcher.stats is not None:
            layer.dispatcher.stats.reset()


def _time_experts(layers, timed: dict) -> None:
    """Host time of the routed and shared experts' forward (the last step's: the hooks add into ``timed``)."""
    for layer in layers:
        for name, module in (("experts", layer.experts), ("shared", layer.shared_experts)):
            if module is None:
                continue

            def pre(_module, _args, name=name):
                timed[name + "_start"] = time.perf_counter()

            def post(_module, _args, _out, name=name):
                if timed.get(name + "_start") is not None:
                    timed[name] += time.perf_counter() - timed.pop(name + "_start")

            module.register_forward_pre_hook(pre)
            module.register_forward_hook(post)


def rank_main(args) -> None:
    import torch
    import torch.distributed as dist

    from xmoe.config import ParallelConfig
    from xmoe.parallel.dims import ParallelDims
    from xmoe.plan.step_time import row_bytes

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    par = ParallelConfig(ep=world, gpus_per_node=local)
    dims = ParallelDims.from_config(par, world, rank=rank, node_size=local).build_mesh("cpu")
    latency = collective_latency(world, local, args.sync_segment_ms)
    # what a flat dispatch sends each rank: a rank's slots spread evenly, bf16 rows
    pair_bytes = round(args.batch * args.seq * args.top_k / world * row_bytes(args.hidden, "bf16"))
    latency |= alltoall_rate(world, local, pair_bytes, args.chunks)
    for case in _cases(args, world // local):
        row = _run_case(args, dims, world, rank, case) | latency
        gc.collect()  # the case's model, optimizer and graphs, before the next one is built
        if rank == 0:  # each row as it comes: a run cut short keeps what it measured
            print(json.dumps(row), flush=True)
            if args.raw:
                with open(args.raw, "a") as f:
                    f.write(json.dumps(row) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def collective_latency(world: int, local: int, segment_ms: float, reps: int = 30) -> dict:
    """The fixed cost of one collective on this cluster, as the planner's Network takes it (its latency terms), over
    every rank (``inter_lat_ms``: its pairs cross nodes) and over each node's ranks at once (``intra_lat_ms``), the
    mean over ranks: what an all-to-all of one value per pair adds to a loop of compute segments of ``segment_ms``
    (every rank computing, as in a step). On an emulated cluster whose ranks outnumber its cores, that is mostly
    the processes' turns on the shared cores: a rank reaches the collective when the scheduler lets it, and the
    others wait. Also recorded: that difference alone (``*_amid_lat_ms``) and the same all-to-all back to back
    with nothing between (``*_idle_lat_ms``); the latency taken is the larger of the two."""
    import torch
    import torch.distributed as dist

    nodes = world // local
    node_groups = [dist.new_group(list(range(n * local, (n + 1) * local))) for n in range(nodes)]
    mine = node_groups[dist.get_rank() // local]
    a = torch.randn(256, 256)

    def matmuls(n: int) -> None:
        for _ in range(n):
            a @ a

    def idle_ms(group, size: int) -> float:
        send, recv = torch.zeros(size), torch.empty(size)
        times = []
        dist.barrier()
        for i in range(reps + 3):
            start = time.perf_counter()
            dist.all_to_all_single(recv, send, group=group)
            if i >= 3:  # the first calls set up the pairs' connections
                times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)

    # a segment's matmuls, timed with every rank computing at once
    dist.barrier()
    start = time.perf_counter()
    matmuls(100)
    per_matmul = (time.perf_counter() - start) / 100
    count = max(1, round(segment_ms / 1e3 / per_matmul))
    loops = max(4, reps * 2 // 3)

    def amid_compute_ms(group, size: int) -> float:
        send, recv = torch.zeros(size), torch.empty(size)

        def loop(collective: bool) -> float:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(loops):
                matmuls(count)
                if collective:
                    dist.all_to_all_single(recv, send, group=group)
            dist.barrier()
            return time.perf_counter() - start

        dist.all_to_all_single(recv, send, group=group)  # the pairs' connections
        return 1e3 * max(0.0, loop(True) - loop(False)) / loops

    measured = [
        amid_compute_ms(None, world),
        amid_compute_ms(mine, local),
        idle_ms(None, world),
        idle_ms(mine, local),
    ]
    per_rank: list = [None] * world
    dist.all_gather_object(per_rank, measured)
    keys = ("inter_amid_lat_ms", "intra_amid_lat_ms", "inter_idle_lat_ms", "intra_idle_lat_ms")
    out = {k: statistics.mean(m[i] for m in per_rank) for i, k in enumerate(keys)} | {"lat_segment_ms": segment_ms}
    # Ranks that outnumber the cores take turns on them, and a collective waits for the last rank's turn: then the
    # cost amid compute is the planner's latency (never less than the collective's own time; a smaller difference of
    # the loops is their noise). With a core per rank there are no turns, and the difference of two loops of seconds
    # is noise of tens of ms (0-61 ms per collective over 8 and 4 ranks on 16 cores): the time back to back is taken.
    out["lat_cores"] = os.cpu_count() or 1
    out["lat_contended"] = world > out["lat_cores"]
    for where in ("inter", "intra"):
        amid = out[f"{where}_amid_lat_ms"] if out["lat_contended"] else 0.0
        out[f"{where}_lat_ms"] = max(amid, out[f"{where}_idle_lat_ms"])
    return out


def alltoall_rate(world: int, local: int, pair_bytes: int, chunks: int, reps: int = 12) -> dict:
    """The rate a node's link delivers to an all-to-all over every rank, as the step's exchanges load it: every rank
    sends ``pair_bytes`` to each other rank at once (by default what a flat dispatch sends a rank), back to back; the
    rate is the bytes a node sends off-node over the median time. This, not one TCP flow's rate (measure_link), is
    the planner's inter-node bandwidth: many flows through one shaped queue deliver less than one flow does. Also
    the rate under the ``chunks`` overlap: the same bytes as ``chunks`` all-to-alls of 1/chunks each, two of them
    in flight at once as moe/routed.py posts them (a second exchange can fill the link where the first one's last
    flows leave it idle). The two are timed in turn, ``reps`` times each, so that a slow spell of the host slows
    both alike and the medians pass over it."""
    import torch
    import torch.distributed as dist

    per_pair = max(1, pair_bytes // (4 * chunks))  # fp32 values a pair exchanges per part: whole = chunks parts

    pair_sent = 4 * per_pair * chunks  # bytes a rank sends each other rank, whole or in parts
    buffers = {}
    for parts in (1, chunks):
        sends = [torch.zeros(world * per_pair * chunks // parts) for _ in range(parts)]
        buffers[parts] = sends, [torch.empty_like(x) for x in sends]

    def once(parts: int) -> float:
        sends, recvs = buffers[parts]
        dist.barrier()
        start = time.perf_counter()
        works = [dist.all_to_all_single(recvs[p], sends[p], async_op=True) for p in range(min(2, parts))]
        for p in range(parts):
            works[p].wait()
            if p + 2 < parts:
                works.append(dist.all_to_all_single(recvs[p + 2], sends[p + 2], async_op=True))
        return time.perf_counter() - start

    once(1)  # the first exchanges set up the pairs' connections
    once(chunks)
    times: dict[int, list[float]] = {1: [], chunks: []}
    for _ in range(reps):
        for parts in times:
            times[parts].append(once(parts))

    def seconds(parts: int) -> float:
        per_rank: list = [None] * world
        dist.all_gather_object(per_rank, statistics.median(times[parts]))
        return max(per_rank)  # the exchange ends when its slowest rank's does

    node_bytes = local * (world - local) * pair_sent
    whole, parted = seconds(1), seconds(chunks)
    return {
        "a2a_pair_bytes": pair_sent,
        "a2a_ms": 1e3 * whole,
        "a2a_node_mbyte_s": node_bytes / whole / 1e6,
        "a2a_chunks": chunks,
        "a2a_chunks_ms": 1e3 * parted,
        "a2a_chunks_node_mbyte_s": node_bytes / parted / 1e6,
    }


# ---------------------------------------------------------------------------------------- the planner's view


def _waits_behind_compute(base: dict, row: dict) -> float:
    """The exposed time (ms) of the overlap-off case ``base`` that is not compute, for the prediction of ``row``.
    Ranks reach each exchange at different times: the arrival skew, the ranks' mean exposed time less the least
    one's. Where ranks outnumber the cores (``lat_contended``), the skew is their turns on the cores: compute that
    nothing hides. Where exchanges run one at a time, every rank waits for the last to arrive. In both cases the
    critical compute is the step less the least-waiting rank's exposed time. With a core per rank, ``chunks`` keeps
    two exchanges in flight, and a rank that arrives late finds the other one under way: the skew is absorbed, and
    the compute is the ranks' mean (the step less their mean wait). Measured on such a host (docs/expert-parallel.md):
    `chunks`' posted exchanges spent as long on the network from the last rank's post as overlap off's, while its
    exposed time fell by several times the expert compute it can hide behind. RBD's ``chunks`` keeps its blocking
    stages (the exchanges inside a node around the posted ones), and at those every rank still waits for the last
    to arrive (the arrival column, 60-280 ms a step there against 9-21 ms for flat ``chunks``): the least-waiting
    rank's rule holds for it."""
    least = base.get("least_exposed_ms", base["exposed_ms"])
    absorbed = row["dispatcher"] == "pft" and row["mode"] == "chunks" and not row.get("lat_contended", True)
    return base["exposed_ms"] if absorbed else least


def predictions(args, rows: list[dict], nodes: int, link_bytes_s: float, rtt_ms: float) -> None:
    """Each row's predicted step (xmoe/plan/step_time.py) from the link and the overlap-off case's compute."""
    from dataclasses import replace

    from xmoe.plan.comm import Network, estimate_comm
    from xmoe.plan.step_time import Techniques, compute_model, predict_step

    world = nodes * args.ranks_per_node
    # a node's link is shared by its ranks: each rank's share of it; inside a node, loopback (fast, unshaped)
    for row in rows:
        # the node's rate under the case's all-to-alls where measured (alltoall_rate), else one flow's; the
        # collectives' fixed cost measured on the cluster (collective_latency), else the link's half round trip
        rate_key = "a2a_chunks_node_mbyte_s" if row["mode"] == "chunks" else "a2a_node_mbyte_s"
        node_bytes_s = 1e6 * row.get(rate_key, row.get("a2a_node_mbyte_s", link_bytes_s / 1e6))
        network = Network(
            intra_bw=20.0,
            inter_bw=node_bytes_s / 1e9 / args.ranks_per_node,
            intra_lat=1e3 * row.get("intra_lat_ms", 0.05),
            inter_lat=1e3 * row.get("inter_lat_ms", rtt_ms / 2),
        )
        group = (row["dispatcher"], row["dtype"], row["node_limit"])
        base = next(
            (r for r in rows if r["mode"] == "off" and (r["dispatcher"], r["dtype"], r["node_limit"]) == group), None
        )
        if base is None:  # a run cut short before this group's overlap-off case
            continue
        cfg = _model_config(args, world, row)
        tokens = args.batch * args.seq
        est = estimate_comm(
            cfg,
            world,
            gpus_per_node=args.ranks_per_node,
            ep=world,
            tokens_per_gpu=tokens,
            network=network,
            max_nodes_per_token=row["node_limit"],
            mc_tokens=1024,
            mc_sources=4,
        )
        est = replace(est, bytes_per_elem=2)
        compute = compute_model(
            cfg,
            tokens,
            ep=world,
            compute_ms=base["step_ms"] - _waits_behind_compute(base, row),
            experts_ms=base["experts_fwd_ms"],
        )
        tech = Techniques(row["dispatcher"], row["mode"], args.chunks, row["dtype"], est.max_nodes_per_token)
        pred = predict_step(est, compute, tech, top_k=args.top_k)
        row["predicted_ms"] = pred.step_ms
        row["predicted_exposed_ms"] = pred.exposed_ms
        row["predicted_network_ms"] = pred.network_ms
        row["error"] = row["step_ms"] / pred.step_ms - 1


# ------------------------------------------------------------------------------------------------ launcher


def launcher_main(args, argv: list[str]) -> int:
    from benchmarks.emulated_cluster import EmulatedCluster, have_net_admin
    from benchmarks.harness import commit

    ok, reason = have_net_admin()
    if not ok:
        print(f"bench_ep_cluster.py: {reason}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = dict(
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        machine=f"{platform.node()}: {os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}",
        **commit(),
        command="python benchmarks/bench_ep_cluster.py " + " ".join(argv),
        settings={k: v for k, v in vars(args).items() if k not in ("rank_mode", "raw")},
        clusters=[],
    )
    status = 0
    for nodes in args.nodes:
        raw = out / f"bench_ep_cluster_raw_{nodes}nodes.jsonl"
        raw.unlink(missing_ok=True)  # rows are appended as each case ends: none of an earlier run
        with EmulatedCluster(nodes=nodes, inter_gbit=args.inter_gbit) as cluster:
            link = cluster.measure_link(0, 1)
            print(f"{nodes} nodes: {link.describe()}", flush=True)
            command = [str(Path(__file__).resolve()), "--rank-mode", "--raw", str(raw.resolve()), *argv]
            result = cluster.run(command, ranks_per_node=args.ranks_per_node, timeout=args.timeout)
        rows = [json.loads(line) for line in raw.read_text().splitlines() if line.strip()] if raw.exists() else []
        if result.returncode != 0:
            print(
                f"{nodes} nodes: the run failed (exit {result.returncode}) after {len(rows)} cases; logs in "
                f"{result.out}",
                file=sys.stderr,
            )
            status = 1
        predictions(args, rows, nodes, link.rate_bit / 8, link.rtt_ms)
        report["clusters"].append(
            dict(nodes=nodes, link=link.describe(), link_mbyte_s=link.mbyte_s, link_rtt_ms=link.rtt_ms, rows=rows)
        )
        # the report so far after each cluster: a run cut short keeps what it measured
        (out / "bench_ep_cluster.json").write_text(json.dumps(report, indent=1))
        (out / "bench_ep_cluster.md").write_text(_markdown(report))
        raw.unlink(missing_ok=True)
        if status:
            return status
    print(_markdown(report))
    return 0


def repredict(path: Path) -> Path:
    """The predictions of the saved report ``path`` made again from its measured rows and settings (no cluster, no
    root): what a change to the planner or to the inputs it takes from the rows does to a committed run."""
    from benchmarks.harness import commit

    try:
        report = json.loads(path.read_text())
        args = argparse.Namespace(**report["settings"])
        needed = {"nodes", "link_mbyte_s", "rows"}
        if not report["clusters"] or not all(needed <= cluster.keys() for cluster in report["clusters"]):
            raise ValueError(f"no clusters, or one without {', '.join(sorted(needed))}")
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise SystemExit(
            f"bench_ep_cluster.py --repredict: {path} is not a report of this benchmark ({type(e).__name__}: {e}); "
            "give the bench_ep_cluster.json a run wrote"
        ) from None
    for cluster in report["clusters"]:
        for row in cluster["rows"]:
            for key in ("predicted_ms", "predicted_exposed_ms", "predicted_network_ms", "error"):
                row.pop(key, None)
        # the link's round trip is only the fallback latency of rows that predate the measured collective latency
        rtt_ms = cluster.get("link_rtt_ms", 0.0)
        predictions(args, cluster["rows"], cluster["nodes"], 1e6 * cluster["link_mbyte_s"], rtt_ms)
    report["repredicted"] = dict(
        date=datetime.datetime.now().isoformat(timespec="seconds"),
        **commit(),
        command=f"python benchmarks/bench_ep_cluster.py --repredict {path}",
    )
    out = path.with_name(f"{path.stem}_repredicted.json")
    out.write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(_markdown(report))
    return out


def _bytes_sent(traffic: dict) -> float:
    """Bytes a rank sent per step: the flat dispatcher's count, or RBD's two stages' (inside and across nodes)."""
    return traffic.get("bytes_sent", traffic.get("bytes_intra", 0) + traffic.get("bytes_inter", 0))


def _markdown(report: dict) -> str:
    from benchmarks.harness import commit_line, commit_ref

    lines = [
        "# Expert parallelism on the emulated cluster",
        "",
        f"{report['date']}, {report['machine']}",
        "",
        commit_line(report),
        "",
        f"`{report['command']}`",
        "",
    ]
    if "repredicted" in report:
        again = report["repredicted"]
        lines += [
            f"The measurements above; the predictions made again on {again['date']} at commit {commit_ref(again)}: "
            f"`{again['command']}`.",
            "",
        ]
    for cluster in report["clusters"]:
        rows = cluster["rows"]
        lines += [
            f"## {cluster['nodes']} nodes x {report['settings']['ranks_per_node']} ranks",
            "",
            cluster["link"],
            "",
        ]
        if rows and "inter_lat_ms" in rows[0]:
            r = rows[0]
            seg = f"amid compute segments of {r.get('lat_segment_ms', 0):.0f} ms"
            amid = f"{r.get('inter_amid_lat_ms', 0):.2f} and {r.get('intra_amid_lat_ms', 0):.2f} ms"
            idle = f"{r.get('inter_idle_lat_ms', 0):.2f} and {r.get('intra_idle_lat_ms', 0):.2f} ms"
            ranks = cluster["nodes"] * report["settings"]["ranks_per_node"]
            if r.get("lat_contended", True):
                how = f"the larger of what it adds {seg} ({amid}) and its time back to back ({idle})"
            else:
                how = (
                    f"with {ranks} ranks on {r['lat_cores']} cores no rank waits for a core: its time back to back "
                    f"({idle}); what it added {seg} ({amid}) is the two loops' noise, not used"
                )
            if "a2a_node_mbyte_s" in r:
                lines += [
                    f"An all-to-all over every rank, {r['a2a_pair_bytes'] / 1024:.0f} KiB per pair back to back "
                    f"(alltoall_rate): {r['a2a_ms']:.0f} ms, {r['a2a_node_mbyte_s']:.1f} MB/s sent off each node, the "
                    f"planner's inter-node rate ({r['a2a_node_mbyte_s'] / cluster['link_mbyte_s']:.2f}x one flow's)"
                    + (
                        f"; as {r['a2a_chunks']} all-to-alls of 1/{r['a2a_chunks']} each, two in flight, as `chunks` "
                        f"runs them: {r['a2a_chunks_ms']:.0f} ms, {r['a2a_chunks_node_mbyte_s']:.1f} MB/s, the rate "
                        f"of the `chunks` cases."
                        if "a2a_chunks_ms" in r
                        else "."
                    ),
                    "",
                ]
            lines += [
                f"A collective's fixed cost, the planner's latency terms (collective_latency): across nodes "
                f"{r['inter_lat_ms']:.2f} ms, inside a node {r['intra_lat_ms']:.2f} ms; {how}.",
                "",
            ]
        lines += [
            "| dispatcher | dispatch | node limit | overlap | step ms | exposed ms | predicted ms | error | vs today "
            "| MB sent per step | inter-node rows | most nodes a token reached |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        today = next(
            (r for r in rows if (r["dispatcher"], r["dtype"], r["node_limit"], r["mode"]) == ("pft", "bf16", 0, "off")),
            None,
        )
        for r in rows:
            speed = f"{today['step_ms'] / r['step_ms']:.2f}x" if today else ""
            traffic = r.get("traffic", {})
            # no prediction without its group's overlap-off case (its compute), e.g. --cases that leave it out
            predicted, error = (
                (f"{r['predicted_ms']:.0f}", f"{100 * r['error']:+.0f}%") if "predicted_ms" in r else ("-", "-")
            )
            lines.append(
                f"| {'flat' if r['dispatcher'] == 'pft' else 'RBD'} | {r['dtype']} | {r['node_limit'] or 'off'} | "
                f"{r['mode']} | {r['step_ms']:.0f} | {r['exposed_ms']:.0f} | {predicted} | "
                f"{error} | {speed} | {_bytes_sent(traffic) / 1e6:.1f} | "
                f"{traffic.get('rows_inter', 0):.0f} | {traffic.get('max_token_nodes', 0):.0f} |"
            )
        lines += ["", "Traffic per rank and timed step (the ranks' mean; the most nodes: the largest on any rank).", ""]
        if rows and "exposed_by_kind_ms" in rows[0]:
            lines += [
                "Exposed time by kind (ms per step, the ranks' mean) beside the planner's: the waits of posted "
                "exchanges, the blocking exchanges, the count exchange and its host sync; the planner's exposed "
                "time and its network time (all of the step's collectives, hidden or not); the posted exchanges' "
                "time on the network, from the last rank's post to completion (overlapping ones once: _flights).",
                "",
                "| dispatcher | node limit | overlap | posted | blocking | counts | of blocking and counts: waiting "
                "for the last to arrive | and exchanging after | exposed | planner's exposed | planner's network "
                "| posted exchanges in flight |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|",
            ]
            nan = float("nan")
            for r in rows:
                k = r["exposed_by_kind_ms"]
                planned = (
                    (f"{r['predicted_exposed_ms']:.0f}", f"{r['predicted_network_ms']:.0f}")
                    if "predicted_network_ms" in r
                    else ("-", "-")
                )
                lines.append(
                    f"| {'flat' if r['dispatcher'] == 'pft' else 'RBD'} | {r['node_limit'] or 'off'} | {r['mode']} | "
                    f"{k['posted']:.0f} | {k['blocking']:.0f} | {k['counts']:.0f} | "
                    f"{r.get('in_place_arrival_ms', nan):.0f} | {r.get('in_place_exchange_ms', nan):.0f} | "
                    f"{r['exposed_ms']:.0f} | "
                    f"{planned[0]} | {planned[1]} | {r.get('posted_transfer_ms', nan):.0f} |"
                )
            lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.rank_mode:
        rank_main(args)
        return 0
    if args.repredict:
        print(f"written: {repredict(Path(args.repredict))}")
        return 0
    from benchmarks.emulated_cluster import Interrupted

    try:
        return launcher_main(args, argv)
    except Interrupted as e:  # the cluster already stopped every node and removed what it made
        print(
            f"bench_ep_cluster.py: {e}; every node stopped, everything removed (the cases measured so far are in "
            f"{args.out})",
            file=sys.stderr,
        )
        return 128 + e.signum


if __name__ == "__main__":
    sys.exit(main())
