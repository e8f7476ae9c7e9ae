"""The checkpoint directory's pieces: the names under ``OUT/checkpoints/``, the steps by which a save becomes
visible, who may delete what, and how ranks agree on a failure. ``rundir.RunDir`` runs them in order (its ``save``);
what a checkpoint holds, written into the staged directory and loaded back, is ``checkpoint.py``; checking its
files, ``checkpoint_verify.py``.

Names under the run directory OUT::

    OUT/checkpoints/step_000100/                  a checkpoint (``step_dir_name``, ``step_of``); complete once it
                                                  holds COMPLETE, written last: one without it is never loaded
    OUT/checkpoints/step_000100.tmp-<hex>/        a save in progress, or the leftover of a crashed one
    OUT/checkpoints/step_000100.superseded-<hex>/ set aside by a resume from an older checkpoint (kept, never found)
    OUT/checkpoints/latest                        name of the newest checkpoint written (for scripts; resume scans)

The steps of a save that are the directory's (``RunDir.save`` runs them around the writing of the state):
``_stage`` (rank 0 removes ``*.tmp-*`` leftovers and makes the temporary directory, whose name every rank learns),
``_publish_collective`` (rank 0 writes meta.json, then COMPLETE, then renames the directory to its final name) and
``_point_and_prune`` (``latest`` repointed, older checkpoints pruned to ``keep_last``). Renames are atomic, and so
is a deletion (``_discard`` renames first): a crash at any point leaves either the old state or the new one, never
a directory that looks complete. Readers of a live run pin the checkpoint they read (``pinned``, ``read_pinned``);
pruning leaves a pinned one for a later save. Every failure a rank can hit becomes the same ``CheckpointError`` on
all ranks (``_agree``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

CKPT_SUBDIR = "checkpoints"
LATEST = "latest"
META = "meta.json"
COMPLETE = "COMPLETE"
_TMP = ".tmp-"
_LOW_SPACE = 16 << 20  # a failed write with less free space than this is reported as a full disk
T = TypeVar("T")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read (incomplete, corrupt, or a rank failed during save)."""


# ----------------------------------------------------------------------------------------- ranks agree


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather(obj: Any) -> list[Any]:
    _, world = _rank_world()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


def _broadcast(obj: Any) -> Any:
    if _rank_world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _underlying(exc: BaseException) -> BaseException:
    """The first rank's own exception inside a DCP CheckpointException (whose text is a whole traceback)."""
    if isinstance(exc, CheckpointException) and exc.failures:
        return next(iter(exc.failures.values()))[0]
    return exc


def _disk_full(exc: BaseException, where: Path) -> bool:
    """ENOSPC / EDQUOT anywhere in the exception chain or its text (DCP and torch.save report write failures
    as strings, torch.save even as "unexpected pos"), or less than _LOW_SPACE left where we were writing."""
    seen: BaseException | None = _underlying(exc)
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(seen) or "Disk quota exceeded" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        return shutil.disk_usage(where if where.exists() else where.parent).free < _LOW_SPACE
    except OSError:
        return False


def _explain(exc: BaseException, where: Path) -> str:
    cause = _underlying(exc)
    text = f"{type(cause).__name__}: {cause}"
    if _disk_full(exc, where):
        try:
            free = f"{shutil.disk_usage(where if where.exists() else where.parent).free / 2**20:.0f} MiB free"
        except OSError:
            free = "free space unknown"
        return f"disk full on the filesystem of {where} ({free}); free some space or write to another --out ({text})"
    return text


def _agree(exc: BaseException | None, what: str, where: Path) -> None:
    """Collective: raise the same CheckpointError on every rank if any rank failed."""
    errors = _all_gather(None if exc is None else _explain(exc, where))
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if failed:
        rank, message = failed[0]
        raise CheckpointError(f"{what} failed on rank {rank} ({len(failed)} rank(s) failed): {message}") from exc


