"""The run directory: one trainer at a time, and nothing lost by a start that fails (``--overwrite`` sets the
previous run aside until the new one has written something).

``open_run_dir`` runs first in every trainer, before anything is written:
  1. rank 0 takes an exclusive lock on ``OUT/xmoe.lock`` (``runlock.py``: a lock left by a run that died is taken
     over, saying what showed it dead).
  2. a directory that already holds a run (a non-empty metrics.jsonl, summary.json, a checkpoint) is refused
     unless the user resumes it (``--resume``; refused too when it has no checkpoint to resume from) or replaces
     it (``--overwrite``). A new run never deletes before it has started: the previous run's outputs (OUTPUTS)
     are moved into ``OUT/xmoe.replaced/`` and deleted only when the new run writes its first log line or
     checkpoint (``RunLock.commit``); a new run that ends before that (a bad data path, a failed build, Ctrl-C)
     removes what it wrote and moves them back (and the directories it created for ``OUT``, if they are empty
     then). A start killed before either is settled by the next one.
  3. leftovers of crashed saves (``*.tmp-*``) are removed: under the lock nothing can still be writing them.
A run directory's own entries (the lock, OUTPUTS, the set-aside) must not be symbolic links: xmoe writes, moves and
deletes them and follows no link there, so a link is refused, its target left alone. A directory deleted, moved or
replaced under a live run is noticed (``DirLock.lost``): the trainer stops and saves elsewhere, writing nothing more
at the path, which may be another run's by then.
Rank 0's outcome is broadcast, so all ranks start or fail together (no rank waits in a collective forever).
What a resume must match, and the checkpoint it continues from, is ``resume.py``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch.distributed as dist

from xmoe.train.runlock import DirLock, RunDirError, _holder_text, refuse_link

log = logging.getLogger(__name__)

REPLACED = "xmoe.replaced"  # the previous run's outputs while a new run (--overwrite) has not yet written its own
MOVING = "xmoe.replaced.tmp"  # REPLACED while being filled or emptied: a start killed then restores it, always
# everything a trainer writes into its run directory (tokenizer.json and hf_config.json: copies an --init-from
# run keeps for eval, export and generate)
OUTPUTS = (
    "metrics.jsonl",
    "summary.json",
    "loss.png",
    "checkpoints",
    "tensorboard",
    "tokenizer.json",
    "hf_config.json",
)


class RunLock(DirLock):
    """The run directory's lock, which also carries a new run's start (``commit`` / ``release``): see the module
    docstring, step 2."""

    def __init__(self, out_dir: Path, created: tuple[Path, ...] = ()) -> None:
        super().__init__(out_dir)
        self.new_run = False  # a fresh start (not a resume): undone by release() unless committed
        self.created = created  # the directories this start made (out_dir first): an undone start removes them

    def commit(self) -> None:
        """The new run has written its first output: the run it replaced (--overwrite) is deleted now."""
        if not self.new_run or self.lost():  # the path is no longer this run's directory: touch nothing there
            return
        self.new_run = False
        aside = self.path.parent / REPLACED
        if aside.exists():
            shutil.rmtree(aside)
            log.info(f"--overwrite: deleted the previous run, set aside in {aside}")

    def release(self) -> None:
        """Unlock; a new run that never committed takes back what it wrote and restores the run it replaced."""
        undone = self._fd is not None and self.new_run and not self.lost()
        if undone:
            self.new_run = False
            note = _undo_start(self.path.parent)
            if note:
                log.info(note)
        super().release()
        if undone:  # a refused start leaves no empty run directory behind (the lock file has gone with release)
            for path in self.created:
                try:
                    path.rmdir()
                except OSError:  # not empty (or no longer there): what is in it is someone else's
                    break


def _refuse_links(out_dir: Path) -> None:
    """RunDirError naming the first of the run directory's own entries that is a symbolic link."""
    for name in (REPLACED, MOVING, *OUTPUTS):
        refuse_link(out_dir / name, "set-aside run" if name in (REPLACED, MOVING) else f"{name}")


