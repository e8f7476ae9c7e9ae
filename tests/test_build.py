"""The construction pipeline (xmoe/parallel/build.py): meta build, parallelism, local shards only, layout-independent
initial values, Hugging Face weights read into shards.

The references are independent of the pipeline: a model built directly on one device (``Transformer(cfg)`` then
``init_weights(seed)``), gathered full state dicts compared bitwise, and transformers' own logits.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dist_utils import run_distributed


def _config(**moe):
    from xmoe.config import ModelConfig, MoEConfig

    moe = MoEConfig(
        hidden_size=32, ffn_hidden_size=16, num_experts=8, top_k=2, num_shared_experts=1, kernel_backend="torch", **moe
    )
    return ModelConfig(
        vocab_size=64,
        hidden_size=32,
        num_layers=3,
        num_heads=4,
        ffn_hidden_size=48,
        moe=moe,
        first_k_dense=1,
        max_seq_len=32,
    )


def _direct_state(cfg, seed: int) -> dict[str, torch.Tensor]:
    """The reference: the model built and initialised on one device, no meta device, no parallelism."""
    from xmoe.model.transformer import Transformer

    model = Transformer(cfg)
    model.init_weights(seed=seed)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_block_rows_and_seeds_do_not_depend_on_layout() -> None:
    from xmoe.model import init

    assert init.block_rows((8, 32, 16)) == 1  # one generator per expert
    assert init.block_rows((64, 32)) >= 64  # a small matrix is one block
    assert init.block_rows((2**12, 2**10)) == 2**10
    assert init.block_seed(0, "a", 1) == init.block_seed(0, "a", 1)
    assert len({init.block_seed(s, n, b) for s in (0, 1) for n in ("a", "b") for b in (0, 1)}) == 8


def test_a_box_filled_alone_equals_that_box_of_the_whole_tensor() -> None:
    from xmoe.model import init

    for shape in [(5, 3, 7), (3000, 700), (37,)]:
        whole = torch.empty(shape)
        init.normal_(whole, 0.02, 3, "w")
        assert whole.std().item() == pytest.approx(0.02, rel=0.1)
        box = (slice(1, shape[0] - 1),) + ((slice(2, 5),) if len(shape) > 1 else ())
        local = torch.full_like(whole[box], float("nan"))
        offset = tuple(b.start for b in box) + (0,) * (len(shape) - len(box))
        init.normal_box_(local, shape, offset, 0.02, 3, "w")
        assert torch.equal(local, whole[box]), shape


def _gathered_state(rank: int, world_size: int, layout: dict, seed: int, out: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from xmoe.config import ParallelConfig
    from xmoe.parallel.build import build_model
    from xmoe.parallel.dims import ParallelDims

    cfg = _config()
    par = ParallelConfig(**layout)
    dims = ParallelDims.from_config(par, world_size, rank=rank).build_mesh("cpu")
    built = build_model(cfg, "cpu", dims, seed=seed, fsdp=True)
    state = get_model_state_dict(built.wrapped, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(state, out)


@pytest.mark.parametrize(
    "layout",
    [dict(dp=4, ep=1), dict(dp=2, ep=2), dict(dp=1, ep=4), dict(dp=2, ep=1, tp=2)],
    ids=["ep1", "ep2", "ep4", "tp2"],
)
def test_layout_independent_init(tmp_path, layout: dict) -> None:
    """The gathered full state dict of a meta-built, sharded model equals, bitwise, the model built directly on one
    device from the same seed (and so every layout equals every other)."""
    out = tmp_path / "state.pt"
    run_distributed(_gathered_state, 4, layout, 11, str(out))
    want = _direct_state(_config(), 11)
    got = torch.load(out)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    assert not torch.equal(_direct_state(_config(), 12)["layers.1.ffn.experts.w1"], want["layers.1.ffn.experts.w1"])


def test_one_process_meta_build_equals_direct_build() -> None:
    from xmoe.parallel.build import build_model

    built = build_model(_config(), "cpu", seed=5)
    want = _direct_state(_config(), 5)
    for name, value in built.model.state_dict().items():
        assert torch.equal(value, want[name]), name
    tokens = torch.randint(0, 64, (2, 9))
    direct = __import__("xmoe.model.transformer", fromlist=["Transformer"]).Transformer(_config())
    direct.load_state_dict(want)
    with torch.no_grad():
        torch.testing.assert_close(built.model(tokens), direct(tokens), rtol=0, atol=0)


def test_experts_that_do_not_split_over_dp_shard_on_hidden(tmp_path) -> None:
    """One expert per EP rank and dp = 2: FSDP2 shards each stack on dim 1, so both dp ranks hold half of it."""
    out = tmp_path / "shapes.pt"
    run_distributed(_expert_shard_shapes, 4, str(out))
    shapes = torch.load(out)
    assert set(shapes) == {(1, 16, 16)}, shapes  # (E_local=1, H/dp=16, F) on every rank


def _expert_shard_shapes(rank: int, world_size: int, out: str) -> None:
    import torch.distributed as dist

    from xmoe.config import ParallelConfig
    from xmoe.parallel.build import build_model
    from xmoe.parallel.dims import ParallelDims

    cfg = dataclasses.replace(_config(), moe=dataclasses.replace(_config().moe, num_experts=2))
    dims = ParallelDims.from_config(ParallelConfig(dp=2, ep=2), world_size, rank=rank).build_mesh("cpu")
    built = build_model(cfg, "cpu", dims, seed=0, param_dtype=torch.bfloat16)
    # DTensors: the experts' weights stay on the autograd path (cast per forward), and the optimizer writes nothing
    assert built.copy_writers == [] and not built.model.layers[1].ffn.experts.expert_weights.detached
    shape = tuple(built.model.layers[1].ffn.experts.w1.to_local().shape)
    shapes = [None] * world_size
    dist.all_gather_object(shapes, shape)
    if rank == 0:
        torch.save(set(shapes), out)


def _ddp_replica(rank: int, world_size: int, out: str) -> None:
    import warnings

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from xmoe.config import ParallelConfig
    from xmoe.parallel.build import build_model
    from xmoe.parallel.dims import ParallelDims

    dims = ParallelDims.from_config(ParallelConfig(dp=2), world_size, rank=rank).build_mesh("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # a deprecated argument of DDP's raises here
        built = build_model(_config(), "cpu", dims, seed=0, param_dtype=torch.bfloat16)
    assert isinstance(built.wrapped, DistributedDataParallel)
    # DDP reduces through autograd hooks: the experts' copies are autograd casts, none written by the optimizer
    assert built.copy_writers == [] and not built.model.layers[1].ffn.experts.expert_weights.detached
    buffers = {name: b.clone() for name, b in built.model.named_buffers()}
    router = built.model.layers[1].ffn.router
    with torch.no_grad():
        router.expert_bias.fill_(float(rank))  # a rank's own values, which a broadcast before a forward would replace
    tokens = torch.arange(16).reshape(2, 8)
    built.wrapped(tokens, tokens).backward()
    found = [None] * world_size
    dist.all_gather_object(found, (buffers, router.expert_bias.clone()))
    if rank == 0:
        torch.save(found, out)


def test_data_parallel_replicas_sync_no_buffer_before_a_forward(tmp_path) -> None:
    """DDP replicas are built without a deprecated argument; their buffers (rotary tables, expert biases) are the
    same on every rank once built, and DDP does not broadcast them before a forward: each rank's expert_bias moves
    by the all-reduced loads alone (xmoe/moe/step.py)."""
    out = tmp_path / "buffers.pt"
    run_distributed(_ddp_replica, 2, str(out))
    (built_0, bias_0), (built_1, bias_1) = torch.load(out)
    assert built_0.keys() == built_1.keys() and any("expert_bias" in name for name in built_0)
    assert all(torch.equal(built_0[name], built_1[name]) for name in built_0)
    assert bias_0.eq(0).all() and bias_1.eq(1).all()


def _sharded_logits(rank: int, world_size: int, hf_dir: str, layout: dict, out: str) -> None:
    from xmoe.config import ParallelConfig
    from xmoe.hf.checkpoint import read_config
    from xmoe.hf.families import model_config_from_hf
    from xmoe.parallel.build import build_model
    from xmoe.parallel.dims import ParallelDims

    cfg = model_config_from_hf(read_config(hf_dir))
    dims = ParallelDims.from_config(ParallelConfig(**layout), world_size, rank=rank).build_mesh("cpu")
    built = build_model(cfg, "cpu", dims, init_from=hf_dir)
    tokens = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = built.wrapped(tokens)
    torch.save(logits, f"{out}.{rank}")


@pytest.mark.parametrize("family,layout", [("deepseek_v3", dict(dp=1, ep=2)), ("qwen3_moe", dict(dp=2, ep=2))])
def test_init_from_into_shards_gives_the_one_process_logits(tmp_path, family: str, layout: dict) -> None:
    """Each rank reads only its part of each Hugging Face tensor; the sharded model's logits (every rank fed the
    same tokens) equal those of the model loaded whole in one process, and transformers' own."""
    from hf_models import rel_err, saved_reference

    from xmoe.hf import load_pretrained

    reference = saved_reference(family, tmp_path / "hf")
    world = layout["dp"] * layout["ep"]
    run_distributed(_sharded_logits, world, str(tmp_path / "hf"), layout, str(tmp_path / "logits"))
    tokens = torch.randint(0, reference.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        whole = load_pretrained(tmp_path / "hf")(tokens)
        theirs = reference(tokens).logits
    assert rel_err(whole, theirs) < 1e-5
    for rank in range(world):
        assert rel_err(torch.load(tmp_path / f"logits.{rank}"), whole) < 1e-6, rank


def _big_run(rank: int, world_size: int, layout: dict, out_dir: str, result: str) -> None:
    """`xmoe train`'s Trainer on a model whose full fp32 weights are 4x what a rank should hold; peak RSS growth
    after building, and after 2 steps and a checkpoint."""
    import ctypes
    import resource

    import torch.distributed as dist

    from xmoe.config import ModelConfig, MoEConfig, ParallelConfig, RunConfig, TrainConfig
    from xmoe.train.trainer import Trainer

    def rss() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    # RSS counts what glibc keeps of freed memory too; a fixed mmap threshold makes it return every large block (a
    # tensor of >= 128 KiB) when it is freed, so RSS follows the live tensors (gloo's threads otherwise leave freed
    # blocks in arenas of their own: +0.5 GiB here)
    ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD

    moe = MoEConfig(hidden_size=256, ffn_hidden_size=256, num_experts=64, top_k=2, kernel_backend="torch")
    model = ModelConfig(
        vocab_size=256, hidden_size=256, num_layers=8, num_heads=4, moe=moe, first_k_dense=0, max_seq_len=32
    )
    train = TrainConfig(steps=2, global_batch_size=8, seq_len=32, log_every=1, ckpt_every=2, warmup_steps=1)
    run = RunConfig(model=model, train=train, parallel=ParallelConfig(**layout))
    base = rss()
    trainer = Trainer(run, out_dir, device="cpu")
    built = rss() - base
    trainer.train()
    stats = [None] * world_size
    dist.all_gather_object(stats, (built, rss() - base, trainer.step))
    if rank == 0:
        torch.save(stats, result)


@pytest.mark.parametrize("layout", [dict(dp=1, ep=4), dict(dp=2, ep=2)], ids=["ep4", "ep2xdp2"])
def test_no_rank_allocates_the_whole_model(tmp_path, layout: dict) -> None:
    """4 gloo ranks train 2 steps and save a checkpoint; each one's memory grows by its share, not by the model."""
    from xmoe.config import ModelConfig, MoEConfig
    from xmoe.model.counting import count_params

    moe = MoEConfig(hidden_size=256, ffn_hidden_size=256, num_experts=64, top_k=2)
    params = count_params(
        ModelConfig(
            vocab_size=256, hidden_size=256, num_layers=8, num_heads=4, moe=moe, first_k_dense=0, max_seq_len=32
        )
    ).total
    weights, state = 4 * params, 16 * params  # fp32 weights; with gradients and AdamW's two moments
    run_distributed(_big_run, 4, layout, str(tmp_path / "run"), str(tmp_path / "rss.pt"), timeout_s=240)
    for rank, (built, peak, steps) in enumerate(torch.load(tmp_path / "rss.pt")):
        assert steps == 2
        assert built < 0.5 * weights, (rank, built / 2**20, weights / 2**20)
        assert peak < 0.5 * state, (rank, peak / 2**20, state / 2**20)
    assert (tmp_path / "run" / "checkpoints").is_dir()


def _tiny_torch():
    from xmoe.model.presets import get_preset

    cfg = get_preset("tiny")
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, kernel_backend="torch"))


