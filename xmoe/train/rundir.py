"""The run directory: one trainer at a time, nothing lost by a start that fails, and what a resume must match.

``open_run_dir`` runs first in every trainer, before anything is written:
  1. rank 0 takes an exclusive lock on ``OUT/xmoe.lock`` (``flock``; the file records pid, host and start
     time, and its holder touches it every HEARTBEAT_S seconds). The kernel drops a ``flock`` when its process
     dies, so a lock file whose flock is free was left by a run that ended without releasing it, and is taken
     over (saying what was checked). Another host's lock file is taken over only once it has not been touched
     for STALE_AFTER_S seconds: where a filesystem keeps flocks per host, a free flock proves nothing about a
     run on another host. Where ``flock`` is unsupported, the file itself is the lock: created with O_EXCL, and
     taken over only when it names a process of this host that no longer runs, or has not been touched for
     STALE_AFTER_S.
  2. a directory that already holds a run (a non-empty metrics.jsonl, summary.json, a checkpoint) is refused
     unless the user resumes it (``--resume``; refused too when it has no checkpoint to resume from) or replaces
     it (``--overwrite``). A new run never deletes before it has started: the previous run's outputs (OUTPUTS)
     are moved into ``OUT/xmoe.replaced/`` and deleted only when the new run writes its first log line or
     checkpoint (``RunLock.commit``); a new run that ends before that (a bad data path, a failed build, Ctrl-C)
     removes what it wrote and moves them back. A start killed before either is settled by the next one.
  3. leftovers of crashed saves (``*.tmp-*``) are removed: under the lock nothing can still be writing them.
Rank 0's outcome is broadcast, so all ranks start or fail together (no rank waits in a collective forever).

``fingerprint`` and ``resume_mismatches`` say what a checkpoint must share with the run resuming it;
``check_resume`` compares a checkpoint's stored config with a RunConfig without building anything.
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
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

log = logging.getLogger(__name__)

LOCK = "xmoe.lock"
REPLACED = "xmoe.replaced"  # the previous run's outputs while a new run (--overwrite) has not yet written its own
MOVING = "xmoe.replaced.tmp"  # REPLACED while being filled or emptied: a start killed then restores it, always
# everything a trainer writes into its run directory (tokenizer.json and hf_config.json: copies an --init-from
# run keeps for eval, export and generate)
OUTPUTS = ("metrics.jsonl", "summary.json", "loss.png", "checkpoints", "tensorboard", "tokenizer.json",
           "hf_config.json")
HEARTBEAT_S = 15.0  # a lock holder touches its lock file this often
STALE_AFTER_S = 60.0  # another host's lock file untouched this long belongs to a run that has ended
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


def _untouched_s(path: Path) -> float:
    """Seconds since the lock file was last written or touched by its holder's heartbeat."""
    try:
        return max(0.0, time.time() - path.stat().st_mtime)
    except OSError:
        return float("inf")


def _pid_text(holder: dict[str, Any]) -> str:
    pid = int(holder.get("pid", 0) or 0)
    return f"pid {pid} is not running" if not _pid_alive(pid) else f"pid {pid} now belongs to another process"


