"""The kernels section of a run (KernelConfig): checked values, the environment's defaults, their precedence under
--config, --set and the flags, the choice resolved on the device and reaching the kernels, and its record in the
run header, summary.json and every checkpoint's meta.json."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by conftest.py, before anything imports triton

import json
import re
from pathlib import Path

import pytest
import torch

from xmoe.cli import _parser, main
from xmoe.config import KernelConfig
from xmoe.kernels import tiles
from xmoe.kernels.choice import resolve_choice
from xmoe.train.cli import build_run_config

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
# one MoE layer of 4 experts on 16 tokens: seconds in Triton's interpreter
TINY = [
    "--set",
    "model.hidden_size=16",
    "--set",
    "moe.hidden_size=16",
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
    "8",
]


def _run(*argv: str):
    parser, _ = _parser()
    return build_run_config(parser.parse_args(["train", *TINY, *argv]))


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.delenv("XMOE_WGRAD", raising=False)
    monkeypatch.delenv("XMOE_AUTOTUNE", raising=False)
    return monkeypatch


def test_values_are_checked_and_the_errors_name_them(clean_env):
    assert KernelConfig() == KernelConfig(wgrad="auto", autotune=False)
    with pytest.raises(ValueError, match=r"kernels.wgrad \('cutlass'\) must be one of 'auto', 'triton', 'grouped_mm'"):
        KernelConfig(wgrad="cutlass")
    with pytest.raises(ValueError, match=r"kernels.autotune \(1\) must be true or false, not int"):
        _run("--set", "kernels.autotune=1")
    with pytest.raises(ValueError, match=r"unknown field kernels\.legacy; valid fields: autotune, wgrad"):
        _run("--set", "kernels.legacy=true")


def test_the_environment_gives_the_defaults_when_a_config_is_made(clean_env):
    clean_env.setenv("XMOE_WGRAD", "triton")
    clean_env.setenv("XMOE_AUTOTUNE", "1")
    assert KernelConfig() == KernelConfig(wgrad="triton", autotune=True)  # read now, not when xmoe was imported
    assert _run().kernels == KernelConfig(wgrad="triton", autotune=True)
    clean_env.setenv("XMOE_WGRAD", "cutlass")
    with pytest.raises(
        ValueError,
        match=r"XMOE_WGRAD \('cutlass'\) must be one of auto, triton, grouped_mm \(it "
        r"sets the default of kernels.wgrad\)",
    ):
        KernelConfig()
    clean_env.setenv("XMOE_WGRAD", "auto")
    clean_env.setenv("XMOE_AUTOTUNE", "yes")
    with pytest.raises(ValueError, match=r"XMOE_AUTOTUNE \('yes'\) must be one of 0, 1"):
        KernelConfig()


def test_precedence_environment_file_set_flags(tmp_path, clean_env):
    clean_env.setenv("XMOE_WGRAD", "triton")
    clean_env.setenv("XMOE_AUTOTUNE", "1")
    cfg = tmp_path / "run.toml"
    cfg.write_text("[kernels]\nwgrad = 'grouped_mm'\n")
    assert _run("--config", str(cfg)).kernels == KernelConfig("grouped_mm", True)
    assert _run("--config", str(cfg), "--set", "kernels.wgrad=auto").kernels == KernelConfig("auto", True)
    run = _run("--config", str(cfg), "--set", "kernels.wgrad=auto", "--wgrad", "triton", "--no-autotune")
    assert run.kernels == KernelConfig("triton", False)


def test_the_environment_is_read_in_one_place():
    # XMOE_WGRAD / XMOE_AUTOTUNE only as the kernels section's defaults; TRITON_INTERPRET once, by the kernels
    readers: dict[str, set[str]] = {
        "XMOE_WGRAD": set(),
        "XMOE_AUTOTUNE": set(),
        "TRITON_INTERPRET": set(),
        "XMOE_KERNELS_LEGACY": set(),
    }
    for path in (ROOT / "xmoe").rglob("*.py"):
        text = path.read_text()
        for name in readers:
            if re.search(rf'environ[^\n]*"{name}"|_from_env\("{name}"', text):
                readers[name].add(path.relative_to(ROOT).as_posix())
    assert readers == {
        "XMOE_WGRAD": {"xmoe/config.py"},
        "XMOE_AUTOTUNE": {"xmoe/config.py"},
        "TRITON_INTERPRET": {"xmoe/kernels/_common.py"},
        "XMOE_KERNELS_LEGACY": set(),
    }


def test_the_choice_resolves_on_the_device(clean_env, monkeypatch):
    cpu_default = resolve_choice(_run(), CPU, torch.float32)  # auto on CPU: the torch backend, no Triton GEMMs
    assert (cpu_default.backend, cpu_default.wgrad, cpu_default.tiles) == ("torch", "autograd", "none")
    padded = resolve_choice(_run("--kernel-backend", "triton", "--dispatcher", "padded"), CPU, torch.float32)
    assert (padded.backend, padded.wgrad, padded.tiles) == ("triton", "autograd", "none")  # its experts: bmm
    triton = resolve_choice(_run("--kernel-backend", "triton"), CPU, torch.float32)
    assert (triton.backend, triton.wgrad, triton.tiles) == ("triton", "triton", "interpreter")  # auto: not sm_90
    forced = resolve_choice(_run("--kernel-backend", "triton", "--wgrad", "grouped_mm"), CPU, torch.float32)
    assert forced.wgrad == "grouped_mm"
    assert forced.record() == {
        "wgrad": "grouped_mm",
        "autotune": False,
        "effective": {"backend": "triton", "wgrad": "grouped_mm", "tiles": "interpreter"},
    }
    assert forced.describe() == (
        "kernels: backend triton, weight gradients grouped_mm (kernels.wgrad grouped_mm), "
        "tiles interpreter (kernels.autotune off)"
    )
    # "auto" is asked for the rows a rank routes on average: T * K, at most E * C kept, over E / ep experts
    from xmoe.kernels import grouped_wgrad

    asked = []
    monkeypatch.setattr(grouped_wgrad, "wgrad_engine", lambda x, *args: asked.append(args) or tiles.OPTIONS.wgrad)
    expert_parallel = ["--kernel-backend", "triton", "--ep", "2", "--dp", "1", "--batch-size", "8"]
    assert resolve_choice(_run(*expert_parallel), CPU, torch.float32).wgrad == "auto"
    resolve_choice(_run(*expert_parallel, "--set", "moe.capacity_factor=0.5"), CPU, torch.float32)
    # T = 4 sequences of 8 tokens, K = 2: 64 rows; capacity factor 0.5: C = 8 slots for each of 4 experts, 32 kept
    assert asked == [(64, 2, 16, 16), (32, 2, 16, 16)]


needs_cpu_grouped_mm = pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch has no _grouped_mm")


@needs_cpu_grouped_mm
@pytest.mark.parametrize("engine", ["triton", "grouped_mm"])
def test_the_run_applies_its_choice_and_records_it(tmp_path, capsys, clean_env, monkeypatch, engine):
    from xmoe.kernels import grouped_wgrad

    calls = []
    real = grouped_wgrad.grouped_mm_wgrad
    monkeypatch.setattr(grouped_wgrad, "grouped_mm_wgrad", lambda *a: calls.append(1) or real(*a))
    before = tiles.OPTIONS
    out = tmp_path / "run"
    main(
        [
            "train",
            "--out",
            str(out),
            "--device",
            "cpu",
            *TINY,
            "--steps",
            "2",
            "--log-every",
            "1",
            "--kernel-backend",
            "triton",
            "--wgrad",
            engine,
        ]
    )
    assert tiles.OPTIONS is before  # applied for the run only
    assert bool(calls) == (engine == "grouped_mm")  # the run's choice reached the fused backward
    effective = {"backend": "triton", "wgrad": engine, "tiles": "interpreter"}
    record = {"wgrad": engine, "autotune": False, "effective": effective}
    assert f"kernels: backend triton, weight gradients {engine} (kernels.wgrad {engine})" in capsys.readouterr().out
    assert json.loads((out / "summary.json").read_text())["kernels"] == record
    meta = json.loads((out / "checkpoints" / "step_000002" / "meta.json").read_text())
    assert meta["config"]["kernels"] == record
