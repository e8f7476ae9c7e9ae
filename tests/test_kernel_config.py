"""The kernels section of a run (KernelConfig): checked values, the environment's defaults, their precedence under
--config, --set and the flags, the choice resolved on the device and built into the MoE layers, which run under it
wherever they run, what the kernels launched, and its record in the run header, summary.json and every checkpoint's
meta.json."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by conftest.py, before anything imports triton

import json
import re
from pathlib import Path

import pytest
import torch

from xmoe.cli import _parser, main
from xmoe.config import KernelConfig, MoEConfig
from xmoe.kernels import launches
from xmoe.kernels.choice import Kernels, resolve_choice, resolve_kernels
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
        match=r"XMOE_WGRAD \('cutlass'\) must be one of auto, triton, grouped_mm, fp8 \(it "
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
    monkeypatch.setattr(grouped_wgrad, "wgrad_engine", lambda x, *args: asked.append(args[:4]) or args[4])
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
    assert bool(calls) == (engine == "grouped_mm")  # the run's choice reached the fused backward
    effective = {"backend": "triton", "wgrad": engine, "tiles": "interpreter"}
    record = {"wgrad": engine, "autotune": False, "effective": effective}
    assert f"kernels: backend triton, weight gradients {engine} (kernels.wgrad {engine})" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["kernels"] == record
    # what launched, counted by the launchers: 2 steps of the one MoE layer (the first is dense), each forward and
    # backward 4 grouped GEMMs and 3 weight gradients, the Triton ones 2 launches more (dW2, then dW1 and dW3 in one)
    wgrad_tiles = 2 if engine == "triton" else 0
    assert summary["launches"] == {"tiles": {"interpreter": 2 * (4 + wgrad_tiles)}, "wgrad": {engine: 2 * 3}}
    # and each logged window's (one step each), with the step's statistics
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    per_step = {"tiles": {"interpreter": 4 + wgrad_tiles}, "wgrad": {engine: 3}}
    assert [r["launches"] for r in records] == [per_step, per_step]
    meta = json.loads((out / "checkpoints" / "step_000002" / "meta.json").read_text())
    assert meta["config"]["kernels"] == record


@needs_cpu_grouped_mm
def test_a_layer_outside_any_trainer_runs_under_the_choice_it_was_built_with(clean_env):
    # the environment says one thing, the layer was built with another: the layer's choice is what runs, counted
    # where the kernels launch; a layer built afterwards takes the environment's default as it is then
    from xmoe.moe.layer import MoELayer

    cfg = MoEConfig(hidden_size=16, ffn_hidden_size=16, num_experts=4, top_k=2, kernel_backend="triton")
    torch.manual_seed(0)
    built = MoELayer(cfg, kernels=resolve_kernels("triton", KernelConfig(wgrad="grouped_mm"), CPU))
    clean_env.setenv("XMOE_WGRAD", "triton")
    later = MoELayer(cfg)
    later.load_state_dict(built.state_dict())
    x, g = torch.randn(3, 5, 16), torch.randn(3, 5, 16)
    grads = []
    for layer, engine in ((built, "grouped_mm"), (later, "triton")):
        before = launches.snapshot()
        layer(x).backward(g)
        # 4 grouped GEMMs (up, down; the down GEMM's backward, dx) and 3 weight gradients; the Triton ones launch
        # 2 kernels more (dW2, then dW1 and dW3 in one), torch._grouped_mm none
        wgrad_tiles = 2 if engine == "triton" else 0
        assert launches.since(before) == {"tiles": {"interpreter": 4 + wgrad_tiles}, "wgrad": {engine: 3}}
        grads.append([p.grad for p in layer.parameters()])
    for a, b in zip(*grads, strict=True):  # the two engines compute the same gradients, in another order
        assert float((a - b).norm()) <= 1e-5 * float(b.norm())


def test_a_layer_moved_where_auto_names_another_backend_is_refused():
    from xmoe.kernels import triton_ops

    built_for_gpu = Kernels("auto", "triton", triton_ops, "cuda", "auto", False)
    with pytest.raises(ValueError, match=r"resolved for cuda \(kernel_backend 'auto' -> triton\) but it runs on cpu"):
        built_for_gpu.check_device(CPU)
    Kernels("triton", "triton", triton_ops, "cuda", "auto", False).check_device(CPU)  # named: the same anywhere
    cfg = MoEConfig(hidden_size=16, ffn_hidden_size=16, num_experts=4, top_k=2, kernel_backend="torch")
    with pytest.raises(ValueError, match=r"resolved for kernel_backend 'auto', its config names 'torch'"):
        from xmoe.moe.layer import MoELayer

        MoELayer(cfg, kernels=resolve_kernels("auto"))


def test_a_layer_moved_to_another_device_type_takes_its_auto_choice_along():
    # built for a GPU (auto -> triton, a weight-gradient engine chosen), then moved: .to() resolves the same choice
    # for the device it lands on, in the layer and everything it hands its kernels to; a named backend stays
    from xmoe.kernels import reference, triton_ops
    from xmoe.moe.layer import MoELayer

    cfg = MoEConfig(hidden_size=16, ffn_hidden_size=16, num_experts=4, top_k=2)
    layer = MoELayer(cfg, kernels=Kernels("auto", "triton", triton_ops, "cuda", "grouped_mm", True))
    layer.to(CPU)
    k = layer.kernels
    assert (k.requested, k.backend, k.ops, k.device_type, k.wgrad, k.autotune) == (
        "auto",
        "torch",
        reference,
        "cpu",
        "grouped_mm",
        True,
    )
    assert layer.router.kernels is k and layer.experts.kernels is k and layer.dispatcher.kernels is k
    assert layer(torch.randn(2, 3, 16)).shape == (2, 3, 16)
    named = MoELayer(
        MoEConfig(hidden_size=16, ffn_hidden_size=16, num_experts=4, top_k=2, kernel_backend="torch"),
        kernels=Kernels("torch", "torch", reference, "cuda", "auto", False),
    )
    assert named.to(CPU).kernels.device_type == "cuda"  # named outright: nothing to resolve again


# ---------------------------------------------------------------------- the other commands that run the model


@pytest.fixture
def options_seen(monkeypatch):
    """The kernels section every MoE layer's forward ran under (the one it was built with), in call order."""
    from xmoe.moe.layer import MoELayer

    seen: list[KernelConfig] = []
    forward = MoELayer.forward

    def recorded(self, x):
        seen.append(KernelConfig(self.kernels.wgrad, self.kernels.autotune))
        return forward(self, x)

    monkeypatch.setattr(MoELayer, "forward", recorded)
    return seen


