"""`xmoe data prepare`: text, JSONL and Parquet inputs into token shards with a document index and a manifest.

The output directory (format: docs/data.md):
  prepare.json          the plan: inputs (path, size, mtime), tokenizer, options and tasks; written first
  shards/NNNNN.bin      little-endian tokens (uint16, or uint32 when the vocabulary exceeds 65536), each document
                        followed by the end-of-document token
  shards/NNNNN.idx      little-endian int64: where each document of the shard starts
  shards/NNNNN.json     the shard's record (counts, crc32 of both files, the SHA-256 of the input it read); written
                        last, so a shard without one is unfinished
  manifest.json         written when every shard is done: what the set holds (docs/data.md)

Resuming: a run into a directory holding the same plan keeps every shard whose record checks out (sizes and crc32)
and makes the others; a different plan is refused. Every file appears by rename after an fsync, so none is ever
seen half-written. Shards depend only on the plan, not on the number of workers or on interruptions.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from xmoe.data.sources import DataError, Task, documents, list_inputs, locate, new_digest, plan_tasks
from xmoe.data.tokenizer import Encoder, TokenizerSpec, resolve_tokenizer, set_tokenizer_threads

FORMAT, VERSION = "xmoe-prepared", 1
MANIFEST, PLAN, SHARDS = "manifest.json", "prepare.json", "shards"
BATCH_CHARS = 1 << 20  # text encoded per call: the tokenizers library batches well, and memory stays small
FAULT_ENV = "XMOE_PREPARE_FAULT_TASK"  # tests: the worker making this task dies midway, as a killed run would


def write_atomic(path: Path, data: bytes) -> None:
    """``data`` at ``path`` by a temporary file, fsync and rename: ``path`` is absent or whole, never partial."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


class _ShardWriter:
    """One task's shard, written to a temporary file; ``finish`` makes it visible."""

    def __init__(self, out: Path, task: Task, spec: TokenizerSpec) -> None:
        self.out, self.task, self.spec = out, task, spec
        self.name = f"{task.index:05d}"
        self.tmp = out / SHARDS / f"{self.name}.bin.tmp-{os.getpid()}"
        self.file = open(self.tmp, "wb")  # closed by finish
        self.dtype = np.dtype(spec.dtype).newbyteorder("<")
        self.starts: list[int] = []
        self.tokens, self.skipped, self.crc = 0, 0, 0

    def add(self, ids_list: list[np.ndarray], wheres: list[str | int], path: str) -> None:
        """Append documents (each then the end-of-document token); empty ones are skipped and counted."""
        pieces: list[np.ndarray] = []
        eos = np.array([self.spec.eos_id], dtype=np.int64)
        at = self.tokens  # where the next document starts in the shard
        for ids, where in zip(ids_list, wheres, strict=True):
            if len(ids) == 0:
                self.skipped += 1
                continue
            top = int(ids.max())
            if top >= self.spec.vocab_size or int(ids.min()) < 0:
                raise DataError(
                    f"{path}, {locate(path, where)}: token id {top} is beyond the vocabulary ({self.spec.vocab_size}) "
                    f"of tokenizer {self.spec.spec}; use a tokenizer whose ids fit its model's vocab_size"
                )
            self.starts.append(at)
            pieces += [ids, eos]
            at += len(ids) + 1
        if pieces:
            data = np.concatenate(pieces).astype(self.dtype).tobytes()
            self.file.write(data)
            self.crc = zlib.crc32(data, self.crc)
            self.tokens += len(data) // self.dtype.itemsize

    def finish(self, parts: list[dict]) -> dict:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        shards = self.out / SHARDS
        os.replace(self.tmp, shards / f"{self.name}.bin")
        index = np.asarray(self.starts, dtype="<i8").tobytes()
        write_atomic(shards / f"{self.name}.idx", index)
        record = {
            "name": self.name,
            "tokens": self.tokens,
            "documents": len(self.starts),
            "skipped_empty": self.skipped,
            "token_crc32": f"{self.crc:08x}",
            "index_crc32": f"{zlib.crc32(index):08x}",
            "parts": parts,
        }
        write_atomic(shards / f"{self.name}.json", json.dumps(record).encode())
        _fsync_dir(shards)
        return record


