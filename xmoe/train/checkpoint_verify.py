"""Whether a checkpoint's files check out: the sizes and crc32 a save records of what it wrote, meta.json read
and checked, every file against its record (once, split over the ranks), and the newest checkpoint that passes.
Nothing here builds or loads a model: a resume picks and checks its checkpoint before anything is built.
The files meta.json names are plain files of the checkpoint directory: a name with a path is refused before any
file is looked at, and a recorded file that is a link is refused unread, so no file elsewhere is read or sized.
"""

from __future__ import annotations

import json
import os
import stat
import warnings
import zlib
from pathlib import Path
from typing import Any

from xmoe.train.checkpoint_dir import (
    _TMP,
    COMPLETE,
    META,
    CheckpointError,
    _agree,
    _all_gather,
    _broadcast,
    _ckpt_root,
    _complete_checkpoints,
    _rank_world,
    _suggest_previous,
)

FORMAT = "xmoe-checkpoint-v1"
_CHUNK = 8 << 20  # crc32 read size: large enough that Python overhead is negligible


def _crc32(path: Path) -> str:
    crc = 0
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _verify(tmp: Path, checksum: bool) -> dict[str, dict[str, Any]]:
    """Step 3. Sizes + checksums of what was written, split round-robin over ranks (a big checkpoint is read
    once, in parallel). Rank 0 lists the files so that every rank works from the same list even where a shared
    filesystem shows new files to ranks at different times."""
    rank, world = _rank_world()
    exc, entries = None, {}
    try:
        names = _broadcast(sorted(p.name for p in tmp.iterdir() if p.is_file()) if rank == 0 else None)
        for name in names[rank::world]:
            entries[name] = {"size": (tmp / name).stat().st_size}
            if checksum:
                entries[name]["crc32"] = _crc32(tmp / name)
    except OSError as e:
        exc = e
    gathered = _all_gather(entries)
    _agree(exc, f"checksumming checkpoint {tmp}", tmp)
    return {k: v for part in gathered for k, v in part.items()}


def read_meta(ckpt: str | os.PathLike) -> dict[str, Any]:
    """meta.json of a complete checkpoint dir; CheckpointError if it is incomplete or unreadable."""
    ckpt = Path(ckpt)
    if _TMP in ckpt.name:
        raise CheckpointError(f"{ckpt} is the temporary dir of an unfinished save. {_suggest_previous(ckpt)}")
    if not (ckpt / COMPLETE).is_file():
        raise CheckpointError(
            f"checkpoint {ckpt} is incomplete (no {COMPLETE} marker: the save was interrupted). "
            f"{_suggest_previous(ckpt)}"
        )
    try:
        meta = json.loads((ckpt / META).read_text())
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("files"), dict):
            raise ValueError(f"not an {FORMAT} meta.json")
        int(meta["step"]), int(meta["world_size"]), bool(meta["has_optimizer"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"checkpoint {ckpt} has a missing or corrupt {META} ({type(e).__name__}: {e}). {_suggest_previous(ckpt)}"
        ) from e
    for name in meta["files"]:
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", "..") or "\0" in name:
            raise CheckpointError(
                f"checkpoint {ckpt}'s {META} names {name!r}, which is not a file name in the checkpoint's directory "
                f"(a name with a path reaches outside it). {_suggest_previous(ckpt)}"
            )
    return meta


def _problem(path: Path, want: dict[str, Any]) -> str:
    """What is wrong with recorded file ``path`` beside its record's size ("" if nothing), looked at without
    following a link."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return f"{path.name} is missing"
    if stat.S_ISLNK(st.st_mode):
        return f"{path.name} is a symbolic link (a checkpoint's files are its own)"
    if not stat.S_ISREG(st.st_mode):
        return f"{path.name} is not a plain file"
    if st.st_size != want.get("size"):
        return f"{path.name} has {st.st_size} bytes, expected {want.get('size')} (truncated?)"
    return ""


def _check_sizes(ckpt: Path, meta: dict[str, Any]) -> None:
    """Every recorded file present at its recorded size (cheap: no reads); CheckpointError otherwise."""
    problems = [p for name, want in sorted(meta["files"].items()) if (p := _problem(ckpt / name, want))]
    if problems:
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: {'; '.join(problems[:5])}. {_suggest_previous(ckpt)}")


def _verify_files(ckpt: Path, meta: dict[str, Any], checksums: bool) -> None:
    """Collective: sizes on every rank (cheap), checksums split round-robin; same error everywhere."""
    rank, world = _rank_world()
    problems = []
    names = sorted(meta["files"])
    for i, name in enumerate(names):
        want = meta["files"][name]
        path = ckpt / name
        if problem := _problem(path, want):
            problems.append(problem)
        elif checksums and "crc32" in want and i % world == rank and _crc32(path) != want["crc32"]:
            problems.append(f"{name} fails its crc32 check (content corrupted)")
    problems = sorted({p for part in _all_gather(problems) for p in part})
    if problems:
        raise CheckpointError(f"checkpoint {ckpt} is corrupt: {'; '.join(problems[:5])}. {_suggest_previous(ckpt)}")


def verify_checkpoint(ckpt: str | os.PathLike) -> dict[str, Any]:
    """Collective: meta.json of a checkpoint whose every file has its recorded size and crc32 (read once, split
    over the ranks), for a load with ``verify=False``; CheckpointError naming what is wrong otherwise."""
    meta = read_meta(ckpt)
    _verify_files(Path(ckpt), meta, checksums=True)
    return meta


def find_latest(out_dir: str | os.PathLike, *, checksums: bool = False) -> Path | None:
    """Newest complete, verified checkpoint under ``out_dir`` (the run dir or its ``checkpoints/``), or None.

    Found by scanning, never by trusting the ``latest`` pointer (a failed pointer update must not send a resume
    back to an older step). A checkpoint counts when it has COMPLETE, a readable meta.json and every file at
    its recorded size; with ``checksums`` (collective: every rank calls it) also every file's crc32, read once,
    split over the ranks, so the caller loads it with ``verify=False``. Newer checkpoints that fail this are
    skipped with a warning naming each and why; if every complete one fails, CheckpointError names them.
    """
    root = _ckpt_root(Path(out_dir))
    problems = []
    for _, path in reversed(_complete_checkpoints(root)):
        try:
            meta = read_meta(path)
            _check_sizes(path, meta)
            if checksums:
                _verify_files(path, meta, checksums=True)
        except CheckpointError as e:
            problems.append(str(e).split(". ")[0])
            continue
        if problems:
            warnings.warn(
                f"skipped {len(problems)} newer checkpoint(s) that fail verification "
                f"({'; '.join(problems)}); using {path}",
                stacklevel=2,
            )
        return path
    if problems:
        raise CheckpointError(
            f"no usable checkpoint under {root}: {'; '.join(problems)}. Start again with "
            "--overwrite, or repair or remove the damaged checkpoint(s)"
        )
    return None