def ran_under(seen: list[KernelConfig], expected: KernelConfig) -> bool:
    return bool(seen) and all(options == expected for options in seen)


def test_bench_times_its_layer_under_its_kernel_flags(clean_env, capsys, options_seen):
    from xmoe import bench

    argv = ["bench", "--device", "cpu", "--tokens", "16", "--repeats", "1", "--wgrad", "grouped_mm", "--autotune"]
    parser, _ = _parser()
    rows = bench.run(parser.parse_args(argv))
    assert ran_under(options_seen, KernelConfig("grouped_mm", True))
    effective = {"backend": "torch", "wgrad": "autograd", "tiles": "none"}
    assert [r["kernels"] for r in rows] == [{"wgrad": "grouped_mm", "autotune": True, "effective": effective}] * 2
    assert "PFT kernels: backend torch, weight gradients autograd (kernels.wgrad grouped_mm)" in capsys.readouterr().out
    options_seen.clear()
    bench.run(parser.parse_args(argv[:-3]))  # no flags: the environment's defaults
    assert ran_under(options_seen, KernelConfig())


@needs_cpu_grouped_mm
@pytest.mark.parametrize("engine", ["triton", "grouped_mm"])
def test_a_simulated_rank_trains_under_its_kernels_section(clean_env, monkeypatch, engine):
    from xmoe.config import ParallelConfig
    from xmoe.kernels import grouped_wgrad
    from xmoe.train.simulate import measure_rank

    calls = []
    real = grouped_wgrad.grouped_mm_wgrad
    monkeypatch.setattr(grouped_wgrad, "grouped_mm_wgrad", lambda *a: calls.append(1) or real(*a))
    model = _run("--kernel-backend", "triton").model
    m = measure_rank(model, ParallelConfig(), micro_batch=2, seq_len=8, device="cpu", kernels=KernelConfig(engine))
    assert bool(calls) == (engine == "grouped_mm")  # the section reached the fused backward of every step
    effective = {"backend": "triton", "wgrad": engine, "tiles": "interpreter"}
    assert m.kernels == {"wgrad": engine, "autotune": False, "effective": effective}