_ENCODERS: dict[str, Encoder] = {}  # one per tokenizer in each worker process


def run_task(task: Task, spec: TokenizerSpec, field: str, out: str) -> dict:
    """Make the shard of ``task``; returns its record. Runs in a worker process (or inline with one worker)."""
    encoder = _ENCODERS.get(spec.sha256) or _ENCODERS.setdefault(spec.sha256, Encoder(spec))
    writer = _ShardWriter(Path(out), task, spec)
    fault = os.environ.get(FAULT_ENV) == str(task.index)
    parts = []
    for part in task.parts:
        digest = new_digest()
        texts: list[str] = []
        wheres: list[str | int] = []
        size = 0
        for text, where in documents(part, field, digest):
            texts.append(text)
            wheres.append(where)
            size += len(text)
            if size >= BATCH_CHARS:
                writer.add(encoder.encode(texts), wheres, part.path)
                texts, wheres, size = [], [], 0
                if fault:
                    os._exit(17)  # a kill midway: the shard's temporary file is left behind, half-written
        writer.add(encoder.encode(texts), wheres, part.path)
        if fault:
            os._exit(17)
        parts.append({**asdict(part), "sha256": digest.hexdigest()})
    return writer.finish(parts)


def shard_is_done(out: Path, name: str, itemsize: int) -> dict | None:
    """The record of a finished shard whose files check out (sizes and crc32), else None."""
    shards = out / SHARDS
    try:
        record = json.loads((shards / f"{name}.json").read_text())
        tokens, index = shards / f"{name}.bin", shards / f"{name}.idx"
        if tokens.stat().st_size != record["tokens"] * itemsize or index.stat().st_size != record["documents"] * 8:
            return None
        if file_crc32(tokens) != record["token_crc32"] or file_crc32(index) != record["index_crc32"]:
            return None
        return record
    except (OSError, ValueError, KeyError, TypeError):
        return None


def make_plan(inputs: list[str], spec: TokenizerSpec, field: str, shard_bytes: int) -> tuple[dict, list[Task]]:
    files = list_inputs(inputs)
    tasks = plan_tasks(files, shard_bytes)
    plan = {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": spec.record(),
        "field": field,
        "shard_bytes": shard_bytes,
        "inputs": [{"path": str(p), "size": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns} for p in files],
        "tasks": [[asdict(part) for part in task.parts] for task in tasks],
    }
    return plan, tasks


def _open_out(out: Path, plan: dict) -> bool:
    """Create ``out`` or check that it holds this plan; True when it is already complete."""
    plan_file = out / PLAN
    if plan_file.is_file():
        try:
            old = json.loads(plan_file.read_text())
        except ValueError:
            old = None
        if old != plan:
            differ = (
                [key for key in plan if not isinstance(old, dict) or old.get(key) != plan[key]]
                if isinstance(old, dict)
                else ["prepare.json unreadable"]
            )
            raise ValueError(
                f"--out {out} holds a prepare of other inputs or options ({', '.join(differ)} differ); pass "
                "another --out, or delete it to start again"
            )
        return (out / MANIFEST).is_file()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} exists and is not a prepare output directory; pass a new or empty directory")
    (out / SHARDS).mkdir(parents=True, exist_ok=True)
    write_atomic(plan_file, json.dumps(plan, indent=1).encode())
    return False


def _sources(plan: dict, records: list[dict]) -> list[dict]:
    """Each input's size and content hash: the SHA-256 of the file when one task read it whole, else (a .jsonl
    split into byte ranges) the SHA-256 of its parts' digests in order."""
    digests: dict[str, list[str]] = {}
    for record in records:
        for part in record["parts"]:
            digests.setdefault(part["path"], []).append(part["sha256"])
    out = []
    for item in plan["inputs"]:
        parts = digests[item["path"]]
        entry = {"path": item["path"], "size": item["size"]}
        if len(parts) == 1:
            entry["sha256"] = parts[0]
        else:
            entry["sha256_of_parts"] = hashlib.sha256("".join(parts).encode()).hexdigest()
            entry["parts"] = len(parts)
        out.append(entry)
    return out