def _real_rank(rank: int, world_size: int, out: str) -> None:
    import torch.distributed as dist

    from xmoe.config import ParallelConfig
    from xmoe.train.simulate import measure_rank

    m = measure_rank(
        _tiny_torch(), ParallelConfig(dp=2, ep=2), micro_batch=2, seq_len=64, rank=rank, device="cpu", simulate=False
    )
    found = [None] * world_size
    dist.all_gather_object(found, (m.measured_peak_bytes, m.measured_by_kind))
    if rank == 0:
        torch.save(found, out)


def test_a_simulated_rank_allocates_what_a_real_rank_does(tmp_path) -> None:
    """The same layout (dp 2 x ep 2) run for real on 4 gloo processes and simulated one rank at a time in torch's
    fake process group: the peak and the local shard's weights, gradients and optimizer state agree within 10% on
    every rank; activations within 25% (the real ranks route random tokens through a random router unevenly, the
    simulated one receives the balanced count)."""
    from xmoe.config import ParallelConfig
    from xmoe.train.simulate import measure_rank

    run_distributed(_real_rank, 4, str(tmp_path / "real.pt"), timeout_s=120)
    for rank, (peak, by_kind) in enumerate(torch.load(tmp_path / "real.pt")):
        sim = measure_rank(
            _tiny_torch(), ParallelConfig(dp=2, ep=2), micro_batch=2, seq_len=64, rank=rank, device="cpu"
        )
        assert sim.measured_peak_bytes == pytest.approx(peak, rel=0.1), rank
        for kind in ("weights", "gradients", "optimizer"):
            assert sim.measured_by_kind[kind] == pytest.approx(by_kind[kind], rel=0.1), (rank, kind)
        assert sim.measured_by_kind["activations"] == pytest.approx(by_kind["activations"], rel=0.25), rank
        assert sim.measured_by_kind["optimizer"] > 0 and sim.measured_by_kind["weights"] > 0