class RunLock:
    """An exclusive lock on a run directory, held until ``release`` (or the process's death); while held, a
    thread touches the lock file every HEARTBEAT_S seconds, so other hosts can tell a live holder from a dead one.

    It also carries a new run's start (``commit`` / ``release``): see the module docstring, step 2."""

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / LOCK
        self._fd: Optional[int] = None
        self.stale: Optional[dict[str, Any]] = None  # the dead holder whose lock was taken over
        self.stale_reason = ""  # what showed that holder to be gone
        self.new_run = False  # a fresh start (not a resume): undone by release() unless committed
        self._stop_beating = threading.Event()
        self._beating: Optional[threading.Thread] = None

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
        if previous:  # the flock was free: whoever wrote this ended without releasing it, unless on another host
            try:
                self._check_free_flock(previous, me["host"])
            except RunDirError:
                os.close(fd)
                raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self._fd = fd
        self._start_heartbeat()
        return self

    def _check_free_flock(self, holder: dict[str, Any], host: str) -> None:
        """A lock file with a free flock: stale on this host; on another host only once untouched for
        STALE_AFTER_S (waiting up to that long, so a run requeued after a crash still starts)."""
        checked = "no process holds its flock"
        if holder.get("host") == host:
            self.stale, self.stale_reason = holder, f"{checked} and {_pid_text(holder)}"
            return
        untouched = _untouched_s(self.path)
        if untouched < STALE_AFTER_S:
            log.info(f"{self.path} names {_holder_text(holder)}, touched {untouched:.0f} s ago: waiting up to "
                     f"{STALE_AFTER_S - untouched:.0f} s to see whether that run is still alive")
        mtime = self.path.stat().st_mtime
        while untouched < STALE_AFTER_S:
            time.sleep(min(1.0, STALE_AFTER_S - untouched))
            if self.path.stat().st_mtime != mtime:
                raise RunDirError(
                    f"run directory {self.path.parent} is in use by {_holder_text(holder)}: its lock file is kept "
                    f"fresh, so that run is alive (this filesystem's flocks do not reach across hosts); wait for it "
                    "to end or stop it, or choose another --out")
            untouched = _untouched_s(self.path)
        self.stale = holder
        self.stale_reason = (f"{checked} and its host has not touched the lock file for {untouched:.0f} s (a live "
                             f"run touches it every {HEARTBEAT_S:.0f} s)")

    def _acquire_exclusive_file(self, me: dict[str, Any]) -> "RunLock":
        """Fallback without flock: the lock file's existence is the lock; a dead holder on this host, or one that
        has not touched the file for STALE_AFTER_S, is stale."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            holder = _read_holder(self.path)
            pid = int(holder.get("pid", 0) or 0)
            untouched = _untouched_s(self.path)
            if holder.get("host") == me["host"] and not _pid_alive(pid):
                self.stale_reason = f"pid {pid} is not running"
            elif untouched >= STALE_AFTER_S:
                self.stale_reason = (f"its lock file has not been touched for {untouched:.0f} s (a live run touches "
                                     f"it every {HEARTBEAT_S:.0f} s)")
            else:
                raise RunDirError(
                    f"run directory {self.path.parent} is in use by {_holder_text(holder)} (its lock file was "
                    f"touched {untouched:.0f} s ago); wait for that run to end or stop it, or choose another --out "
                    f"(a lock file untouched for {STALE_AFTER_S:.0f} s is taken over)") from None
            self.stale = holder
            self.path.unlink(missing_ok=True)
            return self._acquire_exclusive_file(me)
        os.write(fd, json.dumps(me).encode())
        self._fd = fd
        self._start_heartbeat()
        return self

    def _start_heartbeat(self) -> None:
        stop, fd = self._stop_beating, self._fd

        def beat() -> None:
            while not stop.wait(HEARTBEAT_S):
                try:
                    os.utime(fd)
                except OSError:
                    pass  # a filesystem that refuses it: other hosts then wait STALE_AFTER_S longer, no more

        self._beating = threading.Thread(target=beat, name="xmoe-lock-heartbeat", daemon=True)
        self._beating.start()

    def commit(self) -> None:
        """The new run has written its first output: the run it replaced (--overwrite) is deleted now."""
        if not self.new_run:
            return
        self.new_run = False
        aside = self.path.parent / REPLACED
        if aside.exists():
            shutil.rmtree(aside)
            log.info(f"--overwrite: deleted the previous run, set aside in {aside}")

    def release(self) -> None:
        """Unlock; a new run that never committed takes back what it wrote and restores the run it replaced."""
        if self._fd is None:
            return
        if self.new_run:
            self.new_run = False
            note = _undo_start(self.path.parent)
            if note:
                log.info(note)
        if self._beating is not None:  # stopped before the descriptor closes: it never touches a reused one
            self._stop_beating.set()
            self._beating.join()
        self.path.unlink(missing_ok=True)  # before unlocking: a waiter then locks a fresh file, not this one
        os.close(self._fd)
        self._fd = None


def _present(out_dir: Path) -> list[str]:
    """Names of the trainer outputs in ``out_dir`` (directories with a trailing /)."""
    return [name + ("/" if (out_dir / name).is_dir() else "") for name in OUTPUTS if os.path.lexists(out_dir / name)]


def _holds_run(out_dir: Path) -> bool:
    """Whether ``out_dir`` holds a run's work: a logged step, a summary or a checkpoint, set aside ones included
    (an empty metrics.jsonl and copied tokenizer files are what a start that failed leaves, not a run)."""
    metrics, ckpts = out_dir / "metrics.jsonl", out_dir / "checkpoints"
    saved = ckpts.is_dir() and any(p.name.startswith("step_") and ".tmp-" not in p.name for p in ckpts.iterdir())
    return (metrics.is_file() and metrics.stat().st_size > 0) or (out_dir / "summary.json").is_file() or saved


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _move_back(out_dir: Path, moving: Path) -> None:
    for item in moving.iterdir():
        os.rename(item, out_dir / item.name)
    moving.rmdir()


def _undo_start(out_dir: Path) -> str:
    """Remove the outputs of a start that never wrote a log line or checkpoint and move back the run it replaced;
    returns what was done, for the log."""
    for name in _present(out_dir):
        _remove(out_dir / name.rstrip("/"))
    if not (out_dir / REPLACED).is_dir():
        return ""
    os.rename(out_dir / REPLACED, out_dir / MOVING)  # a kill from here on is finished by _settle_replaced
    _move_back(out_dir, out_dir / MOVING)
    return f"the new run ended before writing anything: restored the previous run in {out_dir}"


def _settle_replaced(out_dir: Path) -> str:
    """What a killed start left: a set-aside or restore cut short is completed as a restore; a complete set-aside
    is deleted if the new run had written output, else restored. Returns what was done, for the log."""
    if (out_dir / MOVING).is_dir():  # no new run output can exist yet (set aside) or any more (restore)
        _move_back(out_dir, out_dir / MOVING)
        return f"restored the previous run in {out_dir}: a killed start had left setting it aside or back unfinished"
    aside = out_dir / REPLACED
    if not aside.is_dir():
        return ""
    if _holds_run(out_dir):
        shutil.rmtree(aside)
        return f"deleted {aside}: the run it held was replaced by the run now in {out_dir} (--overwrite)"
    return _undo_start(out_dir).replace("the new run ended before writing anything",
                                        "an --overwrite start was killed before writing anything")


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


def _check_resumable(out_dir: Path, found: list[str]) -> None:
    """A resume of a run that has work but no checkpoint would start at step 0 over its metrics: refuse."""
    from xmoe.train.checkpoint_dir import complete_checkpoints

    if not complete_checkpoints(out_dir):
        raise RunDirError(
            f"run directory {out_dir} holds a run ({_describe_run(out_dir, found)}) but no checkpoint to resume "
            "from (trained with --ckpt-every 0?); pass --overwrite to start again in its place, or choose another "
            "--out")


def _start_new(out_dir: Path, lock: RunLock, overwrite: bool) -> list[str]:
    """A fresh start: refuse a directory holding a run unless ``overwrite``; set aside whatever outputs are there."""
    found = _present(out_dir)
    notes = []
    if _holds_run(out_dir):
        if not overwrite:
            raise RunDirError(
                f"run directory {out_dir} already holds a run ({_describe_run(out_dir, found)}); pass --resume "
                "to continue it, --overwrite to delete it and start again, or choose another --out")
        moving = out_dir / MOVING
        moving.mkdir()
        for name in found:
            os.rename(out_dir / name.rstrip("/"), moving / name.rstrip("/"))
        os.rename(moving, out_dir / REPLACED)
        notes.append(f"--overwrite: set the previous run in {out_dir} aside "
                     f"({_describe_run(out_dir / REPLACED, found)}); it is deleted when this run writes its first "
                     "log line or checkpoint, and restored if it ends before")
    else:
        for name in found:  # what a start that failed left (an empty metrics.jsonl, copied tokenizer files)
            _remove(out_dir / name.rstrip("/"))
        if found:
            notes.append(f"removed what an earlier start that failed left in {out_dir}: {', '.join(found)}")
    lock.new_run = True
    return notes


def _prepare(out_dir: Path, resume: bool, overwrite: bool) -> tuple[RunLock, list[str]]:
    """Rank 0's part of ``open_run_dir``; returns the lock and lines to print."""
    if out_dir.exists() and not out_dir.is_dir():
        raise RunDirError(f"--out ({out_dir}) is a file, not a directory; choose a directory path")
    out_dir.mkdir(parents=True, exist_ok=True)
    lock = RunLock(out_dir).acquire()
    notes = []
    try:
        if lock.stale:
            notes.append(f"took over the lock of {_holder_text(lock.stale)}: {lock.stale_reason}, so that run ended "
                         "without releasing it")
        settled = _settle_replaced(out_dir)
        if settled:
            notes.append(settled)
        if resume and _holds_run(out_dir):
            _check_resumable(out_dir, _present(out_dir))
        else:  # a resume with nothing to resume is a fresh start (a requeue loop's first run)
            notes += _start_new(out_dir, lock, overwrite)
        from xmoe.train.checkpoint_dir import remove_leftovers

        removed = remove_leftovers(out_dir)
        if removed:
            notes.append(f"removed {len(removed)} leftover(s) of interrupted saves: {', '.join(removed[:4])}")
    except BaseException:
        lock.release()
        raise
    return lock, notes


