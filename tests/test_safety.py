"""Run safety: one trainer per run directory, no silent overwrite, non-finite training stops without saving,
signals save and exit 128 + signum (all ranks agreeing), and a resume checks what it resumes."""

from __future__ import annotations

import errno
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_train import SMALL, losses

from xmoe.cli import main
from xmoe.train import rundir, runlock, trainer
from xmoe.train.checkpoint_dir import complete_checkpoints
from xmoe.train.resume import fingerprint

ROOT = Path(__file__).resolve().parents[1]


def train(out: Path, *extra: str) -> None:
    main(["train", "--out", str(out), "--device", "cpu", *SMALL, *extra])


def fails(capsys, out: Path, *extra: str) -> tuple[int, str]:
    """Exit code and stderr of a train run that must fail; its message is one line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        train(out, *extra)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("xmoe train: "), err
    return exc.value.code, err


def spawn(out: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "xmoe", "train", "--out", str(out), "--device", "cpu", *SMALL, *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def wait_for_line(proc: subprocess.Popen, prefix: str) -> None:
    for line in proc.stdout:
        if line.startswith(prefix):
            return
    raise AssertionError(f"no line starting {prefix!r}; stderr: {proc.stderr.read()[-2000:]}")


# ------------------------------------------------------------------------------------------- run directory


def test_lock_is_exclusive_and_names_its_holder(tmp_path):
    first = rundir.RunLock(tmp_path).acquire()
    holder = json.loads((tmp_path / runlock.LOCK).read_text())
    assert holder["pid"] == os.getpid()
    with pytest.raises(rundir.RunDirError, match=f"pid {os.getpid()} on host {holder['host']}"):
        rundir.RunLock(tmp_path).acquire()  # flock conflicts between two opens, even in one process
    first.release()
    assert not (tmp_path / runlock.LOCK).exists()
    rundir.RunLock(tmp_path).acquire().release()


def test_stale_lock_is_taken_over(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = {"pid": int(dead.stdout), "host": os.uname().nodename, "started": "yesterday"}
    (tmp_path / runlock.LOCK).write_text(json.dumps(stale))  # left by a killed run: no flock held on it
    lock = rundir.RunLock(tmp_path).acquire()
    assert lock.stale["pid"] == stale["pid"]
    lock.release()


def test_lock_without_flock_uses_pid_liveness(tmp_path, monkeypatch):
    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(runlock.fcntl, "flock", no_flock)
    lock = rundir.RunLock(tmp_path).acquire()
    with pytest.raises(rundir.RunDirError, match=f"pid {os.getpid()}"):
        rundir.RunLock(tmp_path).acquire()  # alive on this host: refused
    lock.release()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / runlock.LOCK).write_text(json.dumps({"pid": int(dead.stdout), "host": os.uname().nodename}))
    assert rundir.RunLock(tmp_path).acquire().stale["pid"] == int(dead.stdout)


def test_existing_run_needs_resume_or_overwrite(tmp_path, capsys):
    out = tmp_path / "r"
    train(out, "--steps", "2", "--ckpt-every", "2")
    before = (out / "metrics.jsonl").read_text()
    code, err = fails(capsys, out, "--steps", "2")
    assert code == 2 and "--resume" in err and "--overwrite" in err and "step_000002" in err
    assert (out / "metrics.jsonl").read_text() == before  # untouched
    (out / "checkpoints" / "step_000009.tmp-dead").mkdir()  # a crashed save's leftover
    train(out, "--steps", "1", "--ckpt-every", "1", "--overwrite")
    text = capsys.readouterr().out
    assert "--overwrite: set the previous run" in text and "--overwrite: deleted the previous run" in text
    assert "leftover" not in text and not (out / rundir.REPLACED).exists()  # went with the old run
    assert sorted(losses(out)) == [1]
    assert [p.name for _, p in complete_checkpoints(out)] == ["step_000001"]


def test_overwrite_that_fails_to_start_keeps_the_previous_run(tmp_path, capsys):
    out = tmp_path / "r"
    train(out, "--steps", "3", "--ckpt-every", "1", "--set", "train.keep_last=3")
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    code, err = fails(capsys, out, "--steps", "2", "--overwrite", "--data", str(tmp_path / "typo.txt"))
    assert code == 2 and "typo.txt" in err
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before  # every file back, byte for byte, and nothing of the failed start left
    assert [s for s, _ in complete_checkpoints(out)] == [1, 2, 3]


def test_overwrite_killed_before_its_first_output_is_undone_by_the_next_start(tmp_path, capsys):
    out = tmp_path / "r"
    train(out, "--steps", "2", "--ckpt-every", "2")
    lock, _ = rundir._prepare(out, resume=False, overwrite=True)  # what an --overwrite start does first ...
    (out / "metrics.jsonl").write_text("")  # ... and the empty log it opens, then it is killed:
    lock._stop_beating.set()
    os.close(lock._fd)  # the kernel drops its flock; nothing is restored by the dead process
    assert (out / rundir.REPLACED).is_dir() and not complete_checkpoints(out)
    train(out, "--steps", "3", "--resume")
    text = capsys.readouterr().out
    assert "killed before writing anything: restored the previous run" in text, text
    assert f"resumed from {out / 'checkpoints' / 'step_000002'} at step 2" in text
    assert sorted(losses(out)) == [2, 3] and not (out / rundir.REPLACED).exists()


def test_a_set_aside_cut_short_by_a_kill_is_restored_whole(tmp_path, capsys):
    out = tmp_path / "r"
    train(out, "--steps", "2", "--ckpt-every", "2")
    moving = out / rundir.MOVING  # killed after moving the checkpoints aside, before the metrics
    moving.mkdir()
    (out / "checkpoints").rename(moving / "checkpoints")
    train(out, "--steps", "3", "--resume")
    assert "a killed start had left setting it aside or back unfinished" in capsys.readouterr().out
    assert sorted(losses(out)) == [2, 3] and not moving.exists()


def test_overwrite_removes_every_output_of_the_previous_run(tmp_path, capsys):
    out = tmp_path / "r"
    train(out, "--steps", "1")
    (out / "tokenizer.json").write_text("{}")  # what an --init-from run keeps for eval and generate
    (out / "hf_config.json").write_text("{}")
    train(out, "--steps", "1", "--overwrite")
    assert not (out / "tokenizer.json").exists() and not (out / "hf_config.json").exists()


def test_resume_of_a_run_without_checkpoints_is_refused(tmp_path, capsys):
    out = tmp_path / "r"
    train(out, "--steps", "2", "--ckpt-every", "0")
    before = {name: (out / name).read_bytes() for name in ("metrics.jsonl", "summary.json", "loss.png")}
    code, err = fails(capsys, out, "--steps", "4", "--resume")
    assert code == 2 and "no checkpoint to resume from" in err and "--overwrite" in err, err
    assert {name: (out / name).read_bytes() for name in before} == before


def test_what_a_failed_start_left_is_not_a_run(tmp_path, capsys):
    out = tmp_path / "r"
    out.mkdir()
    (out / "metrics.jsonl").write_text("")  # a start killed after opening its log
    (out / "tokenizer.json").write_text("{}")  # and after copying an imported tokenizer
    train(out, "--steps", "1")
    assert "removed what an earlier start that failed left" in capsys.readouterr().out
    assert sorted(losses(out)) == [1] and not (out / "tokenizer.json").exists()


def test_stale_lock_message_says_what_was_checked(tmp_path, capsys):
    host = os.uname().nodename
    (tmp_path / runlock.LOCK).write_text(json.dumps({"pid": 1, "host": host}))  # pid 1 runs: a reused pid
    lock, notes = rundir._prepare(tmp_path, resume=False, overwrite=False)
    lock.release()
    assert "no process holds its flock and pid 1 now belongs to another process" in notes[0], notes


def test_another_hosts_lock_is_taken_over_only_once_its_heartbeat_stops(tmp_path, monkeypatch):
    monkeypatch.setattr(runlock, "STALE_AFTER_S", 0.6)
    path = tmp_path / runlock.LOCK
    path.write_text(json.dumps({"pid": 4242, "host": "elsewhere"}))  # its flock is not visible from here
    beating = [True]

    def heartbeat():
        while beating[0]:
            os.utime(path)
            time.sleep(0.1)

    thread = threading.Thread(target=heartbeat)
    thread.start()
    try:
        with pytest.raises(rundir.RunDirError, match="pid 4242 on host elsewhere: its lock file is kept fresh"):
            rundir.RunLock(tmp_path).acquire()
    finally:
        beating[0] = False
        thread.join()
    lock = rundir.RunLock(tmp_path).acquire()  # waits until it has been untouched for STALE_AFTER_S
    assert lock.stale["host"] == "elsewhere" and "has not touched the lock file" in lock.stale_reason
    lock.release()


def test_lock_holder_keeps_its_lock_file_fresh(tmp_path, monkeypatch):
    monkeypatch.setattr(runlock, "HEARTBEAT_S", 0.05)
    lock = rundir.RunLock(tmp_path).acquire()
    os.utime(tmp_path / runlock.LOCK, (0, 0))
    time.sleep(0.3)
    assert time.time() - (tmp_path / runlock.LOCK).stat().st_mtime < 5
    lock.release()


def test_empty_out_is_an_error(tmp_path, capsys):
    assert fails(capsys, Path(""), "--steps", "1")[0] == 2


# -------------------------------------------------------------------------------------------- non-finite


def _poison_weights_at(monkeypatch, step: int) -> None:
    """Make every weight NaN just before ``step``'s forward pass: its loss and gradients are NaN from then on."""
    original = trainer.Trainer._forward_backward

    def forward_backward(self, accum):
        if self.step == step:
            with torch.no_grad():
                for p in self.model.parameters():
                    p.fill_(math.nan)
        return original(self, accum)

    monkeypatch.setattr(trainer.Trainer, "_forward_backward", forward_backward)


