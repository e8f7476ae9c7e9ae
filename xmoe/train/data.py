"""Training data: the embedded Markov source (``markov.py``), token files, text files, and a sharded loader.

A dataset yields samples of ``seq_len + 1`` tokens (inputs plus the target shifted by one) at positions of a
seeded, per-epoch order; ``TokenLoader`` walks that order one global batch per step and hands each
data-parallel rank its contiguous slice, so the ranks' slices concatenated in rank order are the
one-process batch. Its whole state is one counter (samples consumed), so resuming reproduces the stream.

Specs for ``build_dataset``:
  "markov[:opt=value,...]"  generated on the fly, no download; options in ``MarkovSource``.
  "path.npy"                1-D integer array, memory-mapped.
  "path.bin"                raw little-endian uint16/uint32 tokens, memory-mapped (dtype rules: ``load_tokens``).
  "path.txt"                text, tokenized into memory (bytes or a `tokenizers` JSON); at most
                            MAX_TEXT_BYTES: pre-tokenize larger corpora once with ``tokenize_file``.

Real data order (epoch e): windows start at ``shift_e + k * seq_len`` for k in a seeded permutation of
``range(num_windows)``, num_windows = (num_tokens - 1) // seq_len, and shift_e a seeded offset in
[0, (num_tokens - 1) % seq_len] so window edges move between epochs. Both come from (seed, e).
"""

from __future__ import annotations

import os
import warnings
from typing import NamedTuple

import numpy as np

from xmoe.checks import missing
from xmoe.train.markov import MarkovSource

# Legend: N samples, S seq_len.

MAX_TEXT_BYTES = 256 * 2**20  # text is tokenized in memory (~4-8 bytes per token); larger: tokenize_file
_SCAN_CHUNK = 2**24  # tokens per chunk when checking a memory-mapped file's range


class Draw(NamedTuple):
    """Rows of a dataset: ``tokens_NS1`` (N, seq_len + 1) int64; ``starts_NS1`` bool, True where a document starts
    (None unless asked for); ``sources_N`` int64, the mixture source of each row (None for one source)."""

    tokens_NS1: np.ndarray
    starts_NS1: np.ndarray | None = None
    sources_N: np.ndarray | None = None


def eos_starts(tokens_NS1: np.ndarray, eos_id: int) -> np.ndarray:
    """Where documents start in rows of a stream that ends each document with ``eos_id``: after every such token."""
    starts_NS1 = np.zeros(tokens_NS1.shape, dtype=bool)
    starts_NS1[:, 1:] = tokens_NS1[:, :-1] == eos_id
    return starts_NS1