def open_run_dir(out_dir: str | os.PathLike, *, rank: int, resume: bool, overwrite: bool) -> Optional[RunLock]:
    """Collective. Lock and prepare ``out_dir`` (see the module docstring); rank 0 returns the lock, whose
    ``commit`` the trainer calls once it has written its first log line or checkpoint and whose ``release`` ends
    the run; other ranks get None. Every rank raises RunDirError if rank 0 could not."""
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
    """Size and the crc32 of the whole file, streamed: any edit changes it. It costs one read of the file per
    start, about 0.3 s per GB from the page cache (measured: 20 MB in 0.01 s, 200 MB in 0.06-0.09 s; 2-core
    CPU), the disk's read time otherwise."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return {"size": os.path.getsize(path), "crc32": f"{crc:08x}"}


def fingerprint(data_spec: str, dataset: Any) -> dict[str, Any]:
    """Collective when torch.distributed is initialised (rank 0 reads the file, the others receive its result).
    What identifies the training data: the dataset's name (markov options included), its vocabulary and, for a
    file, its size and the crc32 of its whole content."""
    info: dict[str, Any] = {"name": dataset.name, "vocab_size": dataset.vocab_size}
    if os.path.isfile(data_spec):
        parts = [_file_fingerprint(data_spec) if not dist.is_initialized() or dist.get_rank() == 0 else None]
        if dist.is_initialized():
            dist.broadcast_object_list(parts, src=0)
        info.update(parts[0])
    return info


def flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    """``out[prefix.key.subkey] = value`` for every leaf of the nested dict ``value``."""
    if isinstance(value, dict):
        for k, v in value.items():
            flatten(f"{prefix}.{k}" if prefix else k, v, out)
    else:
        out[prefix] = value


def resume_mismatches(saved: Optional[dict[str, Any]], run: Any, data: dict[str, Any]) -> list[str]:
    """``section.field: checkpoint X, now Y`` for every model field, data property and schedule field
    (RESUME_TRAIN_FIELDS) that differs between a checkpoint's stored config and this run."""
    if not isinstance(saved, dict):
        return []  # written before configs were stored: nothing to compare
    now: dict[str, Any] = {}
    flatten("model", dataclasses.asdict(run.model), now)
    flatten("data", data, now)
    for name in RESUME_TRAIN_FIELDS:
        now[f"train.{name}"] = getattr(run.train, name)
    then: dict[str, Any] = {}
    flatten("", {k: saved.get(k) for k in ("model", "data", "train") if isinstance(saved.get(k), dict)}, then)
    return [f"{key}: checkpoint {then[key]!r}, now {value!r}" for key, value in now.items()
            if key in then and then[key] != value]


