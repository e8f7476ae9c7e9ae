"""The CLI as a person sees it: one-line errors (exit 2) for every bad input, typed config values, flag
precedence, help with defaults and examples, quick start-up, and the outputs named at the end of a run."""

from __future__ import annotations

import argparse
import collections
import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from xmoe.cli import _parser, main
from xmoe.train import checkpoint as ckpt
from xmoe.train import checkpoint_dir
from xmoe.train.cli import build_run_config
from xmoe.train.metrics import MetricsLogger, describe_outputs, fit_postfix, summary_text

ROOT = Path(__file__).resolve().parents[1]


def one_line_error(capsys, argv: list[str], command: str = "train") -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith(f"xmoe {command}: error: "), err
    return err


@pytest.mark.parametrize(
    "setting, expected",
    [
        ("train.steps=true", "train.steps (True) must be an integer, not bool"),
        ("moe.top_k=abc", "moe.top_k ('abc') must be an integer, not str"),
        ("moe.top_k=2.5", "moe.top_k (2.5) must be an integer"),
        ("moe.num_experts=16.0", "moe.num_experts (16.0) must be an integer"),
        ("moe.top_k=[1]", "moe.top_k ([1]) must be an integer"),
        ("moe.score_func=1", "moe.score_func (1) must be one of 'softmax', 'sigmoid'"),
        ("moe.capacity_factor=abc", "moe.capacity_factor ('abc') must be a number or null"),
        ("model.norm_eps=-1", "norm_eps (-1.0) must be finite and > 0"),
        ("train.lr=NaN", "lr (nan) must be finite and > 0"),
        ("train.lr=0", "lr (0.0) must be finite and > 0"),
        ("train.beta2=1", "beta2 (1.0) must be in [0, 1)"),
        ("train.optimizer=sgd", "train.optimizer ('sgd') must be 'auto', 'torch' or 'triton'"),
        ("parallel.sequence_parallel=1", "parallel.sequence_parallel (1) must be true or false"),
        ("data.path=3", "data.path (3) must be a string, not int"),
        ("data.tokenizer=", "data.tokenizer ('') is empty; name 'bytes' or a tokenizers JSON file"),
    ],
)
def test_config_values_are_type_and_range_checked(tmp_path, capsys, setting, expected):
    err = one_line_error(capsys, ["train", "--out", str(tmp_path / "r"), "--set", setting, "--dry-run"])
    assert expected in err


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--tp", "0"], "--tp (0) must be >= 1"),
        (["--ep", "0"], "--ep (0) must be >= 1"),
        (["--dp", "-1"], "--dp (-1) must be >= 1"),
        (["--lr", "inf"], "lr (inf) must be finite and > 0"),
        (["--lr", "-3"], "lr (-3.0) must be finite and > 0"),
        (["--steps", "0"], "steps (0) must be finite and > 0"),
        (["--out", ""], "--out ('') must name a run directory"),
        (["--ep", "3"], "num_experts (16) must be divisible by the expert-parallel degree ep (3)"),
        (["--allow-changes"], "--allow-changes only applies with --resume"),
        (
            ["--batch-size", "10", "--micro-batch-size", "4"],
            "per-rank batch (10) must be divisible by micro_batch_size (4)",
        ),
        (["--batch-size", "10", "--dp", "4"], "global batch (10) must be divisible by the 4 data-parallel ranks"),
        (["--seq-len", "4096"], "seq_len (4096) exceeds the model's max_seq_len (256)"),
        (["--seed", str(10**23)], f"seed ({10**23}) must be in [0, 2**63)"),
        (["--device", "tpu"], "--device ('tpu') must be auto, cpu, cuda or cuda:N"),
    ],
)
def test_bad_train_flags(tmp_path, capsys, argv, expected):
    base = ["train", "--dry-run"] + ([] if "--out" in argv else ["--out", str(tmp_path / "r")])
    assert expected in one_line_error(capsys, base + argv)


