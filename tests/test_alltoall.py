"""AllToAllDispatcher and expert-parallel MoELayer on 2 and 4 gloo ranks vs single-process runs of the same weights.

Every rank builds the same global problem from one seed (all ranks' tokens, full weights), runs its own share
with expert parallelism, and checks its outputs and gradients against the single-process reference it computes
itself: outputs and input gradients of its own tokens, and the gradients of the experts it owns (which sum the
contributions of every rank's tokens). fp64 throughout, so the tolerance is tight.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

from xmoe.dispatch.alltoall import AllToAllDispatcher, regroup_indices
from xmoe.dispatch.local import LocalDispatcher
from xmoe.dispatch.routing import build_plan
from xmoe.kernels import reference as ops
from xmoe.kernels.choice import resolve_kernels

TOL = 1e-10
TORCH = resolve_kernels("torch")  # the dispatchers' and experts' kernels: the reference ops


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def test_regroup_indices_is_the_expert_major_permutation():
    counts_PE = torch.tensor([[2, 0, 1], [0, 0, 0], [1, 3, 2]])
    labels = [(p, e) for p in range(3) for e in range(3) for _ in range(int(counts_PE[p, e]))]  # received order
    src_of_dst, dst_of_src = regroup_indices(counts_PE, len(labels))
    regrouped = [labels[i] for i in src_of_dst.tolist()]
    assert regrouped == sorted(labels, key=lambda pe: (pe[1], pe[0]))  # expert-major, then source, stable
    assert torch.equal(src_of_dst[dst_of_src], torch.arange(len(labels)))
    empty = regroup_indices(torch.zeros(2, 2, dtype=torch.long), 0)
    assert empty[0].numel() == 0 and empty[1].numel() == 0


# ---- dispatcher alone: dispatch -> per-expert function -> combine, vs LocalDispatcher on the same tokens ----


def _routing_cases(num_ranks: int, num_experts: int, top_k: int, num_tokens: int, gen: torch.Generator):
    """(name, expert_ids (R, T, K), capacity) for every rank's tokens."""
    local = num_experts // num_ranks

    def topk_of(scores):
        return scores.topk(top_k, dim=-1).indices

    uniform = torch.rand(num_ranks, num_tokens, num_experts, generator=gen)
    skew = uniform.clone()
    skew[..., :2] += 0.8  # most slots land on experts 0 and 1 (rank 0)
    first_rank_only = uniform.clone()
    first_rank_only[..., :local] += 2.0  # every slot goes to rank 0's experts: the others receive nothing
    own_rank_only = uniform.clone()  # every rank keeps its rows: nothing crosses the network
    for r in range(num_ranks):
        own_rank_only[r, :, r * local : (r + 1) * local] += 2.0
    return [
        ("uniform", topk_of(uniform), None),
        ("skewed", topk_of(skew), None),
        ("all_to_rank0", topk_of(first_rank_only), None),
        ("own_rank", topk_of(own_rank_only), None),
        ("capacity_drop", topk_of(skew), 3),
    ]


