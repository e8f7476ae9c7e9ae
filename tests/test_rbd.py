"""RBD (xmoe/dispatch/hierarchical.py) vs flat all-to-all and the single-process reference, on virtual nodes.

Every rank builds the same global problem from one seed (all ranks' tokens and the full weights), runs its share
through the HierarchicalDispatcher, and checks outputs, all gradients, the rows its experts see and the traffic
counters against the flat AllToAllDispatcher, LocalDispatcher on one process, and xmoe.plan.comm.count_rows. One
gloo world of 4 ranks serves several node maps (2 x 2, 4 x 1, 1 x 4, and an uneven 3 + 1): the node map is a
dispatcher argument, so no new processes are needed for each. A world of 8 ranks covers 4 nodes x 2. These runs
give the dispatcher its node and side groups, as training does; the layer test below runs without them (every
exchange on the EP group).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

from xmoe.dispatch.alltoall import AllToAllDispatcher
from xmoe.dispatch.hierarchical import HierarchicalDispatcher
from xmoe.dispatch.local import LocalDispatcher
from xmoe.dispatch.rbd_units import source_units
from xmoe.dispatch.routing import build_plan
from xmoe.kernels import reference as ops
from xmoe.kernels.choice import resolve_kernels
from xmoe.plan.comm import count_rows

# fp64 data, but ops.combine_rows accumulates in fp32 on every path; RBD sums in another order: ~1e-8 observed
TOL = 1e-6
TORCH = resolve_kernels("torch")  # the dispatchers' and experts' kernels: the reference ops
ALL_CONFIGS = [(1, 3), (2, 3), (4, 6)]  # (experts per rank, top-k)
# (node map of the EP ranks, configs): 2 nodes x 2 ranks in full; one rank per node (stage 2 skipped), one node
# (no pilots) and an uneven 3 + 1 split more briefly
LAYOUTS_4 = [
    ([0, 0, 1, 1], ALL_CONFIGS),
    ([0, 1, 2, 3], [(2, 3)]),
    ([0, 0, 0, 0], [(2, 3)]),
    ([0, 0, 0, 1], [(1, 3), (2, 3)]),
]


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def kept_ids(plan, top_k: int) -> torch.Tensor:
    """(T, K) expert ids of the plan's kept slots, -1 where dropped (count_rows' convention)."""
    ids = torch.full((plan.num_tokens * top_k,), -1, dtype=torch.long)
    ids[plan.slot_ids_N] = plan.expert_ids_N
    return ids.view(plan.num_tokens, top_k)


# ---- step 1 alone (no processes): units, pilots and replicas against the traffic model's exact counter ----


def test_source_units_match_count_rows():
    gen = torch.Generator().manual_seed(0)
    for num_ranks, node_size, num_local, top_k in [
        (4, 2, 1, 3),
        (4, 2, 4, 6),
        (8, 2, 2, 5),
        (8, 4, 3, 8),
        (8, 1, 2, 4),
        (6, 3, 1, 1),
        (4, 4, 2, 4),
    ]:
        num_experts = num_ranks * num_local
        rank_to_node = torch.arange(num_ranks) // node_size
        node_of_expert = rank_to_node.repeat_interleave(num_local)
        ids = torch.rand(40, num_experts, generator=gen).topk(top_k, dim=-1).indices
        ids[torch.rand(ids.shape, generator=gen) < 0.2] = -1  # dropped slots
        for src in range(num_ranks):
            my_node = int(rank_to_node[src])
            u = source_units(ids, node_of_expert, num_ranks // node_size, num_local, my_node)
            want = count_rows(ids, torch.arange(num_experts) // num_local, rank_to_node, src)
            pilots = u.unit_head_TK & ~u.own_TK
            assert int(pilots.sum()) == want.rbd_inter
            assert int(u.replica_TK.sum()) == want.rbd_replicas
            assert int(u.node_head_TK.sum()) == want.token_nodes and int(u.valid_TK.sum()) == want.slots
            # the pilot rule: a pilot goes to the GPU of the token's lowest expert on that node
            for t, k in pilots.nonzero().tolist():
                node = int(node_of_expert[u.ids_TK[t, k]])
                lowest = min(int(e) for e in ids[t] if e >= 0 and int(node_of_expert[e]) == node)
                assert int(u.rank_TK[t, k]) == lowest // num_local
            # own node: one direct row per (token, GPU), the GPU itself included
            own_pairs = {
                (t, int(e) // num_local)
                for t in range(ids.shape[0])
                for e in ids[t]
                if e >= 0 and int(node_of_expert[e]) == my_node
            }
            assert int((u.unit_head_TK & u.own_TK).sum()) == len(own_pairs)
            if top_k == 1:
                assert int(pilots.sum()) == want.flat_inter


# ---- the dispatcher alone: dispatch -> per-expert function -> combine ----


def _routings(node_map: list[int], num_experts: int, top_k: int, num_tokens: int, gen: torch.Generator):
    """(name, expert ids (R, T, K), capacity) per case; node-aware cases derived from the node map."""
    world = len(node_map)
    local = num_experts // world
    node_of_expert = torch.tensor(node_map).repeat_interleave(local)
    uniform = torch.rand(world, num_tokens, num_experts, generator=gen)
    skew = uniform.clone()
    skew[..., :2] += 0.8
    on_node0 = uniform + 2.0 * (node_of_expert == 0)  # every slot on node 0: the other nodes receive nothing
    own_node = uniform.clone()  # no slot leaves its source's node: no pilots at all
    for r in range(world):
        own_node[r] += 2.0 * (node_of_expert == node_map[r])

    def topk(scores, k=top_k):
        return scores.topk(k, dim=-1).indices

    return [
        ("uniform", topk(uniform), None),
        ("skewed", topk(skew), None),
        ("on_node0", topk(on_node0), None),
        ("own_node", topk(own_node), None),
        ("capacity_drop", topk(skew), 2),
        ("top1", topk(uniform, 1), None),
    ]


def _identity_check(disp, flat, plan, top_k, x_int, w_int, g_int, rank, where):
    """Integer data, dyadic weights, identity experts: every sum is exact in fp32, so RBD must equal the local
    reference and flat all-to-all bit for bit, forward and backward; the rows each local expert sees must equal
    flat's (as sets: the order inside a group is free)."""
    loc = LocalDispatcher(TORCH)
    x_ref, w_ref = x_int.clone().requires_grad_(True), w_int.clone().requires_grad_(True)
    rows, _, ctx = loc.dispatch(x_ref, plan)
    out_ref = loc.combine(rows, w_ref, plan, ctx)
    (out_ref * g_int).sum().backward()
    x, w = x_int.clone().requires_grad_(True), w_int.clone().requires_grad_(True)
    rows, counts, ctx = disp.dispatch(x, plan)
    out = disp.combine(rows, w, plan, ctx)
    (out * g_int).sum().backward()
    assert torch.equal(out, out_ref) and torch.equal(x.grad, x_ref.grad) and torch.equal(w.grad, w_ref.grad), where
    again, _, ctx2 = disp.dispatch(x_int, plan)  # deterministic: a second call is bit-identical
    assert torch.equal(disp.combine(again, w_int, plan, ctx2), out.detach()), where
    x_flat, w_flat = x_int.clone().requires_grad_(True), w_int.clone().requires_grad_(True)
    flat_rows, flat_counts, flat_ctx = flat.dispatch(x_flat, plan)
    out_flat = flat.combine(flat_rows, w_flat, plan, flat_ctx)
    (out_flat * g_int).sum().backward()
    assert torch.equal(out, out_flat) and torch.equal(x.grad, x_flat.grad) and torch.equal(w.grad, w_flat.grad), where
    flat_rows = flat_rows.detach()
    assert torch.equal(counts, flat_counts), where
    for mine, theirs in zip(rows.detach().split(counts.tolist()), flat_rows.split(flat_counts.tolist()), strict=False):
        # column 0 holds the global token id: sort both groups by it (order inside a group is free)
        assert torch.equal(mine[mine[:, 0].argsort()], theirs[theirs[:, 0].argsort()]), where


