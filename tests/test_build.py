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

    moe = MoEConfig(hidden_size=32, ffn_hidden_size=16, num_experts=8, top_k=2, num_shared_experts=1,
                    kernel_backend="torch", **moe)
    return ModelConfig(vocab_size=64, hidden_size=32, num_layers=3, num_heads=4, ffn_hidden_size=48, moe=moe,
                       first_k_dense=1, max_seq_len=32)


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


@pytest.mark.parametrize("layout", [dict(dp=4, ep=1), dict(dp=2, ep=2), dict(dp=1, ep=4), dict(dp=2, ep=1, tp=2)],
                         ids=["ep1", "ep2", "ep4", "tp2"])
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
    built = build_model(cfg, "cpu", dims, seed=0)
    shape = tuple(built.model.layers[1].ffn.experts.w1.to_local().shape)
    shapes = [None] * world_size
    dist.all_gather_object(shapes, shape)
    if rank == 0:
        torch.save(set(shapes), out)