def _dispatcher_body(rank: int, world_size: int):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1234)
    # (E, K, H, F, T): several experts per rank; k = 1; one expert per rank with k = E (every rank gets every token)
    for num_experts, top_k, hidden, ffn, num_tokens in [
        (8, 2, 6, 5, 11),
        (4 * world_size, 1, 3, 4, 7),
        (world_size, world_size, 4, 3, 5),
    ]:
        w1 = torch.randn(num_experts, hidden, ffn, dtype=torch.float64, generator=gen)
        w3 = torch.randn(num_experts, hidden, ffn, dtype=torch.float64, generator=gen)
        w2 = torch.randn(num_experts, ffn, hidden, dtype=torch.float64, generator=gen)
        local = num_experts // world_size
        mine = slice(rank * local, (rank + 1) * local)
        dispatcher = AllToAllDispatcher(dist.group.WORLD, num_experts, TORCH)
        for name, ids_RTK, capacity in _routing_cases(world_size, num_experts, top_k, num_tokens, gen):
            x_RTH = torch.randn(world_size, num_tokens, hidden, dtype=torch.float64, generator=gen)
            w_RTK = torch.rand(world_size, num_tokens, top_k, dtype=torch.float64, generator=gen)
            g_RTH = torch.randn(world_size, num_tokens, hidden, dtype=torch.float64, generator=gen)
            scores_RTK = torch.rand(world_size, num_tokens, top_k, generator=gen)

            # single-process reference: each rank's tokens through all experts, losses summed
            ref_w = [w.clone().requires_grad_(True) for w in (w1, w3, w2)]
            ref_out, ref_x, ref_gw = [], [], []
            for r in range(world_size):
                plan = build_plan(ids_RTK[r], scores_RTK[r], num_experts, capacity)
                x = x_RTH[r].clone().requires_grad_(True)
                wk = w_RTK[r].clone().requires_grad_(True)
                loc = LocalDispatcher(TORCH)
                rows, counts, ctx = loc.dispatch(x, plan)
                out = loc.combine(ops.grouped_swiglu(rows, *ref_w, counts), wk, plan, ctx)
                (out * g_RTH[r]).sum().backward()
                ref_out.append(out.detach())
                ref_x.append(x.grad)
                ref_gw.append(wk.grad)

            # expert parallel: this rank's tokens, this rank's experts
            ep_w = [w[mine].clone().requires_grad_(True) for w in (w1, w3, w2)]
            plan = build_plan(ids_RTK[rank], scores_RTK[rank], num_experts, capacity)
            x = x_RTH[rank].clone().requires_grad_(True)
            wk = w_RTK[rank].clone().requires_grad_(True)
            dispatcher.stats.reset()
            rows, counts, ctx = dispatcher.dispatch(x, plan)
            assert counts.shape == (local,) and int(counts.sum()) == rows.shape[0], name
            out = dispatcher.combine(ops.grouped_swiglu(rows, *ep_w, counts), wk, plan, ctx)
            (out * g_RTH[rank]).sum().backward()
            stats = dispatcher.stats.as_dict()

            where = f"{name} E={num_experts} k={top_k} rank={rank}"
            assert rel_err(out, ref_out[rank]) < TOL, where
            assert x.grad is not None, where
            assert rel_err(x.grad, ref_x[rank]) < TOL, where
            assert rel_err(wk.grad, ref_gw[rank]) < TOL, where
            for p, ref in zip(ep_w, ref_w, strict=False):
                if ref.grad[mine].abs().max() == 0:  # no rows for my experts: an exact zero, not an error
                    assert p.grad is None or p.grad.abs().max() == 0, where
                else:
                    assert rel_err(p.grad, ref.grad[mine]) < TOL, where

            # the received rows, exactly: expert-major, then source rank, then the source's plan order
            want_rows = []
            for e in range(rank * local, (rank + 1) * local):
                for r in range(world_size):
                    plan_r = build_plan(ids_RTK[r], scores_RTK[r], num_experts, capacity)
                    want_rows.append(x_RTH[r][plan_r.token_ids_N[plan_r.expert_ids_N == e]])
            assert torch.equal(rows.detach(), torch.cat(want_rows)), where
            # a round trip with identity experts is a pure permutation + the same k-ordered sum: bit-identical
            loc = LocalDispatcher(TORCH)
            local_rows, _, local_ctx = loc.dispatch(x_RTH[rank], plan)
            rows, counts, ctx = dispatcher.dispatch(x_RTH[rank], plan)
            assert torch.equal(
                dispatcher.combine(rows, w_RTK[rank], plan, ctx), loc.combine(local_rows, w_RTK[rank], plan, local_ctx)
            ), where

            # traffic counters of the first call: rows to / from other ranks; bytes of dispatch + combine
            kept = int(plan.tokens_per_expert_E[mine].sum())
            sent, received = int(plan.tokens_per_expert_E.sum()) - kept, sum(len(w) for w in want_rows) - kept
            assert (stats["calls"], stats["rows_kept"], stats["rows_sent"], stats["rows_received"]) == (
                1,
                kept,
                sent,
                received,
            ), where
            assert stats["bytes_sent"] == stats["bytes_received"] == (sent + received) * hidden * 8, where
            if name == "all_to_rank0" and rank > 0 and top_k <= local:
                assert rows.shape[0] == 0, where
            if name == "own_rank" and top_k <= local:
                assert dispatcher.stats.rows_sent == 0 and dispatcher.stats.rows_received == 0, where


@pytest.mark.parametrize("world_size", [2, 4])
def test_dispatcher_matches_local_dispatch(world_size):
    run_distributed(_dispatcher_body, world_size)


# ---- the MoELayer with expert parallelism (shard_experts: DTensor experts + AllToAllDispatcher) ----


def _layer_cases(num_experts: int, world_size: int):
    """(name, MoEConfig overrides, expert_bias or None). The bias only steers selection, so it forces routing."""
    local = num_experts // world_size
    to_rank0 = torch.zeros(num_experts)
    to_rank0[:local] = 10.0  # every token picks rank 0's experts: ranks > 0 receive nothing
    starve_rank0 = torch.zeros(num_experts)
    starve_rank0[:local] = -10.0  # nobody picks rank 0's experts: rank 0 computes nothing
    return [
        ("uniform", dict(), None),
        ("shared_aux_zloss", dict(num_shared_experts=2, aux_loss_coef=0.1, z_loss_coef=0.01), None),
        ("capacity_drops", dict(capacity_factor=0.5), None),
        ("top1_sigmoid", dict(top_k=1, score_func="sigmoid"), None),
        ("all_to_rank0", dict(), to_rank0),
        ("rank0_starved", dict(num_shared_experts=1), starve_rank0),
    ]


