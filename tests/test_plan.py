"""The planning models: exact row counts, closed form vs Monte Carlo, memory arithmetic, the `xmoe plan` CLI."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
import torch

from xmoe.cli import main
from xmoe.config import RECOMPUTE_MODES, ParallelConfig
from xmoe.model.counting import count_params
from xmoe.model.presets import get_preset, tiny
from xmoe.model.transformer import Block, rope_tables
from xmoe.plan import comm, layouts, memory, terms

# ------------------------------------------------------------------------------------------- count_rows

# 4 GPUs on 2 nodes (ranks 0, 1 on node 0; 2, 3 on node 1), 8 experts, two per GPU
E2R = np.repeat(np.arange(4), 2)
R2N = np.array([0, 0, 1, 1])


def test_count_rows_hand_made() -> None:
    ids_TK = np.array(
        [
            [0, 1, 2],  # all on GPU 0 and GPU 1: local 2, intra 1
            [4, 5, 6],  # GPU 2 twice, GPU 3 once: inter 3; one pilot, one replica (GPU 2 expands its 2 locally)
            [2, 4, 7],  # GPU 1, GPU 2, GPU 3: intra 1, inter 2; one pilot, one replica
            [6, -1, 0],  # a dropped slot; GPU 3 (inter 1, pilot 1), GPU 0 (local 1)
        ]
    )
    rows = comm.count_rows(ids_TK, E2R, R2N, src_rank=0)
    assert (rows.tokens, rows.slots) == (4, 11)
    assert (rows.flat_local, rows.flat_intra, rows.flat_inter) == (3, 2, 6)
    assert (rows.rbd_inter, rows.rbd_replicas) == (3, 2)
    assert rows.token_nodes == 1 + 1 + 2 + 2
    assert rows.redundancy_rate == pytest.approx(1 - 6 / 11)
    # seen from GPU 3 (node 1): token 0 sends 3 slots to GPUs 0, 0, 1 (one pilot, one replica), token 1 two
    # intra rows to GPU 2, token 2 one row each way, token 3 one inter row; local: 6, 7, 6
    rows3 = comm.count_rows(torch.as_tensor(ids_TK), E2R, R2N, src_rank=3)
    assert (rows3.flat_local, rows3.flat_intra, rows3.flat_inter) == (3, 3, 5)
    assert (rows3.rbd_inter, rows3.rbd_replicas) == (3, 1)


def test_count_rows_degenerate_cases() -> None:
    rng = np.random.default_rng(0)
    ids_TK = np.stack([rng.choice(8, 3, replace=False) for _ in range(50)])
    # every expert on node 1, source on node 0: one pilot per token, i.e. the distinct (token, node) pairs
    rows = comm.count_rows(ids_TK, np.full(8, 2), R2N, src_rank=0)
    assert rows.rbd_inter == rows.token_nodes == 50
    assert rows.flat_inter == 150 and rows.rbd_replicas == 0
    # k = 1: nothing to bypass, RBD sends exactly what flat sends
    rows = comm.count_rows(ids_TK[:, :1], E2R, R2N, src_rank=1)
    assert rows.rbd_inter == rows.flat_inter and rows.rbd_replicas == 0 and rows.redundancy_rate == 0
    # one node: RBD is flat, and its predicted time too
    one_node = comm.count_rows(ids_TK, E2R, np.zeros(4, dtype=int), src_rank=0)
    assert one_node.flat_inter == one_node.rbd_inter == one_node.rbd_replicas == 0


def test_closed_form_is_the_exact_mean_over_all_routings() -> None:
    # Uniform routing = every K-subset equally likely: averaging count_rows over all of them is the expectation.
    E, K = 8, 3
    subsets = np.array(list(itertools.combinations(range(E), K)))
    for src in range(4):
        exact = comm.count_rows(subsets, E2R, R2N, src).scaled(1 / len(subsets))
        closed = comm.expected_rows_uniform(E, K, E2R, R2N, src, num_tokens=1)
        for f in dataclasses.fields(comm.RowCounts):
            assert getattr(closed, f.name) == pytest.approx(getattr(exact, f.name), rel=1e-12), f.name


def test_hit_probability_is_hypergeometric() -> None:
    assert comm.hit_probability(64, 6, 0) == 0
    assert comm.hit_probability(64, 6, 59) == 1  # 5 experts outside the set cannot hold 6 picks
    assert comm.hit_probability(64, 1, 8) == pytest.approx(8 / 64)
    assert comm.hit_probability(64, 6, 8) == pytest.approx(1 - math.prod(range(51, 57)) / math.prod(range(59, 65)))


@pytest.mark.parametrize(
    "preset,gpus,placement", [("small", 32, "ep_first"), ("large", 64, "ep_first"), ("small", 128, "dp_first")]
)
def test_closed_form_matches_monte_carlo(preset: str, gpus: int, placement: str) -> None:
    cfg = get_preset(preset)
    exact = comm.estimate_comm(cfg, gpus, placement=placement)
    mc = comm.estimate_comm(cfg, gpus, placement=placement, method="mc", mc_tokens=4096, mc_sources=4, seed=1)
    for name in ("flat_inter", "rbd_inter", "rbd_replicas", "token_nodes"):
        assert getattr(mc.rows, name) == pytest.approx(getattr(exact.rows, name), rel=0.03), name
    assert mc.speedup == pytest.approx(exact.speedup, rel=0.03)


def test_comm_model_trends() -> None:
    cfg = get_preset("small")
    one_node = comm.estimate_comm(cfg, 8)
    assert one_node.group_nodes == 1 and one_node.rows.flat_inter == 0 and one_node.speedup == 1.0
    few_nodes = comm.estimate_comm(cfg, 32)  # 16 experts per node: tokens often hit a node twice
    strided = comm.estimate_comm(cfg, 1024, placement="dp_first")  # one expert per node: never twice
    assert few_nodes.speedup > 1.3 and few_nodes.rows.redundancy_rate > 0.4
    assert strided.group_nodes == 64 and strided.rows.rbd_inter == pytest.approx(strided.rows.flat_inter)
    assert [e.gpus for e in comm.scaling_table(cfg)] == list(comm.GPU_COUNTS)
    skewed = comm.estimate_comm(cfg, 32, routing="skewed", mc_tokens=1024)
    assert skewed.method.startswith("monte carlo") and 0 < skewed.rows.inter_saving < 1


def test_routing_histogram_file(tmp_path) -> None:
    path = tmp_path / "hist.json"
    path.write_text('{"tokens_per_expert": [[0, 1, 2, 3, 4, 5, 6, 7], [1, 1, 1, 1, 1, 1, 1, 1]]}')
    probs = comm.routing_probs(str(path), 8, 2)
    assert probs == pytest.approx(np.arange(1, 9) / 36)
    ids_TK = comm.sample_routing(probs, 8, 2, 500, np.random.default_rng(0))
    assert all(len(set(row)) == 2 for row in ids_TK.tolist())
    with pytest.raises(ValueError, match="expected 16 experts"):
        comm.routing_probs(str(path), 16, 2)
    with pytest.raises(ValueError, match="uniform"):
        comm.routing_probs("zipf", 8, 2)


# ----------------------------------------------------------------------------------------------- memory


def test_parameter_bytes_follow_count_params() -> None:
    cfg = get_preset("small")
    parts = count_params(cfg).total_by_part
    total = count_params(cfg).total
    whole = memory.estimate_memory(cfg, ParallelConfig(gpus_per_node=8))
    assert whole.wrapper == "none" and whole.params == 4 * total and whole.optimizer == 8 * total
    m = memory.estimate_memory(cfg, ParallelConfig(dp=4, ep=8, tp=2, gpus_per_node=8))
    # TP splits attention (and dense FFNs) only: embedding, head, norms, router and shared experts stay whole
    tp_split = parts["attention"] + parts["dense_ffn"]
    replicated = parts["embedding"] + parts["head"] + parts["norms"] + parts["router"] + parts["shared_experts"]
    dense = (tp_split / 2 + replicated) / (4 * 8)
    experts = parts["routed_experts"] / 8 / 4
    assert m.wrapper == "FSDP2"
    assert m.dense_params == pytest.approx(dense)
    assert m.expert_params == pytest.approx(experts)
    assert m.params == pytest.approx(4 * (dense + experts)) and m.optimizer == pytest.approx(8 * (dense + experts))


def test_buffers_scale_as_the_paper_says() -> None:
    moe = get_preset("small").moe
    H, K, E = moe.hidden_size, moe.top_k, moe.num_experts
    for T in (1000, 2048, 4096):
        pft = terms.moe_activations(moe, T)
        assert pft["dispatch_buffer"] == pft["combine_buffer"] == 2 * T * K * H  # A = s*k*h
        padded = terms.moe_activations(moe, T, padded=True, capacity_factor=1.25)
        C = math.ceil(1.25 * T * K / E)
        assert padded["dispatch_buffer"] == 2 * E * C * H
        assert padded["dispatch_masks"] == (2 + 4) * T * E * C
        assert sum(padded.values()) > sum(pft.values())


def test_ssmb_divides_the_moe_block_by_tp() -> None:
    cfg = get_preset("medium")
    H, E = cfg.hidden_size, cfg.moe.num_experts
    # what does not scale with tokens: the fp32 copy of the norm weight, and of the router weight in a module cast
    # to bf16 (the trainer's router weight is an fp32 parameter, used as is)
    assert sum(terms.moe_activations(cfg.moe, 0).values()) == 4 * E * H + 4 * H
    per_layer_constant = sum(terms.moe_activations(cfg.moe, 0, router_fp32=True).values())
    assert per_layer_constant == 4 * H
    for tp in (2, 4, 8):
        par = ParallelConfig(dp=1, ep=8 // tp, tp=tp, gpus_per_node=8)
        off = memory.estimate_memory(cfg, par, micro_batch=2, ssmb=False)
        on = memory.estimate_memory(cfg, par, micro_batch=2, ssmb=True)
        per_token_off = off.moe_layer_bytes - per_layer_constant
        assert (on.moe_layer_bytes - per_layer_constant) * tp == pytest.approx(per_token_off, rel=1e-12)
        assert on.attention_layer == off.attention_layer
        assert on.activations < off.activations


def test_recompute_reduces_the_peak() -> None:
    # Large at ep 256: activations set the peak (about 2 GiB per layer per sequence), so each mode lowers it
    cfg, par = get_preset("large"), ParallelConfig(dp=1, ep=256, tp=1, gpus_per_node=8)
    none, moe_rc, full = (memory.estimate_memory(cfg, par, recompute=r) for r in RECOMPUTE_MODES)
    assert none.peak > moe_rc.peak > full.peak
    assert none.activations > moe_rc.activations > full.activations


def test_bf16_end_of_backward_holds_14_bytes_per_vocab_weight() -> None:
    # GPUs: at the root's reduce-scatter (FSDP2's final callback) the untied embedding's fp32 gather and gradient
    # (4 + 4 B), the head's bf16 gradient (2 B) and the root's fp32 reduce-scatter input (4 B) are alive at once,
    # beside fp32 weights, AdamW (12 B) and every other unit's reduced fp32 gradient (4 B per local parameter)
    cfg = dataclasses.replace(get_preset("small"), num_layers=2)
    par = ParallelConfig(dp=4, ep=16, tp=1, gpus_per_node=8)
    m = memory.estimate_memory(cfg, par, micro_batch=1, seq_len=256, precision="bf16")
    assert m.peak_at == "root reduce-scatter"
    VH, H, ranks = cfg.vocab_size * cfg.hidden_size, cfg.hidden_size, par.dp * par.ep
    P = m.dense_params + m.expert_params
    reduced = 4 * (P - (VH + H) / ranks - VH / ranks)
    assert m.peak == pytest.approx(12 * P + reduced + 14 * VH + 4 * H)
    assert sum(m.tracker_parts().values()) == pytest.approx(m.peak)


def test_ddp_replica_adds_its_buckets() -> None:
    cfg = tiny()
    total = count_params(cfg).total
    for precision in terms.PRECISIONS:
        one = memory.estimate_memory(cfg, ParallelConfig(), micro_batch=2, precision=precision)
        ddp = memory.estimate_memory(cfg, ParallelConfig(dp=4), micro_batch=2, precision=precision)
        assert (one.wrapper, ddp.wrapper) == ("none", "DDP") and one.peak_at == ddp.peak_at
        assert ddp.peak - one.peak == pytest.approx(4 * total)  # fp32 buckets as large as the gradients
    with pytest.raises(ValueError, match="precision"):
        memory.estimate_memory(cfg, ParallelConfig(), precision="fp16")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layer_id,padded", [(0, False), (1, False), (1, True)])
def test_layer_model_matches_autograd(dtype: torch.dtype, layer_id: int, padded: bool) -> None:
    """The per-layer terms count what autograd really saves (torch backend on CPU; parameters excluded)."""
    cfg = tiny()
    cfg = dataclasses.replace(
        cfg,
        moe=dataclasses.replace(
            cfg.moe,
            kernel_backend="torch",
            dispatcher="padded" if padded else "pft",
            capacity_factor=1.25 if padded else None,
        ),
    )
    block = Block(cfg, layer_id).to(dtype)
    B, S = 2, 64
    cos, sin = rope_tables(S, cfg.head_dim, cfg.rope_theta)
    x = torch.randn(B, S, cfg.hidden_size, dtype=dtype, requires_grad=True) * 1.0
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, cos, sin)
    measured = sum(storages.values()) - cos.nbytes - sin.nbytes  # the rotary tables are shared by all layers
    b, T = dtype.itemsize, B * S
    model = sum(terms.attention_activations(T, cfg.hidden_size, cfg.num_heads, 1, b).values())
    if block.is_moe:
        model += sum(terms.moe_activations(cfg.moe, T, padded=padded, kernel="torch", b=b).values())
    else:
        model += sum(terms.dense_ffn_activations(T, cfg.hidden_size, cfg.ffn_hidden_size, 1, b).values())
    assert model == pytest.approx(measured, rel=0.01)


def test_search_proposes_a_fitting_layout() -> None:
    ranked = layouts.search_layouts(get_preset("small"), 16, 40.0)
    best = ranked[0]
    assert best.fits(40.0) and best.parallel.world_size == 16
    assert best.parallel.placement == "ep_first"
    fixed = layouts.search_layouts(get_preset("small"), 16, 40.0, tp=1, ep=8, dp=2, micro_batch=1, recompute="none")
    assert len(fixed) == 1 and (fixed[0].parallel.ep, fixed[0].parallel.dp) == (8, 2)


# ---------------------------------------------------------------------------------------------------- CLI


def test_cli_plan_memory(capsys) -> None:
    main(["plan", "memory", "--preset", "large", "--gpus", "256", "--gpu-mem", "64"])
    out = capsys.readouterr().out
    assert "per-GPU memory (GiB)" in out and "layout: tp" in out and "fits (" in out
    for part in ("parameters", "gradients", "optimizer", "activations", "dispatch_buffer", "combine_buffer"):
        assert part in out
    main(["plan", "memory", "--preset", "tiny", "--gpus", "1", "--gpus-per-node", "1", "--gpu-mem", "4"])
    assert "shared_experts" in capsys.readouterr().out


def test_cli_plan_comm(capsys) -> None:
    main(["plan", "comm", "--preset", "small", "--gpus", "64", "--gpus-per-node", "8", "--mc-tokens", "512"])
    out = capsys.readouterr().out
    assert "redundancy rate R = 0.244" in out and "check by monte carlo" in out
    # each GPU count is in one row's label: its own, or a range "lo-hi" of counts whose rows read the same
    labels = [line.split()[0] for line in out.split("scaling")[1].splitlines()[2:] if line.strip()]
    spans = [tuple(int(v) for v in label.split("-")) for label in labels]
    assert all(any(span[0] <= g <= span[-1] for span in spans) for g in comm.GPU_COUNTS), labels


@pytest.mark.parametrize(
    "argv,message",
    [
        (["memory", "--gpus", "100"], "multiple of gpus per node"),
        (["memory", "--gpus", "64", "--tp", "16"], "must be <= --gpus-per-node"),
        (["memory", "--preset", "giant"], "unknown preset"),
        (["memory", "--gpus", "64", "--tp", "2", "--ep", "8", "--dp", "2"], "must equal"),
        (["memory", "--gpus", "64", "--ep", "3"], "must divide"),
        (["comm", "--gpus", "100"], "multiple of gpus per node"),
        (["comm", "--preset", "giant"], "unknown preset"),
    ],
)
def test_cli_bad_inputs(capsys, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_trainer_memory_walk_and_cli(capsys):
    # the one-GPU trainer layout: states are 12 B per parameter + 2 B per routed-expert weight; where activations
    # set the peak (large micro-batches) recompute lowers it, moe less than full; with accumulation every fp32
    # gradient exists throughout the last micro-batch; the CLI prints exactly what estimate_trainer_memory returns
    from dataclasses import replace

    from xmoe.cli import main
    from xmoe.model.counting import count_params
    from xmoe.model.presets import get_preset
    from xmoe.plan.trainer_memory import estimate_trainer_memory

    cfg = replace(get_preset("small"), num_layers=4)
    parts = count_params(cfg).total_by_part
    total = sum(parts.values())
    for mb in (1, 8, 32):
        peaks = {}
        for mode in ("none", "moe", "full"):
            m = estimate_trainer_memory(cfg, micro_batch=mb, seq_len=2048, recompute=mode)
            assert m.states == 12 * total + 2 * parts["routed_experts"]
            peaks[mode] = m.total
        if mb == 32:
            assert peaks["full"] < peaks["moe"] < peaks["none"]
    one = estimate_trainer_memory(cfg, micro_batch=32, seq_len=2048)
    accumulating = estimate_trainer_memory(cfg, micro_batch=32, seq_len=2048, accumulation=2)
    assert accumulating.grads == 4 * total and one.grads < 4 * total and accumulating.total > one.total
    with pytest.raises(ValueError, match="recompute"):
        estimate_trainer_memory(cfg, micro_batch=1, recompute="some")
    main(
        [
            "plan",
            "memory",
            "--trainer",
            "--preset",
            "small",
            "--layers",
            "4",
            "--seq",
            "2048",
            "--micro-batch",
            "32",
            "--accumulation",
            "2",
            "--recompute",
            "none",
            "--gpu-mem",
            "60",
        ]
    )
    row = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("none"))
    assert row.split()[-2] == f"{accumulating.total / 2**30:.1f}" and row.split()[-1] == "no"
