"""Hugging Face directory -> `xmoe train --init-from` -> `xmoe export` -> transformers; `xmoe eval` against a direct
computation; validation during training; an imported model under expert parallelism."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hf_models import FAMILIES, VOCAB, load_reference, rel_err, saved_reference

from xmoe.cli import main
from xmoe.infer import load_source
from xmoe.train.data import build_dataset
from xmoe.train.loader import TokenLoader

SEQ, BATCH = 16, 4


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def token_file(tmp_path: Path, n: int = 4000) -> Path:
    path = tmp_path / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, VOCAB, n).astype(np.int64))
    return path


def init_args(hf_dir: Path, data: Path, run: Path, *extra: str) -> list[str]:
    return [
        "train",
        "--init-from",
        str(hf_dir),
        "--data",
        str(data),
        "--out",
        str(run),
        "--device",
        "cpu",
        "--seq-len",
        str(SEQ),
        "--batch-size",
        str(BATCH),
        "--log-every",
        "1",
        *extra,
    ]


def first_batch_loss(ref, data: Path) -> float:
    """transformers' mean next-token loss on the batch `xmoe train` takes first."""
    inputs, targets = next(TokenLoader(build_dataset(str(data), SEQ, VOCAB, seed=0), BATCH))
    with torch.no_grad():
        logits = ref(inputs).logits
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_init_from_trains_from_the_imported_weights_and_exports(family: str, tmp_path) -> None:
    ref = saved_reference(family, tmp_path / "hf")
    data, run = token_file(tmp_path), tmp_path / "run"
    main(init_args(tmp_path / "hf", data, run, "--steps", "3", "--ckpt-every", "3"))
    first = records(run)[0]
    assert first["step"] == 1
    assert abs(first["loss"] - first_batch_loss(ref, data)) < 1e-5 * first["loss"]
    # export the trained weights; transformers reads them and computes what xmoe computes
    main(["export", str(run), "--hf", str(tmp_path / "out")])
    model, _, _, _ = load_source(str(run))
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours, theirs = model(x), load_reference(tmp_path / "out")(x).logits
    assert rel_err(theirs, ours) < 1e-5
    assert rel_err(theirs, ref(x).logits) > 1e-4  # the weights did train


