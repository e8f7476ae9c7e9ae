"""Node-limited routing (moe.max_nodes_per_token, xmoe/moe/node_limit.py): the router's rule against a plain loop,
its refusals, its composition with group-limited routing; on 4 gloo ranks as 2 nodes x 2 and 4 nodes x 1 with
EP = 4, flat and RBD: no token's experts on more than M nodes, the counters that reach metrics.jsonl (the most
nodes of one token, inter-node rows) against counts from the routing, RBD's pilots, and the layer against one
process routing with the same node map; `xmoe train --max-nodes-per-token` logging them.

# T tokens, H hidden, E experts, K top-k, M max nodes per token
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from dist_utils import run_distributed

from xmoe.config import MoEConfig
from xmoe.dispatch.base import add_counters
from xmoe.dispatch.routing import TokenNodes, build_plan
from xmoe.moe.node_limit import node_limit
from xmoe.moe.router import Router
from xmoe.train.report import comm_metrics

# ------------------------------------------------------------------------------------ the rule, one process


def _loop_rule(choice, node_of, top_k, max_nodes, groups=1, topk_groups=1, sigmoid=False):
    """One token, plain Python: node score = sum of its ceil(K/M) best choice values, the M best nodes eligible;
    then (groups > 1) the topk_groups best eligible groups (score: max of the group, or its top-2 sum for sigmoid);
    then the K best experts left. Returns (eligible nodes, chosen experts), both as sets."""
    num_experts = len(choice)
    per_node = math.ceil(top_k / max_nodes)
    node_score = {}
    for n in sorted(set(node_of)):
        mine = sorted((choice[e] for e in range(num_experts) if node_of[e] == n), reverse=True)
        node_score[n] = sum(mine[:per_node])
    eligible = set(sorted(node_score, key=lambda n: -node_score[n])[:max_nodes])
    allowed = [e for e in range(num_experts) if node_of[e] in eligible]
    if groups > 1:
        size = num_experts // groups
        group_score = {}
        for g in range(groups):
            members = sorted((choice[e] for e in range(g * size, (g + 1) * size)), reverse=True)
            if node_of[g * size] in eligible:
                group_score[g] = sum(members[:2]) if sigmoid and size >= 2 else members[0]
        best = set(sorted(group_score, key=lambda g: -group_score[g])[:topk_groups])
        allowed = [e for e in allowed if e // size in best]
    return eligible, set(sorted(allowed, key=lambda e: -choice[e])[:top_k])


def _router(num_experts, top_k, max_nodes, nodes, backend="torch", **kw):
    cfg = MoEConfig(
        hidden_size=8,
        ffn_hidden_size=4,
        num_experts=num_experts,
        top_k=top_k,
        max_nodes_per_token=max_nodes,
        kernel_backend=backend,
        **kw,
    )
    torch.manual_seed(num_experts * 31 + top_k * 7 + max_nodes)
    router = Router(cfg)
    router.expert_bias.normal_(std=0.05)
    node_of = [e * nodes // num_experts for e in range(num_experts)]
    router.node_limit = node_limit(cfg, node_of)
    return router, node_of


def _reference_scores(router, x_TH):
    logits = x_TH.double() @ router.weight.detach().double().T
    scores = torch.sigmoid(logits) if router.cfg.score_func == "sigmoid" else torch.softmax(logits, -1)
    return scores, scores + router.expert_bias.double()


# (E, nodes, K, M, extra config): K < M, K = M, K = M * e_n (every eligible expert chosen), K not a multiple of M,
# M = 1, one expert per node, sigmoid scores with normalised and scaled weights
RULE_CASES = [
    (16, 4, 4, 2, {}),
    (16, 4, 1, 3, {}),
    (16, 4, 3, 3, {}),
    (16, 4, 8, 2, {}),
    (16, 4, 3, 2, {"score_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5}),
    (12, 3, 4, 1, {}),
    (8, 8, 3, 5, {"norm_topk_prob": True}),
    (32, 8, 8, 4, {"score_func": "sigmoid", "norm_topk_prob": True}),
]


@pytest.mark.parametrize("num_experts,nodes,top_k,max_nodes,extra", RULE_CASES)
def test_router_matches_the_plain_loop(num_experts, nodes, top_k, max_nodes, extra):
    router, node_of = _router(num_experts, top_k, max_nodes, nodes, **extra)
    x_TH = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    assert set(router.state_dict()) == {"weight", "expert_bias"}  # the layout is not state: no checkpoint holds it
    out = router(x_TH)
    scores, choice = _reference_scores(router, x_TH)
    restricted = router.node_limit.restrict(choice.float())
    unlimited = choice.topk(top_k, dim=-1).indices
    for t in range(x_TH.shape[0]):
        eligible, chosen = _loop_rule(choice[t].tolist(), node_of, top_k, max_nodes)
        assert {node_of[e] for e in torch.isfinite(restricted[t]).nonzero().view(-1).tolist()} == eligible, t
        ids = out.expert_ids_TK[t].tolist()
        assert set(ids) == chosen, (t, ids, chosen)
        assert len({node_of[e] for e in ids}) <= max_nodes
        # the weights are the chosen experts' scores, as without the limit
        want = scores[t, ids]
        if router.cfg.norm_topk_prob:
            want = want / want.sum()
        want = want * router.cfg.routed_scaling_factor
        assert torch.allclose(out.weights_TK[t].double(), want, rtol=1e-6, atol=0)
    spans = [len({node_of[e] for e in unlimited[t].tolist()}) for t in range(64)]
    if top_k > max_nodes:  # the limit binds somewhere (else this would test nothing)
        assert max(spans) > max_nodes
    else:  # K <= M: the nodes of a token's K best experts are among its M best nodes, so nothing changes
        assert all(set(out.expert_ids_TK[t].tolist()) == set(unlimited[t].tolist()) for t in range(64))


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_groups_inside_nodes_choose_among_the_eligible_nodes(score_func):
    # 32 experts on 4 nodes of 8, in 8 groups of 4 (two per node): M = 2 nodes, then the 3 best of their 4 groups
    router, node_of = _router(32, 6, 2, 4, num_expert_groups=8, topk_groups=3, score_func=score_func)
    x_TH = torch.randn(64, 8, generator=torch.Generator().manual_seed(2))
    ids = router(x_TH).expert_ids_TK
    _, choice = _reference_scores(router, x_TH)
    for t in range(64):
        _, chosen = _loop_rule(choice[t].tolist(), node_of, 6, 2, 8, 3, sigmoid=score_func == "sigmoid")
        assert set(ids[t].tolist()) == chosen, t
        assert len({e // 4 for e in ids[t].tolist()}) <= 3 and len({node_of[e] for e in ids[t].tolist()}) <= 2


def test_layouts_the_rule_cannot_align_are_refused():
    def cfg(**kw):
        base = dict(hidden_size=8, ffn_hidden_size=4, num_experts=16, top_k=4, max_nodes_per_token=2)
        return MoEConfig(**{**base, **kw})

    with pytest.raises(ValueError, match="unevenly"):  # a node holding more of the group's ranks than another
        node_limit(cfg(), [0] * 4 + [1] * 4 + [2] * 8)
    with pytest.raises(ValueError, match=r"top_k \(9\) > max_nodes_per_token \(2\) x experts per node \(4\)"):
        node_limit(cfg(top_k=9), [e // 4 for e in range(16)])
    with pytest.raises(ValueError, match="straddle"):  # 2 groups of 8 over 4 nodes of 4
        node_limit(cfg(num_expert_groups=2, topk_groups=1), [e // 4 for e in range(16)])
    with pytest.raises(ValueError, match="max_nodes_per_token"):
        cfg(max_nodes_per_token=-1)
    assert node_limit(cfg(max_nodes_per_token=0), [e // 4 for e in range(16)]) is None
    for nodes, max_nodes in ((1, 2), (2, 2), (2, 3)):  # one node, or M at least the nodes: nothing to limit
        with pytest.warns(UserWarning, match="does nothing here"):
            assert node_limit(cfg(max_nodes_per_token=max_nodes), [e * nodes // 16 for e in range(16)]) is None


def test_the_triton_router_kernel_is_not_used_under_a_node_limit(monkeypatch):
    from xmoe.kernels import triton_ops

    def refuse(*args, **kwargs):
        raise AssertionError("router_topk has no node limit")

    monkeypatch.setattr(triton_ops, "router_topk", refuse)
    x_TH = torch.randn(9, 8, generator=torch.Generator().manual_seed(3))
    fused, _ = _router(16, 4, 2, 4, backend="triton")
    plain, _ = _router(16, 4, 2, 4, backend="torch")
    assert torch.equal(fused(x_TH).expert_ids_TK, plain(x_TH).expert_ids_TK)
    fused.node_limit = None
    with pytest.raises(AssertionError, match="no node limit"):  # the patch is the kernel the router calls
        fused(x_TH)


def test_ep_groups_that_lie_differently_over_nodes_are_refused():
    from xmoe.parallel.dims import ParallelDims
    from xmoe.parallel.expert_parallel import ep_group_nodes

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ParallelDims warns about the straddling group itself
        odd = ParallelDims(dp=3, ep=2, tp=1, world_size=6, node_size=3, placement="ep_first")
    with pytest.raises(ValueError, match="lie differently over the nodes"):  # groups on nodes (0,0), (0,1), (1,1)
        ep_group_nodes(odd)
    strided = ParallelDims(dp=2, ep=4, tp=1, world_size=8, node_size=2, placement="dp_first")
    assert ep_group_nodes(strided) == [0, 1, 2, 3]  # EP peers 2 ranks apart: one per node
    with_tp = ParallelDims(dp=1, ep=4, tp=2, world_size=8, node_size=4, placement="ep_first")
    assert ep_group_nodes(with_tp) == [0, 0, 1, 1]  # ranks (0, 2, 4, 6) of 2 nodes of 4


# ------------------------------------------------------------------------------------ counters


def test_token_nodes_and_counters_against_loops():
    gen = torch.Generator().manual_seed(4)
    ids_TK = torch.randint(0, 12, (40, 3), generator=gen)
    scores_TK = torch.rand(40, 3, generator=gen)
    node_of_rank = [5, 5, 9, 7]  # any labels; 3 experts per rank
    node_of_expert = [node_of_rank[e // 3] for e in range(12)]
    for capacity in (None, 8):
        plan = build_plan(ids_TK, scores_TK, 12, capacity)
        kept = (plan.row_of_slot_TK >= 0).tolist()
        want = max(
            len({node_of_expert[e] for e, k in zip(row, keep, strict=True) if k})
            for row, keep in zip(ids_TK.tolist(), kept, strict=True)
        )
        (most,) = TokenNodes(node_of_rank, 3).most_of([plan])
        assert most.tolist() == [want]
    empty = build_plan(ids_TK[:0], scores_TK[:0], 12)
    assert TokenNodes(node_of_rank, 3).most_of([empty])[0].tolist() == [0]
    assert TokenNodes([0, 0, 0, 0], 3).most_of([empty]) == []  # one node: known on the host
    assert TokenNodes(node_of_rank, 3).inter_rows([4, 1, 6, 2], 1) == 8  # rank 1 on node 5: ranks 2, 3 elsewhere
    totals = {"rows_inter": 5, "max_token_nodes": 2}
    add_counters(totals, {"rows_inter": 7, "max_token_nodes": 1, "calls": 1})
    assert totals == {"rows_inter": 12, "max_token_nodes": 2, "calls": 1}
    metrics = comm_metrics({"bytes_sent": 2**21, **totals}, 2)
    assert metrics == {"comm_mb_per_step": 1.0, "inter_node_rows": 6.0, "max_token_nodes": 2}


# ------------------------------------------------------------------------------------ 4 gloo ranks

H, F, E, K = 12, 6, 16, 4
WORLD = 4
TOKENS = [10, 7, 0, 9]  # rank 2 routes nothing


def _layer(dispatcher: str, max_nodes: int):
    from xmoe.moe.layer import MoELayer

    cfg = MoEConfig(
        hidden_size=H,
        ffn_hidden_size=F,
        num_experts=E,
        top_k=K,
        num_shared_experts=1,
        aux_loss_coef=0.01,
        kernel_backend="torch",
        dispatcher=dispatcher,
        max_nodes_per_token=max_nodes,
    )
    torch.manual_seed(0)
    layer = MoELayer(cfg).double()
    layer.router.expert_bias.normal_(std=0.02)
    return layer


def _inputs(rank: int, call: int = 0):
    gen = torch.Generator().manual_seed(100 + 10 * call + rank)
    return torch.randn(TOKENS[rank], H, generator=gen, dtype=torch.float64), torch.randn(
        TOKENS[rank], H, generator=gen, dtype=torch.float64
    )


def _reference(max_nodes: int, node_of_expert: list[int]):
    """One process, all experts, its router given the same node map: each rank's tokens through the layer; expert
    gradients summed over ranks (their owner receives every rank's rows) and divided by ep, the rest per rank."""
    layer = _layer("pft", max_nodes)
    layer.router.node_limit = node_limit(layer.cfg, node_of_expert)
    per_rank = []
    for r in range(WORLD):
        x, g = _inputs(r)
        x.requires_grad_(True)
        layer.zero_grad()
        out = layer(x)
        (out * g).sum().backward()
        per_rank.append((out.detach(), x.grad.clone(), {n: p.grad.clone() for n, p in layer.named_parameters()}))
    experts = {n: sum(pr[2][n] for pr in per_rank) / WORLD for n in ("experts.w1", "experts.w3", "experts.w2")}
    return per_rank, experts


def _expected_counters(ids_list: list[torch.Tensor], node_of_expert: list[int], my_node: int, rbd: bool):
    """(inter-node rows sent, the most nodes of one token) of this rank's calls, from the routing alone."""
    inter, most = 0, 0
    for ids_TK in ids_list:
        for row in ids_TK.tolist():
            nodes = [node_of_expert[e] for e in row]
            most = max(most, len(set(nodes)))
            remote = [n for n in nodes if n != my_node]
            inter += len(set(remote)) if rbd else len(remote)  # RBD: one pilot per remote node; flat: per slot
    return inter, most


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item() if b.numel() else float((a - b).abs().sum())


def _check_layout(rank: int, node_size: int, dispatcher: str, max_nodes: int, mode: str):
    from xmoe.config import ParallelConfig
    from xmoe.moe.step import MoEStep
    from xmoe.parallel.dims import ParallelDims
    from xmoe.parallel.expert_parallel import shard_experts

    dims = ParallelDims.from_config(ParallelConfig(ep=WORLD, gpus_per_node=node_size), WORLD, num_experts=E)
    dims.build_mesh("cpu")
    node_of_expert = [e // (E // WORLD) // node_size for e in range(E)]  # rank e // 4, node rank // node_size
    my_node = rank // node_size
    where = (node_size, dispatcher, max_nodes, mode)
    layer = _layer(dispatcher, max_nodes)
    shard_experts(torch.nn.Sequential(layer), dims, mode, 2)
    assert layer.router.node_limit is not None and layer.router.node_limit.node_of_expert == node_of_expert

    # the layer against one process routing with the same node map: outputs and every gradient
    per_rank, experts = _reference(max_nodes, node_of_expert)
    ref_out, ref_dx, ref_grads = per_rank[rank]
    tol = 1e-12 if dispatcher == "pft" else 1e-6  # RBD sums a row's partials across GPUs in fp32 (rbd.md)
    x, g = _inputs(rank)
    x.requires_grad_(True)
    out = layer(x)
    (out * g).sum().backward()
    assert _rel(out, ref_out) < tol and _rel(x.grad, ref_dx) < tol, where
    for name, p in layer.named_parameters():
        got = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        assert _rel(got, experts.get(name, ref_grads[name])) < tol, (where, name)

    # two micro-batches of an optimizer step: what MoEStep.finish() hands the trainer's metrics
    layer.dispatcher.stats.reset()
    ids_list = []
    with MoEStep(torch.nn.Sequential(layer), 2, torch.device("cpu")) as step, torch.no_grad():
        for call in range(2):
            x, _ = _inputs(rank, call)
            ids_list.append(layer.router(x).expert_ids_TK)
            layer(x)
            step.end_micro_batch()
    traffic = step.finish(update_bias=False).traffic
    for ids_TK in ids_list:  # the limit: no token's experts on more than M nodes
        assert all(len({node_of_expert[e] for e in row}) <= max_nodes for row in ids_TK.tolist()), where
    inter, most = _expected_counters(ids_list, node_of_expert, my_node, dispatcher == "rbd")
    metrics = comm_metrics(traffic, 1)
    assert (metrics["inter_node_rows"], metrics["max_token_nodes"]) == (inter, most), (where, metrics, inter, most)
    assert most <= max_nodes and (most > 0) == (TOKENS[rank] > 0)
    if dispatcher == "rbd":  # at most M pilots per token, one per remote node it is sent to
        assert inter <= max_nodes * sum(len(ids) for ids in ids_list)


def _layouts(rank: int, world: int, cases):
    for case in cases:
        _check_layout(rank, *case)


# (node size, dispatcher, M, overlap): 2 nodes x 2 ranks and 4 nodes x 1, flat (in one piece and in chunks) and RBD
CASES_2x2 = [(2, "pft", 1, "off"), (2, "pft", 1, "chunks"), (2, "rbd", 1, "off")]
CASES_4x1 = [(1, "pft", 2, "chunks"), (1, "rbd", 2, "off"), (1, "rbd", 3, "shared")]


def test_ep4_node_limit_on_two_and_four_nodes():
    run_distributed(_layouts, WORLD, CASES_2x2 + CASES_4x1, timeout_s=120)


# ------------------------------------------------------------------------------------ xmoe train


def _train(rank: int, world: int, out: str):
    from xmoe.cli import main

    args = ["train", "--out", out, "--device", "cpu", "--preset", "tiny", "--ep", str(world), "--gpus-per-node", "1"]
    args += ["--max-nodes-per-token", "1", "--batch-size", "4", "--seq-len", "16", "--steps", "2", "--log-every", "1"]
    main(args + ["--ckpt-every", "100", "--set", "train.warmup_steps=1", "--set", "model.num_layers=2"])


def test_train_logs_the_most_nodes_per_token_and_inter_node_rows(tmp_path):
    run_distributed(_train, 2, str(tmp_path / "run"), local_world_size=1, timeout_s=120)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for r in records:  # 2 nodes of one rank each, every token's experts on one of them: some on the other node
        assert r["max_token_nodes"] == 1 and r["inter_node_rows"] > 0, r
