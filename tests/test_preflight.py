"""The memory pre-flight of `xmoe train` / `eval` / `generate` (xmoe/train/preflight.py, xmoe/plan/fit.py), running
out of memory during a run as one line (xmoe/train/oom.py), and a resume refused for its fingerprint before its size.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from test_cli import _args, one_line_error

from xmoe.cli import main
from xmoe.config import RECOMPUTE_MODES
from xmoe.log import configure_logging
from xmoe.plan import fit
from xmoe.train import checkpoint_verify, preflight
from xmoe.train.cli import build_run_config

GIB = 2**30
SMALL_RUN = ["--steps", "3", "--batch-size", "4", "--seq-len", "32", "--log-every", "1", "--device", "cpu"]


def _inject_free(monkeypatch, free: float) -> None:
    """The pre-flight sees ``free`` bytes of host memory (the test hook: nothing is allocated to make it so)."""
    monkeypatch.setattr(preflight, "available_memory", lambda device: (free, "of host memory available"))


def test_a_model_larger_than_this_hosts_memory_is_refused_in_one_line(tmp_path, capsys):
    """The small shape with enough layers that training needs about twice the memory available now, its weights
    well below the machine's: refused from the planner's prediction, before the model is built."""
    available = preflight.host_available()
    per_layer = 16 * 3 * 64 * 2048 * 1408  # fp32 weights, gradients and AdamW of one layer's experts
    layers = math.ceil(2 * available / per_layer)
    out = tmp_path / "r"
    argv = ["train", "--out", str(out), "--preset", "small", "--set", f"model.num_layers={layers}", *SMALL_RUN]
    err = one_line_error(capsys, argv)
    run = build_run_config(_args(*argv[1:]))
    peak = fit.predict_train_peak(run, "cpu")
    assert peak > 1.9 * available  # the independent count above: the prediction is at least the states
    assert f"needs {fit.gib(peak)} (the planner's peak) of the" in err and "of host memory available" in err, err
    assert not out.exists()  # nothing was left behind


def test_check_refuses_naming_fixes_that_fit_and_auto_runs_the_first(tmp_path, capsys, monkeypatch):
    """With the free memory injected between the needs of micro-batch 2 and 4 of a 4-sequence batch, `--fit check`
    refuses naming --micro-batch-size 2 (and its prediction), `--fit auto` trains with it and says so."""
    argv = ["train", *SMALL_RUN, "--seq-len", "256"]
    run = build_run_config(_args(*argv[1:], "--out", str(tmp_path / "x")))
    peaks = {
        mb: fit.predict_train_peak(
            dataclasses.replace(run, train=dataclasses.replace(run.train, micro_batch_size=mb)), "cpu"
        )
        for mb in (1, 2, 4)
    }
    assert peaks[1] < peaks[2] < peaks[4]
    free = (peaks[2] + peaks[4] * (1 - fit.WARN_MARGIN)) / 2 / (1 - fit.WARN_MARGIN)  # mb 2 fits the budget, 4 not
    assert peaks[2] <= free * (1 - fit.WARN_MARGIN) < peaks[4] and peaks[4] > free
    _inject_free(monkeypatch, free)
    err = one_line_error(capsys, [*argv, "--out", str(tmp_path / "check")])
    assert f"try --micro-batch-size 2 ({fit.gib(peaks[2])})" in err and "--fit auto applies the first" in err, err
    assert not (tmp_path / "check").exists()

    main([*argv, "--out", str(tmp_path / "auto"), "--fit", "auto", "--steps", "1", "--ckpt-every", "1"])
    header = capsys.readouterr().out
    assert "global batch 4 (2 x 2 micro-batches x 1 ranks)" in header, header
    assert f"memory: planned peak {fit.gib(peaks[2])} of {fit.gib(free)} of host memory available with --fit " in header
    assert "--fit auto's --micro-batch-size 2" in header, header
    assert (tmp_path / "auto" / "checkpoints" / "step_000001").is_dir()


def test_within_the_margin_warns_and_runs(capsys):
    configure_logging()
    run = build_run_config(_args("--steps", "1"))
    peak = fit.predict_train_peak(run, "cpu")
    kept, line = preflight.check_train(run, torch.device("cpu"), "check", free=peak * 1.02)
    assert kept is run and line is not None and line.endswith("(within the margin)")
    said = capsys.readouterr().out
    assert "is within 5% of the" in said and "may run out of memory" in said, said
    assert preflight.check_train(run, torch.device("cpu"), "off", free=1.0) == (run, None)


def test_fixes_are_checked_and_cheapest_first():
    """Every fix offered is predicted within the budget; those --fit auto may take change only the micro-batch (a
    divisor of the batch) and recompute, in the planner's order (fewest tricks, then the largest micro-batch);
    fewer layers come last; a resume's advice keeps the model."""
    run = build_run_config(_args("--batch-size", "32", "--seq-len", "256"))
    budget = 0.7 * fit.predict_train_peak(run, "cpu")
    fixes = fit.train_fixes(run, "cpu", budget)
    assert len(fixes) >= 3 and all(f.peak <= budget for f in fixes)
    applicable = [f.run for f in fixes if f.run is not None]
    for changed in applicable:
        assert changed.model == run.model and changed.parallel == run.parallel
        assert 32 % changed.train.micro_batch_size == 0 and fit.predict_train_peak(changed, "cpu") <= budget
    order = [(RECOMPUTE_MODES.index(r.train.recompute), -r.train.micro_batch_size) for r in applicable]
    assert order == sorted(order)
    assert fixes[0].flags == f"--micro-batch-size {applicable[0].train.micro_batch_size}"
    assert "model.num_layers" in fixes[-1].flags and fixes[-1].run is None
    assert not any("num_layers" in f.flags for f in fit.train_fixes(run, "cpu", budget, same_model=True))


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: you tried to "
            "allocate 1073741824 bytes."
        )


