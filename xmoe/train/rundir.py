"""The run directory as one object, ``RunDir``: what the trainer and the readers of a run (``xmoe eval``, ``export``,
``generate``) do with ``OUT`` and its checkpoints goes through it.

A trainer opens it (``RunDir.open``, collective, before anything is written):
  1. rank 0 takes an exclusive lock on ``OUT/xmoe.lock`` (``runlock.py``: a lock left by a run that died is taken
     over, saying what showed it dead).
  2. a directory that already holds a run (a non-empty metrics.jsonl, summary.json, a checkpoint) is refused
     unless the user resumes it (``--resume``; refused too when it has no checkpoint to resume from) or replaces
     it (``--overwrite``: the previous run is set aside, not deleted, until the new one has written something;
     ``run_outputs.py``). ``commit`` says the new run has written; ``close`` releases the lock, and a new run
     that never committed takes back what it wrote and restores the run it replaced.
  3. leftovers of crashed saves (``*.tmp-*``) are removed: under the lock nothing can still be writing them.
Rank 0's outcome is broadcast, so all ranks start or fail together (no rank waits in a collective forever).
A run directory's own entries (the lock, the outputs, the set-aside) must not be symbolic links: xmoe writes, moves
and deletes them and follows no link there, so a link is refused, its target left alone. A directory deleted, moved
or replaced under a live run is noticed (``lost``): the trainer stops and ``rescue`` moves the run to a new
directory beside it, writing nothing more at the path, which may be another run's by then.

Checkpoints, ``OUT/checkpoints/step_000100/`` (names and pins: ``checkpoint_dir.py``; checks of the files:
``checkpoint_verify.py``; what a checkpoint holds, written into the directory ``save`` stages: ``checkpoint.py``).
``save`` runs the protocol, one step each (why each exists):
  1. ``_stage``: rank 0 removes ``*.tmp-*`` leftovers of crashed saves and creates ``step_XXXXXX.tmp-<random>``;
     the name is broadcast so every rank writes into the same directory (a shared filesystem is assumed).
  2. the caller's ``write``: every rank writes its part of the state (``checkpoint.py``: DCP shards, extra state).
  3. ``_verify``: ranks record sizes and checksums round-robin (a big checkpoint is read once, in parallel).
  4. ``_publish_collective``: rank 0 writes meta.json, then COMPLETE, then renames the directory to its final
     name, and broadcasts success or its error, so all ranks return or raise together (no hang).
  5. ``_point_and_prune``: rank 0 repoints ``latest`` (tmp file + os.replace) and prunes to ``keep_last``, leaving
     a checkpoint a reader has pinned (``read_pinned``) for a later save.
Renames are atomic, so a crash at any point leaves either the old state or the new one, never a directory that
looks complete. A resume (``resume_checkpoint``) and a reader (``checkpoint``) take the newest complete checkpoint
whose files check out, whatever ``latest`` says; what a resume must match is ``resume.py``.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from xmoe.train.checkpoint_dir import (
    _TMP,
    CKPT_SUBDIR,
    COMPLETE,
    LATEST,
    META,
    _broadcast,
    _ckpt_root,
    _discard,
    _point_and_prune,
    _publish_collective,
    _rank_world,
    _stage,
    complete_checkpoints,
    read_pinned,
    remove_leftovers,
    set_aside_newer,
    step_dir_name,
    step_of,
)
from xmoe.train.checkpoint_verify import FORMAT, _verify, _verify_files, find_latest, read_meta, verify_checkpoint
from xmoe.train.resume import check_resume
from xmoe.train.run_outputs import (
    MOVING,
    OUTPUTS,
    REPLACED,
    check_resumable,
    holds_run,
    mark_resumed,
    settle_replaced,
    start_new,
    undo_start,
)
from xmoe.train.runlock import DirLock, RunDirError, _holder_text, refuse_link

log = logging.getLogger(__name__)
T = TypeVar("T")


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
            note = undo_start(self.path.parent)
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


def _prepare(out_dir: Path, resume: bool, overwrite: bool) -> tuple[RunLock, list[str]]:
    """Rank 0's part of ``RunDir.open``; returns the lock and lines to print."""
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
        settled = settle_replaced(out_dir)
        if settled:
            notes.append(settled)
        if resume and holds_run(out_dir):
            check_resumable(out_dir)
            mark_resumed(out_dir)
        else:  # a resume with nothing to resume is a fresh start (a requeue loop's first run)
            notes += start_new(out_dir, overwrite)
            lock.new_run = True
        removed = remove_leftovers(out_dir)
        if removed:
            notes.append(f"removed {len(removed)} leftover(s) of interrupted saves: {', '.join(removed[:4])}")
    except BaseException:
        lock.release()
        raise
    return lock, notes