def _manifest(plan: dict, records: list[dict]) -> dict:
    spec = plan["tokenizer"]
    return {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": spec,
        "dtype": "uint16" if spec["vocab_size"] <= 2**16 else "uint32",
        "eos_id": spec["eos_id"],
        "vocab_size": spec["vocab_size"],
        "field": plan["field"],
        "tokens": sum(r["tokens"] for r in records),
        "documents": sum(r["documents"] for r in records),
        "skipped_empty": sum(r["skipped_empty"] for r in records),
        "sources": _sources(plan, records),
        "shards": [{k: r[k] for k in ("name", "tokens", "documents", "token_crc32", "index_crc32")} for r in records],
    }


def _run(todo: list[Task], spec: TokenizerSpec, field: str, out: Path, workers: int, bar: Any) -> list[dict]:
    done = []
    if workers == 1:
        for task in todo:
            done.append(run_task(task, spec, field, str(out)))
            bar.update(done[-1]["tokens"])
        return done
    set_tokenizer_threads(workers)
    with ProcessPoolExecutor(workers, mp_context=get_context("fork")) as pool:
        futures = [pool.submit(run_task, task, spec, field, str(out)) for task in todo]
        try:
            for future in futures:
                done.append(future.result())
                bar.update(done[-1]["tokens"])
        except BrokenProcessPool:
            raise ValueError(
                f"a worker process died (killed, or out of memory); run the same command again to continue: the "
                f"{len(done)} shard(s) finished in order so far, and any others finished, are kept"
            ) from None
        finally:  # on an error, stop at once: tasks not started are dropped, running ones finish
            for future in futures:
                future.cancel()
    return done


def prepare(
    inputs: list[str],
    out: str | os.PathLike,
    tokenizer: str = "bytes",
    *,
    field: str = "text",
    eos_token: str | None = None,
    shard_bytes: int = 128 << 20,
    workers: int | None = None,
    progress: bool = True,
) -> dict:
    """Prepare ``inputs`` into ``out`` (module docstring); returns the manifest. ``workers``: processes (default:
    the CPU count, at most one per task)."""
    if shard_bytes < 1:
        raise ValueError(f"--shard-size ({shard_bytes}) must be >= 1 byte")
    if not field.strip():
        raise ValueError("--field is empty; name the JSON field or Parquet column holding the text")
    spec = resolve_tokenizer(tokenizer, eos_token)
    plan, tasks = make_plan(inputs, spec, field, shard_bytes)
    out = Path(out)
    if _open_out(out, plan):
        return json.loads((out / MANIFEST).read_text())
    for stale in (out / SHARDS).glob("*.tmp-*"):  # what a killed run was writing
        stale.unlink()
    itemsize = np.dtype(spec.dtype).itemsize
    records: dict[int, dict] = {}
    for task in tasks:
        found = shard_is_done(out, f"{task.index:05d}", itemsize)
        if found is not None:
            records[task.index] = found
    todo = [t for t in tasks if t.index not in records]
    workers = max(1, min(workers or os.cpu_count() or 1, len(todo) or 1))
    from tqdm import tqdm

    with tqdm(
        desc=f"prepare ({len(records)}/{len(tasks)} shards kept)" if records else "prepare",
        unit="tok",
        unit_scale=True,
        disable=None if progress else True,  # None: shown on a terminal only
    ) as bar:
        for record, task in zip(_run(todo, spec, field, out, workers, bar), todo, strict=True):
            records[task.index] = record
    manifest = _manifest(plan, [records[t.index] for t in tasks])
    write_atomic(out / MANIFEST, json.dumps(manifest, indent=1).encode())
    _fsync_dir(out)
    return manifest
