"""What a model directory or a checkpoint may claim: two models in one Hugging Face directory, file names that
reach outside their directory, sizes in config.json that the weights do not hold, and the modes of exported
files."""

from __future__ import annotations

import json
import os
import re
import shutil
import time

import pytest
from hf_models import saved_reference
from test_hf import _edit_config

from xmoe.cli import main
from xmoe.hf import load_pretrained, save_pretrained
from xmoe.train.checkpoint_dir import CheckpointError
from xmoe.train.checkpoint_verify import find_latest, read_meta


def one_line_error(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and err.startswith(f"xmoe {argv[0]}: error: "), err
    return err


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mixtral")
    saved_reference("mixtral", directory)
    return directory


def _copy(mixtral, tmp_path):
    return shutil.copytree(mixtral, tmp_path / "m")


def _index(directory, weight_map: dict[str, str]) -> None:
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _names(directory) -> list[str]:
    from safetensors import safe_open

    with safe_open(directory / "model.safetensors", framework="pt") as f:
        return list(f.keys())


# ----------------------------------------------------------------------------------------- two models


def test_a_single_file_beside_an_index_of_other_shards_is_refused(mixtral, tmp_path, capsys):
    d = _copy(mixtral, tmp_path)
    shutil.copy(d / "model.safetensors", d / "model-00001-of-00001.safetensors")
    _index(d, dict.fromkeys(_names(d), "model-00001-of-00001.safetensors"))
    with pytest.raises(ValueError, match="holds two models") as info:
        load_pretrained(d)
    assert "model.safetensors" in str(info.value) and "model-00001-of-00001.safetensors" in str(info.value)
    err = one_line_error(capsys, ["generate", str(d), "--prompt-ids", "1", "--max-new-tokens", "1"])
    assert "holds two models" in err, err


def test_an_index_that_names_only_the_single_file_is_one_model(mixtral, tmp_path):
    d = _copy(mixtral, tmp_path)
    _index(d, dict.fromkeys(_names(d), "model.safetensors"))
    load_pretrained(d)


# --------------------------------------------------------------------------------- names out of bounds


@pytest.mark.parametrize("name", ["../outside.safetensors", "ABSOLUTE", "sub/../../outside.safetensors"])
def test_index_names_outside_the_directory_are_refused(mixtral, tmp_path, name):
    d = _copy(mixtral, tmp_path)
    outside = tmp_path / "outside.safetensors"
    os.rename(d / "model.safetensors", outside)
    name = str(outside) if name == "ABSOLUTE" else name
    _index(d, dict.fromkeys(_names_of(outside), name))
    with pytest.raises(ValueError, match=re.escape(f"names {name!r}")):
        load_pretrained(d)


def _names_of(file) -> list[str]:
    from safetensors import safe_open

    with safe_open(file, framework="pt") as f:
        return list(f.keys())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from test_train import SMALL

    out = tmp_path_factory.mktemp("run") / "r"
    main(["train", "--out", str(out), "--device", "cpu", *SMALL, "--steps", "1", "--ckpt-every", "1"])
    return out


def _meta_with(run, tmp_path, edit):
    copy = shutil.copytree(run, tmp_path / "r")
    ckpt = copy / "checkpoints" / "step_000001"
    meta = json.loads((ckpt / "meta.json").read_text())
    edit(ckpt, meta)
    (ckpt / "meta.json").write_text(json.dumps(meta))
    return copy, ckpt


@pytest.mark.parametrize("name", ["../../../secret.txt", "/etc/hostname", "a/b"])
def test_meta_json_names_outside_the_checkpoint_are_refused(run, tmp_path, name):
    (tmp_path / "secret.txt").write_text("x" * 123)
    copy, ckpt = _meta_with(run, tmp_path, lambda ckpt, meta: meta["files"].update({name: {"size": 1}}))
    with pytest.raises(CheckpointError, match=re.escape(f"names {name!r}")) as info:
        read_meta(ckpt)
    assert "123" not in str(info.value)  # nothing learnt of the file it named
    with pytest.raises(CheckpointError, match="names"):
        find_latest(copy)


def test_a_checkpoint_file_that_is_a_link_is_refused(run, tmp_path):
    (tmp_path / "secret.txt").write_text("x" * 123)

    def link(ckpt, meta):
        name = sorted(meta["files"])[-1]
        os.remove(ckpt / name)
        os.symlink(tmp_path / "secret.txt", ckpt / name)

    copy, _ = _meta_with(run, tmp_path, link)
    with pytest.raises(CheckpointError, match="is a symbolic link") as info:
        find_latest(copy)
    assert "123" not in str(info.value)


# -------------------------------------------------------------------------- sizes checked before allocation


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_hidden_layers", 1_000_000),
        ("hidden_size", 1_000_000),
        ("vocab_size", 2_000_000_000),
        ("num_local_experts", 1_000_000_000),
        ("intermediate_size", 1_000_000_000),
    ],
)
def test_sizes_the_weights_do_not_hold_are_refused_at_once(mixtral, tmp_path, capsys, field, value):
    d = _copy(mixtral, tmp_path)
    _edit_config(d, **{field: value})
    started = time.monotonic()
    with pytest.raises(ValueError, match=re.escape(f"{field} ({value})")):
        load_pretrained(d)
    err = one_line_error(capsys, ["eval", str(d), "--data", str(tmp_path / "none.npy")])
    assert f"{field} ({value})" in err, err
    err = one_line_error(capsys, ["train", "--init-from", str(d), "--dry-run", "--out", str(tmp_path / "r")])
    assert f"{field} ({value})" in err, err
    assert time.monotonic() - started < 30


# ----------------------------------------------------------------------------------------------- modes


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_exported_files_follow_the_umask(mixtral, tmp_path, umask):
    model = load_pretrained(mixtral)
    old = os.umask(umask)
    try:
        save_pretrained(model, tmp_path / "a")
        save_pretrained(model, tmp_path / "b", max_shard_bytes=20_000)
    finally:
        os.umask(old)
    files = [p for d in ("a", "b") for p in (tmp_path / d).iterdir()]
    assert len(files) > 4
    assert {oct(p.stat().st_mode & 0o777) for p in files} == {oct(0o666 & ~umask)}
