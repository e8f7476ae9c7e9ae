"""The run directory under faults and misuse: links where xmoe expects its own files, a directory deleted or
replaced under a live run, another host's lock stamped in the future."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
from test_safety import fails, train
from test_train import losses

from xmoe.train import rundir, runlock, trainer
from xmoe.train.checkpoint_dir import complete_checkpoints

# ------------------------------------------------------------------------------------------------- links


def test_a_lock_file_that_is_a_link_is_refused_and_its_target_kept(tmp_path, capsys):
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    out = tmp_path / "r"
    out.mkdir()
    (out / runlock.LOCK).symlink_to(victim)
    code, err = fails(capsys, out, "--steps", "1")
    assert code == 2 and f"{out / runlock.LOCK} is a symbolic link" in err, err
    assert victim.read_text() == "keep me"


def test_a_set_aside_that_is_a_link_moves_nothing_into_the_run(tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("not the run's")
    out = tmp_path / "r"
    out.mkdir()
    (out / rundir.REPLACED).symlink_to(other, target_is_directory=True)
    code, err = fails(capsys, out, "--steps", "1")
    assert code == 2 and f"{out / rundir.REPLACED} is a symbolic link" in err, err
    assert (other / "notes.txt").read_text() == "not the run's" and not (out / "notes.txt").exists()


@pytest.mark.parametrize("name", ["loss.png", "checkpoints", "metrics.jsonl"])
def test_outputs_that_are_links_are_refused_on_resume(tmp_path, capsys, name):
    out = tmp_path / "r"
    train(out, "--steps", "1", "--ckpt-every", "1")
    elsewhere = tmp_path / "elsewhere"
    os.rename(out / name, elsewhere)
    (out / name).symlink_to(elsewhere)
    before = elsewhere.read_bytes() if elsewhere.is_file() else sorted(p.name for p in elsewhere.iterdir())
    code, err = fails(capsys, out, "--steps", "2", "--resume")
    assert code == 2 and f"{out / name} is a symbolic link" in err, err
    after = elsewhere.read_bytes() if elsewhere.is_file() else sorted(p.name for p in elsewhere.iterdir())
    assert after == before


def test_checkpoint_links_are_not_checkpoints(tmp_path, capsys):
    out = tmp_path / "r"
    train(out, "--steps", "1", "--ckpt-every", "1")
    other = tmp_path / "o"
    train(other, "--steps", "3", "--ckpt-every", "3")
    (out / "checkpoints" / "step_000003").symlink_to(other / "checkpoints" / "step_000003")
    assert [s for s, _ in complete_checkpoints(out)] == [1]


# --------------------------------------------------------------------------- a directory gone while training


def _remove_at(monkeypatch, step: int, how) -> None:
    original = trainer.Trainer._forward_backward

    def forward_backward(self, accum):
        if self.step == step:
            how(self.out_dir)
        return original(self, accum)

    monkeypatch.setattr(trainer.Trainer, "_forward_backward", forward_backward)


def _delete(out: Path) -> None:
    import shutil

    shutil.rmtree(out)


def _replace(out: Path) -> None:
    os.rename(out, out.with_name("moved"))
    out.mkdir()
    (out / "mine.txt").write_text("a new directory's file")


@pytest.mark.parametrize("how", [_delete, _replace])
def test_a_run_whose_directory_goes_stops_and_saves_elsewhere(tmp_path, capsys, monkeypatch, how):
    out = tmp_path / "r"
    _remove_at(monkeypatch, 3, how)
    code, err = fails(capsys, out, "--steps", "50", "--log-every", "1", "--ckpt-every", "2")
    rescued = Path(f"{out}.recovered-step_000003")
    assert code == 2 and f"run directory {out} was" in err and str(rescued) in err, err
    assert [s for s, _ in complete_checkpoints(rescued)] == [3]
    assert sorted(losses(rescued)) == [1, 2, 3]
    assert np.load(rescued / "expert_load.npy")["step"].tolist() == [1, 2, 3]  # the experts' loads come along
    assert json.loads((rescued / "summary.json").read_text())["steps"] == 3
    if how is _replace:  # the new directory is left as it was: no checkpoints/, metrics or lock added
        assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]
        assert (tmp_path / "moved" / "checkpoints" / "step_000002").is_dir()
    else:
        assert not out.exists()
    monkeypatch.undo()
    train(rescued, "--steps", "4", "--resume")  # the rescued directory is a run to continue
    assert sorted(losses(rescued)) == [1, 2, 3, 4]


def test_a_deleted_lock_file_stops_the_run(tmp_path, capsys, monkeypatch):
    out = tmp_path / "r"
    _remove_at(monkeypatch, 2, lambda out: (out / runlock.LOCK).unlink())
    code, err = fails(capsys, out, "--steps", "50", "--log-every", "1", "--ckpt-every", "0")
    assert code == 2 and f"its lock file {out / runlock.LOCK} was removed" in err, err


def test_release_leaves_a_lock_file_it_does_not_hold(tmp_path):
    lock = rundir.RunLock(tmp_path).acquire()
    (tmp_path / runlock.LOCK).unlink()
    theirs = rundir.RunLock(tmp_path).acquire()  # another run takes the directory
    lock.release()
    assert json.loads((tmp_path / runlock.LOCK).read_text())["pid"] == os.getpid()
    with pytest.raises(rundir.RunDirError, match="in use"):
        rundir.RunLock(tmp_path).acquire()
    theirs.release()


# -------------------------------------------------------------------------------------------- clock skew


def test_another_hosts_lock_from_the_future_waits_by_the_local_clock(tmp_path, monkeypatch):
    monkeypatch.setattr(runlock, "STALE_AFTER_S", 0.5)
    path = tmp_path / runlock.LOCK
    path.write_text(json.dumps({"pid": 4242, "host": "elsewhere"}))
    ahead = time.time() + 3600
    os.utime(path, (ahead, ahead))  # that host's clock runs an hour ahead of ours
    started = time.monotonic()
    lock = rundir.RunLock(tmp_path).acquire()
    assert time.monotonic() - started < 5
    assert lock.stale["host"] == "elsewhere" and "in the future" in lock.stale_reason, lock.stale_reason
    lock.release()


def _lose_dir_body(rank: int, world_size: int, out: str):
    import shutil

    from test_train import SMALL

    from xmoe.cli import _parser
    from xmoe.train.cli import build_run_config

    args = _parser()[0].parse_args(["train", "--out", out, *SMALL, "--dp", "2", "--steps", "100", "--log-every", "50"])
    original = trainer.Trainer._forward_backward

    def forward_backward(self, accum):
        if self.step == 3 and self.rank == 0:
            shutil.rmtree(out)  # rank 0 sees it after this step; rank 1 learns of it from the vote, one step later
        return original(self, accum)

    trainer.Trainer._forward_backward = forward_backward
    runlock.LOST_CHECK_S = 0.0  # every step (a step takes less than the default second here)
    run = trainer.Trainer(build_run_config(args), out, device="cpu")
    with pytest.raises(rundir.RunDirError, match="was deleted while this run trained"):
        run.train()
    assert run.step == 4 and run.out_dir == Path(f"{out}.recovered-step_000004"), (rank, run.step, run.out_dir)


def test_a_lost_directory_stops_every_rank_at_the_same_step(tmp_path):
    from dist_utils import run_distributed

    run_distributed(_lose_dir_body, 2, str(tmp_path / "r"))
    rescued = tmp_path / "r.recovered-step_000004"
    assert [s for s, _ in complete_checkpoints(rescued)] == [4] and not (tmp_path / "r").exists()
    assert json.loads((rescued / "checkpoints" / "step_000004" / "meta.json").read_text())["world_size"] == 2
