"""A prepared set (the output of `xmoe data prepare`), read back: its manifest, its shards memory-mapped as one
stream of tokens, where documents start, the fingerprint a checkpoint keeps, and what `xmoe data info` says of it.

The stream is the shards in order, so every document is followed by the end-of-document token and global position
``offset[k] + i`` is token ``i`` of shard ``k``. Opening a set reads only its manifest and checks each shard's size;
``verify`` reads every shard against the crc32 the manifest records.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from pathlib import Path

import numpy as np

from xmoe.data.prepare import FORMAT, MANIFEST, PLAN, SHARDS, VERSION, file_crc32

OPEN_SHARDS = 256  # memory maps kept open at once (each holds a file descriptor); others are reopened when read


def is_prepared(path: str | Path) -> bool:
    """Whether ``path`` is a directory that `xmoe data prepare` wrote (finished or not)."""
    p = Path(path)
    return p.is_dir() and ((p / MANIFEST).is_file() or (p / PLAN).is_file())


class PreparedSet:
    def __init__(self, directory: str | Path) -> None:
        self.directory = d = Path(directory)
        if not (d / MANIFEST).is_file():
            if (d / PLAN).is_file():
                raise ValueError(
                    f"prepared set {d} is unfinished (no {MANIFEST}); run the same `xmoe data prepare` again to "
                    "finish it"
                )
            raise ValueError(f"{d} is not a prepared set (no {MANIFEST}); make one with `xmoe data prepare`")
        raw = (d / MANIFEST).read_bytes()
        try:
            self.manifest = m = json.loads(raw)
        except ValueError:
            m = None
        if not isinstance(m, dict) or m.get("format") != FORMAT:
            raise ValueError(f"{d / MANIFEST} is not an xmoe manifest; prepare the set again")
        if m["version"] != VERSION:
            raise ValueError(
                f"prepared set {d} has format version {m['version']}; this xmoe reads version {VERSION}: prepare "
                "it again"
            )
        self.manifest_sha256 = hashlib.sha256(raw).hexdigest()
        self.dtype = np.dtype(m["dtype"]).newbyteorder("<")
        self.eos_id, self.vocab_size = int(m["eos_id"]), int(m["vocab_size"])
        self.names = [s["name"] for s in m["shards"]]
        counts = np.array([s["tokens"] for s in m["shards"]], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(counts)])
        self.num_tokens, self.num_documents = int(self.offsets[-1]), int(m["documents"])
        for shard in m["shards"]:
            self._check_sizes(shard)
        self._maps: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def _check_sizes(self, shard: dict) -> None:
        for suffix, expected in ((".bin", shard["tokens"] * self.dtype.itemsize), (".idx", shard["documents"] * 8)):
            path = self.directory / SHARDS / f"{shard['name']}{suffix}"
            size = path.stat().st_size if path.is_file() else None
            if size != expected:
                found = "missing" if size is None else f"{size} bytes, not {expected}"
                raise ValueError(
                    f"prepared set {self.directory}: shard file {path.name} is {found}; run the same `xmoe data "
                    "prepare` again into a new --out"
                )

    def _shard(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, document starts) of shard k, memory-mapped (empty shards as empty arrays)."""
        if k in self._maps:
            self._maps.move_to_end(k)
            return self._maps[k]
        base = self.directory / SHARDS / self.names[k]
        size = int(self.offsets[k + 1] - self.offsets[k])
        tokens = np.memmap(f"{base}.bin", dtype=self.dtype, mode="r") if size else np.empty(0, self.dtype)
        docs = self.manifest["shards"][k]["documents"]
        starts = np.memmap(f"{base}.idx", dtype="<i8", mode="r") if docs else np.empty(0, np.int64)
        self._maps[k] = (tokens, starts)
        if len(self._maps) > OPEN_SHARDS:
            self._maps.popitem(last=False)
        return tokens, starts

    def _pieces(self, start: int, length: int):
        """(shard, local start, local end, offset in the output) for each shard that [start, start + length) meets."""
        if start < 0 or start + length > self.num_tokens:
            raise IndexError(f"tokens [{start}, {start + length}) outside the set's {self.num_tokens}")
        k = int(np.searchsorted(self.offsets, start, side="right")) - 1
        done = 0
        while done < length:
            lo = start + done - int(self.offsets[k])
            hi = min(int(self.offsets[k + 1] - self.offsets[k]), lo + length - done)
            if hi > lo:
                yield k, lo, hi, done
                done += hi - lo
            k += 1

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the stream, int64."""
        out = np.empty(length, dtype=np.int64)
        for k, lo, hi, at in self._pieces(start, length):
            out[at : at + hi - lo] = self._shard(k)[0][lo:hi]
        return out

    def document_starts(self, start: int, length: int) -> np.ndarray:
        """bool (length,): True where a document starts in [start, start + length)."""
        out = np.zeros(length, dtype=bool)
        for k, lo, hi, at in self._pieces(start, length):
            starts = self._shard(k)[1]
            inside = np.asarray(starts[np.searchsorted(starts, lo) : np.searchsorted(starts, hi)])
            out[at + inside - lo] = True
        return out

    def fingerprint(self) -> dict:
        """What identifies the set in a checkpoint: the SHA-256 of its manifest (which holds every source's content
        hash, the tokenizer's hash and every shard's crc32) and its counts."""
        return {"manifest_sha256": self.manifest_sha256, "tokens": self.num_tokens, "documents": self.num_documents}

    def verify(self) -> list[str]:
        """Every shard file whose crc32 differs from the manifest's (reads the whole set)."""
        bad = []
        for shard in self.manifest["shards"]:
            for suffix, key in ((".bin", "token_crc32"), (".idx", "index_crc32")):
                path = self.directory / SHARDS / f"{shard['name']}{suffix}"
                if file_crc32(path) != shard[key]:
                    bad.append(f"{path.name}: crc32 {file_crc32(path)}, manifest {shard[key]}")
        return bad

    def describe(self) -> str:
        """What `xmoe data info` prints."""
        m, tok = self.manifest, self.manifest["tokenizer"]
        docs = max(self.num_documents, 1)
        size = sum(s["size"] for s in m["sources"])
        lines = [
            f"prepared set {self.directory} (format {m['format']} v{m['version']})",
            f"  tokens     {self.num_tokens:,} ({m['dtype']}), {self.num_documents:,} documents of "
            f"{(self.num_tokens - self.num_documents) / docs:,.1f} tokens on average (end token apart), "
            f"{m['skipped_empty']:,} empty skipped",
            f"  tokenizer  {tok['spec']} ({tok['kind']}, sha256 {tok['sha256'][:16]}), vocab {self.vocab_size:,}, "
            f"end of document {tok['eos_token']!r} = id {self.eos_id}",
            f"  shards     {len(self.names)} in {self.directory / SHARDS}",
            f"  sources    {len(m['sources'])} file(s), {size:,} bytes, field {m['field']!r}:",
        ]
        for source in m["sources"][:10]:
            digest = source.get("sha256") or source["sha256_of_parts"]
            lines.append(f"    {source['path']} ({source['size']:,} bytes, sha256 {digest[:16]})")
        if len(m["sources"]) > 10:
            lines.append(f"    ... and {len(m['sources']) - 10} more (manifest.json lists them)")
        lines.append(f"  manifest   sha256 {self.manifest_sha256} (the fingerprint checkpoints keep)")
        return "\n".join(lines)