def _layer_body(rank: int, world_size: int, dispatcher: str = "pft"):
    import copy

    from xmoe.config import MoEConfig, ParallelConfig
    from xmoe.dispatch.comm import WaitTimer
    from xmoe.moe.layer import MoELayer
    from xmoe.parallel.dims import ParallelDims
    from xmoe.parallel.expert_parallel import shard_experts

    dims = ParallelDims.from_config(ParallelConfig(ep=world_size), world_size).build_mesh("cpu")
    num_experts, hidden = 2 * world_size, 8
    mine = slice(rank * 2, rank * 2 + 2)
    for name, overrides, bias in _layer_cases(num_experts, world_size):
        torch.manual_seed(0)
        kwargs = dict(
            hidden_size=hidden,
            ffn_hidden_size=6,
            num_experts=num_experts,
            top_k=2,
            kernel_backend="torch",
            dispatcher=dispatcher,
        )
        cfg = MoEConfig(**{**kwargs, **overrides})
        ref = MoELayer(cfg).double()
        with torch.no_grad():
            ref.router.weight.normal_(0, 0.5)  # decisive, tie-free routing
            if bias is not None:
                ref.router.expert_bias.copy_(bias)
        x_R = torch.randn(world_size, 2, 5, hidden, dtype=torch.float64)  # (B, S, H) per rank: 2 sequences
        g_R = torch.randn_like(x_R)

        # single process, same weights: rank r's tokens alone; expert gradients summed over all ranks' tokens
        ref_params = dict(ref.named_parameters())
        ref_out, ref_grads = [], []
        for r in range(world_size):
            x = x_R[r].clone().requires_grad_(True)
            out = ref(x)
            grads = torch.autograd.grad((out * g_R[r]).sum(), [x, *ref_params.values()], allow_unused=True)
            ref_out.append(out.detach())
            ref_grads.append(dict(zip(["x", *ref_params], grads, strict=False)))

        layer = shard_experts(copy.deepcopy(ref), dims)
        x = x_R[rank].clone().requires_grad_(True)
        WaitTimer.enabled, _ = True, WaitTimer.reset()
        events = WaitTimer.events = []
        out = layer(x)
        (out * g_R[rank]).sum().backward()
        kinds, waited = dict(WaitTimer.by_kind), WaitTimer.seconds
        WaitTimer.enabled, _, WaitTimer.events = False, WaitTimer.reset(), None
        # each posted exchange's time in flight, recorded when it is waited for: posted before that wait began
        flights, posted = [e for e in events if e[0] == "flight"], [e for e in events if e[0] == "posted"]
        assert len(flights) == len(posted), events
        assert all(f[1] <= f[2] and f[1] <= p[1] for f, p in zip(flights, posted, strict=True)), events
        # the time blocked in the exchanges, by kind: the counts and their host sync (none where the capacity fixes
        # the sizes), then the rows
        assert ("counts" in kinds) is (dispatcher != "padded") and {"posted", "blocking"} & set(kinds), kinds
        assert set(kinds) <= {"posted", "blocking", "counts"} and sum(kinds.values()) == pytest.approx(waited), kinds

        where = f"{name} rank={rank}"
        assert rel_err(out, ref_out[rank]) < LAYER_TOL, where
        assert rel_err(x.grad, ref_grads[rank]["x"]) < LAYER_TOL, where
        for pname, p in layer.named_parameters():
            if pname.startswith("experts."):
                # all ranks' tokens reach my experts; shard_experts scales expert gradients by 1 / ep so that data
                # parallelism can average them like dense ones (see xmoe/parallel/expert_parallel.py)
                want = sum(g[pname] for g in ref_grads if g[pname] is not None)[mine] / world_size
                got = p.grad.to_local()
            else:  # dense (router, shared experts): this rank's tokens only; data parallelism is not in play here
                want, got = ref_grads[rank][pname], p.grad
            if want is None or want.abs().max() == 0:
                assert got is None or got.abs().max() == 0, (where, pname)
            else:
                assert rel_err(got, want) < LAYER_TOL, (where, pname, rel_err(got, want))
        if dispatcher == "padded":  # the capacity buffers travel whole, padding included
            assert type(layer.dispatcher).__name__ == "PaddedAllToAllDispatcher", where
        elif (name == "all_to_rank0" and rank > 0) or (name == "rank0_starved" and rank == 0):
            assert layer.dispatcher.stats.rows_received == 0 and layer.dispatcher.stats.rows_kept == 0, where


# Routing and combine accumulate in fp32 on both sides; expert GEMMs see different row groupings: ~1e-7 at worst
LAYER_TOL = 1e-6


@pytest.mark.parametrize("world_size", [2, 4])
def test_moe_layer_expert_parallel_matches_single_process(world_size):
    run_distributed(_layer_body, world_size)


def test_padded_baseline_under_expert_parallelism_matches_single_process():
    # the GShard / DeepSpeed-MoE capacity buffers moved by an equal-split all-to-all (PaddedAllToAllDispatcher):
    # the same function as the one-rank padded layer, drops (capacity_factor 0.5) and starved ranks included
    run_distributed(_layer_body, 2, "padded")