def _named_checkpoint(out_dir: Path, resume_from: str) -> Path:
    """--resume-from's checkpoint directory; the ``latest`` file stands for the one it names."""
    from xmoe.train.checkpoint_dir import LATEST

    path = Path(resume_from)
    if path.is_file() and path.name == LATEST:
        named = path.parent / path.read_text().strip()
        log.info(f"--resume-from {path}: the pointer names {named}")
        path = named
    if not path.is_dir():
        what = "is a file" if path.is_file() else "does not exist"
        raise FileNotFoundError(f"--resume-from {path} {what}; pass a checkpoint directory such as "
                                f"{out_dir}/checkpoints/step_000100")
    return path


def resume_checkpoint(out_dir: Path, resume_from: Optional[str], run: Any, data: dict[str, Any],
                      allow_changes: bool) -> Optional[Path]:
    """Collective. The checkpoint a resume continues from, verified (sizes and crc32) and checked against
    ``run`` and ``data`` before anything is built: ``resume_from`` (a checkpoint directory, or the ``latest``
    file), else the newest under ``out_dir`` whose files check out, newer damaged ones skipped with a warning
    saying why; None when ``out_dir`` has no checkpoint. Load it with ``verify=False``."""
    from xmoe.train import checkpoint as ckpt

    if resume_from is not None:
        found = _named_checkpoint(out_dir, resume_from)
        meta = ckpt.verify_checkpoint(found)
    else:
        found = ckpt.find_latest(out_dir, checksums=True)
        if found is None:
            return None
        meta = ckpt.read_meta(found)
    check_resume(found, meta, run, data, allow_changes)
    return found


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
