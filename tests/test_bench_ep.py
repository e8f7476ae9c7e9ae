"""The multi-GPU expert-parallel benchmarks on CPU processes (gloo): what benchmarks/ep_exchanges.py records,
replays and replaces is exactly the layer call's row all-to-alls (splits against a count of the routing, the FP8
payload's width, no collective left but the count exchange under local copies); bench_ep.py end to end on 2 ranks;
bench_rbd.py's node-limited routing keeps every token on at most M nodes."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch
from dist_utils import run_distributed

ROOT = Path(__file__).resolve().parents[1]
H, F, E, K = 128, 16, 8, 3  # H = 128: one FP8 scale group a row


def _layer(dims, dispatch_dtype: str):
    from xmoe.config import MoEConfig
    from xmoe.moe.layer import MoELayer
    from xmoe.parallel.expert_parallel import shard_experts

    cfg = MoEConfig(
        hidden_size=H, ffn_hidden_size=F, num_experts=E, top_k=K, kernel_backend="torch", dispatch_dtype=dispatch_dtype
    )
    torch.manual_seed(0)
    return shard_experts(MoELayer(cfg), dims)


def _exchanges_body(rank, world):
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT))
    from benchmarks.ep_exchanges import local_copies, recording, replay
    from xmoe.config import ParallelConfig
    from xmoe.parallel.dims import ParallelDims

    dims = ParallelDims.from_config(ParallelConfig(ep=world), world).build_mesh("cpu")
    x = torch.randn(40 + 7 * rank, H, generator=torch.Generator().manual_seed(rank)).requires_grad_(True)
    for dispatch_dtype in ("bf16", "fp8"):
        layer = _layer(dims, dispatch_dtype)
        # the rows this rank sends to each rank: its slots whose expert lives there (experts contiguous per rank)
        ids = layer.router(x.detach()).expert_ids_TK
        sends = torch.bincount(ids.flatten() // (E // world), minlength=world).tolist()
        every: list = [None] * world
        dist.all_gather_object(every, sends)  # every rank's sends: what this rank receives from each
        receives = [every[p][rank] for p in range(world)]
        log: list = []
        with recording(log):
            layer(x).sum().backward()
        # forward dispatch, forward combine, then backward: the combine's reverse, the dispatch's reverse
        assert [(r.input_splits, r.output_splits) for r in log] == [
            (tuple(sends), tuple(receives)),
            (tuple(receives), tuple(sends)),
            (tuple(sends), tuple(receives)),
            (tuple(receives), tuple(sends)),
        ]
        first = (torch.uint8, (H + 4,)) if dispatch_dtype == "fp8" else (torch.float32, (H,))
        assert (log[0].dtype, log[0].width) == first
        assert all((r.dtype, r.width) == (torch.float32, (H,)) for r in log[1:])
        assert log[0].bytes_sent == sum(sends) * math.prod(first[1]) * first[0].itemsize
        replay(log, dims.group("ep"), torch.device("cpu"))()  # every rank replays its own log: they match
        # under local copies only the count exchange is a collective; the shapes are those of the real call
        calls: list = []
        real = dist.all_to_all_single

        def counted(*args, calls=calls, real=real, **kwargs):
            calls.append(args[0].shape)
            return real(*args, **kwargs)

        dist.all_to_all_single = counted
        try:
            out = layer(x)
            real_calls = len(calls)
            with local_copies():
                local_out = layer(x)
                local_out.sum().backward()
        finally:
            dist.all_to_all_single = real
        assert real_calls == 3  # forward: the count exchange, the dispatch, the combine
        assert len(calls) - real_calls == 1  # local copies, forward and backward: the count exchange alone
        assert local_out.shape == out.shape and torch.isfinite(local_out).all()


def test_exchanges_recorded_replayed_and_replaced():
    run_distributed(_exchanges_body, 2, timeout_s=60)


def _bench_body(rank, world, out):
    sys.path.insert(0, str(ROOT))
    os.environ["XMOE_RESULTS_DIR"] = out
    from benchmarks import bench_ep

    argv = ["--cpu", "--modes", "chunks", "--tokens", "64", "--check-tokens", "64", "--iters", "1", "--trials", "1"]
    bench_ep.main(argv)


def test_bench_ep_runs_every_case_on_two_ranks(tmp_path):
    run_distributed(_bench_body, 2, str(tmp_path), timeout_s=90)
    data = json.loads((tmp_path / "bench_ep_ep2.json").read_text())
    rows, meta = data["rows"], data["meta"]
    assert [(r["dtype"], r["mode"]) for r in rows] == [
        ("bf16", "off"),
        ("bf16", "chunks"),
        ("fp8", "off"),
        ("fp8", "chunks"),
    ]
    assert all(c["ok"] for c in meta["checks"]) and {c["mode"] for c in meta["checks"]} == {"off", "chunks"}
    for r in rows:
        assert r["exposed_ms"] == r["layer_ms"] - r["nocomm_ms"]
        assert r["layer_ms"] > 0 and r["comm_ms"] > 0
        assert (r["hidden"] is None) == (r["mode"] == "off")
        # the planner's prediction, or its refusal of the measured times (CPU timings of one call are noisy: the
        # experts' forward alone can exceed a third of the layer's compute, which compute_model refuses)
        case = f"planner, tiny T=64 EP=2 {r['dtype']} {r['mode']}: "
        if "pred_ms" in r:
            assert r["pred_ms"] > 0 and r["pred_err"] == r["layer_ms"] / r["pred_ms"] - 1
            assert any(line.startswith(case + "measured") for line in meta["targets"])
        else:
            assert any(line == case + "no prediction: " + r["pred_note"] for line in meta["targets"])
    # FP8 dispatch sends H + 4 bytes a dispatched row instead of 4 H (fp32 on CPU); the other exchanges as they were
    bf16, fp8 = rows[0], rows[2]
    assert fp8["comm_mb"] < bf16["comm_mb"]
    assert any(line.startswith("FP8 dispatch, tiny T=64 EP=2") for line in meta["targets"])
    assert "exposed_ms = layer_ms - nocomm_ms" in (tmp_path / "bench_ep_ep2.md").read_text()


def test_node_limited_routing_keeps_each_token_on_m_nodes():
    sys.path.insert(0, str(ROOT))
    from benchmarks.bench_rbd import route

    scores = torch.rand(500, 16, generator=torch.Generator().manual_seed(0))
    rank_of_expert, node_of_rank = [e // 4 for e in range(16)], [0, 0, 1, 1]  # 4 ranks, 2 nodes of 2
    assert torch.equal(route(scores, 4, 0, rank_of_expert, node_of_rank), scores.topk(4, dim=-1).indices)
    ids = route(scores, 4, 1, rank_of_expert, node_of_rank)
    nodes = (ids // 8).tolist()  # 8 experts a node
    assert all(len(set(n)) == 1 for n in nodes) and {n[0] for n in nodes} == {0, 1}
    # each token's experts: the top 4 of its scores on the node whose top ceil(4 / 1) scores sum highest
    for t in range(0, 500, 50):
        node = int(scores[t].view(2, 8).topk(4, dim=-1).values.sum(-1).argmax())
        assert sorted(ids[t].tolist()) == sorted(
            (scores[t, node * 8 : node * 8 + 8].topk(4).indices + 8 * node).tolist()
        )
