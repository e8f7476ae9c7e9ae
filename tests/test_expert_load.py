"""Expert load you can see (xmoe/train/expert_load.py): the logged load against a float64 reference routing of the
same batches, dead and hot experts on crafted loads, the load file (numpy reads it; resumes cut it back; a torn write
is never read), the heat map (a planted dead expert and a collapse show), and all of it through `xmoe train`."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import SMALL as SMALL_MODEL

from xmoe.cli import main
from xmoe.config import ModelConfig, MoEConfig, RunConfig
from xmoe.model.loss import IGNORE_INDEX
from xmoe.model.transformer import Transformer
from xmoe.moe.layer import moe_layers
from xmoe.train import expert_load
from xmoe.train.expert_load import ExpertLoadFile, dead_and_hot, heat_rows, plot_expert_load, read_records
from xmoe.train.metrics import MetricsLogger
from xmoe.train.report import Reporter, Window
from xmoe.train.step import forward_backward

CPU = torch.device("cpu")
E, K = 8, 2


def test_logged_load_equals_a_reference_routing_of_the_same_batches(tmp_path):
    moe = MoEConfig(hidden_size=32, ffn_hidden_size=16, num_experts=E, top_k=K, aux_loss_coef=0.01)
    cfg = ModelConfig(
        vocab_size=50, hidden_size=32, num_layers=3, num_heads=4, first_k_dense=1, moe=moe, max_seq_len=16
    )
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():  # decisive, tie-free routing
        for layer in moe_layers(model):
            layer.router.weight.normal_(0, 0.5)
    gen = torch.Generator().manual_seed(1)
    steps = []  # each optimizer step: 2 micro-batches of (inputs, targets), some positions without a target
    for _ in range(3):
        micro = []
        for _ in range(2):
            tokens = torch.randint(0, 50, (2, 11), generator=gen)
            targets = tokens[:, 1:].clone()
            targets[torch.rand(targets.shape, generator=gen) < 0.3] = IGNORE_INDEX
            micro.append((tokens[:, :-1], targets))
        steps.append(micro)

    # the reference: every MoE layer's input captured, routed again in float64 by a loop, real tokens counted
    want = np.zeros((2, E), dtype=np.int64)
    inputs: list[torch.Tensor] = []
    hooks = [m.router.register_forward_pre_hook(lambda mod, args: inputs.append(args[0])) for m in moe_layers(model)]
    with torch.no_grad():
        for micro in steps:
            for tokens, targets in micro:
                inputs.clear()
                model(tokens)
                for i, (x, layer) in enumerate(zip(inputs, moe_layers(model), strict=True)):
                    logits = x.double() @ layer.router.weight.double().T
                    for t, valid in enumerate((targets != IGNORE_INDEX).reshape(-1).tolist()):
                        if valid:
                            for e in torch.softmax(logits[t], -1).topk(K).indices.tolist():
                                want[i, e] += 1
    for h in hooks:
        h.remove()

    # the trainer's path: the steps' statistics into one window, logged through the Reporter (no optimizer step:
    # the weights stay those the reference routed with)
    run = RunConfig(model=cfg)
    logger = MetricsLogger(tmp_path, rank=0, total_steps=3, progress_bar=False, stream=open(os.devnull, "w"))
    data = SimpleNamespace(source_names=())  # one source: no per-source losses
    report = Reporter(run, tmp_path, logger, rank=0, world=1, device=CPU, dataset=data, preset="", kernels=None)
    window = Window(CPU)
    for micro in steps:
        _, step = forward_backward(model, model, iter(micro), 2, CPU, autocast=False)
        window.add(step.finish(update_bias=False))
    zero = torch.zeros(())
    report.log_window(3, zero, zero, zero, 1e-3, window)
    records = read_records(tmp_path / expert_load.NAME)
    assert records["step"].tolist() == [3]
    assert np.array_equal(records["load"][0], want)
    line = logger.records[-1]
    dead, hot = dead_and_hot(want)
    assert line["dead_per_layer"] == dead.tolist() and line["hot_per_layer"] == hot.tolist()
    assert line["dead_experts"] == dead.sum() and line["hot_experts"] == hot.sum()
    assert line["imbalance"] == pytest.approx(max(w.max() / w.mean() for w in want))


def test_dead_and_hot_experts_of_a_crafted_load():
    load = np.array(
        [
            [0, 0, 10, 10, 10, 10, 10, 30],  # mean 10: two dead, one hot (30 > 2 x 10)
            [5, 5, 5, 5, 5, 5, 5, 5],  # balanced
            [0, 0, 0, 0, 0, 0, 0, 0],  # routed nothing in the window: no expert called dead
            [0, 0, 0, 0, 0, 0, 0, 16],  # collapse: seven dead, one hot (16 > 2 x 2)
            [1, 1, 1, 1, 1, 1, 1, 9],  # mean 2: 9 is hot, 4 would not be (exactly 2x is not more than 2x)
        ]
    )
    dead, hot = dead_and_hot(load)
    assert dead.tolist() == [2, 0, 0, 7, 0]
    assert hot.tolist() == [1, 0, 0, 1, 1]
    assert dead_and_hot(np.array([[1, 1, 1, 1, 1, 1, 1, 1]]))[1].tolist() == [0]
    assert (
        dead_and_hot(np.array([[4, 0, 0, 0]]))[1].tolist() == [1] and dead_and_hot(np.array([[2, 2, 0, 0]]))[1][0] == 0
    )


def test_the_load_file_appends_resumes_and_survives_a_torn_write(tmp_path):
    rng = np.random.default_rng(0)
    loads = [rng.integers(0, 1000, (3, 5)) for _ in range(4)]
    log = ExpertLoadFile(tmp_path)
    for i, load in enumerate(loads[:3]):
        log.append(10 * (i + 1), load)
    path = tmp_path / expert_load.NAME
    records = np.load(path)  # numpy reads it as it is
    assert records["step"].tolist() == [10, 20, 30]
    assert np.array_equal(records["load"], np.stack(loads[:3]))
    with open(path, "ab") as f:  # a write killed before the header counted it
        f.write(b"\x01" * 37)
    assert len(np.load(path)) == 3 and len(read_records(path)) == 3
    resumed = ExpertLoadFile(tmp_path, resume_step=20)  # the interrupted run's later windows are logged again
    assert read_records(path)["step"].tolist() == [10, 20]
    resumed.append(30, loads[3])
    assert np.array_equal(np.load(path)["load"], np.stack([loads[0], loads[1], loads[3]]))
    ExpertLoadFile(tmp_path).append(5, np.array([[2**40, 3]]))  # a new run starts a new file; counts saturate
    assert np.load(path)["load"].tolist() == [[[2**32 - 1, 3]]]


def test_heat_map_shows_a_planted_dead_expert_and_a_collapse(tmp_path):
    rng = np.random.default_rng(0)
    balanced = rng.poisson(1000, (12, 4, 32))
    planted = balanced.copy()
    planted[:, 2, 5] = 0  # MoE layer 2's expert 5 never gets a token
    rows, per_layer = heat_rows(planted)
    assert rows.shape == (4 * 32, 12) and per_layer == 32
    assert np.isneginf(rows[2 * 32 + 5]).all() and np.isfinite(np.delete(rows, 2 * 32 + 5, axis=0)).all()
    # 61 layers of 256 experts: groups of 16 experts per row, the dead one still shows in its row
    big = rng.poisson(100, (3, 61, 256))
    big[:, 40, 77] = 0
    rows, per_layer = heat_rows(big)
    assert rows.shape == (61 * 16, 3) and np.isneginf(rows[40 * 16 + 77 // 16]).all()
    assert np.isneginf(rows).sum() == 3

    def draw(load: np.ndarray, name: str) -> np.ndarray:
        out = tmp_path / name
        out.mkdir()
        log = ExpertLoadFile(out)
        for w, window in enumerate(load):
            log.append(10 * (w + 1), window)
        png = plot_expert_load(out, name)
        assert png == out / expert_load.PLOT
        from matplotlib.image import imread

        return imread(png)[..., :3]

    def black(image: np.ndarray) -> int:
        return int((image.max(-1) == 0).sum())

    plain, dead = draw(balanced, "balanced"), draw(planted, "dead")
    assert plain.shape == dead.shape
    assert black(dead) > black(plain) + 300  # the dead expert's row, black across the whole heat map
    collapse = balanced.copy()
    collapse[4:9, 1] = 0
    collapse[4:9, 1, :2] = 16000  # layer 1 routes everything to two experts for five windows, then recovers
    image = draw(collapse, "collapse")
    assert black(image) > black(plain) + 3000 and (image[..., 0] - image[..., 2] > 0.5).sum() > 50  # black, and red
    assert plot_expert_load(tmp_path / "none", "none") is None


SMALL = [
    *SMALL_MODEL,
    "--log-every",
    "2",
    "--ckpt-every",
    "4",
    "--device",
    "cpu",
]


def test_xmoe_train_logs_the_load_and_draws_it_and_a_resume_continues_it(tmp_path, capsys):
    full, part = tmp_path / "full", tmp_path / "part"
    main(["train", "--out", str(full), "--steps", "6", *SMALL])
    assert "dead " in capsys.readouterr().out  # the progress lines name the dead and hot experts
    main(["train", "--out", str(part), "--steps", "4", *SMALL])
    main(["train", "--out", str(part), "--steps", "6", "--resume", *SMALL])
    records = np.load(full / expert_load.NAME)
    assert records["step"].tolist() == [2, 4, 6] and records["load"].shape == (3, 1, 8)
    assert (records["load"].sum(-1) == 2 * 8 * 64 * 4).all()  # each window: 2 steps of 8 x 64 tokens, top-4
    again = np.load(part / expert_load.NAME)
    assert np.array_equal(again, records)  # the resumed run's windows are the uninterrupted run's
    lines = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    assert all(len(r["dead_per_layer"]) == 1 and r["dead_experts"] == r["dead_per_layer"][0] for r in lines)
    assert (full / expert_load.PLOT).stat().st_size > 0 and (part / expert_load.PLOT).stat().st_size > 0


def test_no_moe_layers_no_load(tmp_path):
    logger = MetricsLogger(tmp_path, rank=0, total_steps=1, progress_bar=False, stream=open(os.devnull, "w"))
    logger.log(1, loss=1.0)
    logger.finish(info={})
    assert not (tmp_path / expert_load.NAME).exists() and not (tmp_path / expert_load.PLOT).exists()
