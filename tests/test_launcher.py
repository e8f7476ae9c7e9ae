"""Under torchrun (2 CPU ranks, gloo): a signal to one rank, the launcher killed, a frozen rank, and what a requeue
script reads; the process-group timeout."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_utils import free_port
from test_safety import ROOT, fails, train
from test_train import SMALL

from xmoe.train import runlock
from xmoe.train.checkpoint_dir import complete_checkpoints

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads parent pids from /proc")

# what docs/operations.md tells a Slurm script to test before requeueing a run launched by torchrun
REQUEUE = '"status": "stopped by SIGTERM'


def launch(out: Path, *extra: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        "-m",
        "xmoe",
        "train",
        "--dp",
        "2",
        "--device",
        "cpu",
        "--out",
        str(out),
        "--steps",
        "100000",
        "--log-every",
        "1",
        "--ckpt-every",
        "100000",
        *SMALL,
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def wait_for(proc: subprocess.Popen, pattern: str) -> str:
    for line in proc.stdout:
        if re.search(pattern, line):
            return line
    raise AssertionError(f"no line matching {pattern!r}; stderr: {proc.stderr.read()[-3000:]}")


def ranks_of(launcher: int) -> list[int]:
    """The launcher's child processes (its ranks), lowest pid (rank 0, started first) first."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == launcher:
            children.append(int(stat.parent.name))
    return sorted(children)


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:
        return True


def wait_gone(pids: list[int], timeout_s: float) -> float:
    started = time.monotonic()
    while not all(gone(p) for p in pids):
        assert time.monotonic() - started < timeout_s, f"ranks {pids} still running after {timeout_s} s"
        time.sleep(0.2)
    return time.monotonic() - started


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def test_sigterm_to_one_rank_ends_every_rank_with_143_and_names_the_requeue_condition(tmp_path):
    out = tmp_path / "r"
    proc = launch(out)
    wait_for(proc, r"^step 3/")
    _rank0, rank1 = ranks_of(proc.pid)
    os.kill(rank1, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err  # torchrun's own code for any failed rank: it cannot say 143
    assert err.count("exitcode  : 143") == 2 and "(SIGTERM)" not in err, err  # each rank: 128 + SIGTERM
    assert err.count("xmoe train: stopped by SIGTERM at step") == 2, err
    assert not re.search(r'File ".*/xmoe/', err), err  # no traceback of xmoe's
    ((step, _),) = complete_checkpoints(out)
    assert summary(out)["status"] == f"stopped by SIGTERM at step {step}"
    assert REQUEUE in (out / "summary.json").read_text()


class Crash(Exception):
    """A failure xmoe does not know (the CLI lets it through)."""


def test_a_resumed_run_that_crashes_is_not_taken_for_a_stopped_one(tmp_path, capsys, monkeypatch):
    from xmoe.train import trainer

    out = tmp_path / "r"
    original = trainer.Trainer._forward_backward

    def signal_at_2(self, accum):
        if self.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, accum)

    monkeypatch.setattr(trainer.Trainer, "_forward_backward", signal_at_2)
    assert fails(capsys, out, "--steps", "10", "--ckpt-every", "100")[0] == 143
    assert REQUEUE in (out / "summary.json").read_text()

    def crash(self, accum):
        raise Crash("the machine went down")

    monkeypatch.setattr(trainer.Trainer, "_forward_backward", crash)
    with pytest.raises(Crash):
        train(out, "--steps", "10", "--resume")
    text = (out / "summary.json").read_text()
    assert REQUEUE not in text and summary(out)["previous_status"] == "stopped by SIGTERM at step 2", text


def test_killing_the_launcher_stops_its_ranks_with_a_checkpoint(tmp_path):
    out = tmp_path / "r"
    proc = launch(out)
    wait_for(proc, r"^step 3/")
    ranks = ranks_of(proc.pid)
    proc.kill()  # what a scheduler's or an operator's SIGKILL does to torchrun: its ranks get no signal
    proc.wait()
    wait_gone(ranks, 120)
    ((step, _),) = complete_checkpoints(out)
    assert summary(out)["status"] == f"stopped by its launcher's exit at step {step}"
    assert not (out / runlock.LOCK).exists()  # released: the next run takes the directory without a wait
    proc.stdout.close()
    proc.stderr.close()


def test_a_frozen_rank_is_named_and_the_timeout_ends_the_run(tmp_path):
    out = tmp_path / "r"
    proc = launch(out, "--timeout", "8")
    wait_for(proc, r"^step 3/")
    rank0, rank1 = ranks_of(proc.pid)
    os.kill(rank1, signal.SIGSTOP)
    try:
        line = wait_for(proc, "no step has finished")
        assert f"rank 1 (pid {rank1} on host" in line and "sent no heartbeat" in line, line
        assert wait_gone([rank0], 60) < 30  # the collective timeout (8 s), not torch's 30 minutes
    finally:
        os.kill(rank1, signal.SIGKILL)
        proc.communicate(timeout=60)


def _mesh_timeout_body(rank: int, world_size: int):
    import torch
    import torch.distributed as dist

    from xmoe.config import ParallelConfig
    from xmoe.parallel.dims import ParallelDims

    dims = ParallelDims.from_config(ParallelConfig(ep=2, timeout=1.0), world_size).build_mesh("cpu")
    if rank == 1:
        time.sleep(4)  # silent past the 1 s timeout, well inside the harness's 60 s
    else:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"[Tt]ime[d ]*out"):
            dist.all_reduce(torch.ones(1), group=dims.group("ep"))
        assert time.monotonic() - started < 3.5


def test_the_mesh_groups_time_out_after_parallel_timeout():
    from dist_utils import run_distributed

    run_distributed(_mesh_timeout_body, 2)


def test_the_timeout_is_checked(tmp_path, capsys):
    code, err = fails(capsys, tmp_path / "r", "--timeout", "0")
    assert code == 2 and "timeout (0.0) must be finite and > 0" in err, err