def rescue(lock: DirLock | None, out_dir: Path, step: int) -> tuple[str, Path | None]:
    """Collective, after rank 0's ``lock`` found ``out_dir`` lost: (why, a new directory beside it for the run,
    ``OUT.recovered-step_000123``, or None where none can be made: its parent went too), rank 0's on every rank."""
    why, made = "", None
    if lock is not None:
        why = lock.lost() or f"run directory {out_dir} changed"
        name = f"{out_dir.name}.recovered-step_{step:06d}"
        for suffix in ("", *(f"-{i}" for i in range(2, 100))):
            try:
                (path := out_dir.parent / f"{name}{suffix}").mkdir()
            except FileExistsError:
                continue
            except OSError:
                break
            made = path
            break
    if dist.is_initialized():
        box = [(why, made)]
        dist.broadcast_object_list(box, src=0)
        why, made = box[0]
    return why, made


def rescue_text(why: str, made: Path | None, step: int, saved: bool) -> str:
    """The line a run stopped by a lost directory ends with."""
    noticed = f"{why} while this run trained (noticed at step {step})"
    if made is None:
        return f"{noticed}; nothing could be saved: its parent directory is gone too"
    what = f"its metrics and a checkpoint of step {step} are" if saved else "its metrics are"
    return f"{noticed}: {what} saved in {made}" + (f"; continue it with --out {made} --resume" if saved else "")


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
    return _undo_start(out_dir).replace(
        "the new run ended before writing anything", "an --overwrite start was killed before writing anything"
    )


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
            "--out"
        )


def _mark_resumed(out_dir: Path) -> None:
    """summary.json's status says "resumed" (the old one kept as previous_status) until this run writes its own: a
    run that then crashes is not taken for the one stopped by a signal before it (what a requeue script reads)."""
    from xmoe.train.checkpoint_dir import _write_text

    path = out_dir / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if isinstance(summary, dict):
        previous = summary.get("status", "finished")
        summary["status"] = f"resumed at {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, running (pid {os.getpid()})"
        summary["previous_status"] = previous
        _write_text(path, json.dumps(summary, indent=1) + "\n")


def _start_new(out_dir: Path, lock: RunLock, overwrite: bool) -> list[str]:
    """A fresh start: refuse a directory holding a run unless ``overwrite``; set aside whatever outputs are there."""
    found = _present(out_dir)
    notes = []
    if _holds_run(out_dir):
        if not overwrite:
            raise RunDirError(
                f"run directory {out_dir} already holds a run ({_describe_run(out_dir, found)}); pass --resume "
                "to continue it, --overwrite to delete it and start again, or choose another --out"
            )
        moving = out_dir / MOVING
        moving.mkdir()
        for name in found:
            os.rename(out_dir / name.rstrip("/"), moving / name.rstrip("/"))
        os.rename(moving, out_dir / REPLACED)
        notes.append(
            f"--overwrite: set the previous run in {out_dir} aside "
            f"({_describe_run(out_dir / REPLACED, found)}); it is deleted when this run writes its first "
            "log line or checkpoint, and restored if it ends before"
        )
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
    created = tuple(d for d in (out_dir, *out_dir.parents) if not d.exists())
    out_dir.mkdir(parents=True, exist_ok=True)
    lock = RunLock(out_dir, created).acquire()
    notes = []
    try:
        _refuse_links(out_dir)
        if lock.stale:
            notes.append(
                f"took over the lock of {_holder_text(lock.stale)}: {lock.stale_reason}, so that run ended "
                "without releasing it"
            )
        settled = _settle_replaced(out_dir)
        if settled:
            notes.append(settled)
        if resume and _holds_run(out_dir):
            _check_resumable(out_dir, _present(out_dir))
            _mark_resumed(out_dir)
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


def open_run_dir(out_dir: str | os.PathLike, *, rank: int, resume: bool, overwrite: bool) -> RunLock | None:
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
