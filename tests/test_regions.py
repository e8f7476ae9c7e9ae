"""Activation recompute and compiled regions (xmoe/parallel/regions.py) against the plain eager model.

Recompute must not change the function: losses and every gradient of "moe" and "full" equal "none" (fp32, CPU).
Compilation must not change it beyond float reassociation, and a block's branches must compile without a graph
break on the path GPUs take (the Triton kernels, run here by Triton's interpreter, as opaque custom ops).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by conftest.py, before anything imports triton

from dataclasses import replace

import pytest
import torch
from conftest import SMALL

from xmoe.model.presets import get_preset
from xmoe.model.transformer import Transformer
from xmoe.parallel import regions


def _model(backend="torch", seed=0, **moe):
    cfg = get_preset("tiny")
    cfg = replace(cfg, num_layers=3, moe=replace(cfg.moe, kernel_backend=backend, **moe))
    torch.manual_seed(seed)
    return Transformer(cfg)


def _loss_and_grads(model, tokens):
    model.zero_grad(set_to_none=True)
    loss = model(tokens, tokens.roll(-1, dims=1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode", ["moe", "full"])
def test_recompute_gives_the_losses_and_gradients_of_none(mode):
    tokens = torch.randint(0, 256, (3, 40), generator=torch.Generator().manual_seed(1))
    model = _model(aux_loss_coef=0.01, z_loss_coef=0.001)
    want_loss, want = _loss_and_grads(model, tokens)
    regions.apply_recompute(model, mode)
    assert {b.recompute for b in regions.blocks(model)} == {mode}
    got_loss, got = _loss_and_grads(model, tokens)
    assert got.keys() == want.keys() and len(got) > 10
    assert torch.allclose(got_loss, want_loss, rtol=1e-6, atol=0)
    for name in want:
        rel = ((got[name] - want[name]).norm() / want[name].norm().clamp(min=1e-30)).item()
        assert rel < 1e-5, (name, rel)


def test_recompute_rejects_unknown_modes():
    with pytest.raises(ValueError, match="recompute"):
        regions.apply_recompute(_model(), "attention")


def test_should_compile_defaults():
    assert regions.should_compile("auto", torch.device("cuda")) is True
    assert regions.should_compile("auto", torch.device("cpu")) is False
    assert regions.should_compile("auto", torch.device("cuda"), ep=2) is False
    assert regions.should_compile("on", torch.device("cpu")) is True
    with pytest.raises(ValueError, match="compile"):
        regions.should_compile("yes", torch.device("cpu"))


def test_compiled_blocks_have_no_graph_break_and_match_eager():
    # fullgraph=True turns any graph break inside a branch into an error; aot_eager traces forward and backward
    # without code generation, so the test checks what compilation sees in seconds
    torch._dynamo.reset()
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))
    model = _model(backend="triton")
    want_loss, want = _loss_and_grads(model, tokens)
    for block in regions.blocks(model):
        block.attn_branch = torch.compile(block.attn_branch, fullgraph=True, backend="aot_eager")
        block.ffn_branch = torch.compile(block.ffn_branch, fullgraph=True, backend="aot_eager")
    model._loss_sum = torch.compile(model._loss_sum, fullgraph=True, backend="aot_eager")
    regions.apply_recompute(model, "moe")
    got_loss, got = _loss_and_grads(model, tokens)
    assert torch.allclose(got_loss, want_loss, rtol=1e-5)
    for name in want:
        assert ((got[name] - want[name]).norm() / want[name].norm()).item() < 1e-4, name


def test_compiled_training_tracks_eager_over_20_steps(tmp_path):
    # the real trainer with inductor on CPU (the torch backend's expert loop reads its group sizes on the host,
    # so the MoE branch compiles in two parts there): fp32 losses of 20 steps agree with the eager run's
    import json

    from xmoe.cli import main

    small = [
        *SMALL,
        "--steps",
        "20",
        "--log-every",
        "1",
        "--ckpt-every",
        "0",
        "--device",
        "cpu",
    ]
    losses = {}
    for mode in ("off", "on"):
        out = tmp_path / mode
        main(["train", "--out", str(out), "--compile", mode, *small])
        losses[mode] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(losses["on"]) == len(losses["off"]) == 20
    for step, (a, b) in enumerate(zip(losses["on"], losses["off"], strict=False), 1):
        assert abs(a - b) <= 1e-4 * abs(b), (step, a, b)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_recompute_through_xmoe_train_gives_the_losses_of_none(tmp_path, monkeypatch, backend):
    # as in a fresh `xmoe train`, the kernel backend is first resolved (and the torch backend first imported, which
    # runs a small autograd probe) inside the first MoE branch, here inside its activation checkpoint
    import json
    import sys

    from xmoe import kernels
    from xmoe.cli import main

    small = [
        "--set",
        "model.hidden_size=32",
        "--set",
        "moe.hidden_size=32",
        "--set",
        "model.num_layers=2",
        "--set",
        "moe.ffn_hidden_size=16",
        "--set",
        "moe.num_experts=4",
        "--set",
        "moe.top_k=2",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--steps",
        "2",
        "--log-every",
        "1",
        "--ckpt-every",
        "0",
        "--device",
        "cpu",
        "--kernel-backend",
        backend,
    ]
    losses = {}
    for mode in ("moe", "full", "none"):
        monkeypatch.setattr(kernels, "_RESOLVED", {})
        monkeypatch.delitem(sys.modules, "xmoe.kernels.reference", raising=False)
        monkeypatch.delattr(kernels, "reference", raising=False)
        out = tmp_path / mode
        main(["train", "--out", str(out), "--recompute", mode, *small])
        losses[mode] = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
        monkeypatch.undo()
    assert len(losses["none"]) == 2
    for mode in ("moe", "full"):
        for a, b in zip(losses[mode], losses["none"], strict=False):
            assert abs(a - b) <= 1e-5 * abs(b), (mode, a, b)
