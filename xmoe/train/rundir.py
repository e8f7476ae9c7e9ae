"""The run directory: one trainer at a time, no silent overwrite, and what a resume must match.

``open_run_dir`` runs first in every trainer, before anything is written:
  1. rank 0 takes an exclusive lock on ``OUT/xmoe.lock`` (``flock``; the file records pid, host and start
     time). The kernel drops a ``flock`` when its process dies, so a lock file left by a killed run is stale
     by construction and is simply taken over (and reported). Where ``flock`` is unsupported (some network
     filesystems), the file itself is the lock: created with O_EXCL, and taken over only when it names a
     process of this host that no longer runs.
  2. a directory that already holds a run (metrics, summary, checkpoints) is refused unless the user
     resumes it (``--resume``) or replaces it (``--overwrite`` deletes the old outputs and says which).
  3. leftovers of crashed saves (``*.tmp-*``) are removed: under the lock nothing can still be writing them.
Rank 0's outcome is broadcast, so all ranks start or fail together (no rank waits in a collective forever).

``fingerprint`` and ``resume_mismatches`` say what a checkpoint must share with the run resuming it.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import time
import zlib
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

log = logging.getLogger(__name__)

LOCK = "xmoe.lock"
OUTPUTS = ("metrics.jsonl", "summary.json", "loss.png", "checkpoints", "tensorboard")
# train fields a bit-identical continuation depends on (steps, cadences and micro-batching may change freely)
RESUME_TRAIN_FIELDS = ("seed", "global_batch_size", "seq_len", "lr", "min_lr_ratio", "warmup_steps",
                       "weight_decay", "beta1", "beta2", "grad_clip")


class RunDirError(ValueError):
    """The run directory cannot be used as asked (locked, already holds a run, not a directory)."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def _read_holder(path: Path) -> dict[str, Any]:
    try:
        holder = json.loads(path.read_text())
        return holder if isinstance(holder, dict) else {}
    except (OSError, ValueError):
        return {}


def _holder_text(holder: dict[str, Any]) -> str:
    return (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}"
            + (f" (since {holder['started']})" if holder.get("started") else ""))


class RunLock:
    """An exclusive lock on a run directory, held until ``release`` (or the process's death)."""

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / LOCK
        self._fd: Optional[int] = None
        self.stale: Optional[dict[str, Any]] = None  # the dead holder whose lock was taken over

    def acquire(self) -> "RunLock":
        me = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        for _ in range(5):  # retried only when a releasing holder unlinks the file between open and lock
            created = not self.path.exists()
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunDirError(
                    f"run directory {self.path.parent} is in use by {_holder_text(_read_holder(self.path))}; "
                    "wait for that run to end or stop it, or choose another --out") from None
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                if created:  # the empty file just made by the open above is nobody's lock
                    self.path.unlink(missing_ok=True)
                return self._acquire_exclusive_file(me)
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # locked a file that was unlinked meanwhile: the lock is on the new one
        else:
            raise RunDirError(f"could not lock {self.path}: it keeps being replaced; is another run starting?")
        previous = _read_holder(self.path)
        if previous:  # the lock was free, so whoever wrote this is gone (killed, or its host rebooted)
            self.stale = previous
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self._fd = fd
        return self

    def _acquire_exclusive_file(self, me: dict[str, Any]) -> "RunLock":
        """Fallback without flock: the lock file's existence is the lock; a dead holder on this host is stale."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            holder = _read_holder(self.path)
            if holder.get("host") != me["host"] or _pid_alive(int(holder.get("pid", 0) or 0)):
                raise RunDirError(
                    f"run directory {self.path.parent} is in use by {_holder_text(holder)}; wait for that run "
                    f"to end or stop it, or choose another --out (a lock left by a crash on another host: "
                    f"delete {self.path})") from None
            self.stale = holder
            self.path.unlink(missing_ok=True)
            return self._acquire_exclusive_file(me)
        os.write(fd, json.dumps(me).encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)  # before unlocking: a waiter then locks a fresh file, not this one
        os.close(self._fd)
        self._fd = None


def _existing_outputs(out_dir: Path) -> list[str]:
    found = []
    for name in OUTPUTS:
        path = out_dir / name
        if path.is_file() or (path.is_dir() and any(path.iterdir())):
            found.append(name + ("/" if path.is_dir() else ""))
    return found


def _describe_run(out_dir: Path, found: list[str]) -> str:
    parts = []
    try:
        lines = (out_dir / "metrics.jsonl").read_text().splitlines()
        last = json.loads(lines[-1])["step"] if lines else None
        if last is not None:
            parts.append(f"metrics up to step {last}")
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        pass
    ckpts = sorted(p.name for p in (out_dir / "checkpoints").glob("step_*")) if "checkpoints/" in found else []
    if ckpts:
        parts.append(f"{len(ckpts)} checkpoint(s), newest {ckpts[-1]}")
    return f"{', '.join(found)}" + (f": {', '.join(parts)}" if parts else "")


def _prepare(out_dir: Path, resume: bool, overwrite: bool) -> tuple[RunLock, list[str]]:
    """Rank 0's part of ``open_run_dir``; returns the lock and lines to print."""
    if out_dir.exists() and not out_dir.is_dir():
        raise RunDirError(f"--out ({out_dir}) is a file, not a directory; choose a directory path")
    out_dir.mkdir(parents=True, exist_ok=True)
    lock = RunLock(out_dir).acquire()
    notes = []
    try:
        if lock.stale:
            notes.append(f"took over the stale lock of {_holder_text(lock.stale)}, which is no longer running")
        found = _existing_outputs(out_dir)
        if found and not resume:
            if not overwrite:
                raise RunDirError(
                    f"run directory {out_dir} already holds a run ({_describe_run(out_dir, found)}); pass --resume "
                    "to continue it, --overwrite to delete it and start again, or choose another --out")
            notes.append(f"--overwrite: deleting the previous run in {out_dir} ({_describe_run(out_dir, found)})")
            for name in found:
                path = out_dir / name.rstrip("/")
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        from xmoe.train.checkpoint import remove_leftovers

        removed = remove_leftovers(out_dir)
        if removed:
            notes.append(f"removed {len(removed)} leftover(s) of interrupted saves: {', '.join(removed[:4])}")
    except BaseException:
        lock.release()
        raise
    return lock, notes