def test_nonfinite_loss_stops_without_saving_or_pruning_good_checkpoints(tmp_path, capsys, monkeypatch):
    out = tmp_path / "r"
    _poison_weights_at(monkeypatch, 4)
    code, err = fails(capsys, out, "--steps", "8", "--log-every", "8", "--ckpt-every", "1")
    assert code == 3 and "non-finite at step 4" in err and "step_000003" in err, err
    assert [s for s, _ in complete_checkpoints(out)] == [2, 3]  # keep_last 2: both good ones stay
    assert "non-finite loss or gradient norm at step 4" in json.loads((out / "summary.json").read_text())["status"]


def test_nonfinite_detected_at_the_log_step_without_per_step_sync(tmp_path, capsys, monkeypatch):
    out = tmp_path / "r"
    _poison_weights_at(monkeypatch, 3)
    code, err = fails(capsys, out, "--steps", "8", "--log-every", "4", "--ckpt-every", "2")
    assert code == 3 and "at step 3" in err and "step_000002" in err
    assert [s for s, _ in complete_checkpoints(out)] == [2]  # step 4 (after the NaN) was not saved


def _nan_grad_norm_at(monkeypatch, bad_calls: set[int]) -> None:
    original = trainer.clip_gradients
    calls = []

    def clip(optimizer, params, max_norm, dims):
        calls.append(1)
        norm, divisor = original(optimizer, params, max_norm, dims)
        return (torch.full_like(norm, math.nan) if len(calls) in bad_calls else norm), divisor

    monkeypatch.setattr(trainer, "clip_gradients", clip)