def _fsync_dir(path: Path) -> None:
    # Make a rename durable: the directory entry itself must reach the disk (some network FSs refuse).
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_text(path: Path, text: str | bytes) -> None:
    """Write via a temp file + fsync + os.replace so a reader sees the old or the new content only (a failed write,
    a full disk say, leaves no temp file behind)."""
    tmp = path.with_name(f"{path.name}{_TMP}{secrets.token_hex(4)}")
    try:
        with open(tmp, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


# ----------------------------------------------------------------------------------------------- names


def step_dir_name(step: int) -> str:
    """The directory name of the checkpoint of ``step``; ``step_of`` reads it back."""
    return f"step_{step:06d}"


def step_of(path: Path) -> int | None:
    """The step of a checkpoint directory's name (``step_000100``: 100); None for any other name, a save in
    progress or set aside included."""
    name = path.name
    if not name.startswith("step_") or _TMP in name:
        return None
    try:
        return int(name[len("step_") :])
    except ValueError:
        return None


def _ckpt_root(out_dir: Path) -> Path:
    # Accept the run directory OUT or OUT/checkpoints itself.
    if out_dir.name == CKPT_SUBDIR or not (out_dir / CKPT_SUBDIR).is_dir():
        return out_dir
    return out_dir / CKPT_SUBDIR


def _complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    # a link is not a checkpoint of this run (pruning and --resume-from would act on what it points to)
    found = [(step_of(p), p) for p in root.iterdir() if p.is_dir() and not p.is_symlink()]
    return sorted((s, p) for s, p in found if s is not None and (p / COMPLETE).is_file())


def _discard(path: Path) -> None:
    """Rename out of the way first (atomic), then delete: a half-deleted checkpoint never looks complete."""
    doomed = path.with_name(f"{path.name}{_TMP}del-{secrets.token_hex(4)}")
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _suggest_previous(ckpt: Path) -> str:
    step = step_of(ckpt)
    older = [p for s, p in _complete_checkpoints(ckpt.parent) if p != ckpt and (step is None or s < step)]
    if older:
        return f"Load the previous complete checkpoint instead: {older[-1]} (xmoe train --resume-from {older[-1]})"
    return f"No older complete checkpoint exists in {ckpt.parent}."


def complete_checkpoints(out_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint dir with a COMPLETE marker, oldest first."""
    return _complete_checkpoints(_ckpt_root(Path(out_dir)))


def remove_leftovers(out_dir: str | os.PathLike) -> list[str]:
    """Delete ``*.tmp-*`` dirs and files of interrupted saves (only safe while no save is running: the trainer
    calls it under the run lock, a save on rank 0 before staging); return their names."""
    root = _ckpt_root(Path(out_dir))
    if not root.is_dir():
        return []
    removed = []
    for leftover in root.iterdir():
        if _TMP in leftover.name:  # a crashed save's dir or pointer file; nothing references it
            if leftover.is_dir() and not leftover.is_symlink():  # a link goes, never what it points to
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)
            removed.append(leftover.name)
    return removed


def set_aside_newer(out_dir: str | os.PathLike, step: int) -> list[Path]:
    """Rename complete checkpoints above ``step`` to ``step_XXXXXX.superseded-<hex>`` (kept, but never found by
    a resume again): after resuming from an older checkpoint, the newer ones belong to the abandoned run."""
    moved = []
    for s, path in complete_checkpoints(out_dir):
        if s > step:
            target = path.with_name(f"{path.name}.superseded-{secrets.token_hex(2)}")
            os.rename(path, target)
            moved.append(target)
    return moved


# --------------------------------------------------------------------- the directory's steps of a save


def _stage(root: Path, final: Path) -> Path:
    """Step 1. Rank 0 removes ``*.tmp-*`` leftovers of crashed saves and creates a fresh temp dir; every rank
    learns its name (or rank 0's error)."""
    tmp, exc = None, None
    if _rank_world()[0] == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            remove_leftovers(root)
            tmp = root / f"{final.name}{_TMP}{secrets.token_hex(4)}"
            tmp.mkdir()
        except OSError as e:
            exc = e
    tmp = _broadcast(tmp)
    _agree(exc, f"preparing checkpoint dir in {root}", root)
    return tmp


def _publish_collective(tmp: Path, final: Path, meta: dict[str, Any]) -> None:
    """Step 4. Rank 0 writes meta.json, then COMPLETE, then renames the directory to its final name; its
    outcome is broadcast so no rank waits forever on a failed rank 0."""
    exc, error = None, None
    if _rank_world()[0] == 0:
        try:
            _write_text(tmp / META, json.dumps(meta, indent=1, default=str))
            _write_text(tmp / COMPLETE, f"{meta['step']}\n")
            _publish(tmp, final)
        except Exception as e:  # noqa: BLE001 - broadcast to all ranks below
            exc, error = e, _explain(e, tmp)
    error = _broadcast(error)
    if error is not None:
        raise CheckpointError(f"publishing checkpoint {final} failed on rank 0: {error}") from exc


def _point_and_prune(root: Path, step: int, final: Path, keep_last: int) -> None:
    """Step 5. The checkpoint is durable now; pointer and pruning failures only warn (resume scans for the
    newest complete checkpoint, and a failed prune leaves an extra good checkpoint rather than losing one)."""
    if _rank_world()[0] != 0:
        return
    try:
        _write_text(root / LATEST, final.name + "\n")
        _prune(root, step, final, keep_last)
    except OSError as e:
        warnings.warn(f"checkpoint {final} is saved, but updating '{LATEST}' or pruning failed: {e}", stacklevel=2)


def _publish(tmp: Path, final: Path) -> None:
    """Rename tmp -> final. A same-step checkpoint (re-saved after resuming earlier) is swapped out."""
    old = None
    if os.path.lexists(final):
        old = final.with_name(f"{final.name}{_TMP}old-{secrets.token_hex(4)}")
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _prune(root: Path, step: int, keep: Path, keep_last: int) -> None:
    """Discard the older checkpoints past ``keep_last``, except those a reader has pinned (``pinned``): they stay
    until a later save finds them unpinned."""
    older = [p for s, p in _complete_checkpoints(root) if s < step and p != keep]
    for path in older[: max(0, len(older) - (keep_last - 1))]:
        try:
            fd = os.open(path / COMPLETE, os.O_RDONLY)
        except FileNotFoundError:
            continue  # gone meanwhile
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # being read: never wait for a reader
            except OSError as e:
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise  # where flock is unsupported, readers retry instead (read_pinned)
            _discard(path)
        finally:
            os.close(fd)


# --------------------------------------------------------------------------------------------- readers


@contextlib.contextmanager
def pinned(ckpt: Path):
    """Within: ``ckpt`` is not pruned (a shared flock on its COMPLETE file, which pruning takes exclusively or
    leaves the checkpoint alone). FileNotFoundError when it was pruned before the pin took hold."""
    fd = os.open(ckpt / COMPLETE, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):  # unsupported (some network filesystems): unpinned, read_pinned retries
            fcntl.flock(fd, fcntl.LOCK_SH)
        if not (ckpt / COMPLETE).is_file():  # renamed away by a prune that held the lock first
            raise FileNotFoundError(f"checkpoint {ckpt} was pruned by its run while being opened")
        yield ckpt
    finally:
        os.close(fd)


def read_pinned(pick: Callable[[], Path], read: Callable[[Path], T], attempts: int = 5) -> T:
    """``read(pick())`` with the picked checkpoint pinned against pruning, for readers of a run that is still
    training (``xmoe eval`` / ``export`` / ``generate``). A checkpoint pruned between the pick and the pin (or, where
    pins are unsupported, during the read) is picked again, up to ``attempts`` times."""
    for attempt in range(1, attempts + 1):
        path = pick()
        try:
            with pinned(path):
                return read(path)
        except (FileNotFoundError, CheckpointError):
            if (path / COMPLETE).is_file() or attempt == attempts:
                raise  # a real error of a checkpoint still there, or no end to the pruning
    raise ValueError(f"attempts ({attempts}) must be >= 1")
