"""`xmoe plan memory` / `plan comm` for any model `xmoe train` can train: a preset, a config file, a Hugging Face
directory (its config.json alone), --set overrides; and the bounds that keep absurd requests from running for
minutes."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
from test_cli import one_line_error

from xmoe.cli import main
from xmoe.model.presets import get_preset

LAYOUT = ["--gpus", "16", "--gpu-mem", "80", "--gpus-per-node", "8"]


def _plan(capsys, *argv: str) -> list[str]:
    """The command's output lines after the first (which names the model by how it was given)."""
    capsys.readouterr()
    main(["plan", *argv])
    return capsys.readouterr().out.splitlines()[1:]


def _model_file(path, cfg) -> str:
    """A JSON config file describing ``cfg`` field by field (its moe section apart), no preset key."""
    fields = dataclasses.asdict(cfg)
    path.write_text(json.dumps({"moe": fields.pop("moe"), "model": fields}))
    return str(path)


def test_a_toml_a_json_and_set_plan_the_preset_they_describe(tmp_path, capsys):
    reference = _plan(capsys, "memory", "--preset", "small", "--layers", "3", *LAYOUT)
    toml = tmp_path / "run.toml"
    toml.write_text('preset = "small"\n[model]\nnum_layers = 3\n[train]\nlr = 1e-4\n')
    assert _plan(capsys, "memory", "--config", str(toml), *LAYOUT) == reference
    assert _plan(capsys, "memory", "--set", "model.num_layers=3", *LAYOUT) == reference  # the default preset, small
    described = dataclasses.replace(get_preset("small"), num_layers=3)
    assert _plan(capsys, "memory", "--config", _model_file(tmp_path / "m.json", described), *LAYOUT) == reference
    # a different model plans differently
    assert _plan(capsys, "memory", "--set", "model.num_layers=3", "--set", "moe.top_k=2", *LAYOUT) != reference
    comm = _plan(capsys, "comm", "--preset", "small", "--gpus", "64")
    assert _plan(capsys, "comm", "--set", "model.num_layers=28", "--gpus", "64") == comm  # small's own 28
    assert _plan(capsys, "comm", "--config", str(toml), "--gpus", "64") != comm  # 3 layers: a shorter step


def test_a_hugging_face_directory_is_planned_from_its_config_alone(tmp_path, capsys):
    hf_models = pytest.importorskip("hf_models")
    from xmoe.hf.checkpoint import read_model_config

    directory = tmp_path / "qwen"
    hf_models.hf_config("qwen3_moe").save_pretrained(directory)  # config.json only: there are no weights to read
    assert [p.name for p in directory.iterdir()] == ["config.json"]
    imported = read_model_config(directory)[1]
    capsys.readouterr()
    main(["plan", "memory", "--init-from", str(directory), *LAYOUT])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"xmoe plan memory: {directory} on 16 GPUs")
    assert "model: 3 layers (2 MoE), H 32, 6 experts x F 16, top-2" in out[1], out[1]
    assert out[1:] == _plan(capsys, "memory", "--config", _model_file(tmp_path / "m.json", imported), *LAYOUT)
    # an imported architecture may be changed for planning (nothing is trained)
    shorter = _plan(capsys, "memory", "--init-from", str(directory), "--set", "model.num_layers=2", *LAYOUT)
    assert "model: 2 layers (1 MoE)" in shorter[0]


def test_measure_builds_the_model_it_is_given(tmp_path, capsys):
    toml = tmp_path / "run.toml"
    toml.write_text('preset = "tiny"\n[model]\nnum_layers = 2\nhidden_size = 64\n[moe]\nnum_experts = 8\n')
    capsys.readouterr()
    main(
        ["plan", "memory", "--config", str(toml), "--gpus", "4", "--ep", "2", "--tp", "1", "--seq", "32"]
        + ["--micro-batch", "1", "--recompute", "none", "--measure", "--json", "--device", "cpu"]
    )
    result = json.loads(capsys.readouterr().out)
    assert result["layout"]["layers"] == 2 and result["layout"]["ep"] == 2 and result["preset"] == str(toml)
    assert 0.8 < result["ratio"] < 1.2, result["ratio"]  # the planner's peak of that model, measured


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["memory", "--layers", "1000000"], "--layers (1000000) must be <= 1024"),
        (["memory", "--set", "model.num_layers=1000000"], "has 1000000 layers; `xmoe plan memory` takes at most 1024"),
        (["memory", "--preset", "tiny", "--measure", "--gpus", "1000000"], "must be <= 65536 with --measure"),
    ],
)
def test_absurd_plans_are_refused_at_once(capsys, argv, expected):
    start = time.perf_counter()
    err = one_line_error(capsys, ["plan", *argv], "plan")
    assert expected in err, err
    assert time.perf_counter() - start < 10