def test_config_file_errors_name_the_file(tmp_path, capsys):
    cases = {
        "bin.toml": (bytes(range(256)), "is not text"),
        "scalar.toml": (b"train = 5\n", "section train must be a table of fields"),
        "broken.toml": (b"[train\n", "is not valid TOML"),
        "broken.json": (b"{", "is not valid JSON"),
        "list.json": (b"[1]", "must hold sections"),
        "types.toml": (b"[moe]\ntop_k = 'four'\n", "moe.top_k ('four') must be an integer"),
        "preset.toml": (b"preset = 3\n", "preset (3) must be a string naming a preset"),
        "both.toml": (b"preset = 'small'\ninit_from = 'hf'\n", "both choose the architecture"),
        "unknown.toml": (b"name = 'a'\n", "unknown sections ['name']"),
    }
    for name, (content, expected) in cases.items():
        (tmp_path / name).write_bytes(content)
        err = one_line_error(capsys, ["train", "--dry-run", "--config", str(tmp_path / name)])
        assert expected in err and (name in err or "types" in name), err
    (tmp_path / "dir.toml").mkdir()
    assert "is a directory" in one_line_error(capsys, ["train", "--dry-run", "--config", str(tmp_path / "dir.toml")])


def test_data_file_errors_name_the_file(tmp_path, capsys):
    (tmp_path / "random.npy").write_bytes(os.urandom(700))
    np.save(tmp_path / "objects.npy", np.array([1, "a", None], dtype=object))
    (tmp_path / "dir.npy").mkdir()
    expected = {"random.npy": "is not a .npy file", "objects.npy": "holds Python objects", "dir.npy": "is a directory"}
    for i, (name, message) in enumerate(expected.items()):
        err = one_line_error(
            capsys,
            [
                "train",
                "--out",
                str(tmp_path / f"r{i}"),
                "--device",
                "cpu",
                "--steps",
                "1",
                "--data",
                str(tmp_path / name),
            ],
        )
        assert message in err and name in err, err


def _args(*argv: str) -> argparse.Namespace:
    parser, _ = _parser()
    return parser.parse_args(["train", *argv])


def test_precedence_defaults_file_set_flags_and_dp_after_merge(tmp_path, monkeypatch):
    cfg = tmp_path / "run.toml"
    cfg.write_text("[parallel]\nep = 4\n[train]\nsteps = 50\nlr = 1e-3\n")
    monkeypatch.setenv("WORLD_SIZE", "8")
    run = build_run_config(_args("--config", str(cfg)))
    assert (run.parallel.ep, run.parallel.dp, run.train.steps) == (4, 2, 50)  # dp from the file's ep
    run = build_run_config(_args("--config", str(cfg), "--set", "train.steps=60", "--ep", "2", "--lr", "2e-3"))
    assert (run.parallel.ep, run.parallel.dp, run.train.steps, run.train.lr) == (2, 4, 60, 2e-3)  # flags win
    run = build_run_config(_args("--config", str(cfg), "--set", "parallel.ep=8", "--steps", "70"))
    assert (run.parallel.ep, run.parallel.dp, run.train.steps) == (8, 1, 70)


def test_optimizer_flag_and_setting():
    assert build_run_config(_args()).train.optimizer == "auto"
    assert build_run_config(_args("--optimizer", "torch")).train.optimizer == "torch"
    assert build_run_config(_args("--set", "train.optimizer=triton")).train.optimizer == "triton"


def test_the_run_data_and_preset_come_from_the_file_then_set_then_flags(tmp_path):
    from xmoe.config import DataConfig
    from xmoe.model.presets import get_preset

    cfg = tmp_path / "run.toml"
    cfg.write_text('preset = "small"\n[data]\npath = "a.npy"\nval_path = "v.npy"\n')
    run = build_run_config(_args("--config", str(cfg)))
    # paths in the file are the file's: beside it
    assert (run.preset, run.data.path, run.data.val_path) == ("small", str(tmp_path / "a.npy"), str(tmp_path / "v.npy"))
    assert run.data.tokenizer == "bytes"
    assert run.model == get_preset("small") and run.init_from is None
    run = build_run_config(_args("--config", str(cfg), "--set", "data.path=b.npy", "--set", "data.tokenizer=t.json"))
    assert (run.data.path, run.data.tokenizer) == ("b.npy", "t.json")
    run = build_run_config(
        _args(
            "--config",
            str(cfg),
            "--set",
            "data.path=b.npy",
            "--data",
            "c.npy",
            "--preset",
            "tiny",
            "--val-data",
            "markov",
        )
    )
    assert (run.preset, run.data.path, run.data.val_path, run.model) == ("tiny", "c.npy", "markov", get_preset("tiny"))
    assert build_run_config(_args()).data == DataConfig()  # the synthetic source