class RunDir:
    """A run directory, ``path``: a trainer's (``open``: rank 0 holds its ``lock``) or a reader's (``RunDir(path)``,
    no lock). Collective methods are called by every rank of the run."""

    def __init__(self, path: str | os.PathLike, lock: RunLock | None = None) -> None:
        self.path = Path(path)
        self.lock = lock  # rank 0 of a trainer that opened it; None elsewhere

    @classmethod
    def open(cls, path: str | os.PathLike, *, resume: bool, overwrite: bool) -> RunDir:
        """Collective. Lock and prepare ``path`` for a trainer (the module docstring); every rank raises
        RunDirError if rank 0 could not."""
        out_dir = Path(path)
        if str(out_dir) in ("", "."):
            raise RunDirError(f"--out ({str(out_dir)!r}) must name a run directory, e.g. runs/a")
        lock, error = None, None
        if _rank_world()[0] == 0:
            try:
                lock, notes = _prepare(out_dir, resume, overwrite)
                for line in notes:
                    log.info(line)
            except (OSError, RunDirError) as e:
                error = e if isinstance(e, RunDirError) else RunDirError(f"cannot use --out {out_dir}: {e}")
        message = _broadcast(None if error is None else str(error))
        if message is not None and error is None:
            error = RunDirError(message)
        if error is not None:
            raise error
        return cls(out_dir, lock)

    # ------------------------------------------------------------------------------ the trainer's lock

    def lost(self, *, now: bool = True) -> str:
        """Why the directory is no longer this run's (rank 0 of a trainer: ``DirLock.lost``), or ""."""
        return self.lock.lost(now=now) if self.lock is not None else ""

    def commit(self) -> None:
        """This run has written a log line or a checkpoint: a run it replaces (--overwrite) can go now."""
        if self.lock is not None:
            self.lock.commit()

    def close(self) -> None:
        """Release the lock (a run that has written nothing yet takes its partial outputs back and restores the run
        it was replacing)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def rescue(self, step: int) -> tuple[str, Path | None]:
        """Collective, after rank 0's lock found the directory lost: (why, a new directory beside it for the run,
        ``OUT.recovered-step_000123``, or None where none can be made: its parent went too), rank 0's on every
        rank. The run's directory is the new one from then on; the lock, on the lost one, goes with ``close``."""
        why, made = "", None
        if self.lock is not None:
            why = self.lock.lost() or f"run directory {self.path} changed"
            name = f"{self.path.name}.recovered-step_{step:06d}"
            for suffix in ("", *(f"-{i}" for i in range(2, 100))):
                try:
                    (path := self.path.parent / f"{name}{suffix}").mkdir()
                except FileExistsError:
                    continue
                except OSError:
                    break
                made = path
                break
        why, made = _broadcast((why, made))
        if made is not None:
            self.path = made
        return why, made

    @staticmethod
    def rescue_text(why: str, made: Path | None, step: int, saved: bool) -> str:
        """The line a run stopped by a lost directory ends with."""
        noticed = f"{why} while this run trained (noticed at step {step})"
        if made is None:
            return f"{noticed}; nothing could be saved: its parent directory is gone too"
        what = f"its metrics and a checkpoint of step {step} are" if saved else "its metrics are"
        return f"{noticed}: {what} saved in {made}" + (f"; continue it with --out {made} --resume" if saved else "")

    # ------------------------------------------------------------------------------------- checkpoints

    def is_run(self) -> bool:
        """Whether the directory is a run's (a metrics.jsonl, or a checkpoint directory in checkpoints/)."""
        ckpts = self.path / CKPT_SUBDIR
        return (self.path / "metrics.jsonl").is_file() or (ckpts.is_dir() and any(ckpts.glob("step_*")))

    def has_checkpoints(self) -> bool:
        """Whether it has a checkpoints/ directory (what tells a run directory from a Hugging Face one)."""
        return (self.path / CKPT_SUBDIR).is_dir()

    def checkpoints(self) -> list[tuple[int, Path]]:
        """(step, path) of every complete checkpoint (COMPLETE written), oldest first."""
        return complete_checkpoints(self.path)

    def last_checkpoint(self, before: int) -> Path | None:
        """The newest complete checkpoint of a step below ``before``, or None."""
        good = [p for s, p in self.checkpoints() if s < before]
        return good[-1] if good else None

    def checkpoint(self, step: int | None = None) -> Path:
        """A reader's checkpoint: the one of ``step``, or the newest complete one whose files have their recorded
        sizes (newer damaged ones skipped with a warning); FileNotFoundError when there is none."""
        if step is None:
            found = find_latest(self.path)
            if found is None:
                raise FileNotFoundError(f"no complete checkpoint under {self.path}/checkpoints")
            return found
        matches = [p for p in (self.path / CKPT_SUBDIR).glob("step_*") if step_of(p) == step]
        if not matches:
            raise FileNotFoundError(f"no checkpoint of step {step} under {self.path}/checkpoints")
        return matches[0]

    @staticmethod
    def read_pinned(pick: Callable[[], Path], read: Callable[[Path], T]) -> T:
        """``read(pick())`` with the checkpoint picked pinned against the pruning of a run still training (picked
        again when it was pruned first): ``checkpoint_dir.read_pinned``."""
        return read_pinned(pick, read)

    @staticmethod
    def read_meta(ckpt: Path) -> dict[str, Any]:
        """meta.json of a complete checkpoint; CheckpointError if it is incomplete or unreadable."""
        return read_meta(ckpt)

    @staticmethod
    def locate(path: Path, *, checksums: bool) -> tuple[Path, dict[str, Any]]:
        """Collective: the checkpoint ``path`` names (a checkpoint directory, or the newest complete one under a
        run directory or its checkpoints/) and its meta.json, every file at its recorded size (``checksums``: and
        crc32, read once, split over the ranks). FileNotFoundError (nothing there), CheckpointError (incomplete or
        corrupt)."""
        if not path.exists():
            raise FileNotFoundError(f"checkpoint path {path} does not exist")
        if step_of(path) is None and _TMP not in path.name and not (path / META).exists():
            root = _ckpt_root(path)
            found = find_latest(path)
            if found is None:
                raise FileNotFoundError(f"no complete checkpoint under {root} (dirs without {COMPLETE} are ignored)")
            path = found
        meta = read_meta(path)
        _verify_files(path, meta, checksums)
        return path, meta

    def save(
        self, step: int, write: Callable[[Path], None], about: dict[str, Any], *, keep_last: int, checksum: bool = True
    ) -> Path:
        """Collective: checkpoint ``step`` made atomically (the module docstring, steps 1-5); returns its path.
        ``write(tmp)`` writes the state into the staged directory on every rank; meta.json holds ``about`` beside
        the format, step, world size and every file's size and crc32. After success only the ``keep_last`` newest
        checkpoints with step <= ``step`` remain (higher steps, left by an abandoned timeline, are not deleted).
        On failure no existing checkpoint is touched and every rank raises the same CheckpointError."""
        if keep_last < 1:
            raise ValueError(f"keep_last ({keep_last}) must be >= 1")
        if step < 0:
            raise ValueError(f"step ({step}) must be >= 0")
        rank, world = _rank_world()
        root = self.path / CKPT_SUBDIR
        final = root / step_dir_name(step)
        tmp = _stage(root, final)
        try:
            write(tmp)
            files = _verify(tmp, checksum)
            meta = {"format": FORMAT, "step": step, "world_size": world, **about, "files": files}
            _publish_collective(tmp, final, meta)
        except BaseException:
            if rank == 0 and tmp.exists():
                try:
                    _discard(tmp)
                except OSError:
                    pass  # left behind as a .tmp- dir: ignored by loads, removed by the next save or run start
            raise
        _point_and_prune(root, step, final, keep_last)
        return final

    def resume_checkpoint(
        self, resume_from: str | None, run: Any, data: dict[str, Any], allow_changes: bool
    ) -> Path | None:
        """Collective. The checkpoint a resume continues from, verified (sizes and crc32) and checked against
        ``run`` and ``data`` before anything is built (``resume.check_resume``): ``resume_from`` (a checkpoint
        directory, or the ``latest`` file), else the newest whose files check out, newer damaged ones skipped with
        a warning saying why; None when there is no checkpoint. Load it with ``verify=False``."""
        found: Path | None
        if resume_from is not None:
            found = self._named_checkpoint(resume_from)
            meta = verify_checkpoint(found)
        else:
            found = find_latest(self.path, checksums=True)
            if found is None:
                return None
            meta = read_meta(found)
        check_resume(found, meta, run, data, allow_changes)
        return found

    def _named_checkpoint(self, resume_from: str) -> Path:
        """--resume-from's checkpoint directory; the ``latest`` file stands for the one it names."""
        path = Path(resume_from)
        if path.is_file() and path.name == LATEST:
            named = path.parent / path.read_text().strip()
            log.info(f"--resume-from {path}: the pointer names {named}")
            path = named
        if not path.is_dir():
            what = "is a file" if path.is_file() else "does not exist"
            raise FileNotFoundError(
                f"--resume-from {path} {what}; pass a checkpoint directory such as {self.path}/checkpoints/step_000100"
            )
        return path

    def set_aside_newer(self, step: int) -> None:
        """Rank 0, after resuming from a checkpoint named by --resume-from: the later checkpoints belong to the
        timeline being replaced, and are renamed ``*.superseded-*`` (kept, never found again)."""
        for path in set_aside_newer(self.path, step):
            name = path.name.split(".")[0]
            log.info(f"set aside {path.parent.name}/{name} (newer than the resumed step) as {path.name}")
