"""The tokenizers `xmoe data prepare` writes shards with: what a spec names, its vocabulary and end-of-document id.

A spec is one of:
  "bytes"       UTF-8 bytes, vocabulary 256; the end of a document is byte 0 (NUL), which text never holds:
                inputs with a NUL byte are refused as binary data.
  FILE.json     a `tokenizers` JSON file; the end of a document is ``eos_token`` if given, else the first of
                EOS_NAMES in its vocabulary.
  DIRECTORY     a Hugging Face model directory, read offline: its tokenizer.json; the end-of-document token is
                ``eos_token``, else tokenizer_config.json's eos_token, else config.json's eos_token_id, else as for
                a JSON file; the vocabulary is config.json's vocab_size where it has one (the model's embedding
                rows; a token id beyond it is an error), else the tokenizer's.

Text is encoded without special tokens (no BOS): documents are separated by the end-of-document token alone.
``TokenizerSpec`` is plain data (it crosses to worker processes); ``Encoder`` is what a worker builds from it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from xmoe.checks import missing

EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[EOS]")
BYTES_EOS = 0


@dataclass(frozen=True)
class TokenizerSpec:
    """``kind``: "bytes", "json" or "hf"; ``path``: the tokenizer.json read (None for bytes); ``sha256``: of that
    file ("bytes" for bytes), so a manifest says exactly which tokenizer made its tokens."""

    spec: str
    kind: str
    path: str | None
    vocab_size: int
    eos_id: int
    eos_token: str
    sha256: str

    def record(self) -> dict:
        return asdict(self)

    @property
    def dtype(self) -> str:
        """The token dtype of shards: uint16 while every id fits, else uint32."""
        return "uint16" if self.vocab_size <= 2**16 else "uint32"


def _json_tokenizer(path: str):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError(
            f"tokenizer {path!r} needs the `tokenizers` package: pip install 'xmoe[tokenizers]', or use "
            "--tokenizer bytes"
        ) from None
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own exception type
        raise ValueError(f"tokenizer {path!r} is not a readable tokenizers JSON file ({e}); restore it") from None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); restore it from the model it came with") from None
    return value if isinstance(value, dict) else {}


def _hf_eos(directory: Path, tok) -> str | None:
    """The end-of-document token a Hugging Face directory names: tokenizer_config.json's eos_token, else the token
    of config.json's eos_token_id."""
    eos = _read_json(directory / "tokenizer_config.json").get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if isinstance(eos, str) and eos:
        return eos
    eos_id = _read_json(directory / "config.json").get("eos_token_id")
    if isinstance(eos_id, list) and eos_id:
        eos_id = eos_id[0]
    if isinstance(eos_id, int):
        return tok.id_to_token(eos_id)
    return None


def resolve_tokenizer(spec: str, eos_token: str | None = None) -> TokenizerSpec:
    """The TokenizerSpec of ``spec`` ("bytes", a tokenizers JSON file or a Hugging Face directory); ValueError naming
    the fix for a missing or unreadable tokenizer or one without an end-of-document token."""
    if spec == "bytes":
        if eos_token is not None:
            raise ValueError(f"--eos-token ({eos_token!r}) does not apply to --tokenizer bytes, whose end is byte 0")
        return TokenizerSpec("bytes", "bytes", None, 256, BYTES_EOS, "\\x00", "bytes")
    where = Path(spec)
    if where.is_dir():
        path, kind = where / "tokenizer.json", "hf"
        if not path.is_file():
            raise ValueError(
                f"--tokenizer {spec}: the directory has no tokenizer.json; pass a directory holding one, a "
                "tokenizers JSON file or 'bytes'"
            )
    elif where.is_file():
        path, kind = where, "json"
    else:
        raise missing(spec, "tokenizer", "pass 'bytes', a tokenizers JSON file or a Hugging Face model directory")
    tok = _json_tokenizer(str(path))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if kind == "hf":
        declared = _read_json(where / "config.json").get("vocab_size")
        vocab = declared if isinstance(declared, int) and declared > 0 else vocab
    name = eos_token or (_hf_eos(where, tok) if kind == "hf" else None)
    if name is None:
        name = next((n for n in EOS_NAMES if tok.token_to_id(n) is not None), None)
    eos_id = tok.token_to_id(name) if name is not None else None
    if name is None or eos_id is None:
        what = f"has no token {name!r}" if name is not None else f"has none of {', '.join(EOS_NAMES)}"
        raise ValueError(
            f"tokenizer {spec} {what} to end documents with; name its end-of-document token with --eos-token"
        )
    if eos_id >= vocab:
        raise ValueError(f"tokenizer {spec}: its end-of-document token {name!r} has id {eos_id} >= vocab size {vocab}")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return TokenizerSpec(spec, kind, str(path.resolve()), vocab, eos_id, name, digest)


class Encoder:
    """Documents to token ids with one tokenizer; built in each worker from its TokenizerSpec."""

    def __init__(self, spec: TokenizerSpec) -> None:
        self.spec = spec
        self._tok = None if spec.kind == "bytes" else _json_tokenizer(str(spec.path))

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        """One int64 array of ids per text (no special tokens)."""
        if self._tok is None:
            return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64) for t in texts]
        encodings = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]


def set_tokenizer_threads(workers: int) -> None:
    """With several worker processes each encodes on its own core: the tokenizers library's own thread pool would
    put every worker on every core."""
    if workers > 1:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
