"""The inputs of `xmoe data prepare`: which files, how they split into tasks, and the documents each task reads.

Inputs are files or folders (searched recursively, in sorted order, hidden entries skipped) of:
  .txt, .md         one document per file
  .jsonl            one document per line, from the field ``field`` (blank lines skipped); large files split into
                    byte ranges, each starting at the first line that begins in it
  .jsonl.gz         the same, gzip-compressed (one task per file: a gzip stream cannot be entered midway)
  .parquet          one document per row of the column ``field`` (one task per file; needs pyarrow)

A task is a run of whole text files or one part of one other file, about ``shard_bytes`` of input; each becomes one
shard. The plan depends only on the inputs and ``shard_bytes``, so the output does not depend on the worker count.
Every read byte goes through a SHA-256, so the manifest names the content it was made from.

Bad input raises DataError: one line naming the file, the line or row, what is wrong and the fix.
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KINDS = {".txt": "text", ".md": "text", ".jsonl": "jsonl", ".jsonl.gz": "jsonl.gz", ".parquet": "parquet"}
PARQUET_FIX = "reading Parquet needs pyarrow: pip install 'xmoe[parquet]'"


class DataError(ValueError):
    """Bad input: the message names the file, the line or row, and the fix."""


@dataclass(frozen=True)
class Part:
    """One input file, or the byte range [start, end) of a .jsonl file (end None: to its end)."""

    path: str
    kind: str
    start: int = 0
    end: int | None = None


@dataclass(frozen=True)
class Task:
    index: int
    parts: tuple[Part, ...]


def kind_of(path: Path) -> str | None:
    name = path.name.lower()
    return next((kind for suffix, kind in KINDS.items() if name.endswith(suffix)), None)


def list_inputs(inputs: list[str]) -> list[Path]:
    """Every input file, in order: each file as given, each folder's files sorted by their path in it."""
    if not inputs:
        raise ValueError("no input given; name files or folders of .txt, .md, .jsonl(.gz) or .parquet")
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            found = sorted(
                p
                for p in path.rglob("*")
                if p.is_file() and kind_of(p) and not any(s.startswith(".") for s in p.relative_to(path).parts)
            )
            if not found:
                raise ValueError(f"input folder {item} holds no .txt, .md, .jsonl(.gz) or .parquet file")
            files.extend(found)
        elif path.is_file():
            if kind_of(path) is None:
                raise ValueError(f"input {item} is not .txt, .md, .jsonl, .jsonl.gz or .parquet; convert or rename it")
            files.append(path)
        else:
            from xmoe.checks import missing

            raise missing(item, "input")
    resolved = [p.resolve() for p in files]
    if len(set(resolved)) != len(resolved):
        twice = next(p for p in resolved if resolved.count(p) > 1)
        raise ValueError(f"input {twice} is named twice (directly or inside a folder); name each file once")
    return resolved


def plan_tasks(files: list[Path], shard_bytes: int) -> list[Task]:
    """Tasks of about ``shard_bytes`` of input each, in input order."""
    tasks: list[tuple[Part, ...]] = []
    group: list[Part] = []
    group_bytes = 0
    for path in files:
        kind, size = kind_of(path), path.stat().st_size
        assert kind is not None  # list_inputs keeps only known kinds
        if kind == "text":
            group.append(Part(str(path), kind))
            group_bytes += size
            if group_bytes >= shard_bytes:
                tasks.append(tuple(group))
                group, group_bytes = [], 0
            continue
        if group:
            tasks.append(tuple(group))
            group, group_bytes = [], 0
        if kind == "jsonl" and size > shard_bytes:
            cuts = list(range(0, size, shard_bytes)) + [size]
            tasks.extend((Part(str(path), kind, a, b),) for a, b in itertools.pairwise(cuts))
        else:
            tasks.append((Part(str(path), kind),))
    if group:
        tasks.append(tuple(group))
    return [Task(i, parts) for i, parts in enumerate(tasks)]


def line_of(path: str, offset: int) -> int:
    """The 1-based line number of byte ``offset`` of a file (counted only when an error is reported)."""
    count, done = 1, 0
    with open(path, "rb") as f:
        while done < offset:
            chunk = f.read(min(1 << 24, offset - done))
            if not chunk:
                break
            count += chunk.count(b"\n")
            done += len(chunk)
    return count


def _decode(raw: bytes, path: str, offset: int) -> str:
    """``raw`` (the bytes at ``offset`` of ``path``) as text; DataError for binary data or invalid UTF-8."""
    nul = raw.find(b"\0")
    if nul >= 0:
        raise DataError(
            f"{path}, line {line_of(path, offset + nul)}: binary data (a NUL byte); pass text files only, or "
            "remove the file"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path}, line {line_of(path, offset + e.start)}: invalid UTF-8 (byte 0x{raw[e.start]:02x}); "
            "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from None


