"""The step-time model of `xmoe plan comm`: node-limited rows against the router's rule written as a plain loop, the
overlap schedules against hand-computed timelines, each exchange's bytes and time by hand, monotonicity, the
compute model, choose_ep_overlap and the CLI."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from xmoe.cli import main
from xmoe.model.flops import FlopDims, train_flops
from xmoe.model.presets import get_preset
from xmoe.plan import comm, node_limit, step_time
from xmoe.plan import overlap as sched
from xmoe.plan.step_time import Techniques


def _moe(preset: str, **changes):
    cfg = get_preset(preset)
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, **changes))


# ------------------------------------------------------------------------------------------------ node limit


def _loop_rule(scores: list[float], node_of: list[int], top_k: int, max_nodes: int) -> list[int]:
    """The router's node-limited rule, one token: node score = sum of its top ceil(K/M) scores, the best M nodes,
    then the top-K of their experts."""
    per_node = math.ceil(top_k / max_nodes)
    node_score = {}
    for n in sorted(set(node_of)):
        mine = sorted((scores[e] for e in range(len(scores)) if node_of[e] == n), reverse=True)
        node_score[n] = sum(mine[:per_node])
    best = sorted(node_score, key=lambda n: -node_score[n])[:max_nodes]
    eligible = [e for e in range(len(scores)) if node_of[e] in best]
    return sorted(eligible, key=lambda e: -scores[e])[:top_k]


def _loop_rows(cfg, e2r, r2n, sources, max_nodes: int, tokens: int, seed: int) -> comm.RowCounts:
    """Mean rows over ``sources`` of tokens routed by _loop_rule on softmax(Gumbel) scores, drawn one by one."""
    rng = np.random.default_rng(seed)
    E, K = cfg.moe.num_experts, cfg.moe.top_k
    node_of = [int(r2n[e2r[e]]) for e in range(E)]
    counts = []
    for src in sources:
        ids = []
        for _ in range(tokens):
            logits = [float(v) for v in rng.gumbel(size=E)]
            z = sum(math.exp(v) for v in logits)
            ids.append(_loop_rule([math.exp(v) / z for v in logits], node_of, K, max_nodes))
        counts.append(comm.count_rows(np.array(ids), e2r, r2n, src))
    return comm.RowCounts.mean(counts).scaled(1 / tokens)  # per token


def test_node_limit_rule_matches_the_loop_on_the_same_scores() -> None:
    rng = np.random.default_rng(3)
    e2r, r2n, _ = comm.ep_layout(16, 8, 8, 2)  # 2 experts per rank, 2 ranks per node: 4 nodes of 4 experts
    for top_k, max_nodes in ((4, 2), (4, 1), (6, 3), (3, 2)):
        nodes_NE = node_limit.experts_by_node(e2r, r2n, max_nodes, top_k)
        scores_TE = rng.random((200, 16))
        ids_TK = node_limit.select_node_limited(scores_TE, nodes_NE, top_k, max_nodes)
        node_of = [int(r2n[e2r[e]]) for e in range(16)]
        for t in range(200):
            assert set(ids_TK[t].tolist()) == set(_loop_rule(scores_TE[t].tolist(), node_of, top_k, max_nodes))
            assert len({node_of[e] for e in ids_TK[t]}) <= max_nodes


def test_node_limit_expectation_against_a_loop_monte_carlo() -> None:
    # tiny: 16 experts, top-4, on 8 ranks of 2 per node (4 nodes): M = 2 and 1 against the plain-loop rule
    cfg = get_preset("tiny")
    e2r, r2n, group = comm.ep_layout(16, 8, 8, 2)
    for max_nodes in (2, 1):
        est = comm.estimate_comm(
            cfg, 8, gpus_per_node=2, ep=8, tokens_per_gpu=1, max_nodes_per_token=max_nodes, mc_tokens=8192, seed=5
        )
        assert est.max_nodes_per_token == max_nodes and est.method.startswith("monte carlo")
        loop = _loop_rows(cfg, e2r, r2n, group, max_nodes, 400, seed=11)
        for name in ("flat_local", "flat_intra", "flat_inter", "rbd_inter", "rbd_replicas", "token_nodes"):
            assert getattr(est.rows, name) == pytest.approx(getattr(loop, name), rel=0.06, abs=0.02), name
        assert est.rows.token_nodes <= max_nodes + 1e-9
    # flat's rows do not depend on the limit (each slot's node is uniform by symmetry); RBD's pilots fall
    free = comm.estimate_comm(cfg, 8, gpus_per_node=2, ep=8, tokens_per_gpu=1)
    one = comm.estimate_comm(cfg, 8, gpus_per_node=2, ep=8, tokens_per_gpu=1, max_nodes_per_token=1, mc_tokens=8192)
    assert one.rows.flat_inter == pytest.approx(free.rows.flat_inter, rel=0.03)
    assert one.rows.rbd_inter < 0.5 * free.rows.rbd_inter


def test_node_limit_exact_small_case() -> None:
    # 4 experts on 4 ranks, 2 per node, K = 2, M = 1: both experts of a token on one node, that node uniform:
    # per token 1 node; flat: 1 inter row (2 slots x 1/2), local 1/2, intra 1/2; RBD: 1/2 pilot, 1/2 replica
    cfg = _moe("tiny", num_experts=4, top_k=2)
    est = comm.estimate_comm(
        cfg, 4, gpus_per_node=2, ep=4, tokens_per_gpu=1, max_nodes_per_token=1, mc_tokens=8192, mc_sources=4
    )
    expected = dict(flat_local=0.5, flat_intra=0.5, flat_inter=1.0, rbd_inter=0.5, rbd_replicas=0.5, token_nodes=1.0)
    for name, value in expected.items():
        assert getattr(est.rows, name) == pytest.approx(value, abs=0.02), name
    # M at least the group's nodes: no limit, the closed form
    assert comm.estimate_comm(cfg, 4, gpus_per_node=2, ep=4, max_nodes_per_token=2).method == "closed form"


def test_node_limit_refuses_what_cannot_align() -> None:
    e2r, r2n, _ = comm.ep_layout(16, 8, 8, 2)
    with pytest.raises(ValueError, match="cannot find its experts"):
        node_limit.experts_by_node(e2r, r2n, 1, 5)  # 4 experts per node, K = 5
    with pytest.raises(ValueError, match="unevenly"):
        node_limit.experts_by_node(np.repeat(np.arange(6), 2), np.array([0, 0, 0, 0, 1, 1]), 1, 2)
    with pytest.raises(ValueError, match=">= 1"):
        node_limit.experts_by_node(e2r, r2n, -1, 2)


# ------------------------------------------------------------------------------------------ the schedules


def _times(**kw) -> sched.CallTimes:
    base = dict(count=0.0, dispatch=0.0, combine=0.0, combine_bwd=0.0, dispatch_bwd=0.0, experts=0.0)
    return sched.CallTimes(**(base | dict(shared_up=0.0, shared_down=0.0) | kw))


def test_schedules_by_hand() -> None:
    t = _times(count=1, dispatch=10, combine=8, combine_bwd=8, dispatch_bwd=8, experts=3, shared_up=4, shared_down=2)
    # off: everything in a row, forward and backward (backward compute 2x)
    assert sched.forward("off", 2, t).time == 1 + 10 + 3 + 8 + 4 + 2
    assert sched.backward("off", 2, t).time == 8 + 4 + 8 + 6 + 8
    # shared: up under the dispatch, down under the combine
    assert sched.forward("shared", 2, t).time == 1 + max(10, 4) + 3 + max(8, 2)
    assert sched.backward("shared", 2, t).time == max(8, 4) + 6 + max(8, 8)
    # chunks of 2 (times are one chunk's): net d0 [1, 11], d1 [11, 21]; gpu su [1, 5], e0 [11, 14], e1 [21, 24];
    # net c0 [21, 29] (after d1), c1 [29, 37]; sd [24, 26]
    fwd = sched.forward("chunks", 2, t)
    assert (fwd.time, fwd.compute, fwd.network) == (37, 4 + 3 + 3 + 2, 1 + 10 + 10 + 8 + 8)
    assert fwd.exposed == 37 - 12
    # backward: net c1' [0, 8], c0' [8, 16]; gpu sd' [0, 4], e1' [8, 14], e0' [16, 22], su' [22, 30];
    # net d1' [16, 24] (after c0' and e1'), d0' [24, 32]
    assert sched.backward("chunks", 2, t).time == 32


def test_three_chunks_wait_as_autograd_runs_them() -> None:
    # forward: d2 is posted after e0, queued behind c0; backward: experts'(0) waits for d'(2)
    t = _times(dispatch=2, combine=2, combine_bwd=2, dispatch_bwd=2, experts=1)
    # net: d0 [0,2] d1 [2,4] c0 [4,6] (e0 [2,3]) d2 [6,8] c1 [8,10] (e1 [4,5]) c2 [10,12] (e2 [8,9])
    assert sched.forward("chunks", 3, t).time == 12
    # net: c2' [0,2] c1' [2,4] c0' [4,6]; gpu e2' [2,4], e1' [4,6]; d2' [6,8]; e0' waits c0' and d2': [8,10];
    # d1' [8,10], d0' [10,12]
    assert sched.backward("chunks", 3, t).time == 12


def test_schedules_are_monotone_and_overlap_never_loses() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        v = rng.random(8) * 10
        t = _times(
            count=v[0], dispatch=v[1], combine=v[2], combine_bwd=v[3], dispatch_bwd=v[4], experts=v[5],
            shared_up=v[6], shared_down=v[7],
        )  # fmt: skip
        for mode in sched.OVERLAP_MODES:
            for n in (2, 3, 4):
                for run in (sched.forward, sched.backward):
                    base = run(mode, n, t)
                    for field in ("dispatch", "combine", "combine_bwd", "dispatch_bwd", "experts", "shared_up"):
                        shorter = dataclasses.replace(t, **{field: getattr(t, field) * rng.random()})
                        assert run(mode, n, shorter).time <= base.time + 1e-9
        # chunking without its cost (each chunk exactly 1/n, no latency) and sharing never lose to off
        for run in (sched.forward, sched.backward):
            off = run("off", 2, t).time
            assert run("shared", 2, t).time <= off + 1e-9
            for n in (2, 3, 4):
                parts = ("dispatch", "combine", "combine_bwd", "dispatch_bwd", "experts")
                split = dataclasses.replace(t, **{f: getattr(t, f) / n for f in parts})
                assert run("chunks", n, split).time <= off + 1e-9


# ------------------------------------------------------------------------------------------ exchanges, step


def test_fp8_row_bytes() -> None:
    assert step_time.row_bytes(2048, "bf16") == 4096
    assert step_time.row_bytes(2048, "fp8") == 2048 + 4 * 16  # 0.516x
    assert step_time.row_bytes(7168, "fp8") / step_time.row_bytes(7168, "bf16") == pytest.approx(0.5156, abs=1e-4)


def _estimate(rows: comm.RowCounts, network: comm.Network, hidden: int = 1000, ep: int = 4, nodes: int = 2):
    return comm.CommEstimate(8, ep, nodes, hidden, 2, rows, "hand", network)


def test_exchanges_by_hand() -> None:
    rows = comm.RowCounts(100, 400, 50, 100, 250, 150, 60, 220)
    net = comm.Network(intra_bw=10.0, inter_bw=1.0, intra_lat=5.0, inter_lat=20.0)  # GB/s, us
    est = _estimate(rows, net)
    H, K = 1000, 4

    def us(nbytes: float, inter: bool) -> float:
        return (20.0 if inter else 5.0) + nbytes / ((1.0 if inter else 10.0) * 1e3)

    flat = step_time.exchange_ms(est, Techniques("pft", dispatch_dtype="fp8"), 0.5, K)
    fp8 = H + 4 * 8
    assert flat["dispatch"] == pytest.approx(max(us(50 * fp8, False), us(125 * fp8, True)) / 1e3)
    assert flat["combine"] == flat["combine_bwd"] == flat["dispatch_bwd"]
    assert flat["combine"] == pytest.approx(max(us(50 * 2 * H, False), us(125 * 2 * H, True)) / 1e3)
    rbd = step_time.exchange_ms(est, Techniques("rbd"), 1.0, K)
    stage1 = max(us(100 * 2 * H, False), us(150 * 2 * H, True))
    ids1 = max(us(100 * 4 * K, False), us(150 * 4 * K, True))
    stage2, ids2 = us(60 * 2 * H, False), us(60 * 4 * K, False)
    assert rbd["dispatch"] == pytest.approx((stage1 + ids1 + stage2 + ids2) / 1e3)
    assert rbd["combine"] == rbd["combine_bwd"] == pytest.approx((stage1 + ids1 + stage2 + ids2) / 1e3)
    assert rbd["dispatch_bwd"] == pytest.approx((stage1 + stage2) / 1e3)


def test_step_off_is_compute_plus_every_exchange() -> None:
    cfg = get_preset("large")
    est = comm.estimate_comm(cfg, 256)  # 25 GB/s per GPU across nodes, 300 inside
    compute = step_time.compute_model(cfg, 4096, ep=256, compute_ms=1110.0)
    today = step_time.predict_step(est, compute, Techniques(), top_k=8)
    count = step_time.count_exchange_ms(est, Techniques(), 1)
    assert today.step_ms == pytest.approx(1110.0 + 28 * (count + 4 * est.flat_us / 1e3))
    assert today.exposed_ms == pytest.approx(today.step_ms - 1110.0) and today.chunk_cost_ms == 0
    assert 3000 < today.step_ms < 3300  # ~2.0 s of all-to-all beside 1.11 s of compute
    # every technique together beats each alone, and the chunks' cost is charged
    limited = comm.estimate_comm(cfg, 256, max_nodes_per_token=4, mc_tokens=1024, mc_sources=4)
    best = step_time.predict_step(limited, compute, Techniques("rbd", "chunks", 2, "fp8", 4), top_k=8)
    assert best.chunk_cost_ms > 0 and best.step_ms < 0.6 * today.step_ms
    for weaker in (Techniques("pft", "chunks", 2, "fp8", 4), Techniques("rbd", "off", 2, "fp8", 4)):
        assert step_time.predict_step(limited, compute, weaker, top_k=8).step_ms > best.step_ms


def test_more_bandwidth_is_never_slower() -> None:
    cfg = get_preset("small")
    compute = step_time.compute_model(cfg, 2048, ep=32)
    for tech in (Techniques(), Techniques("rbd", "chunks", 3, "fp8"), Techniques("pft", "shared")):
        times = []
        for inter in (0.5, 2.0, 10.0, 50.0):
            est = comm.estimate_comm(cfg, 32, network=comm.Network(inter_bw=inter))
            times.append(step_time.predict_step(est, compute, tech, top_k=6).step_ms)
        assert times == sorted(times, reverse=True), tech


def test_overlap_never_slower_than_off_but_for_chunking_cost() -> None:
    cfg = get_preset("tiny")  # shared experts too
    for lat in (0.0, 50.0):
        net = comm.Network(intra_bw=1.0, inter_bw=0.05, intra_lat=lat, inter_lat=lat)
        est = comm.estimate_comm(cfg, 8, gpus_per_node=2, ep=8, tokens_per_gpu=4096, network=net)
        for r0 in (0.0, 300.0):
            compute = step_time.compute_model(cfg, 4096, ep=8, tflops=0.05, chunk_overhead_rows=r0, recompute="moe")
            for dispatcher in step_time.DISPATCHERS:
                for dtype in step_time.DISPATCH_DTYPES:
                    off = step_time.predict_step(est, compute, Techniques(dispatcher, "off", 2, dtype), top_k=4)
                    for mode, n in (("shared", 2), ("chunks", 2), ("chunks", 3), ("chunks", 8)):
                        p = step_time.predict_step(est, compute, Techniques(dispatcher, mode, n, dtype), top_k=4)
                        if mode == "shared" or (lat == 0 and r0 == 0):
                            assert p.step_ms <= off.step_ms + 1e-9
                        assert p.network_ms >= off.network_ms - 1e-9  # splitting never sends less


def test_shared_experts_overlap() -> None:
    # tiny has 2 shared experts: "shared" hides them behind the all-to-all; without shared experts it is "off"
    cfg = get_preset("tiny")
    est = comm.estimate_comm(cfg, 8, gpus_per_node=2, ep=8, network=comm.Network(inter_bw=0.001))
    compute = step_time.compute_model(cfg, 256, ep=8, tflops=0.01)
    off = step_time.predict_step(est, compute, Techniques(), top_k=4)
    shared = step_time.predict_step(est, compute, Techniques(overlap="shared"), top_k=4)
    assert compute.shared_ms > 0
    # the shared compute is smaller than the network time: all of it hides, forward, backward (2x)
    assert off.step_ms - shared.step_ms == pytest.approx(compute.shared_ms * 3 * 3, rel=1e-9)
    none = dataclasses.replace(compute, shared_ms=0.0)
    assert step_time.predict_step(est, none, Techniques(overlap="shared"), top_k=4).step_ms == pytest.approx(
        step_time.predict_step(est, none, Techniques(), top_k=4).step_ms
    )


def test_compute_model() -> None:
    cfg = get_preset("small")
    c = step_time.compute_model(cfg, 2048, ep=64, tflops=400.0)
    assert c.experts_ms == pytest.approx(6 * 2048 * 6 * 2048 * 1408 / 400e9)
    # estimated: the model's training FLOPs at the throughput
    assert c.step_ms == pytest.approx(train_flops(FlopDims.from_model_config(cfg, 2048), 1) / 400e9)
    # recompute moe runs the experts' (and router's) forward again
    r = step_time.compute_model(cfg, 2048, ep=64, recompute="moe")
    assert r.step_ms - c.step_ms == pytest.approx(c.experts_ms * 28 + 2 * 2048 * 2048 * 64 * 28 / 400e9)
    # chunk cost: n chunks of T K / n rows, each GEMM charged r0 rows more per local expert
    assert c.chunked_experts_ms(2) * 2 / c.experts_ms == pytest.approx((12288 + 2 * 300) / (12288 + 300))
    with pytest.raises(ValueError, match="exceeds the step's compute"):
        step_time.compute_model(cfg, 2048, ep=64, compute_ms=10.0)  # experts: 45 ms
    measured = step_time.compute_model(cfg, 2048, ep=64, compute_ms=5000.0, experts_ms=2.0)
    assert measured.experts_ms == 2.0 and measured.step_ms == 5000.0


def test_choose_ep_overlap() -> None:
    large = get_preset("large")
    assert step_time.choose_ep_overlap(large, gpus=8, ep=1) == "off"
    assert step_time.choose_ep_overlap(large, gpus=256, ep=256, compute_ms=1110.0) == "chunks"
    assert step_time.choose_ep_overlap(large, gpus=256, ep=256, dispatcher="padded") == "off"
    # links so fast that the all-to-all is a few latencies: chunking's cost is not worth it
    fast = comm.Network(intra_bw=1e6, inter_bw=1e6, intra_lat=0.0, inter_lat=0.0)
    assert step_time.choose_ep_overlap(get_preset("small"), gpus=64, ep=64, network=fast) == "off"
    # with shared experts and a slow network, at least "shared"
    tiny = get_preset("tiny")
    slow = comm.Network(inter_bw=0.001)
    assert step_time.choose_ep_overlap(tiny, gpus=8, ep=8, gpus_per_node=2, network=slow, tflops=0.01) != "off"


# ----------------------------------------------------------------------------------------------------- CLI


def test_cli_step_table(capsys) -> None:
    argv = ["plan", "comm", "--preset", "small", "--gpus", "16", "--mc-tokens", "256", "--compute-ms", "900"]
    main([*argv, "--max-nodes-per-token", "1", "--node-inter-bw", "100", "--ep-chunks", "3"])
    out = capsys.readouterr().out
    assert "inter 12.5 GB/s + 10 us (the node's 100 GB/s over its GPUs)" in out
    assert "compute 900 ms (measured 900 ms per step)" in out
    table = [line for line in out.splitlines() if line.startswith(("  flat ", "  RBD "))]
    assert len(table) == 2 * 3 * 2 * 2  # dispatcher x overlap x dtype x node limit (off, M=1)
    assert "best with node limit M=1" in out and "default ep_overlap" in out and "by chunks" in out


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--max-nodes-per-token", "two"], "must be integers"),
        (["--ep-chunks", "1"], "--ep-chunks (1) must be >= 2"),
        (["--compute-ms", "5", "--layer-compute-ms", "1"], "not both"),
        (["--tflops", "0"], "--tflops (0.0) must be"),
        (["--compute-ms", "1"], "exceeds the step's compute"),
    ],
)
def test_cli_step_bad_inputs(capsys, extra: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", "comm", "--preset", "small", "--gpus", "16", "--mc-tokens", "256", *extra])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