@pytest.mark.parametrize("phase", ["forward", "backward", "optimizer step"])
def test_out_of_memory_in_a_step_is_one_line_and_keeps_the_last_checkpoint(tmp_path, capsys, monkeypatch, phase):
    """An allocation failure injected at step 3 (a GPU's OutOfMemoryError in the forward, the CPU allocator's
    RuntimeError in the backward, MemoryError in AdamW): one line naming the step, the phase and the checkpoint of
    step 2, which verifies (sizes and crc32); nothing of step 3 is saved."""
    from xmoe.model.transformer import Transformer

    calls = {"forward": 0, "step": 0}
    forward = Transformer.forward
    adamw_step = torch.optim.AdamW.step

    def failing_forward(self, *args, **kwargs):
        calls["forward"] += 1
        if calls["forward"] == 3 and phase == "forward":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        loss = forward(self, *args, **kwargs)
        return _FailInBackward.apply(loss) if calls["forward"] == 3 and phase == "backward" else loss

    def failing_step(self, *args, **kwargs):
        calls["step"] += 1
        if calls["step"] == 3 and phase == "optimizer step":
            raise MemoryError()
        return adamw_step(self, *args, **kwargs)

    monkeypatch.setattr(Transformer, "forward", failing_forward)
    monkeypatch.setattr(torch.optim.AdamW, "step", failing_step)
    out = tmp_path / "r"
    err = one_line_error(capsys, ["train", "--out", str(out), *SMALL_RUN, "--ckpt-every", "1"])
    last = out / "checkpoints" / "step_000002"
    assert f"out of memory at step 3 of 3, in the {phase} (peak " in err, err
    assert f"the last checkpoint, {last}, is whole: continue from it with --resume" in err, err
    checkpoint_verify.verify_checkpoint(last)
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_000001", "step_000002"]


def test_out_of_memory_shows_the_traceback_with_debug(tmp_path, monkeypatch):
    from xmoe.model.transformer import Transformer

    def failing_forward(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(Transformer, "forward", failing_forward)
    with pytest.raises(ValueError, match="out of memory at step 1 of 3, in the forward") as exc:
        main(["--debug", "train", "--out", str(tmp_path / "r"), *SMALL_RUN])
    assert isinstance(exc.value.__cause__, torch.OutOfMemoryError)


def test_out_of_memory_outside_a_step_is_one_line(tmp_path, capsys, monkeypatch):
    """While a model is built (here for `xmoe train`, the pre-flight off): one line, exit 2."""
    import xmoe.train.trainer as trainer

    def no_memory(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(trainer, "build_model", no_memory)
    err = one_line_error(capsys, ["train", "--out", str(tmp_path / "r"), *SMALL_RUN, "--fit", "off"])
    assert "out of memory (MemoryError)" in err and "--debug shows where" in err, err


def test_a_resume_with_another_model_is_refused_for_that_before_its_size(tmp_path, capsys):
    """A tiny run resumed as the small preset (too large for this machine): the differing fields are named, not
    the memory."""
    out = tmp_path / "r"
    main(["train", "--out", str(out), *SMALL_RUN, "--steps", "1"])
    capsys.readouterr()
    err = one_line_error(capsys, ["train", "--out", str(out), "--resume", "--preset", "small", "--steps", "2"])
    assert "was saved by a different run" in err and "model.num_layers: checkpoint 4, now 28" in err, err
    assert "memory" not in err.split("was saved")[0], err


def test_eval_and_generate_refuse_a_forward_that_cannot_fit(tmp_path, capsys, monkeypatch):
    """Refused after the directory's sizes are checked, before its weights are read."""
    hf_models = pytest.importorskip("hf_models")
    hf_models.saved_reference("qwen3_moe", tmp_path / "hf")
    _inject_free(monkeypatch, 64 * 2**20)
    err = one_line_error(
        capsys,
        ["eval", str(tmp_path / "hf"), "--data", "markov", "--seq-len", "64", "--batch-size", "100000"],
        "eval",
    )
    assert "out of memory before the start: the model needs" in err and "lower --batch-size or --seq-len" in err
    err = one_line_error(
        capsys,
        ["generate", str(tmp_path / "hf"), "--prompt-ids", "1,2,3", "--max-new-tokens", "100000000"],
        "generate",
    )
    assert "lower the prompt or --max-new-tokens" in err, err