def test_skip_policy_skips_isolated_bad_steps_and_stops_on_a_run_of_them(tmp_path, capsys, monkeypatch):
    _nan_grad_norm_at(monkeypatch, {3})
    train(tmp_path / "a", "--steps", "5", "--ckpt-every", "5", "--log-every", "1", "--set", "train.nonfinite_skips=1")
    assert "step 3: non-finite loss or gradient norm, update skipped" in capsys.readouterr().out
    logged = losses(tmp_path / "a")
    assert sorted(logged) == [1, 2, 3, 4, 5] and all(math.isfinite(v) for v in logged.values())
    _nan_grad_norm_at(monkeypatch, {2, 3})
    code, err = fails(capsys, tmp_path / "b", "--steps", "5", "--set", "train.nonfinite_skips=1")
    assert code == 3 and "at step 2" in err


def test_skip_policy_saves_nothing_inside_a_run_of_skipped_steps(tmp_path, capsys, monkeypatch):
    _nan_grad_norm_at(monkeypatch, {3, 4, 5})
    out = tmp_path / "r"
    code, err = fails(
        capsys, out, "--steps", "8", "--log-every", "8", "--ckpt-every", "1", "--set", "train.nonfinite_skips=2"
    )
    assert code == 3 and "non-finite at step 3 and stayed so through step 5" in err, err
    assert f"the last good checkpoint is {out / 'checkpoints' / 'step_000002'}" in err
    assert "raise train.nonfinite_skips" in err
    assert [s for s, _ in complete_checkpoints(out)] == [1, 2]  # no copies of step 2 saved as 3 and 4


