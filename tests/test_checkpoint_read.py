"""Reading a checkpoint runs no code from it: a crafted DCP ``.metadata`` or a crafted non-tensor value in a
``.distcp`` file is refused in one line naming the file, before anything it names is called, even when meta.json's
sizes and crc32 were rewritten to match (they detect damage, not tampering)."""

import json
import os
import pickle
import zlib

import pytest
import torch
import torch.nn as nn

from xmoe.cli import main
from xmoe.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from xmoe.train.checkpoint_read import read_metadata


class _Payload:
    """Unpickling this creates ``marker``: evidence that a reader ran code from the file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    return model, opt


def _rewrite_meta(ckpt, name):
    """meta.json records the size and crc32 the tampered file now has, as whoever rewrote the file could do."""
    meta = json.loads((ckpt / "meta.json").read_text())
    data = (ckpt / name).read_bytes()
    meta["files"][name] = {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    (ckpt / "meta.json").write_text(json.dumps(meta))


def _craft_metadata(ckpt, marker):
    """Replace .metadata by a pickle whose loading calls os.mkdir, wrapped in what DCP's metadata holds."""
    real = read_metadata(ckpt)
    real.planner_data = _Payload(marker)  # any field: the unpickler meets the payload while building the object
    (ckpt / ".metadata").write_bytes(pickle.dumps(real))
    _rewrite_meta(ckpt, ".metadata")


def test_the_metadata_of_a_real_checkpoint_reads_and_a_round_trip_holds(tmp_path):
    model, opt = _model_and_optimizer()
    ckpt = save_checkpoint(tmp_path, 1, model, opt)
    stored = read_metadata(ckpt).state_dict_metadata
    assert {"model.0.weight", "optim.param_groups.0.lr", "optim.state.0.weight.exp_avg"} <= set(stored)
    model2 = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.5)
    load_checkpoint(ckpt, model2, opt2, restore_rng=False)
    assert opt2.param_groups[0]["lr"] == 1e-2 and opt2.param_groups[0]["betas"] == (0.9, 0.999)
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_crafted_metadata_file_is_refused_before_its_payload_runs(tmp_path):
    model, opt = _model_and_optimizer()
    ckpt = save_checkpoint(tmp_path, 1, model, opt)
    marker = tmp_path / "ran"
    _craft_metadata(ckpt, marker)
    with pytest.raises(CheckpointError, match=r"\.metadata holds a Python object of type posix\.mkdir") as info:
        load_checkpoint(ckpt, model, opt)
    assert "\n" not in str(info.value) and str(ckpt) in str(info.value)
    assert not marker.exists()


def test_a_crafted_optimizer_value_is_refused_before_its_payload_runs(tmp_path):
    model, opt = _model_and_optimizer()
    marker = tmp_path / "ran"
    opt.param_groups[0]["lr"] = _Payload(marker)  # stored by DCP as a pickled non-tensor value
    ckpt = save_checkpoint(tmp_path, 1, model, opt)
    assert not marker.exists()
    model2, opt2 = _model_and_optimizer()
    with pytest.raises(CheckpointError, match=r"Python object of type posix\.mkdir as optim\.param_groups\.0\.lr"):
        load_checkpoint(ckpt, model2, opt2)
    assert not marker.exists()


TINY = ["--set", "model.hidden_size=16", "--set", "moe.hidden_size=16", "--set", "model.num_layers=1"]
TINY += ["--set", "moe.ffn_hidden_size=16", "--set", "moe.num_experts=4", "--set", "moe.top_k=2"]
TINY += ["--batch-size", "2", "--seq-len", "8", "--steps", "1", "--device", "cpu"]


def test_the_commands_that_read_checkpoints_refuse_a_crafted_one_in_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    main(["train", "--out", str(out), *TINY])
    (ckpt,) = (out / "checkpoints").glob("step_*")
    marker = tmp_path / "ran"
    _craft_metadata(ckpt, marker)
    capsys.readouterr()
    commands = {
        "eval": ["eval", str(out), "--data", "markov", "--seq-len", "8", "--max-windows", "2"],
        "generate": ["generate", str(out), "--prompt-ids", "1,2", "--max-new-tokens", "2", "--ids"],
        "export": ["export", str(out), "--hf", str(tmp_path / "hf")],
        "resume": ["train", "--out", str(out), *TINY[:-4], "--steps", "2", "--device", "cpu", "--resume"],
    }
    for name, argv in commands.items():
        with pytest.raises(SystemExit) as exited:
            main(argv)
        err = capsys.readouterr().err.strip()
        assert exited.value.code == 2, (name, err)
        assert "refusing to read it" in err and len(err.splitlines()) == 1, (name, err)
        assert not marker.exists(), name