def test_a_config_file_describes_a_whole_run(tmp_path):
    # the example run: model, schedule, layout and data from the file; the invocation adds --out and --device
    out = tmp_path / "r"
    main(["train", "--config", str(ROOT / "docs" / "example_run.toml"), "--out", str(out), "--device", "cpu"])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [5, 10, 15, 20] and "val_loss" in records[-1]
    config = json.loads((out / "checkpoints" / "step_000020" / "meta.json").read_text())["config"]
    assert (config["preset"], config["init_from"], config["model"]["num_layers"]) == ("tiny", None, 2)
    # the data section as run, with the fingerprint a resume compares
    assert config["data"] == {
        "path": "markov",
        "val_path": "markov",
        "tokenizer": "bytes",
        "documents": "concat",
        "eos_id": None,
        "vocab_size": 256,
        "name": config["data"]["name"],
    } and config["data"]["name"].startswith("markov(")


def test_a_model_that_cannot_fit_is_refused_before_anything_is_allocated(tmp_path, capsys):
    out = tmp_path / "r"
    err = one_line_error(
        capsys, ["train", "--out", str(out), "--device", "cpu", "--set", "moe.num_experts=1000000000000"]
    )
    assert "7.41e+16 parameters" in err and "moe.num_experts (1000000000000)" in err and "GiB of memory" in err, err
    assert not out.exists()


def test_fp8_experts_on_a_device_without_fp8_are_refused_before_the_run_starts(tmp_path, capsys, monkeypatch):
    from xmoe.kernels import fp8_formats

    monkeypatch.setattr(fp8_formats, "interpreting", lambda: False)  # the tests' interpreter otherwise stands in
    out = tmp_path / "r"
    err = one_line_error(capsys, ["train", "--out", str(out), "--device", "cpu", "--fp8", "experts", "--steps", "1"])
    assert "moe.fp8='experts' needs a GPU with FP8 matrix instructions" in err and "--fp8 off" in err, err
    assert not out.exists()  # the run directory this start created has gone with it
    assert "parameters" not in capsys.readouterr().out  # refused before the model was built and announced


def test_missing_paths_name_symlink_loops(tmp_path, capsys):
    loop = tmp_path / "loop.npy"
    loop.symlink_to(loop)
    err = one_line_error(capsys, ["train", "--out", str(tmp_path / "r"), "--device", "cpu", "--data", str(loop)])
    assert "is a symlink loop" in err, err
    dangling = tmp_path / "gone.toml"
    dangling.symlink_to(tmp_path / "nowhere.toml")
    err = one_line_error(capsys, ["train", "--dry-run", "--config", str(dangling)])
    assert "is a symlink to" in err and "which does not exist" in err, err


def test_val_fraction_names_what_it_leaves_for_training(tmp_path, capsys):
    np.save(tmp_path / "t.npy", np.arange(20000, dtype=np.uint16) % 256)
    err = one_line_error(
        capsys,
        [
            "train",
            "--out",
            str(tmp_path / "r"),
            "--device",
            "cpu",
            "--steps",
            "1",
            "--data",
            str(tmp_path / "t.npy"),
            "--val-fraction",
            "0.999",
        ],
    )
    assert "leaves 20 of the 20000 tokens" in err and "lower val_fraction" in err, err


def test_dispatcher_rbd_without_expert_parallelism_says_so(tmp_path):
    with pytest.warns(UserWarning, match="'rbd'.*does nothing with ep == 1"):
        build_run_config(_args("--dispatcher", "rbd"))


def test_plan_and_bench_sizes_are_bounded(capsys):
    assert "--mc-tokens (1000000000) must be <= 262144" in one_line_error(
        capsys, ["plan", "comm", "--mc-tokens", "1000000000"], "plan"
    )
    assert "--gpus (1000000000) must be <= 1048576" in one_line_error(
        capsys, ["plan", "memory", "--gpus", "1000000000"], "plan"
    )
    err = one_line_error(capsys, ["bench", "--device", "cpu", "--tokens", "100000000000"], "bench")
    assert "--tokens (100000000000) needs at least" in err and "lower --tokens" in err, err