def test_skip_policy_saves_a_checkpoint_due_in_a_skipped_step_at_the_next_good_one(tmp_path, capsys, monkeypatch):
    _nan_grad_norm_at(monkeypatch, {4})
    out = tmp_path / "r"
    train(out, "--steps", "6", "--ckpt-every", "4", "--set", "train.nonfinite_skips=1", "--set", "train.keep_last=4")
    assert [s for s, _ in complete_checkpoints(out)] == [5, 6]


# ------------------------------------------------------------------------------------------------ signals


def test_second_signal_aborts_at_once():
    script = (
        "import os, signal, time, torch\n"
        "from xmoe.train.safety import RunGuard\n"
        "with RunGuard(torch.device('cpu')) as guard:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(0.2)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"  # the same one passed on by a launcher: one request
        "    time.sleep(0.2)\n"
        "    print('first recorded', guard.received, flush=True)\n"
        "    time.sleep(1.0)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(5)\n"
        "    print('still running')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout.split() == ["first", "recorded", str(int(signal.SIGTERM))]
    assert proc.returncode == -signal.SIGTERM


def test_second_trainer_is_refused_and_sigterm_saves_a_checkpoint_and_exits_143(tmp_path, capsys):
    out = tmp_path / "r"
    proc = spawn(out, "--steps", "100000", "--log-every", "1", "--ckpt-every", "100000")
    wait_for_line(proc, "step 2/")
    code, err = fails(capsys, out, "--steps", "2", "--resume")  # the same --out while the first one runs
    assert code == 2 and f"in use by pid {proc.pid} on host" in err, err
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    ((step, path),) = complete_checkpoints(out)
    assert f"stopped by SIGTERM at step {step} of 100000; checkpoint {path} saved" in err
    assert json.loads((out / "summary.json").read_text())["status"] == f"stopped by SIGTERM at step {step}"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP])
def test_signal_mid_step_stops_at_the_boundary_and_resumes(tmp_path, capsys, monkeypatch, sig):
    """The signal arrives inside step 3's forward pass (in this process); the step finishes, is checkpointed,
    and the run exits 128 + signum; a resume continues from step 3 exactly."""
    original = trainer.Trainer._forward_backward

    def forward_backward(self, accum):
        if self.step == 3:
            os.kill(os.getpid(), sig)
        return original(self, accum)

    monkeypatch.setattr(trainer.Trainer, "_forward_backward", forward_backward)
    before = signal.getsignal(sig)
    out, full = tmp_path / "r", tmp_path / "full"
    code, err = fails(capsys, out, "--steps", "6", "--log-every", "1", "--ckpt-every", "100")
    assert code == 128 + sig and f"stopped by {signal.Signals(sig).name} at step 3 of 6" in err
    assert [s for s, _ in complete_checkpoints(out)] == [3]
    assert signal.getsignal(sig) is before  # the trainer's handlers are gone with it
    monkeypatch.undo()
    train(out, "--steps", "6", "--log-every", "1", "--ckpt-every", "100", "--resume")
    train(full, "--steps", "6", "--log-every", "1", "--ckpt-every", "100")
    assert losses(out) == losses(full)  # nothing lost, bit-identical