class TokenDataset:
    """Samples of ``seq_len + 1`` tokens at positions of a seeded order.

    ``epoch_size`` is the number of samples per epoch, None for an endless stream. ``vocab_size`` is the
    vocabulary a model needs: the one given to ``build_dataset`` (checked against the data), else the
    smallest that fits. The entropy fields (nats/token) are exact for generated sources, None for real data.
    ``eos_id``: the end-of-document token, where documents start (None: no documents known).
    ``source_names``: the sources whose rows it mixes (one, its own name, unless it is a mixture).
    """

    def __init__(self, name: str, seq_len: int, vocab_size: int, seed: int, epoch_size: int | None) -> None:
        self.name, self.seq_len, self.vocab_size = name, seq_len, vocab_size
        self.seed, self.epoch_size = seed, epoch_size
        self.eos_id: int | None = None
        self.source_names = [name]
        self.entropy_rate: float | None = None
        self.unigram_entropy: float | None = None
        self.bigram_entropy: float | None = None
        self.loss_floor: float | None = None  # least expected mean loss over one window's predictions

    def samples(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """(N, seq_len + 1) int64: the samples at ``positions`` of epoch ``epoch``'s order."""
        raise NotImplementedError

    @property
    def has_documents(self) -> bool:
        """Whether ``draw`` can say where documents start."""
        return self.eos_id is not None

    def draw(self, epoch: int, positions: np.ndarray, documents: bool = False) -> Draw:
        """The samples at ``positions`` of epoch ``epoch``'s order and, with ``documents``, where documents start."""
        tokens_NS1 = self.samples(epoch, positions)
        if not documents:
            return Draw(tokens_NS1)
        assert self.eos_id is not None  # the loader checks has_documents first
        return Draw(tokens_NS1, eos_starts(tokens_NS1, self.eos_id))

    def describe(self) -> str:
        """One line for the training log."""
        if self.entropy_rate is None:
            return f"{self.name}: {self.epoch_size} windows of {self.seq_len}+1 tokens, vocab {self.vocab_size}"
        return (
            f"{self.name}: vocab {self.vocab_size}; nats/token: unigram {self.unigram_entropy:.4f}, "
            f"bigram {self.bigram_entropy:.4f}, entropy rate {self.entropy_rate:.4f}, "
            f"loss floor at seq_len {self.seq_len} {self.loss_floor:.4f}"
        )


class MarkovDataset(TokenDataset):
    """Endless stream from a ``MarkovSource``; sample i depends only on (seed, i)."""

    def __init__(self, source: MarkovSource, name: str, seq_len: int, vocab_size: int, seed: int) -> None:
        super().__init__(name, seq_len, vocab_size, seed, epoch_size=None)
        self.source = source
        self.entropy_rate = source.entropy_rate
        self.unigram_entropy = source.unigram_entropy
        self.bigram_entropy = source.bigram_entropy
        self.loss_floor = source.loss_floor(seq_len)

    def samples(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        return self.source.sample(self.seed, positions, self.seq_len + 1)

    @property
    def has_documents(self) -> bool:
        return False  # one endless chain


class TokenArrayDataset(TokenDataset):
    """Windows of a 1-D token array (in memory or memory-mapped), ordered as in the module docstring."""

    epoch_size: int  # always finite here

    def __init__(self, tokens: np.ndarray, name: str, seq_len: int, vocab_size: int, seed: int) -> None:
        num_tokens = len(tokens)
        if num_tokens < seq_len + 1:
            raise ValueError(
                f"{name} holds {num_tokens} tokens, fewer than seq_len + 1 = {seq_len + 1}; "
                "use more data or a shorter seq_len"
            )
        super().__init__(name, seq_len, vocab_size, seed, epoch_size=(num_tokens - 1) // seq_len)
        self.tokens = tokens
        self._spare = (num_tokens - 1) - self.epoch_size * seq_len  # slack for the per-epoch shift
        self._order: tuple[int, int, np.ndarray] = (-1, 0, np.empty(0, dtype=np.int64))

    def _epoch_order(self, epoch: int) -> tuple[int, np.ndarray]:
        if self._order[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            shift = int(rng.integers(0, self._spare + 1))
            self._order = (epoch, shift, rng.permutation(self.epoch_size))
        return self._order[1], self._order[2]

    def samples(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        shift, perm = self._epoch_order(epoch)
        starts = shift + perm[positions] * self.seq_len
        length = self.seq_len + 1
        return np.stack([np.asarray(self.tokens[s : s + length], dtype=np.int64) for s in starts])


def _check_range(tokens: np.ndarray, vocab_size: int | None, name: str) -> int:
    """Largest token; raises if any token is negative or >= vocab_size. Scans memory maps in chunks."""
    lo, hi = 0, 0
    for start in range(0, len(tokens), _SCAN_CHUNK):
        chunk = tokens[start : start + _SCAN_CHUNK]
        lo, hi = min(lo, int(chunk.min())), max(hi, int(chunk.max()))
    if lo < 0:
        raise ValueError(f"{name} holds a negative token ({lo}); token ids must be >= 0")
    if vocab_size is not None and hi >= vocab_size:
        raise ValueError(
            f"{name} holds token {hi} >= vocab_size ({vocab_size}); raise vocab_size to at least "
            f"{hi + 1} or check the tokenizer (and, for .bin files, the dtype)"
        )
    return hi


def _bin_dtype(path: str, dtype: str | None, vocab_size: int | None) -> tuple[str, bool]:
    """(dtype, inferred) for a .bin file; see ``load_tokens``."""
    sidecar, source = path + ".dtype", "dtype"
    if dtype is None and os.path.isfile(sidecar):
        with open(sidecar) as f:
            dtype, source = f.read().strip(), f"sidecar {sidecar!r}"
    if dtype is None:
        return ("uint32" if vocab_size is not None and vocab_size > 2**16 else "uint16"), True
    if dtype not in ("uint16", "uint32"):
        raise ValueError(f"{source} ({dtype!r}) for {path!r} must be 'uint16' or 'uint32'")
    return dtype, False


def load_tokens(path: str, dtype: str | None = None, vocab_size: int | None = None) -> np.ndarray:
    """Memory-map a token file as a 1-D integer array.

    .npy: a 1-D integer array (``np.save``). .bin: raw little-endian tokens; the dtype is ``dtype`` if
    given, else the contents ("uint16" or "uint32") of a sidecar file ``<path>.dtype``, else uint32 when
    vocab_size > 65536 and uint16 otherwise. A file whose size is not a multiple of the item size is
    rejected, and so is an inferred-uint16 file that reads like uint32 (every second value 0).
    """
    _check_is_file(path, "token file")
    ext = os.path.splitext(path)[1].lower()
    if ext == ".npy":
        tokens = _load_npy(path)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(
                f"{path!r} holds a {tokens.ndim}-D {tokens.dtype} array; expected 1-D integer "
                "tokens (flatten it, or re-tokenize with tokenize_file)"
            )
    elif ext == ".bin":
        dt, inferred = _bin_dtype(path, dtype, vocab_size)
        size, itemsize = os.path.getsize(path), np.dtype(dt).itemsize
        if size == 0:
            raise ValueError(f"token file {path!r} is empty")
        if size % itemsize:
            raise ValueError(
                f"{path!r} has {size} bytes, not a multiple of {itemsize} ({dt}); "
                "check the dtype (argument or .dtype sidecar)"
            )
        tokens = np.memmap(path, dtype=np.dtype(dt).newbyteorder("<"), mode="r")
        head = tokens[: min(len(tokens), 2**16) // 2 * 2]
        if inferred and len(head) >= 2 and not head[1::2].any() and head[0::2].any():
            raise ValueError(
                f"{path!r} reads like uint32 tokens (every second uint16 is 0); pass "
                f"dtype='uint32' or write 'uint32' into {path + '.dtype'!r}"
            )
    else:
        raise ValueError(f"token file {path!r} has extension {ext!r}; expected .npy or .bin")
    if len(tokens) == 0:
        raise ValueError(f"token file {path!r} is empty")
    return tokens


def _check_is_file(path: str, what: str) -> None:
    if os.path.isdir(path):
        raise ValueError(f"{what} {path!r} is a directory; pass a file")
    if not os.path.isfile(path):
        raise missing(path, what)


def _load_npy(path: str) -> np.ndarray:
    """Memory-map a .npy file; errors name the file and what is wrong with it (numpy's do neither: a file without
    the header is reported as pickled data, an object array as a memory-mapping problem)."""
    with open(path, "rb") as f:
        magic = f.read(6)
    if magic != b"\x93NUMPY":
        raise ValueError(
            f"{path!r} is not a .npy file (no NumPy header); write tokens with np.save, or name raw tokens .bin"
        )
    try:
        return np.load(path, mmap_mode="r")
    except ValueError as e:
        if "Python objects" in str(e) or "pickle" in str(e):
            raise ValueError(f"{path!r} holds Python objects, not tokens; save a 1-D integer array") from None
        raise ValueError(f"{path!r} is not a readable .npy file: {e}") from None


def load_tokenizer(tokenizer: str):
    """(tokenizers.Tokenizer or None for bytes, vocab size)."""
    if tokenizer == "bytes":
        return None, 256
    if not os.path.isfile(tokenizer):
        raise missing(tokenizer, "tokenizer", "pass 'bytes' or a tokenizers JSON file")
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise ImportError(
            "a tokenizers JSON file needs the `tokenizers` package: pip install "
            "'xmoe[tokenizers]', or use tokenizer='bytes'"
        ) from e
    try:
        tok = Tokenizer.from_file(tokenizer)
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own exception type
        raise ValueError(
            f"tokenizer {tokenizer!r} is not a readable tokenizers JSON file ({e}); restore it from the "
            "model it came with"
        ) from None
    return tok, tok.get_vocab_size()


def _text_chunks(text_path: str, tok):
    """Token ids of ``text_path`` in chunks: 64 MiB of bytes, or ~1 MiB of whole lines for a tokenizer (which
    then sees the same text except where a merge or pre-token would cross a chunk edge)."""
    if tok is None:
        with open(text_path, "rb") as f:
            while chunk := f.read(2**26):
                yield np.frombuffer(chunk, dtype=np.uint8)
        return
    with open(text_path, encoding="utf-8") as f:
        while lines := f.readlines(2**20):
            yield np.asarray(tok.encode("".join(lines), add_special_tokens=False).ids, dtype=np.int64)


def tokenize_file(text_path: str, out_path: str, tokenizer: str = "bytes") -> int:
    """Tokenize a text file of any size into a .npy file of uint16 (uint32 when the vocabulary exceeds
    65536) tokens; returns the token count. Streams through a temporary raw file ``<out_path>.tmp``, so
    memory stays at one chunk."""
    if not os.path.isfile(text_path):
        raise FileNotFoundError(f"text file {text_path!r} not found")
    if not out_path.endswith(".npy"):
        raise ValueError(f"out_path {out_path!r} must end in .npy")
    tok, vocab = load_tokenizer(tokenizer)
    dt = np.dtype("<u2" if vocab <= 2**16 else "<u4")
    raw_path, num_tokens = out_path + ".tmp", 0
    with open(raw_path, "wb") as f:
        for ids in _text_chunks(text_path, tok):
            f.write(ids.astype(dt).tobytes())
            num_tokens += len(ids)
    raw = np.memmap(raw_path, dtype=dt, mode="r") if num_tokens else np.empty(0, dtype=dt)
    out = np.lib.format.open_memmap(out_path, mode="w+", dtype=dt, shape=(num_tokens,))
    for start in range(0, num_tokens, _SCAN_CHUNK):
        out[start : start + _SCAN_CHUNK] = raw[start : start + _SCAN_CHUNK]
    out.flush()
    del raw, out
    os.remove(raw_path)
    return num_tokens


_MARKOV_OPTIONS = {
    "vocab": int,
    "order": int,
    "buckets": int,
    "branch": int,
    "alpha": float,
    "smooth": float,
    "source_seed": int,
}


def _parse_markov(spec: str) -> dict:
    opts: dict = {}
    body = spec[len("markov:") :] if spec.startswith("markov:") else ""
    for item in filter(None, body.split(",")):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in _MARKOV_OPTIONS:
            raise ValueError(
                f"bad markov option {item!r} in spec {spec!r}; expected key=value with key in {sorted(_MARKOV_OPTIONS)}"
            )
        try:
            opts[key] = _MARKOV_OPTIONS[key](value)
        except ValueError:
            raise ValueError(
                f"markov option {key}={value!r} in spec {spec!r} is not a valid {_MARKOV_OPTIONS[key].__name__}"
            ) from None
    return opts


def build_dataset(
    spec: str,
    seq_len: int,
    vocab_size: int | None = None,
    seed: int = 0,
    *,
    tokenizer: str = "bytes",
    dtype: str | None = None,
) -> TokenDataset:
    """A dataset from ``spec``: "markov[:opt=value,...]" (options of ``MarkovSource``) or a .npy / .bin /
    .txt path. ``vocab_size`` (the model's) is checked against the data; ``seed`` fixes the sample order
    (and, for markov, the samples, not the chain); ``tokenizer`` ("bytes" or a tokenizers JSON path) is
    for .txt, ``dtype`` for .bin (see ``load_tokens``)."""
    if seq_len < 1:
        raise ValueError(f"seq_len ({seq_len}) must be >= 1")
    if seed < 0:
        raise ValueError(f"seed ({seed}) must be >= 0")
    if vocab_size is not None and vocab_size < 1:
        raise ValueError(f"vocab_size ({vocab_size}) must be >= 1, or None to take it from the data")
    if spec == "markov" or spec.startswith("markov:"):
        return _markov_dataset(spec, seq_len, vocab_size, seed)
    ext = os.path.splitext(spec)[1].lower()
    if os.path.isdir(spec):
        raise ValueError(
            f"data file {spec!r} is a directory but not a prepared set; pass a .npy/.bin/.txt file, a directory that "
            "`xmoe data prepare` wrote, or 'markov'"
        )
    if not os.path.isfile(spec):
        raise missing(
            spec,
            "data file",
            "pass an existing .npy/.bin/.txt path, a prepared set's directory, or 'markov[:opt=value,...]' for the "
            "built-in source",
        )
    if dtype is not None and ext != ".bin":
        warnings.warn(f"dtype ({dtype!r}) only applies to .bin files; ignored for {spec!r}", stacklevel=2)
    if tokenizer != "bytes" and ext != ".txt":
        warnings.warn(f"tokenizer ({tokenizer!r}) only applies to .txt files; ignored for {spec!r}", stacklevel=2)
    if ext == ".txt":
        return _text_dataset(spec, seq_len, vocab_size, seed, tokenizer)
    if ext not in (".npy", ".bin"):
        raise ValueError(
            f"data file {spec!r} has extension {ext!r}; expected .npy, .bin or .txt "
            "(pre-tokenize other text with tokenize_file)"
        )
    tokens = load_tokens(spec, dtype, vocab_size)
    top = _check_range(tokens, vocab_size, repr(spec))
    return TokenArrayDataset(tokens, spec, seq_len, vocab_size or top + 1, seed)


def _markov_dataset(spec: str, seq_len: int, vocab_size: int | None, seed: int) -> MarkovDataset:
    source = MarkovSource(**_parse_markov(spec))
    if vocab_size is not None and vocab_size < source.vocab:
        raise ValueError(
            f"vocab_size ({vocab_size}) is smaller than the markov vocab ({source.vocab}); "
            f"raise vocab_size or use 'markov:vocab={vocab_size}'"
        )
    name = "markov(" + ", ".join(f"{k}={v}" for k, v in source.options.items()) + ")"
    return MarkovDataset(source, name, seq_len, vocab_size or source.vocab, seed)


def _text_dataset(spec: str, seq_len: int, vocab_size: int | None, seed: int, tokenizer: str) -> TokenArrayDataset:
    """A .txt file tokenized in memory (at most MAX_TEXT_BYTES of it)."""
    size = os.path.getsize(spec)
    if size > MAX_TEXT_BYTES:
        raise ValueError(
            f"{spec!r} has {size} bytes, more than MAX_TEXT_BYTES ({MAX_TEXT_BYTES}) that are "
            "tokenized in memory; pre-tokenize once with tokenize_file(text, 'out.npy') and "
            "train on the .npy"
        )
    tok, tok_vocab = load_tokenizer(tokenizer)
    chunks = list(_text_chunks(spec, tok))
    tokens = np.concatenate(chunks) if chunks else np.empty(0, dtype=np.int64)
    if len(tokens) == 0:
        raise ValueError(f"text file {spec!r} is empty")
    _check_range(tokens, vocab_size, repr(spec))
    return TokenArrayDataset(tokens, spec, seq_len, vocab_size or tok_vocab, seed)