def open_run_dir(out_dir: str | os.PathLike, *, rank: int, resume: bool, overwrite: bool) -> Optional[RunLock]:
    """Collective. Lock and prepare ``out_dir`` (see the module docstring); rank 0 returns the lock to release
    at the end of the run, other ranks None. Every rank raises RunDirError if rank 0 could not."""
    out_dir = Path(out_dir)
    if str(out_dir) in ("", "."):
        raise RunDirError(f"--out ({str(out_dir)!r}) must name a run directory, e.g. runs/a")
    lock, error = None, None
    if rank == 0:
        try:
            lock, notes = _prepare(out_dir, resume, overwrite)
            for line in notes:
                log.info(line)
        except (OSError, RunDirError) as e:
            error = e if isinstance(e, RunDirError) else RunDirError(f"cannot use --out {out_dir}: {e}")
    if dist.is_initialized():
        box = [None if error is None else str(error)]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None and error is None:
            error = RunDirError(box[0])
    if error is not None:
        raise error
    return lock


# ------------------------------------------------------------------------------------- what resume checks


def _file_fingerprint(path: str) -> dict[str, Any]:
    """Size and the crc32 of 16 evenly spaced 64 KiB samples: reads at most 1 MiB of any file, yet two data
    files of the same size almost never agree on it (the whole file is read when it is that small)."""
    size = os.path.getsize(path)
    crc, chunk = 0, 1 << 16
    with open(path, "rb") as f:
        for i in range(16):
            f.seek(max(0, (size - chunk) * i // 15))
            crc = zlib.crc32(f.read(chunk), crc)
    return {"size": size, "sample_crc32": f"{crc:08x}"}


def fingerprint(data_spec: str, dataset: Any) -> dict[str, Any]:
    """What identifies the training data: the dataset's name (markov options included), its vocabulary and,
    for a file, its size and sampled checksum."""
    info: dict[str, Any] = {"name": dataset.name, "vocab_size": dataset.vocab_size}
    if os.path.isfile(data_spec):
        info.update(_file_fingerprint(data_spec))
    return info


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else k, v, out)
    else:
        out[prefix] = value


def resume_mismatches(saved: Optional[dict[str, Any]], run: Any, data: dict[str, Any]) -> list[str]:
    """``section.field: checkpoint X, now Y`` for every model field, data property and schedule field
    (RESUME_TRAIN_FIELDS) that differs between a checkpoint's stored config and this run."""
    if not isinstance(saved, dict):
        return []  # written before configs were stored: nothing to compare
    now: dict[str, Any] = {}
    _flatten("model", dataclasses.asdict(run.model), now)
    _flatten("data", data, now)
    for name in RESUME_TRAIN_FIELDS:
        now[f"train.{name}"] = getattr(run.train, name)
    then: dict[str, Any] = {}
    _flatten("", {k: saved.get(k) for k in ("model", "data", "train") if isinstance(saved.get(k), dict)}, then)
    return [f"{key}: checkpoint {then[key]!r}, now {value!r}" for key, value in now.items()
            if key in then and then[key] != value]


def check_resume(ckpt_path: Path, meta: dict[str, Any], run: Any, data: dict[str, Any], allow_changes: bool) -> None:
    """Refuse a checkpoint that has nothing left to do, or (unless ``allow_changes``) a different model, data or
    schedule; ValueError listing the differing fields."""
    step = int(meta["step"])
    if step >= run.train.steps:
        raise ValueError(f"nothing to do: checkpoint {ckpt_path} is at step {step} and --steps is {run.train.steps}; "
                         "pass a larger --steps to train further")
    differ = resume_mismatches(meta.get("config"), run, data)
    if differ and not allow_changes:
        raise ValueError(
            f"checkpoint {ckpt_path} was saved by a different run ({len(differ)} field(s) differ: "
            f"{'; '.join(differ[:8])}); resume with the same settings, or pass --allow-changes to continue from "
            "it anyway (fine-tuning on new data or with a new schedule)")
    if differ:
        log.info(f"--allow-changes: continuing from {ckpt_path} with {len(differ)} changed field(s): "
                 f"{'; '.join(differ[:8])}")