def test_plan_memory_on_a_large_world_is_quick():
    import time

    from xmoe.model.presets import get_preset
    from xmoe.plan.layouts import search_layouts

    start = time.perf_counter()
    search_layouts(get_preset("small"), 65536, 80.0)  # minutes when every rank's EP group was looked up
    assert time.perf_counter() - start < 30


def test_plan_and_bench_flags_are_checked(capsys):
    assert "--gpu-mem (-1.0) must be a finite number > 0" in one_line_error(
        capsys, ["plan", "memory", "--gpu-mem", "-1"], "plan"
    )
    assert "--gpus (0) must be >= 1" in one_line_error(capsys, ["plan", "comm", "--gpus", "0"], "plan")
    assert "--inter-bw (0.0) must be a finite number > 0" in one_line_error(
        capsys, ["plan", "comm", "--inter-bw", "0"], "plan"
    )
    assert "--repeats (0) must be >= 1" in one_line_error(capsys, ["bench", "--repeats", "0"], "bench")
    assert "--device ('tpu') must be auto, cpu or cuda" in one_line_error(capsys, ["bench", "--device", "tpu"], "bench")


def test_plan_memory_says_which_gpu_it_assumes_and_comm_prints_each_row_once(capsys):
    main(["plan", "memory", "--preset", "small"])
    text = capsys.readouterr().out
    assert "GPU memory: 64 GiB assumed" in text or "this machine's" in text
    main(["plan", "comm", "--preset", "small", "--gpus", "64"])
    rows = capsys.readouterr().out.split("scaling")[1].splitlines()[2:]
    bodies = [row.split(None, 1)[1].removesuffix("  <-") for row in rows if row.strip()]
    assert len(bodies) == len(set(bodies)) and any(row.split()[0] == "64-1024" for row in rows)


def test_checkpoint_and_os_errors_are_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    err = one_line_error(capsys, ["train", "--out", str(blocker / "run"), "--device", "cpu", "--steps", "1"])
    assert str(blocker) in err
    err = one_line_error(capsys, ["train", "--out", str(blocker), "--device", "cpu", "--steps", "1"])
    assert "is a file, not a directory" in err


@pytest.mark.parametrize("failure", ["enospc", "stream_writer"])
def test_disk_full_is_named(tmp_path, monkeypatch, failure):
    import torch.nn as nn

    def full(*args, **kwargs):
        if failure == "enospc":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 704 vs 598")

    monkeypatch.setattr(ckpt.torch, "save", full)
    if failure == "stream_writer":  # torch.save does not say why; the free space does
        usage = collections.namedtuple("usage", "total used free")(1 << 30, (1 << 30) - (1 << 20), 1 << 20)
        monkeypatch.setattr(checkpoint_dir.shutil, "disk_usage", lambda path: usage)
    with pytest.raises(ckpt.CheckpointError, match="disk full on the filesystem of"):
        ckpt.save_checkpoint(tmp_path, 1, nn.Linear(2, 2))
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("step_")]


@pytest.mark.parametrize("when", ["scheduled", "signal"])
def test_disk_full_in_the_tensor_data_is_one_line_and_keeps_older_checkpoints(tmp_path, capsys, monkeypatch, when):
    import signal

    import torch.distributed.checkpoint.filesystem as dcp_fs

    from xmoe.train import trainer

    original_write, original_step = dcp_fs._write_item, trainer.Trainer.train_step

    def write_item(*args, **kwargs):  # what torch.save inside DCP raises when the disk fills under it
        if (tmp_path / "r" / "checkpoints" / "step_000002").is_dir():
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        return original_write(*args, **kwargs)

    def train_step(self, *args, **kwargs):
        if self.step == 2 and when == "signal":
            os.kill(os.getpid(), signal.SIGTERM)
        return original_step(self, *args, **kwargs)

    usage = collections.namedtuple("usage", "total used free")(1 << 30, (1 << 30) - (3 << 20), 3 << 20)
    monkeypatch.setattr(dcp_fs, "_write_item", write_item)
    monkeypatch.setattr(trainer.Trainer, "train_step", train_step)
    monkeypatch.setattr(checkpoint_dir.shutil, "disk_usage", lambda path: usage)
    out = tmp_path / "r"
    err = one_line_error(
        capsys,
        [
            "train",
            "--out",
            str(out),
            "--device",
            "cpu",
            "--steps",
            "4",
            "--ckpt-every",
            "2",
            "--batch-size",
            "2",
            "--seq-len",
            "16",
        ],
    )
    assert "disk full on the filesystem of" in err and "(3 MiB free)" in err and str(out) in err, err
    assert [s for s, _ in checkpoint_dir.complete_checkpoints(out)] == [2]
    ckpt.read_meta(out / "checkpoints" / "step_000002")  # the older checkpoint is whole