def test_summary_of_a_run_stopped_between_logging_steps_reports_the_step_it_reached(tmp_path, capsys, monkeypatch):
    original = trainer.Trainer._forward_backward

    def forward_backward(self, accum):
        if self.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, accum)

    monkeypatch.setattr(trainer.Trainer, "_forward_backward", forward_backward)
    out = tmp_path / "r"
    code, _ = fails(capsys, out, "--steps", "100", "--log-every", "50", "--ckpt-every", "100")
    summary = json.loads((out / "summary.json").read_text())
    assert code == 143 and summary["steps"] == 3 and summary["status"] == "stopped by SIGTERM at step 3", summary
    assert [s for s, _ in complete_checkpoints(out)] == [3]


def _signal_rank0_body(rank: int, world_size: int, out: str):
    from xmoe.cli import _parser
    from xmoe.train import safety
    from xmoe.train.cli import build_run_config

    args = _parser()[0].parse_args(
        ["train", "--out", out, *SMALL, "--dp", "2", "--steps", "100", "--log-every", "50", "--ckpt-every", "100"]
    )
    original = trainer.Trainer._forward_backward

    def forward_backward(self, accum):
        # rank 1 never sees a signal: it learns of it from the vote posted after step 3, read after step 4 (not
        # at the next logging step, 50)
        if self.step == 3 and self.rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, accum)

    trainer.Trainer._forward_backward = forward_backward
    run = trainer.Trainer(build_run_config(args), out, device="cpu")
    with pytest.raises(safety.RunStopped) as stopped:
        run.train()
    assert stopped.value.exit_code == 143 and run.step == 4, (rank, run.step)
    assert [s for s, _ in complete_checkpoints(out)] == [4]
    assert json.loads((Path(out) / "checkpoints" / "step_000004" / "meta.json").read_text())["world_size"] == 2


def test_signal_to_one_rank_stops_all_ranks_at_the_same_step(tmp_path):
    from dist_utils import run_distributed

    run_distributed(_signal_rank0_body, 2, str(tmp_path / "r"))
    assert "stopped by SIGTERM at step 4" in json.loads((tmp_path / "r" / "summary.json").read_text())["status"]


# ------------------------------------------------------------------------------------------------- resume


def test_resume_refuses_a_different_model_or_data_unless_allowed(tmp_path, capsys):
    data_a, data_b = tmp_path / "a.npy", tmp_path / "b.npy"
    rng = np.random.default_rng(0)
    np.save(data_a, rng.integers(0, 256, 4096, dtype=np.uint16))
    np.save(data_b, rng.integers(0, 256, 4096, dtype=np.uint16))  # same size, other tokens
    out = tmp_path / "r"
    train(out, "--steps", "2", "--ckpt-every", "2", "--data", str(data_a), "--set", "moe.top_k=4")
    code, err = fails(capsys, out, "--steps", "4", "--resume", "--data", str(data_a), "--set", "moe.top_k=2")
    assert code == 2 and "model.moe.top_k: checkpoint 4, now 2" in err and "--allow-changes" in err
    code, err = fails(capsys, out, "--steps", "4", "--resume", "--data", str(data_b), "--set", "moe.top_k=4")
    assert code == 2 and "data.crc32" in err
    code, err = fails(
        capsys, out, "--steps", "4", "--resume", "--data", str(data_a), "--set", "moe.top_k=4", "--lr", "1e-3"
    )
    assert code == 2 and "train.lr" in err
    train(out, "--steps", "4", "--resume", "--data", str(data_b), "--set", "moe.top_k=4", "--allow-changes")
    assert "--allow-changes: continuing from" in capsys.readouterr().out
    assert max(losses(out)) == 4


def test_data_fingerprint_covers_the_whole_file(tmp_path):
    path = tmp_path / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, 256, 2**20, dtype=np.uint16))  # 2 MiB
    dataset = type("Dataset", (), {"name": str(path), "vocab_size": 256})()
    before = fingerprint(str(path), dataset)
    data = bytearray(path.read_bytes())
    data[230_000:230_004] = b"\x01\x00\x02\x00"  # between the blocks a sampled checksum would read
    path.write_bytes(bytes(data))
    after = fingerprint(str(path), dataset)
    assert after["size"] == before["size"] and after != before


def test_resume_with_nothing_to_do_is_an_error(tmp_path, capsys):
    out = tmp_path / "r"
    train(out, "--steps", "4", "--ckpt-every", "4")
    code, err = fails(capsys, out, "--steps", "3", "--resume")
    assert code == 2 and "nothing to do" in err and "step 4" in err


