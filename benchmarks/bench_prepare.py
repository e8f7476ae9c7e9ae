"""`xmoe data prepare` throughput beside the tokenizer's own speed, on a chosen number of CPU cores.

A synthetic JSONL corpus (words of a Zipf-distributed vocabulary in documents of 20 to 2000 words, --mb of it) is
made first. Then, for the bytes tokenizer and a BPE one (--bpe-vocab tokens, trained here on the corpus with the
`tokenizers` library):
  1. the tokenizer alone: one process pinned to one core encodes every document, in prepare's batches of text
     (xmoe.data.tokenizer.Encoder, no thread pool), the documents already in memory: tokens/s;
  2. `prepare(--workers W)` pinned to W cores: tokens/s of the whole run (reading, JSON parsing, encoding, writing
     and fsync of the shards).
The target: prepare at >= 80% of the tokenizer's own speed x W.
Results: benchmarks/results/data/bench_prepare.{json,md}.

    PYTHONPATH=. python benchmarks/bench_prepare.py --mb 256 --workers 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per process, in both measurements

from harness import environment, write_results

from xmoe.data.prepare import BATCH_CHARS, prepare
from xmoe.data.tokenizer import Encoder, resolve_tokenizer


def make_corpus(path: Path, megabytes: int, seed: int = 0) -> list[str]:
    """Write the corpus; return its documents."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    vocab = ["".join(rng.choice(letters, size=rng.integers(1, 11))) for _ in range(20000)]
    ranks = np.arange(1, len(vocab) + 1)
    zipf = 1.0 / ranks
    zipf /= zipf.sum()
    docs, size = [], 0
    with open(path, "w") as f:
        while size < megabytes * 2**20:
            lengths = rng.integers(20, 2000, size=256)
            words = rng.choice(len(vocab), size=int(lengths.sum()), p=zipf)
            for ids in np.split(words, np.cumsum(lengths)[:-1]):
                text = " ".join(vocab[w] for w in ids) + "."
                line = json.dumps({"text": text}) + "\n"
                f.write(line)
                docs.append(text)
                size += len(line)
    return docs


def train_bpe(docs: list[str], vocab_size: int, path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs[: max(1, len(docs) // 4)], trainer)
    tok.save(str(path))
    return path


def tokenizer_speed(spec: str, docs: list[str], core: int) -> tuple[int, float]:
    """(tokens, seconds) of one process on ``core`` encoding ``docs`` in prepare's batches."""
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        encoder = Encoder(resolve_tokenizer(spec))
        encoder.encode(docs[:8])  # warm-up
        tokens, start = 0, time.perf_counter()
        batch, chars = [], 0
        for doc in docs:
            batch.append(doc)
            chars += len(doc)
            if chars >= BATCH_CHARS:
                tokens += sum(len(ids) for ids in encoder.encode(batch))
                batch, chars = [], 0
        tokens += sum(len(ids) for ids in encoder.encode(batch))
        return tokens, time.perf_counter() - start
    finally:
        os.sched_setaffinity(0, allowed)


def prepare_speed(spec: str, corpus: Path, out: Path, workers: int) -> tuple[int, float]:
    """(tokens without end-of-document tokens, seconds) of prepare on ``workers`` cores."""
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(sorted(allowed)[:workers]))
    try:
        start = time.perf_counter()
        m = prepare([str(corpus)], out, spec, shard_bytes=16 << 20, workers=workers, progress=False)
        return m["tokens"] - m["documents"], time.perf_counter() - start
    finally:
        os.sched_setaffinity(0, allowed)
        shutil.rmtree(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="corpus size in MiB of JSONL")
    parser.add_argument("--workers", type=int, default=2, help="prepare's workers, one core each")
    parser.add_argument("--bpe-vocab", type=int, default=16384)
    parser.add_argument("--tag", default="", help="suffix of the results files")
    args = parser.parse_args()
    if len(os.sched_getaffinity(0)) < args.workers:
        raise SystemExit(f"--workers {args.workers} needs that many cores; this process may use {os.cpu_count()}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        docs = make_corpus(work / "corpus.jsonl", args.mb)
        specs = {"bytes": "bytes", f"bpe {args.bpe_vocab}": str(train_bpe(docs, args.bpe_vocab, work / "bpe.json"))}
        for name, spec in specs.items():
            tokens, seconds = tokenizer_speed(spec, docs, sorted(os.sched_getaffinity(0))[0])
            alone = tokens / seconds
            prepared, wall = prepare_speed(spec, work / "corpus.jsonl", work / "out", args.workers)
            assert prepared == tokens, (prepared, tokens)  # the same documents, the same tokens
            rate = prepared / wall
            rows.append(
                {
                    "tokenizer": name,
                    "corpus_MiB": args.mb,
                    "tokens_M": tokens / 1e6,
                    "tokenizer_1core_Mtok_s": alone / 1e6,
                    "workers": args.workers,
                    "prepare_Mtok_s": rate / 1e6,
                    "prepare_s": wall,
                    "vs_tokenizer_x_workers": rate / (alone * args.workers),
                }
            )
            print(rows[-1], flush=True)
    meta = {**environment(), "cpu": platform.processor() or platform.machine(), "cores_used": args.workers}
    notes = (
        f"CPU: {os.cpu_count()} cores on the machine, prepare pinned to {args.workers}, the tokenizer alone to one. "
        "`vs_tokenizer_x_workers` = prepare's tokens/s / (the tokenizer's one-core tokens/s x workers); target >= 0.8."
    )
    columns = list(rows[0])
    write_results(f"bench_prepare{args.tag}", rows, columns, meta, "xmoe data prepare throughput", notes, topic="data")


if __name__ == "__main__":
    main()