def test_help_defaults_examples_version_and_usage(capsys):
    parser, subs = _parser()
    train_help, bench_help = subs["train"].format_help(), subs["bench"].format_help()
    for flag in ("--batch-size", "--lr", "--log-every", "--ckpt-every"):
        assert "(default" in train_help.split(flag, 2)[-1].split("--", 1)[0], flag
    assert "(default 5)" in bench_help and "default auto" in bench_help
    plan_parsers = subs["plan"]._subparsers._group_actions[0].choices
    mem_help, comm_help = plan_parsers["memory"].format_help(), plan_parsers["comm"].format_help()
    assert "GPUs per node (default 8)" in mem_help and "(default 2)" in mem_help
    assert "(default 64)" in comm_help and "(default ep_first)" in comm_help and "(default 0)" in comm_help
    for text in (train_help, bench_help, mem_help, parser.format_help()):
        assert text.rstrip().split("examples:")[1].count("xmoe") >= 2
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("xmoe 0.")
    with pytest.raises(SystemExit) as exc:
        main([])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("usage:") == 1


def test_help_imports_neither_torch_nor_numpy():
    code = "import sys; from xmoe.cli import _parser; _parser(); print('torch' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    ).stdout
    assert out.split() == ["False", "False"]


def test_debug_shows_the_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "xmoe", "--debug", "train", "--dry-run", "--tp", "0"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "--tp (0)" in proc.stderr


# ----------------------------------------------------------------------------------------- progress, outputs


def test_postfix_fits_and_keeps_the_most_useful_fields():
    record = {
        "loss": 3.21,
        "tokens_per_s": 12345.0,
        "tflops": 1.5,
        "mfu": 0.25,
        "grad_norm": 0.5,
        "lr": 1e-3,
        "mem_bytes": 2**31,
    }
    assert fit_postfix(record, 200) == "loss 3.210, 12.3k tok/s, MFU 25.0%, gnorm 0.50, lr 1.0e-03, mem 2.0 GiB"
    assert fit_postfix(record, 30) == "loss 3.210, 12.3k tok/s"
    assert fit_postfix({**record, "mfu": None}, 40) == "loss 3.210, 12.3k tok/s, 1.50 TFLOP/s"
    assert fit_postfix(record, 3) == "loss 3.210"


def test_bar_starts_at_the_first_log_and_outputs_are_named(tmp_path, capsys):
    log = MetricsLogger(tmp_path, rank=0, total_steps=2, progress_bar=True)
    assert capsys.readouterr().err == ""  # nothing drawn before the trainer's header lines
    log.log(1, loss=2.0, tokens_per_s=1000.0, mem_bytes=3 * 2**30)
    log.log(2, loss=1.5, tokens_per_s=3000.0, mem_bytes=3 * 2**30)
    summary = log.finish(status="stopped by SIGTERM at step 2")
    assert "2/2" in capsys.readouterr().err
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "stopped by SIGTERM at step 2"
    text = summary_text(summary)
    assert "final loss 1.5 nats/token" in text and "3.0k tokens/s" in text and "peak memory 3.00 GiB" in text
    assert "minutes" in text and "(stopped by SIGTERM at step 2)" in text
    (tmp_path / "checkpoints" / "step_000002").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_000002" / "COMPLETE").write_bytes(b"x" * 3000)
    listing = describe_outputs(tmp_path)
    for name in ("metrics.jsonl", "summary.json", "loss.png", "checkpoints/step_000002/", "2.9 KiB"):
        assert name in listing, listing


def test_loss_plot_has_title_and_unit(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    log = MetricsLogger(tmp_path, rank=0, total_steps=1, progress_bar=False, stream=open(os.devnull, "w"))
    log.log(1, loss=2.0)
    log.finish(title="runs/a (preset tiny)")
    ax = saved[0].axes[0]
    assert ax.get_title() == "runs/a (preset tiny)" and ax.get_ylabel() == "loss (nats/token)"
