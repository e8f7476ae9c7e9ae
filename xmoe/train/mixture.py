"""Prepared sets and weighted mixtures as training datasets, and ``open_data``, which turns any ``data.path`` into one.

# N rows, S seq_len, K samples per mixture block

A prepared set (``xmoe data prepare``) is read as one memory-mapped stream. Its epoch e visits windows
``shift_e + k * S`` for k = permute(i) over i in [0, windows): ``permute`` is a keyed bijection computed for the
positions asked (a Feistel network), so no permutation of hundreds of millions of windows is ever held in memory;
``shift_e`` moves window edges between epochs. Both come from (seed, e).

A mixture "W1:SPEC1,W2:SPEC2,..." (weights normalised to sum 1; each SPEC a prepared set, a token or text file)
is endless. Its sample positions are cut into blocks of K = BLOCK; source i owns C_i(b + 1) - C_i(b) slots of
block b, where C_i(b) is the largest-remainder apportionment of b * K slots by the weights, so after any whole
block every source is within one sample of its share; the slots of a block are shuffled by (seed, b). Source i's
n-th slot overall takes its n-th sample, in its own epochs' order (its own seed). Everything is a function of
(seed, position): a resumed run draws what the uninterrupted one would have.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from xmoe.data.prepared import PreparedSet, is_prepared
from xmoe.train.data import Draw, TokenDataset, build_dataset

BLOCK = 1 << 14  # mixture slots apportioned and shuffled together; a weight needs at least one slot per block


def _mix64(x: np.ndarray) -> np.ndarray:
    """A 64-bit finaliser (splitmix64's): every input bit moves every output bit."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def permute(index: np.ndarray, n: int, key: list[int]) -> np.ndarray:
    """A bijection of [0, n) chosen by ``key``, at ``index``: four Feistel rounds on the smallest even number of bits
    that covers n, walked again while a value falls outside [0, n) (which keeps it a bijection of [0, n))."""
    bits = max(2, (n - 1).bit_length())
    bits += bits % 2
    half, mask = np.uint64(bits // 2), np.uint64((1 << (bits // 2)) - 1)
    round_keys = np.random.SeedSequence(key).generate_state(4, dtype=np.uint64)
    x = index.astype(np.uint64)
    todo = np.ones(len(x), dtype=bool)
    with np.errstate(over="ignore"):  # the round function multiplies modulo 2**64 on purpose
        while todo.any():
            left, right = x[todo] >> half, x[todo] & mask
            for k in round_keys:
                left, right = right, left ^ (_mix64(right ^ k) & mask)
            x[todo] = (left << half) | right
            todo = x >= np.uint64(n)
    return x.astype(np.int64)


class PreparedDataset(TokenDataset):
    """Windows of a prepared set's stream, ordered as in the module docstring."""

    epoch_size: int

    def __init__(self, prepared: PreparedSet, name: str, seq_len: int, vocab_size: int, seed: int) -> None:
        if prepared.num_tokens < seq_len + 1:
            raise ValueError(
                f"{name} holds {prepared.num_tokens} tokens, fewer than seq_len + 1 = {seq_len + 1}; use more data "
                "or a shorter seq_len"
            )
        super().__init__(name, seq_len, vocab_size, seed, epoch_size=(prepared.num_tokens - 1) // seq_len)
        self.prepared, self.eos_id = prepared, prepared.eos_id
        self._spare = prepared.num_tokens - 1 - self.epoch_size * seq_len

    def _starts(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        shift = int(np.random.default_rng([self.seed, epoch]).integers(0, self._spare + 1))
        return shift + permute(positions, self.epoch_size, [self.seed, epoch]) * self.seq_len

    def samples(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        return self.draw(epoch, positions).tokens_NS1

    def draw(self, epoch: int, positions: np.ndarray, documents: bool = False) -> Draw:
        length = self.seq_len + 1
        starts = self._starts(epoch, positions)
        tokens_NS1 = np.empty((len(starts), length), dtype=np.int64)
        starts_NS1 = np.zeros(tokens_NS1.shape, dtype=bool) if documents else None
        for row, start in enumerate(starts):
            tokens_NS1[row] = self.prepared.read(int(start), length)
            if starts_NS1 is not None:
                starts_NS1[row] = self.prepared.document_starts(int(start), length)
        return Draw(tokens_NS1, starts_NS1)


def apportion(weights: np.ndarray, total: int) -> np.ndarray:
    """Integer counts summing to ``total`` in the proportions ``weights`` (sum 1): floors, then one more to each of
    the largest remainders (ties to the lower index)."""
    exact = weights * total
    counts = np.floor(exact).astype(np.int64)
    extra = total - int(counts.sum())
    order = np.lexsort((np.arange(len(weights)), -(exact - counts)))
    counts[order[:extra]] += 1
    return counts


class MixtureDataset(TokenDataset):
    """An endless weighted mixture of datasets (module docstring); rows carry their source."""

    def __init__(self, sources: list[TokenDataset], weights: list[float], names: list[str], seed: int) -> None:
        w = np.asarray(weights, dtype=np.float64)
        self.weights = w / w.sum()
        if (self.weights * BLOCK < 1).any():
            small = names[int(np.argmin(self.weights))]
            raise ValueError(f"mixture source {small} has weight below 1/{BLOCK} of the total; raise it or drop it")
        first = sources[0]
        label = ",".join(f"{x:.4g}:{n}" for x, n in zip(self.weights, names, strict=True))
        super().__init__(f"mixture({label})", first.seq_len, max(s.vocab_size for s in sources), seed, None)
        self.sources, self.source_names = sources, names
        self._block: tuple[int, np.ndarray, np.ndarray] = (-1, np.empty(0), np.empty(0))

    @property
    def has_documents(self) -> bool:
        return all(s.has_documents for s in self.sources)

    def _plan(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """(source of each slot of ``block``, the index of that slot's sample in its source's stream)."""
        if self._block[0] != block:
            before = apportion(self.weights, block * BLOCK)
            counts = apportion(self.weights, (block + 1) * BLOCK) - before
            labels = np.random.default_rng([self.seed, block]).permutation(np.repeat(np.arange(len(counts)), counts))
            index = np.empty(BLOCK, dtype=np.int64)
            for i, count in enumerate(counts):
                index[labels == i] = before[i] + np.arange(count)
            self._block = (block, labels, index)
        return self._block[1], self._block[2]

    def samples(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        return self.draw(epoch, positions).tokens_NS1

    def draw(self, epoch: int, positions: np.ndarray, documents: bool = False) -> Draw:
        source_N = np.empty(len(positions), dtype=np.int64)
        index_N = np.empty(len(positions), dtype=np.int64)
        for block in np.unique(positions // BLOCK):
            here = positions // BLOCK == block
            labels, index = self._plan(int(block))
            source_N[here], index_N[here] = labels[positions[here] % BLOCK], index[positions[here] % BLOCK]
        tokens_NS1 = np.empty((len(positions), self.seq_len + 1), dtype=np.int64)
        starts_NS1 = np.zeros(tokens_NS1.shape, dtype=bool) if documents else None
        for i, source in enumerate(self.sources):
            rows = np.flatnonzero(source_N == i)
            size = source.epoch_size
            epoch_R, within_R = np.divmod(index_N[rows], size) if size else (np.zeros_like(rows), index_N[rows])
            for e in np.unique(epoch_R):
                part = source.draw(int(e), within_R[epoch_R == e], documents)
                tokens_NS1[rows[epoch_R == e]] = part.tokens_NS1
                if starts_NS1 is not None and part.starts_NS1 is not None:
                    starts_NS1[rows[epoch_R == e]] = part.starts_NS1
        return Draw(tokens_NS1, starts_NS1, source_N)


def parse_mixture(spec: str) -> list[tuple[float, str]] | None:
    """[(weight, source spec)] of "W1:SPEC1,W2:SPEC2,..."; None when ``spec`` is not a mixture (one plain spec)."""
    items = [item.strip() for item in spec.split(",")]
    parsed = []
    for item in items:
        weight, sep, path = item.partition(":")
        try:
            w = float(weight) if sep else None
        except ValueError:
            w = None
        if w is None:
            if len(items) == 1:
                return None
            raise ValueError(
                f"mixture item {item!r} of {spec!r} has no weight; write WEIGHT:PATH for every source, e.g. "
                "'0.7:data/web,0.3:data/code'"
            )
        if not (w > 0 and np.isfinite(w)) or not path:
            raise ValueError(f"mixture item {item!r} needs a weight > 0 and a path, e.g. 0.3:data/code")
        parsed.append((w, path))
    return parsed


def _source_names(paths: list[str]) -> list[str]:
    """Each source's name in the logs: its folder's or file's name, made unique by its position where two agree."""
    names = [Path(p.rstrip("/")).stem or p for p in paths]
    return [n if names.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(names)]


def _open_one(spec: str, seq_len: int, vocab_size: int | None, seed: int, tokenizer: str, eos_id: int | None):
    if is_prepared(spec):
        prepared = PreparedSet(spec)
        if vocab_size is not None and prepared.vocab_size > vocab_size:
            raise ValueError(
                f"prepared set {spec} has vocabulary {prepared.vocab_size}, more than the model's vocab_size "
                f"({vocab_size}); raise model.vocab_size or prepare with the model's tokenizer"
            )
        return PreparedDataset(prepared, spec, seq_len, vocab_size or prepared.vocab_size, seed)
    dataset = build_dataset(spec, seq_len, vocab_size, seed, tokenizer=tokenizer)
    if eos_id is not None and not spec.startswith("markov"):
        dataset.eos_id = eos_id
    return dataset


def open_data(
    spec: str,
    seq_len: int,
    vocab_size: int | None = None,
    seed: int = 0,
    *,
    tokenizer: str = "bytes",
    eos_id: int | None = None,
) -> TokenDataset:
    """The dataset of ``data.path``: a mixture, a prepared set, or what ``build_dataset`` reads (markov, a token or
    text file). ``eos_id`` is the end-of-document token of token and text files (prepared sets know their own)."""
    mixture = parse_mixture(spec)
    if mixture is None:
        return _open_one(spec, seq_len, vocab_size, seed, tokenizer, eos_id)
    paths = [path for _, path in mixture]
    seeds = [int(np.random.SeedSequence([seed, i]).generate_state(1)[0]) for i in range(len(paths))]  # independent
    sources = [_open_one(p, seq_len, vocab_size, s, tokenizer, eos_id) for p, s in zip(paths, seeds, strict=True)]
    hashes = {s.prepared.manifest["tokenizer"]["sha256"] for s in sources if isinstance(s, PreparedDataset)}
    if len(hashes) > 1:
        raise ValueError(
            f"the prepared sets of {spec!r} were made with different tokenizers; prepare them with one tokenizer"
        )
    return MixtureDataset(sources, [w for w, _ in mixture], _source_names(paths), seed)