def test_plan_memory_measure_runs_one_rank_of_a_64_gpu_world(capsys) -> None:
    """`xmoe plan memory --measure --json` on CPU: rank 5 of tiny at ep 16 x dp 4, the planner's figure beside it."""
    import json

    from xmoe.cli import main

    main(
        [
            "plan",
            "memory",
            "--preset",
            "tiny",
            "--gpus",
            "64",
            "--ep",
            "16",
            "--tp",
            "1",
            "--micro-batch",
            "2",
            "--seq",
            "64",
            "--recompute",
            "none",
            "--rank",
            "5",
            "--measure",
            "--json",
        ]
    )
    result = json.loads(capsys.readouterr().out)
    assert result["layout"] == dict(
        world=64,
        rank=5,
        tp=1,
        ep=16,
        dp=4,
        placement="ep_first",
        micro_batch=2,
        seq_len=64,
        recompute="none",
        imbalance=1.0,
        layers=4,
    )
    assert result["planned_peak_bytes"] > 0 and result["measured_peak_bytes"] > 0
    assert result["compute_ms_per_step"] > 0 and "meaningless" in result["note"]
    # the local shard: 1 of 16 experts per layer, all of it on this rank's dp share, 1/64 of the dense weights
    from xmoe.model.counting import count_params

    parts = count_params(_tiny_torch(), expert_matrices=3).total_by_part
    own = parts["routed_experts"] / 64 + (sum(parts.values()) - parts["routed_experts"]) / 64
    assert result["measured_by_kind"]["optimizer"] == pytest.approx(8 * own, rel=0.05)


def test_router_output_flattens_to_its_tensors() -> None:
    """FSDP2 finds the tensors of a unit's output by pytree flattening to hook its backward gather; the router is a
    unit of its own under mixed precision, so its output must flatten to its tensors, not one opaque leaf."""
    from torch.utils._pytree import tree_flatten

    from xmoe.moe.router import Router

    cfg = _config().moe
    out = Router(cfg)(torch.randn(5, cfg.hidden_size))
    leaves, _ = tree_flatten(out)
    assert len(leaves) == 7 and all(isinstance(t, torch.Tensor) for t in leaves)
    assert out.weights_TK.requires_grad