def test_eval_reports_loss_perplexity_and_bits_per_byte(tmp_path, capsys) -> None:
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    run = tmp_path / "run"
    main(
        [
            "train",
            "--out",
            str(run),
            "--device",
            "cpu",
            "--data",
            str(text),
            "--steps",
            "2",
            "--ckpt-every",
            "2",
            "--seq-len",
            "32",
            "--batch-size",
            "4",
        ]
    )
    capsys.readouterr()
    main(["eval", str(run), "--data", str(text), "--seq-len", "32", "--batch-size", "3"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # direct: every consecutive 33-byte window, cross-entropy of the logits, summed in float64
    model, _, _, _ = load_source(str(run))
    data = np.frombuffer(text.read_bytes(), dtype=np.uint8).astype(np.int64)
    nats, count = 0.0, 0
    with torch.no_grad():
        for i in range((len(data) - 1) // 32):
            window = torch.from_numpy(data[i * 32 : i * 32 + 33])[None]
            logits = model(window[:, :-1]).double()
            nats += F.cross_entropy(logits[0], window[0, 1:], reduction="sum").item()
            count += 32
    assert result["tokens"] == count and result["windows"] == count // 32
    assert result["loss"] == pytest.approx(nats / count, rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(nats / count), rel=1e-5)
    assert result["bits_per_byte"] == pytest.approx(nats / count / math.log(2), rel=1e-5)  # one byte per token


def test_validation_during_training(tmp_path) -> None:
    saved_reference("olmoe", tmp_path / "hf")
    data, run = token_file(tmp_path), tmp_path / "run"
    main(
        init_args(
            tmp_path / "hf",
            data,
            run,
            "--steps",
            "4",
            "--val-fraction",
            "0.25",
            "--eval-every",
            "2",
            "--set",
            "train.val_windows=0",
            "--ckpt-every",
            "4",
            "--log-every",
            "3",
        )
    )
    val = {r["step"]: r["val_loss"] for r in records(run) if "val_loss" in r}
    assert sorted(val) == [2, 4]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_val_loss"] == val[4] and summary["best_val_loss"] == min(val.values())
    # direct: the final model on the last quarter of the tokens, consecutive windows
    model, _, _, _ = load_source(str(run))
    held = np.load(data)[int(4000 * 0.75) :]
    n = (len(held) - 1) // SEQ
    windows = torch.from_numpy(np.stack([held[i * SEQ : i * SEQ + SEQ + 1] for i in range(n)]))
    with torch.no_grad():
        logits = model(windows[:, :-1]).double()
    want = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()
    assert val[4] == pytest.approx(want, rel=1e-5)


def test_imported_model_under_expert_parallelism_gives_the_single_process_losses(tmp_path) -> None:
    saved_reference("deepseek_v3", tmp_path / "hf")
    data = token_file(tmp_path)
    args = ["--steps", "3", "--ckpt-every", "100", "--val-fraction", "0.1"]
    main(init_args(tmp_path / "hf", data, tmp_path / "single", *args))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "xmoe",
        *init_args(tmp_path / "hf", data, tmp_path / "ep", "--ep", "2", *args),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    single, ep = records(tmp_path / "single"), records(tmp_path / "ep")
    for a, b in zip(single, ep, strict=False):
        for key in ("loss", "val_loss"):
            if key in a:
                assert abs(a[key] - b[key]) < 1e-5 * a[key], (key, a, b)


def test_two_sources_of_validation_data_are_refused(tmp_path, capsys) -> None:
    data = token_file(tmp_path)
    with pytest.raises(SystemExit):
        main(
            [
                "train",
                "--out",
                str(tmp_path / "r"),
                "--device",
                "cpu",
                "--data",
                str(data),
                "--val-data",
                str(data),
                "--val-fraction",
                "0.1",
                "--steps",
                "1",
                "--set",
                "model.vocab_size=61",
            ]
        )
    assert "val_fraction (0.1)" in capsys.readouterr().err


def test_a_tokenizer_json_travels_from_import_to_generate_and_eval(tmp_path, capsys) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    words = [f"w{i}" for i in range(VOCAB - 1)]
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}, unk_token="[UNK]")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()  # joins words with spaces
    saved_reference("mixtral", tmp_path / "hf")
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    rng = np.random.default_rng(1)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(rng.choice(words, 3000)) + "\n")
    run = tmp_path / "run"
    main(init_args(tmp_path / "hf", text, run, "--steps", "2", "--ckpt-every", "2"))
    assert (run / "tokenizer.json").is_file() and (run / "hf_config.json").is_file()
    capsys.readouterr()
    main(["generate", str(run), "--prompt", "w3 w7 w1", "--max-new-tokens", "5", "--eos-id", "-1"])
    out = capsys.readouterr().out.split()
    assert out[:3] == ["w3", "w7", "w1"] and len(out) == 8 and all(w in words for w in out)
    main(["export", str(run), "--hf", str(tmp_path / "out")])
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    capsys.readouterr()
    main(["eval", str(tmp_path / "out"), "--data", str(text), "--seq-len", str(SEQ), "--max-windows", "10"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ids = tok.encode(text.read_text()).ids
    targets = [ids[i * SEQ + 1 : i * SEQ + SEQ + 1] for i in range(10)]
    num_bytes = sum(len(tok.decode(t).encode()) for t in targets)
    assert result["tokens"] == 10 * SEQ
    assert result["bits_per_byte"] == pytest.approx(result["loss"] * 10 * SEQ / math.log(2) / num_bytes, rel=1e-9)


def one_line_error(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and err.startswith(f"xmoe {argv[0]}: error: "), err
    return err


@pytest.fixture
def imported_run(tmp_path) -> Path:
    """A run trained for 2 steps from a qwen3_moe directory, one checkpoint per step (keep_last 1)."""
    saved_reference("qwen3_moe", tmp_path / "hf")
    run = tmp_path / "run"
    main(
        init_args(
            tmp_path / "hf",
            token_file(tmp_path),
            run,
            "--steps",
            "2",
            "--ckpt-every",
            "1",
            "--set",
            "train.keep_last=1",
        )
    )
    return run


def test_export_refuses_its_run_directory_and_replaces_a_model_only_when_asked(imported_run, tmp_path, capsys):
    run = imported_run
    err = one_line_error(capsys, ["export", str(run), "--hf", str(run)])
    assert f"is inside the run directory {run}" in err and "write it elsewhere" in err, err
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"model_type": "mine"}')  # someone's model, sharded in two
    (out / "model-00002-of-00002.safetensors").write_bytes(b"stale")
    (out / "model.safetensors.index.json").write_text("{}")
    (out / "README.md").write_text("notes")
    err = one_line_error(capsys, ["export", str(run), "--hf", str(out)])
    assert "is not empty" in err and "--overwrite" in err, err
    assert (out / "config.json").read_text() == '{"model_type": "mine"}'  # untouched
    main(["export", str(run), "--hf", str(out), "--overwrite"])
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3_moe"
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []  # the staging directory is gone
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("x")
    err = one_line_error(capsys, ["export", str(run), "--hf", str(other), "--overwrite"])
    assert "holds no config.json" in err, err


def test_a_checkpoint_being_read_is_not_pruned_by_the_running_trainer(imported_run, monkeypatch):
    from xmoe.train import checkpoint as ckpt

    run = imported_run
    newest = run / "checkpoints" / "step_000002"
    original = ckpt.load_checkpoint

    def load_while_the_trainer_saves(path, model, *args, **kwargs):
        meta = ckpt.read_meta(path)
        ckpt.save_checkpoint(run, 3, model, keep_last=1, config=meta["config"])  # prunes older ones it may
        return original(path, model, *args, **kwargs)

    monkeypatch.setattr(ckpt, "load_checkpoint", load_while_the_trainer_saves)
    model, _, _, _ = load_source(str(run))  # reads step 2 while step 3 is saved
    assert newest.is_dir()  # pinned: pruning left it for a later save
    monkeypatch.undo()
    reference, _, _, _ = load_source(str(run), step=2)
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items(), strict=False):
        assert torch.equal(a, b), name


def test_a_checkpoint_pruned_before_it_is_pinned_is_picked_again(imported_run, monkeypatch):
    from xmoe import infer
    from xmoe.kernels.choice import recorded_config
    from xmoe.train import checkpoint as ckpt

    run = imported_run
    original, picks = infer._run_checkpoint, []

    def pick_then_lose_it(path, step):
        found = original(path, step)
        picks.append(found.name)
        if len(picks) == 1:  # the trainer saves step 3 and prunes step 2 between the pick and the pin
            meta = ckpt.read_meta(found)
            model, _, _ = infer._run_model(found, meta, "cpu", recorded_config(meta["config"]))
            ckpt.save_checkpoint(run, 3, model, keep_last=1, config=meta["config"])
        return found

    monkeypatch.setattr(infer, "_run_checkpoint", pick_then_lose_it)
    load_source(str(run))
    assert picks == ["step_000002", "step_000003"]


def test_eval_and_generate_flags_are_checked(imported_run, capsys):
    run = str(imported_run)
    if not torch.cuda.is_available():
        assert "--device cuda was asked for but" in one_line_error(
            capsys, ["eval", run, "--data", "markov", "--device", "cuda"]
        )
    assert "--device ('tpu') must be auto, cpu, cuda or cuda:N" in one_line_error(
        capsys, ["generate", run, "--prompt", "x", "--device", "tpu"]
    )
    assert "--max-windows (-1) must be >= 0" in one_line_error(
        capsys, ["eval", run, "--data", "markov", "--max-windows", "-1"]
    )
    assert "--prompt is empty" in one_line_error(capsys, ["generate", run, "--prompt", ""])
    assert "--seed (100000000000000000000000) must be in [0, 2**63)" in one_line_error(
        capsys, ["generate", run, "--prompt", "x", "--seed", "100000000000000000000000"]
    )
    assert "--max-shard-gb (0) must be a number of GiB > 0" in one_line_error(
        capsys, ["export", run, "--hf", str(imported_run.parent / "o"), "--max-shard-gb", "0"]
    )
    (imported_run / "hf_config.json").write_text("{corrupt")
    err = one_line_error(capsys, ["eval", run, "--data", "markov", "--seq-len", "8"])
    assert f"{imported_run / 'hf_config.json'} is not valid JSON" in err, err
    (imported_run / "tokenizer.json").write_text("{corrupt")
    (imported_run / "hf_config.json").write_text("{}")
    err = one_line_error(capsys, ["generate", run, "--prompt", "x"])
    assert "tokenizer.json' is not a readable tokenizers JSON file" in err, err


def test_init_from_refuses_a_preset_and_unasked_architecture_changes(tmp_path, capsys, monkeypatch):
    from xmoe.train import metrics

    saved_reference("qwen3_moe", tmp_path / "hf")
    data, run = token_file(tmp_path), tmp_path / "run"
    err = one_line_error(capsys, init_args(tmp_path / "hf", data, run, "--preset", "small"))
    assert "--preset (small) and --init-from" in err, err
    err = one_line_error(capsys, init_args(tmp_path / "hf", data, run, "--set", "model.num_layers=2"))
    assert "model.num_layers: imported 3, now 2" in err and "--allow-changes" in err, err
    titles = []
    monkeypatch.setattr(
        metrics.MetricsLogger, "_plot", lambda self, losses, lines, title, val=None: titles.append(title)
    )
    main(init_args(tmp_path / "hf", data, run, "--steps", "1", "--set", "model.num_layers=2", "--allow-changes"))
    out = capsys.readouterr().out
    assert "--allow-changes: training the imported model with model.num_layers: imported 3, now 2" in out
    assert "router_aux_loss_coef (0.001) is not imported" in out and "preset" not in titles[0], titles
