"""A run directory's outputs: which of them are there, whether they make a run, and a fresh start's set-aside of
the run it replaces (``--overwrite``), deleted once the new run has written something and restored otherwise.

A new run never deletes before it has started: the previous run's outputs (OUTPUTS) are moved into
``OUT/xmoe.replaced/`` (``start_new``) and deleted only when the new run writes its first log line or checkpoint
(``RunLock.commit``); a new run that ends before that removes what it wrote and moves them back (``undo_start``).
A start killed before either is settled by the next one (``settle_replaced``). Every move is a rename, and the
set-aside is filled and emptied under a second name (MOVING), so a kill at any point leaves either a whole
set-aside or a move that the next start completes as a restore. All of it runs on rank 0 under the run's lock
(``rundir.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from xmoe.train.checkpoint_dir import _write_text, complete_checkpoints
from xmoe.train.runlock import RunDirError

REPLACED = "xmoe.replaced"  # the previous run's outputs while a new run (--overwrite) has not yet written its own
MOVING = "xmoe.replaced.tmp"  # REPLACED while being filled or emptied: a start killed then restores it, always
# everything a trainer writes into its run directory (tokenizer.json and hf_config.json: copies an --init-from
# run keeps for eval, export and generate)
OUTPUTS = (
    "metrics.jsonl",
    "summary.json",
    "loss.png",
    "expert_load.npy",
    "expert_load.png",
    "checkpoints",
    "tensorboard",
    "tokenizer.json",
    "hf_config.json",
)


def present(out_dir: Path) -> list[str]:
    """Names of the trainer outputs in ``out_dir`` (directories with a trailing /)."""
    return [name + ("/" if (out_dir / name).is_dir() else "") for name in OUTPUTS if os.path.lexists(out_dir / name)]


def holds_run(out_dir: Path) -> bool:
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


def undo_start(out_dir: Path) -> str:
    """Remove the outputs of a start that never wrote a log line or checkpoint and move back the run it replaced;
    returns what was done, for the log."""
    for name in present(out_dir):
        _remove(out_dir / name.rstrip("/"))
    if not (out_dir / REPLACED).is_dir():
        return ""
    os.rename(out_dir / REPLACED, out_dir / MOVING)  # a kill from here on is finished by settle_replaced
    _move_back(out_dir, out_dir / MOVING)
    return f"the new run ended before writing anything: restored the previous run in {out_dir}"


def settle_replaced(out_dir: Path) -> str:
    """What a killed start left: a set-aside or restore cut short is completed as a restore; a complete set-aside
    is deleted if the new run had written output, else restored. Returns what was done, for the log."""
    if (out_dir / MOVING).is_dir():  # no new run output can exist yet (set aside) or any more (restore)
        _move_back(out_dir, out_dir / MOVING)
        return f"restored the previous run in {out_dir}: a killed start had left setting it aside or back unfinished"
    aside = out_dir / REPLACED
    if not aside.is_dir():
        return ""
    if holds_run(out_dir):
        shutil.rmtree(aside)
        return f"deleted {aside}: the run it held was replaced by the run now in {out_dir} (--overwrite)"
    return undo_start(out_dir).replace(
        "the new run ended before writing anything", "an --overwrite start was killed before writing anything"
    )


def describe_run(out_dir: Path, found: list[str]) -> str:
    """``found`` (``present``'s names) with the last logged step and the checkpoints, for a message."""
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


def check_resumable(out_dir: Path) -> None:
    """A resume of a run that has work but no checkpoint would start at step 0 over its metrics: refuse."""
    if not complete_checkpoints(out_dir):
        raise RunDirError(
            f"run directory {out_dir} holds a run ({describe_run(out_dir, present(out_dir))}) but no checkpoint to "
            "resume from (trained with --ckpt-every 0?); pass --overwrite to start again in its place, or choose "
            "another --out"
        )


def mark_resumed(out_dir: Path) -> None:
    """summary.json's status says "resumed" (the old one kept as previous_status) until this run writes its own: a
    run that then crashes is not taken for the one stopped by a signal before it (what a requeue script reads)."""
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


def start_new(out_dir: Path, overwrite: bool) -> list[str]:
    """A fresh start: refuse a directory holding a run unless ``overwrite``; set aside whatever outputs are there.
    Returns lines for the log; the caller's lock then carries the start (``RunLock.new_run``)."""
    found = present(out_dir)
    notes = []
    if holds_run(out_dir):
        if not overwrite:
            raise RunDirError(
                f"run directory {out_dir} already holds a run ({describe_run(out_dir, found)}); pass --resume "
                "to continue it, --overwrite to delete it and start again, or choose another --out"
            )
        moving = out_dir / MOVING
        moving.mkdir()
        for name in found:
            os.rename(out_dir / name.rstrip("/"), moving / name.rstrip("/"))
        os.rename(moving, out_dir / REPLACED)
        notes.append(
            f"--overwrite: set the previous run in {out_dir} aside "
            f"({describe_run(out_dir / REPLACED, found)}); it is deleted when this run writes its first "
            "log line or checkpoint, and restored if it ends before"
        )
    else:
        for name in found:  # what a start that failed left (an empty metrics.jsonl, copied tokenizer files)
            _remove(out_dir / name.rstrip("/"))
        if found:
            notes.append(f"removed what an earlier start that failed left in {out_dir}: {', '.join(found)}")
    return notes
