"""Small inputs that passed silently or were refused without a reason: a byte-order mark, paths inside a config file,
validation data that is the training data, an end token outside the vocabulary, a dry run of a refused kernel
choice, a benchmark layer too large for the machine."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from test_cli import _args, one_line_error

from xmoe import bench
from xmoe.train.run_config import build_run_config


def test_a_config_file_with_a_byte_order_mark_is_read(tmp_path):
    for suffix, text in ((".toml", "[train]\nsteps = 7\n"), (".json", json.dumps({"train": {"steps": 7}}))):
        cfg = tmp_path / f"run{suffix}"
        cfg.write_bytes(b"\xef\xbb\xbf" + text.encode())
        assert build_run_config(_args("--config", str(cfg))).train.steps == 7


def test_paths_in_a_config_file_are_relative_to_the_file(tmp_path, monkeypatch):
    conf = tmp_path / "conf"
    conf.mkdir()
    cfg = conf / "run.toml"
    cfg.write_text(
        '[data]\npath = "corpus.npy"\nval_path = "0.5:held/a.npy,0.5:/abs/b.npy"\ntokenizer = "tok/tokenizer.json"\n'
    )
    monkeypatch.chdir(tmp_path)  # the file is named from elsewhere: its paths still mean beside it
    run = build_run_config(_args("--config", "conf/run.toml"))
    assert run.data.path == str(Path("conf") / "corpus.npy")
    assert run.data.val_path == f"0.5:{Path('conf') / 'held/a.npy'},0.5:/abs/b.npy"
    assert run.data.tokenizer == str(Path("conf") / "tok/tokenizer.json")
    cfg.write_text('[data]\npath = "markov:order=2"\nval_path = "markov"\ntokenizer = "bytes"\n')
    run = build_run_config(_args("--config", "conf/run.toml"))  # keywords stay keywords
    assert (run.data.path, run.data.val_path, run.data.tokenizer) == ("markov:order=2", "markov", "bytes")
    run = build_run_config(_args("--config", "conf/run.toml", "--data", "here.npy"))  # flags: the working directory
    assert run.data.path == "here.npy"


def test_validation_data_that_is_the_training_data_is_refused(tmp_path, capsys):
    data = tmp_path / "tokens.npy"
    np.save(data, np.arange(4000, dtype=np.uint16) % 256)
    twin = tmp_path / "twin.npy"
    twin.symlink_to(data)
    for val in (str(data), str(twin), f"0.5:{tmp_path / 'other.npy'},0.5:{data}"):
        err = one_line_error(capsys, ["train", "--data", str(data), "--val-data", val, "--out", str(tmp_path / "r")])
        assert f"(--val-data / data.val_path: {val}) is the training data (--data / data.path: {data})" in err, err
    assert build_run_config(_args("--val-data", "markov")).data.val_path == "markov"  # held-out samples


def test_an_end_token_outside_the_vocabulary_is_refused(tmp_path, capsys):
    from hf_models import saved_reference

    saved_reference("mixtral", tmp_path)
    vocab = json.loads((tmp_path / "config.json").read_text())["vocab_size"]
    for eos in (vocab, -2):
        err = one_line_error(capsys, ["generate", str(tmp_path), "--prompt-ids", "1", "--eos-id", str(eos)], "generate")
        assert f"--eos-id ({eos}) is outside the vocabulary [0, {vocab})" in err and "-1 for no end token" in err, err


def test_a_dry_run_refuses_fp8_weight_gradients_without_fp8_experts(tmp_path, capsys):
    err = one_line_error(capsys, ["train", "--dry-run", "--wgrad", "fp8", "--out", str(tmp_path / "r")])
    assert "kernels.wgrad='fp8'" in err and "--fp8 experts" in err, err


def test_a_benchmark_layer_larger_than_the_machine_is_refused_with_one_that_fits(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(bench, "device_memory", lambda device: 16 * 2**30)

    def allocated(*args, **kwargs):
        raise AssertionError("the layer was built")

    monkeypatch.setattr(bench, "bench_layer", allocated)
    err = one_line_error(capsys, ["bench", "--device", "cpu", "--shape", "super"], "bench")
    # 256 experts of 3 x 7168 x 2560 fp32 weights and a 256 x 7168 router, with their gradients
    weights = 2 * 256 * (3 * 7168 * 2560 + 7168) * 4
    assert bench.memory_need("super", 2048, torch.float32)[0] == weights
    assert "--shape super with --tokens (2048) needs at least" in err and f"{weights / 2**30:.3g} GiB of weights" in err
    assert "than this cpu device's 16 GiB; try --shape small (" in err, err  # medium needs 22.5 GiB
    bench.check_fits("tiny", 2048, torch.device("cpu"), torch.float32)  # fits: no error
