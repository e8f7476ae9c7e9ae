"""A full disk while writing metrics.jsonl, loss.png or an export: one line naming the file and the free space, and
nothing already saved lost (the disk's refusal is simulated where the write happens)."""

from __future__ import annotations

import errno
import io
from pathlib import Path

import pytest
from safetensors import SafetensorError
from test_hf_train import imported_run  # noqa: F401 - a fixture: a run trained from a Hugging Face directory
from test_safety import fails

from xmoe.cli import main
from xmoe.train import metrics
from xmoe.train.checkpoint_dir import complete_checkpoints


class _FullFile(io.StringIO):
    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_metrics_on_a_full_disk_are_one_line_naming_the_file(tmp_path, capsys, monkeypatch):
    out = tmp_path / "r"
    opened = []

    def open_full(path, mode="r", *args, **kwargs):  # the log file the logger appends to, opened once
        opened.append(path)
        return _FullFile()

    monkeypatch.setattr(metrics, "open", open_full, raising=False)
    code, err = fails(capsys, out, "--steps", "4", "--log-every", "2", "--ckpt-every", "1")
    assert code == 2 and f"disk full writing {out / 'metrics.jsonl'} (" in err and "MiB free" in err, err
    assert opened == [out / "metrics.jsonl"]
    assert [s for s, _ in complete_checkpoints(out)] == [1]  # what was saved before it stays


class _FullDisk:
    """A file just created whose writes find the disk full."""

    def __init__(self, file) -> None:
        self.file = file

    def write(self, data) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()


def test_a_plot_on_a_full_disk_is_one_line_and_leaves_no_temporary_file(tmp_path, capsys, monkeypatch):
    from xmoe.train import checkpoint_dir

    out = tmp_path / "r"

    def open_full(path, mode="r", *args, **kwargs):
        file = open(path, mode, *args, **kwargs)
        return _FullDisk(file) if Path(path).name.startswith("loss.png") else file

    monkeypatch.setattr(checkpoint_dir, "open", open_full, raising=False)
    code, err = fails(capsys, out, "--steps", "2")
    assert code == 2 and f"disk full writing {out / 'loss.png'} (" in err, err
    assert sorted(p.name for p in out.iterdir() if "loss.png" in p.name) == []  # no temporary file left


def test_an_export_on_a_full_disk_is_one_line_and_leaves_the_target_alone(imported_run, tmp_path, capsys, monkeypatch):  # noqa: F811
    from xmoe.hf import checkpoint

    def full(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        )

    monkeypatch.setattr(checkpoint, "save_file", full)
    out = tmp_path / "exported"
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["export", str(imported_run), "--hf", str(out)])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1, err
    assert "disk full writing" in err and "model.safetensors (" in err and "MiB free" in err, err
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_writing_names_only_a_full_disk(tmp_path):
    from xmoe.checks import DiskFullError, writing

    with pytest.raises(DiskFullError, match=f"disk full writing {tmp_path / 'x'} "):
        with writing(tmp_path / "x"):
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
    with pytest.raises(PermissionError):
        with writing(tmp_path / "x"):
            raise PermissionError(errno.EACCES, "Permission denied")