def test_resume_scans_past_a_stale_latest_pointer_and_resume_from_sets_newer_aside(tmp_path, capsys):
    out = tmp_path / "r"
    keep = ("--log-every", "1", "--ckpt-every", "2", "--set", "train.keep_last=4")
    train(out, "--steps", "6", *keep)
    root = out / "checkpoints"
    (root / "latest").write_text("step_000002\n")  # as if repointing it had failed twice
    (root / "step_000008.tmp-1234").mkdir()  # a crashed save
    train(out, "--steps", "7", "--resume", *keep)
    text = capsys.readouterr().out
    assert f"resumed from {root / 'step_000006'} at step 6" in text and "leftover" in text
    assert not (root / "step_000008.tmp-1234").exists()
    train(out, "--steps", "8", "--resume-from", str(root / "step_000004"), *keep)
    text = capsys.readouterr().out
    assert f"resumed from {root / 'step_000004'} at step 4" in text and "set aside" in text
    assert sorted(p.name.split(".")[0] for p in root.glob("*.superseded-*")) == ["step_000006", "step_000007"]
    assert [s for s, _ in complete_checkpoints(out)] == [2, 4, 6, 8]  # 6 and 8 of the new timeline
    train(out, "--steps", "9", "--resume", *keep)
    assert f"resumed from {root / 'step_000008'} at step 8" in capsys.readouterr().out
    code, err = fails(capsys, out, "--steps", "12", "--resume-from", str(root / "step_000005"))
    assert code == 2 and "step_000005 does not exist" in err


def test_resume_falls_back_past_a_bit_flip_in_the_newest_checkpoint(tmp_path, capsys):
    out = tmp_path / "r"
    train(out, "--steps", "4", "--log-every", "1", "--ckpt-every", "2")
    shard = next((out / "checkpoints" / "step_000004").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: only the checksum can tell
    shard.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match=r"skipped 1 newer checkpoint.*step_000004 is corrupt: .*fails its crc32"):
        train(out, "--steps", "5", "--log-every", "1", "--ckpt-every", "2", "--resume")
    assert f"resumed from {out / 'checkpoints' / 'step_000002'} at step 2" in capsys.readouterr().out
    assert sorted(losses(out)) == [1, 2, 3, 4, 5]


def test_resume_from_the_latest_pointer_resumes_what_it_names(tmp_path, capsys):
    out = tmp_path / "r"
    train(out, "--steps", "2", "--ckpt-every", "2")
    train(out, "--steps", "3", "--resume-from", str(out / "checkpoints" / "latest"))
    assert f"resumed from {out / 'checkpoints' / 'step_000002'} at step 2" in capsys.readouterr().out


def test_lock_released_after_errors_in_setup(tmp_path, capsys):
    out = tmp_path / "r"
    code, _ = fails(capsys, out, "--steps", "1", "--data", str(tmp_path / "missing.npy"))
    assert code == 2 and not (out / runlock.LOCK).exists()
    train(out, "--steps", "1")  # not blocked by the failed attempt
    assert sorted(losses(out)) == [1]


def test_a_failed_start_removes_the_directories_it_created_and_keeps_the_others(tmp_path, capsys):
    out = tmp_path / "runs" / "a" / "r"
    code, _ = fails(capsys, out, "--steps", "1", "--data", str(tmp_path / "missing.npy"))
    assert code == 2 and not (tmp_path / "runs").exists()  # runs/, runs/a/ and r/ were this start's
    out.mkdir(parents=True)
    (out.parent / "notes.txt").write_text("mine")
    code, _ = fails(capsys, out, "--steps", "1", "--data", str(tmp_path / "missing.npy"))
    assert code == 2 and out.is_dir() and not any(out.iterdir())  # there before the start: kept, empty
    keep = tmp_path / "runs" / "a" / "b" / "r"
    code, _ = fails(capsys, keep, "--steps", "1", "--data", str(tmp_path / "missing.npy"))
    assert code == 2 and not (tmp_path / "runs" / "a" / "b").exists()  # b/ was created, a/ was not
    assert (out.parent / "notes.txt").read_text() == "mine"
