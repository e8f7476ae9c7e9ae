"""The optimizer step's seam to the MoE layers (xmoe/moe/step.py): what the layers report, what finish() does, and
that the expert bias it moves resumes bit-exactly through the checkpoint's weights alone."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import SMALL

from xmoe.cli import main
from xmoe.config import ModelConfig, MoEConfig
from xmoe.dispatch.base import TrafficStats
from xmoe.model.transformer import Transformer
from xmoe.moe.layer import moe_layers
from xmoe.moe.step import MoEStep
from xmoe.parallel.regions import apply_recompute

CPU = torch.device("cpu")


def model_cfg(**moe) -> ModelConfig:
    """Three layers, the first dense: two MoE layers of 6 experts."""
    return ModelConfig(
        vocab_size=61,
        hidden_size=32,
        num_layers=3,
        num_heads=4,
        first_k_dense=1,
        ffn_hidden_size=48,
        max_seq_len=24,
        moe=MoEConfig(hidden_size=32, ffn_hidden_size=16, num_experts=6, top_k=2, num_shared_experts=1, **moe),
    )


def tokens(batch: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 61, (batch, seq), generator=torch.Generator().manual_seed(seed))


def run_step(model: Transformer, micro_batches: int, **kw) -> MoEStep:
    step = MoEStep(model, micro_batches, CPU, **kw)
    with step:
        for i in range(micro_batches):
            (model(tokens(2, 10, i), tokens(2, 10, 100 + i)) / micro_batches).backward()
            step.end_micro_batch()
    return step


def test_step_statistics_sum_every_layer_and_micro_batch():
    torch.manual_seed(0)
    model = Transformer(model_cfg(aux_loss_coef=0.01, z_loss_coef=0.001))
    stats = run_step(model, 3).finish()
    load = stats.load_LE
    assert load.shape == (2, 6) and load.dtype == torch.int64
    assert torch.equal(load.sum(1), torch.full((2,), 3 * 2 * 10 * 2))  # dropless: every slot of 3 micro-batches
    assert stats.rows == load.sum()
    assert stats.aux.ndim == 0 and not stats.aux.requires_grad and stats.aux > 0
    assert stats.traffic == {}  # one rank: nothing leaves it
    dense = Transformer(dataclasses.replace(model_cfg(), num_layers=1))  # no MoE layer: nothing to sum
    empty = run_step(dense, 1).finish()
    assert empty.load_LE is None and empty.rows == 0 and empty.aux == 0


def test_a_recomputed_forward_is_counted_once():
    torch.manual_seed(0)
    plain = Transformer(model_cfg())
    torch.manual_seed(0)
    recomputed = Transformer(model_cfg())
    apply_recompute(recomputed, "moe")  # the MoE branches run again in backward, reporting again
    a, b = run_step(plain, 2).finish(), run_step(recomputed, 2).finish()
    assert torch.equal(a.load_LE, b.load_LE) and torch.equal(a.rows, b.rows) and torch.equal(a.aux, b.aux)


def test_end_micro_batch_needs_every_layer_to_have_reported():
    model = Transformer(model_cfg())
    with MoEStep(model, 1, CPU) as step, pytest.raises(RuntimeError, match="forward of every MoE layer"):
        step.end_micro_batch()
    with pytest.raises(ValueError, match=r"micro_batches \(0\) must be >= 1"):
        MoEStep(model, 0, CPU)


def test_finish_moves_the_bias_by_the_step_load_unless_told_not_to():
    torch.manual_seed(0)
    model = Transformer(model_cfg(bias_update_rate=0.1))
    routers = [layer.router for layer in moe_layers(model)]
    run_step(model, 2).finish(update_bias=False)  # a skipped step: statistics, no update
    assert all(not r.expert_bias.any() for r in routers)
    step = run_step(model, 2)
    load = step.finish().load_LE.float()
    for router, load_E in zip(routers, load, strict=False):
        assert torch.equal(router.expert_bias, 0.1 * torch.sign(load_E.mean() - load_E))


@dataclass
class _Counts(TrafficStats):
    rows_sent: int = 0


def test_finish_takes_the_dispatchers_counters_and_resets_them():
    model = Transformer(model_cfg())
    layers = moe_layers(model)
    for i, layer in enumerate(layers):
        layer.dispatcher.stats = _Counts(rows_sent=10 + i)  # a dispatcher that counts
    step = MoEStep(model, 1, CPU)
    assert step.finish().traffic == {"rows_sent": 21}
    assert all(layer.dispatcher.stats.rows_sent == 0 for layer in layers)


def test_resume_with_a_moving_bias_is_bit_identical_from_the_weights_alone(tmp_path, monkeypatch):
    # the routers' expert_bias is a persistent buffer, saved and loaded by DCP with the weights; checkpoints written
    # before it was only there also kept a copy in the extra state, which a resume now ignores
    from xmoe.train import trainer

    def train(out: Path, *extra: str) -> None:
        main(["train", "--out", str(out), "--device", "cpu", *SMALL, *extra])

    def losses(out: Path) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}

    bias = ["--set", "moe.bias_update_rate=0.01", "--log-every", "1", "--ckpt-every", "4"]
    full, part, old = tmp_path / "full", tmp_path / "part", tmp_path / "old"
    train(full, "--steps", "8", *bias)
    train(part, "--steps", "4", *bias)
    save = trainer.ckpt.save_checkpoint

    def save_with_a_bias_copy(out, step, wrapped, optimizer, extra, **kw):  # what checkpoints held before
        extra = {**extra, "expert_bias": [m.router.expert_bias.detach().cpu() for m in moe_layers(wrapped)]}
        return save(out, step, wrapped, optimizer, extra, **kw)

    monkeypatch.setattr(trainer.ckpt, "save_checkpoint", save_with_a_bias_copy)
    train(old, "--steps", "4", *bias)
    monkeypatch.undo()
    extra = torch.load(part / "checkpoints" / "step_000004" / "rank_00000.pt", weights_only=True)["extra"]
    assert set(extra) == {"step", "loader"}
    for out in (part, old):
        train(out, "--steps", "8", "--resume", *bias)
        assert losses(out) == losses(full)  # exactly equal, not approximately
    meta = json.loads((part / "checkpoints" / "step_000008" / "meta.json").read_text())
    assert meta["config"]["model"]["moe"]["bias_update_rate"] == 0.01