def locate(path: str, where: str | int) -> str:
    """``where`` as said in an error: a byte offset (an int) becomes its line number."""
    return f"line {line_of(path, where)}" if isinstance(where, int) else where


def _document(line: bytes, field: str, path: str, at: str | int) -> str | None:
    """The text of one JSON line's ``field`` (None for a blank line); ``at``: where the line is (``locate``)."""
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except UnicodeDecodeError:
        raise DataError(f"{path}, {locate(path, at)}: invalid UTF-8; re-encode the file as UTF-8") from None
    except ValueError as e:
        raise DataError(f"{path}, {locate(path, at)}: invalid JSON ({e}); fix or remove the line") from None
    if not isinstance(record, dict):
        raise DataError(
            f"{path}, {locate(path, at)}: a JSON {type(record).__name__}, not an object with a {field!r} field; "
            "write one object per line"
        )
    if field not in record:
        fields = ", ".join(list(record)[:8]) or "none"
        raise DataError(f"{path}, {locate(path, at)}: no field {field!r} (its fields: {fields}); pass --field NAME")
    text = record[field]
    if not isinstance(text, str):
        raise DataError(
            f"{path}, {locate(path, at)}: field {field!r} is {type(text).__name__}, not a string; pass --field "
            "naming the text"
        )
    if "\0" in text:
        raise DataError(f"{path}, {locate(path, at)}: binary data (a NUL character in {field!r}); remove the line")
    return text


class _Hashed:
    """A binary file read through a SHA-256 of everything read."""

    def __init__(self, f: Any, digest: Any) -> None:
        self.f, self.digest = f, digest

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.digest.update(data)
        return data


def _aligned(f: Any, position: int) -> int:
    """The first line start at or after ``position`` (0 stays 0)."""
    if position == 0:
        return 0
    f.seek(position - 1)
    f.readline()
    return f.tell()


def _jsonl_range(part: Part, field: str, digest: Any) -> Iterator[tuple[str, str | int]]:
    with open(part.path, "rb") as f:
        end = os.path.getsize(part.path) if part.end is None else part.end
        stop = _aligned(f, end) if part.end is not None else end
        f.seek(_aligned(f, part.start))
        while (offset := f.tell()) < stop:
            line = f.readline()
            digest.update(line)
            text = _document(line, field, part.path, offset)
            if text is not None:
                yield text, offset


def _jsonl_gz(part: Part, field: str, digest: Any) -> Iterator[tuple[str, str]]:
    with open(part.path, "rb") as raw:
        hashed = _Hashed(raw, digest)
        number = 0
        try:
            with gzip.GzipFile(fileobj=hashed, mode="rb") as f:  # type: ignore[call-overload]
                for number, line in enumerate(f, 1):  # the line reached is reported on error
                    text = _document(line, field, part.path, f"line {number}")
                    if text is not None:
                        yield text, f"line {number}"
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(
                f"{part.path}, line {number + 1}: not a readable gzip file ({e}); recompress or remove it"
            ) from None
        while hashed.read(1 << 20):  # anything after the gzip stream is part of the file's content
            pass


def _parquet(part: Part, field: str, digest: Any) -> Iterator[tuple[str, str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{part.path}: {PARQUET_FIX}") from None
    with open(part.path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    try:
        table = pq.ParquetFile(part.path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises its own exception types
        raise DataError(f"{part.path}: not a readable Parquet file ({e}); rewrite or remove it") from None
    names = table.schema_arrow.names
    if field not in names:
        raise DataError(f"{part.path}: no column {field!r} (its columns: {', '.join(names[:8])}); pass --field NAME")
    row = 0
    for batch in table.iter_batches(columns=[field], batch_size=1024):
        for value in batch.column(0).to_pylist():
            row += 1
            if not isinstance(value, str):
                what = "null" if value is None else type(value).__name__
                raise DataError(f"{part.path}, row {row}: column {field!r} is {what}, not a string")
            if "\0" in value:
                raise DataError(f"{part.path}, row {row}: binary data (a NUL character in {field!r}); remove the row")
            yield value, f"row {row}"


def documents(part: Part, field: str, digest: Any) -> Iterator[tuple[str, str | int]]:
    """(text, where) for each document of ``part``, every byte read added to ``digest``; ``where`` locates it in
    the file ("line 3", "row 7", or a byte offset that ``locate`` turns into a line) for errors found later (a
    token id beyond the vocabulary)."""
    if part.kind == "text":
        with open(part.path, "rb") as f:
            raw = f.read()
        digest.update(raw)
        yield _decode(raw, part.path, 0), "line 1"
    elif part.kind == "jsonl":
        yield from _jsonl_range(part, field, digest)
    elif part.kind == "jsonl.gz":
        yield from _jsonl_gz(part, field, digest)
    else:
        yield from _parquet(part, field, digest)


def new_digest() -> Any:
    return hashlib.sha256()