def _check_counters(disp, plan, node_map, rank, top_k, where):
    num_local = disp.num_local_experts
    ids = kept_ids(plan, top_k)
    want = count_rows(ids, torch.arange(disp.num_experts) // num_local, torch.tensor(node_map), rank)
    s = disp.last_stats
    assert (s["calls"], s["slots"], s["token_nodes"]) == (1, want.slots, want.token_nodes), where
    assert (s["rows_inter"], s["replicas_caused"]) == (want.rbd_inter, want.rbd_replicas), where
    assert (s["flat_rows_intra"], s["flat_rows_inter"]) == (want.flat_intra, want.flat_inter), where
    assert s["redundancy_rate"] == pytest.approx(want.redundancy_rate), where
    rank_of = ids // num_local
    own_gpus = {
        (t, int(r))
        for t, row in enumerate(rank_of)
        for r, e in zip(row, ids[t], strict=False)
        if e >= 0 and node_map[int(r)] == node_map[rank]
    }
    assert s["rows_local"] + s["rows_intra_direct"] == len(own_gpus), where
    if num_local == 1:  # one expert per GPU: a direct row per slot, as flat sends it
        assert s["rows_intra_direct"] == want.flat_intra, where
    if top_k == 1:  # nothing to deduplicate: RBD sends what flat sends
        assert s["rows_inter"] == want.flat_inter and s["rows_replica"] == s["replicas_caused"] == 0, where
    # every replica caused by a source is forwarded by some pilot's GPU
    both = torch.tensor([s["rows_replica"], s["replicas_caused"]])
    dist.all_reduce(both)
    assert both[0] == both[1], where


def _extra_groups(node_map: list[int], rank: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(this rank's node group, a twin of the world) for a node map, made as ParallelDims.rbd_groups makes them:
    every rank calls new_group for every group, in one order."""
    node_group = None
    for node in sorted(set(node_map)):
        ranks = [r for r, n in enumerate(node_map) if n == node]
        group = dist.new_group(ranks)
        if rank in ranks:
            node_group = group
    assert node_group is not None
    return node_group, dist.new_group(list(range(len(node_map))))


def _dispatcher_body(rank: int, world_size: int, layouts: list[tuple[list[int], list[tuple[int, int]]]]):
    gen = torch.Generator().manual_seed(1234)
    hidden, ffn, num_tokens = 5, 4, 9
    with pytest.raises(ValueError, match="node_of_rank has 3 entries"):
        HierarchicalDispatcher(dist.group.WORLD, 4 * world_size, [0, 0, 1], TORCH)
    for node_map, configs in layouts:
        # the second stage on the node's own group and the ids / weights on a twin of the EP group, as trained
        node_group, side_group = _extra_groups(node_map, rank)
        if len(set(node_map)) > 1:  # a node group that is not this rank's node is refused
            with pytest.raises(ValueError, match="RBD's extra group holds global ranks"):
                HierarchicalDispatcher(dist.group.WORLD, world_size, node_map, TORCH, side_group, side_group)
        for num_local, top_k in configs:
            num_experts = num_local * world_size
            mine = slice(rank * num_local, (rank + 1) * num_local)
            w1, w3 = (torch.randn(num_experts, hidden, ffn, dtype=torch.float64, generator=gen) for _ in range(2))
            w2 = torch.randn(num_experts, ffn, hidden, dtype=torch.float64, generator=gen)
            disp = HierarchicalDispatcher(dist.group.WORLD, num_experts, node_map, TORCH, node_group, side_group)
            flat = AllToAllDispatcher(dist.group.WORLD, num_experts, TORCH)
            for name, ids_RTK, capacity in _routings(node_map, num_experts, top_k, num_tokens, gen):
                k = ids_RTK.shape[-1]
                where = f"{name} nodes={node_map} E_local={num_local} k={k} rank={rank}"
                x_RTH = torch.randn(world_size, num_tokens, hidden, dtype=torch.float64, generator=gen)
                w_RTK = torch.rand(world_size, num_tokens, k, dtype=torch.float64, generator=gen)
                g_RTH = torch.randn(world_size, num_tokens, hidden, dtype=torch.float64, generator=gen)
                scores = torch.rand(world_size, num_tokens, k, generator=gen)
                plans = [build_plan(ids_RTK[r], scores[r], num_experts, capacity) for r in range(world_size)]

                # single-process reference: every rank's tokens through all experts, losses summed
                ref_w = [w.clone().requires_grad_(True) for w in (w1, w3, w2)]
                for r in range(world_size):
                    x = x_RTH[r].clone().requires_grad_(r == rank)
                    wk = w_RTK[r].clone().requires_grad_(r == rank)
                    loc = LocalDispatcher(TORCH)
                    rows, counts, ctx = loc.dispatch(x, plans[r])
                    out = loc.combine(ops.grouped_swiglu(rows, *ref_w, counts), wk, plans[r], ctx)
                    (out * g_RTH[r]).sum().backward()
                    if r == rank:
                        ref_out, ref_x, ref_wk = out.detach(), x.grad, wk.grad

                ep_w = [w[mine].clone().requires_grad_(True) for w in (w1, w3, w2)]
                x = x_RTH[rank].clone().requires_grad_(True)
                wk = w_RTK[rank].clone().requires_grad_(True)
                rows, counts, ctx = disp.dispatch(x, plans[rank])
                assert counts.shape == (num_local,) and int(counts.sum()) == rows.shape[0], where
                out = disp.combine(ops.grouped_swiglu(rows, *ep_w, counts), wk, plans[rank], ctx)
                (out * g_RTH[rank]).sum().backward()
                assert rel_err(out, ref_out) < TOL and rel_err(x.grad, ref_x) < TOL, where
                assert rel_err(wk.grad, ref_wk) < TOL, where
                for p, ref in zip(ep_w, ref_w, strict=False):
                    if ref.grad[mine].abs().max() == 0:  # no rows for my experts: exact zeros
                        assert p.grad is None or p.grad.abs().max() == 0, where
                    else:
                        assert rel_err(p.grad, ref.grad[mine]) < TOL, where
                _check_counters(disp, plans[rank], node_map, rank, k, where)
                if name == "on_node0" and node_map[rank] != 0 and k <= num_local:
                    assert rows.shape[0] == 0, where  # a node that receives nothing
                if name == "own_node" and k <= num_local * node_map.count(node_map[rank]):
                    assert disp.last_stats["rows_inter"] == 0, where

                token_ids = torch.arange(num_tokens, dtype=torch.float64) + rank * num_tokens
                x_int = torch.randint(-3, 4, (num_tokens, hidden), generator=gen).double()
                x_int[:, 0] = token_ids
                w_int = torch.randint(1, 5, (num_tokens, k), generator=gen).double() / 4
                g_int = torch.randint(-3, 4, (num_tokens, hidden), generator=gen).double()
                _identity_check(disp, flat, plans[rank], k, x_int, w_int, g_int, rank, where)


def test_dispatcher_matches_flat_and_local():
    run_distributed(_dispatcher_body, 4, LAYOUTS_4)


def test_dispatcher_four_nodes_of_two():
    run_distributed(_dispatcher_body, 8, [([0, 0, 1, 1, 2, 2, 3, 3], [(1, 3), (2, 4)])], timeout_s=120.0)


# ---- the MoE layer: router, shared experts, aux losses through the RBD dispatcher ----


def _layer_body(rank: int, world_size: int):
    from xmoe.config import MoEConfig, ParallelConfig
    from xmoe.moe.experts import RoutedExperts
    from xmoe.moe.layer import MoELayer
    from xmoe.parallel.dims import ParallelDims
    from xmoe.parallel.expert_parallel import shard_experts

    # the hook: shard_experts installs RBD for dispatcher="rbd", nodes from gpus_per_node
    dims = ParallelDims.from_config(ParallelConfig(ep=world_size, gpus_per_node=2), world_size).build_mesh("cpu")
    hooked = shard_experts(MoELayer(MoEConfig(8, 4, 2 * world_size, 2, dispatcher="rbd")), dims)
    assert isinstance(hooked.dispatcher, HierarchicalDispatcher) and hooked.dispatcher.node_of_rank == [0, 0, 1, 1]

    for num_local in (1, 2, 4):
        num_experts, hidden = num_local * world_size, 8
        mine = slice(rank * num_local, (rank + 1) * num_local)
        node0 = torch.zeros(num_experts)
        node0[: 2 * num_local] = 10.0  # every token picks node 0's experts: node 1 computes nothing
        for name, overrides, bias in [
            ("shared_aux_zloss", dict(num_shared_experts=2, aux_loss_coef=0.1, z_loss_coef=0.01), None),
            ("capacity_drops", dict(capacity_factor=0.5), None),
            ("top1_sigmoid", dict(top_k=1, score_func="sigmoid"), None),
            ("to_node0", dict(num_shared_experts=1), node0),
            ("node0_starved", dict(), -node0),
        ]:
            where = f"{name} E_local={num_local} rank={rank}"
            torch.manual_seed(0)
            kwargs = dict(
                hidden_size=hidden,
                ffn_hidden_size=6,
                num_experts=num_experts,
                top_k=min(3, num_experts),
                kernel_backend="torch",
            )
            ref = MoELayer(MoEConfig(**{**kwargs, **overrides})).double()
            with torch.no_grad():
                ref.router.weight.normal_(0, 0.5)  # decisive, tie-free routing
                if bias is not None:
                    ref.router.expert_bias.copy_(bias)
            x_R = torch.randn(world_size, 2, 5, hidden, dtype=torch.float64)
            g_R = torch.randn_like(x_R)
            names = [n for n, _ in ref.named_parameters()]
            ref_out, ref_grads = [], []
            for r in range(world_size):
                x = x_R[r].clone().requires_grad_(True)
                out = ref(x)
                grads = torch.autograd.grad((out * g_R[r]).sum(), [x, *ref.parameters()], allow_unused=True)
                ref_out.append(out.detach())
                ref_grads.append(dict(zip(["x", *names], grads, strict=False)))

            # expert parallel by hand (plain local slices: this test does not depend on the DTensor path), with RBD
            # and with flat all-to-all: both against the reference, and RBD against flat
            got = {}
            for kind in ("rbd", "flat"):
                layer = copy.deepcopy(ref)
                experts = RoutedExperts(num_local, hidden, 6, kernels=TORCH).double()
                with torch.no_grad():
                    for w in ("w1", "w3", "w2"):
                        getattr(experts, w).copy_(getattr(ref.experts, w)[mine])
                layer.experts = experts
                layer.dispatcher = (
                    HierarchicalDispatcher(dist.group.WORLD, num_experts, [0, 0, 1, 1], TORCH)
                    if kind == "rbd"
                    else AllToAllDispatcher(dist.group.WORLD, num_experts, TORCH)
                )
                x = x_R[rank].clone().requires_grad_(True)
                out = layer(x)
                (out * g_R[rank]).sum().backward()
                got[kind] = {"out": out.detach(), "x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}
                if kind == "rbd" and ((name == "to_node0" and rank >= 2) or (name == "node0_starved" and rank < 2)):
                    assert layer.dispatcher.last_stats["rows_replica"] == 0, where  # its node received nothing
            for pname in got["rbd"]:
                if pname == "out":
                    want = ref_out[rank]
                elif pname.startswith("experts."):  # every rank's tokens reach my experts
                    want = sum(g[pname] for g in ref_grads if g[pname] is not None)[mine]
                else:  # x, router, shared experts: this rank's tokens only
                    want = ref_grads[rank][pname]
                for value in (got["rbd"][pname], got["flat"][pname]):
                    if want is None or want.abs().max() == 0:
                        assert value is None or value.abs().max() == 0, (where, pname)
                    else:
                        assert rel_err(value, want) < TOL, (where, pname, rel_err(value, want))
                if want is not None and want.abs().max() > 0:
                    assert rel_err(got["rbd"][pname], got["flat"][pname]) < TOL, (where, pname)


def test_moe_layer_rbd_matches_single_process():
    run_distributed(_layer_body, 4, local_world_size=2)


# ---- `xmoe train --dispatcher rbd` tracks the flat run (4 ranks, 2 virtual nodes) ----
# The CLI runs inside run_distributed's gloo world (the environment torchrun would give it) rather than under two
# torchrun launches: the same `xmoe train` code path, ~25 s cheaper on 2 cores (4 fresh torch imports per launch).

SMALL = [
    "--set",
    "model.hidden_size=32",
    "--set",
    "moe.hidden_size=32",
    "--set",
    "model.num_layers=1",
    "--set",
    "model.first_k_dense=0",  # the one layer must be an MoE block
    "--set",
    "moe.ffn_hidden_size=16",
    "--set",
    "moe.num_experts=8",
    "--batch-size",
    "8",
    "--seq-len",
    "32",
    "--steps",
    "10",
    "--set",
    "train.warmup_steps=2",
    "--log-every",
    "1",
    "--ckpt-every",
    "100",
]


def _train_body(rank: int, world_size: int, out: str):
    from xmoe.cli import main

    for dispatcher in ("pft", "rbd"):
        main(
            [
                "train",
                "--out",
                f"{out}/{dispatcher}",
                "--device",
                "cpu",
                "--ep",
                str(world_size),
                "--gpus-per-node",
                "2",
                "--dispatcher",
                dispatcher,
                *SMALL,
            ]
        )


def test_train_rbd_tracks_flat(tmp_path):
    import json

    run_distributed(_train_body, 4, str(tmp_path), local_world_size=2, timeout_s=120.0)

    def records(run: str) -> list[dict]:
        return [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

    flat, rbd = records("pft"), records("rbd")
    a, b = [r["loss"] for r in flat], [r["loss"] for r in rbd]
    assert len(a) == len(b) == 10 and a[-1] < a[0] - 0.1, a  # the flat run learns
    # same routing and math; only the order of the combine's fp32 sums differs
    assert np.allclose(a, b, rtol=1e-4, atol=0), (a, b)
    # the trainer logs RBD's counters: fewer inter-node rows than flat would send, R in [0, 1)
    for r in rbd:
        assert 0 <= r["rbd_redundancy"] < 1 and r["rbd_inter_rows"] <= r["flat_inter_rows"], r
    assert any(r["rbd_inter_rows"] < r["flat_inter_rows"] for r in rbd)
    assert all(r["comm_mb_per_step"] > 0 for r in flat)