def test_plan_memory_measure_takes_the_kernel_flags(clean_env, capsys, options_seen):
    argv = ["plan", "memory", "--preset", "tiny", "--layers", "2", "--gpus", "2", "--tp", "1", "--ep", "2"]
    argv += ["--micro-batch", "1", "--seq", "16", "--recompute", "none", "--device", "cpu", "--measure"]
    main([*argv, "--json", "--wgrad", "triton", "--autotune"])
    result = json.loads(capsys.readouterr().out)
    effective = {"backend": "torch", "wgrad": "autograd", "tiles": "none"}  # --measure on a CPU: the torch kernels
    assert result["kernels"] == {"wgrad": "triton", "autotune": True, "effective": effective}
    assert ran_under(options_seen, KernelConfig("triton", True))
    main(argv)
    assert "kernels: backend torch, weight gradients autograd (kernels.wgrad auto)" in capsys.readouterr().out


def test_eval_and_generate_run_under_the_kernels_section_the_run_recorded(tmp_path, capsys, clean_env, options_seen):
    from xmoe.kernels.choice import recorded_config

    out = tmp_path / "run"
    main(["train", "--out", str(out), "--device", "cpu", *TINY, "--steps", "1", "--wgrad", "grouped_mm", "--autotune"])
    capsys.readouterr()
    clean_env.setenv("XMOE_WGRAD", "triton")  # the environment's default, which the recorded section overrides
    options_seen.clear()
    main(["eval", str(out), "--data", "markov", "--seq-len", "8", "--max-windows", "4"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    effective = {"backend": "torch", "wgrad": "autograd", "tiles": "none"}
    assert result["kernels"] == {"wgrad": "grouped_mm", "autotune": True, "effective": effective}
    assert ran_under(options_seen, KernelConfig("grouped_mm", True))
    options_seen.clear()
    main(["generate", str(out), "--prompt-ids", "1,2,3", "--max-new-tokens", "3", "--ids"])
    assert ran_under(options_seen, KernelConfig("grouped_mm", True))
    # a checkpoint written before runs recorded their kernels: the environment's defaults
    assert recorded_config({"model": {}}) == KernelConfig("triton", False)


def test_a_run_trained_with_fp8_experts_is_read_unquantised_where_fp8_cannot_run(tmp_path, capsys, clean_env):
    from xmoe.kernels import fp8_formats

    out = tmp_path / "run"
    main(["train", "--out", str(out), "--device", "cpu", *TINY, "--steps", "1", "--fp8", "experts", "--wgrad", "fp8"])
    evaluate = ["eval", str(out), "--data", "markov", "--seq-len", "8", "--max-windows", "4"]
    capsys.readouterr()
    main(evaluate)  # the tests' interpreter stands in for a GPU with FP8: the experts run quantised
    quantised = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    clean_env.setattr(fp8_formats, "interpreting", lambda: False)  # now a CPU as users have it: no FP8 at all
    main(evaluate)
    captured = capsys.readouterr()
    unquantised = json.loads(captured.out.strip().splitlines()[-1])
    assert captured.err.count("was trained with FP8 experts") == 1 and "run unquantised" in captured.err, captured.err
    assert unquantised["kernels"]["wgrad"] == "auto"  # the recorded "fp8" needs FP8 experts; no gradient runs here
    assert quantised["kernels"]["wgrad"] == "fp8"
    # the same weights, the experts' products without FP8 rounding: close to the quantised loss, not equal to it
    assert unquantised["loss"] != quantised["loss"]
    assert abs(unquantised["loss"] - quantised["loss"]) <= 0.02 * quantised["loss"]
    main(["generate", str(out), "--prompt-ids", "1,2,3", "--max-new-tokens", "3", "--ids"])
    captured = capsys.readouterr()
    assert len(captured.out.strip().split(",")) == 3 and "run unquantised" in captured.err
