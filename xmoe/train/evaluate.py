"""Held-out evaluation: validation windows, their mean loss (under any parallel layout), perplexity, bits per byte.

# N windows, S seq_len

Windows are fixed, not sampled: consecutive, non-overlapping ``seq_len + 1``-token slices (targets never repeat),
so every evaluation of a run sees the same tokens. Under several processes the windows are split over the
data-parallel ranks in equal counts (every rank runs the same number of forwards, as the expert-parallel
all-to-all requires) and the summed nats and token counts are all-reduced; peers that share data (tensor
parallel) add equal amounts to both sums, so the mean is unchanged.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch
import torch.distributed as dist

from xmoe.model.loss import IGNORE_INDEX
from xmoe.train.data import Draw, MarkovDataset, TokenArrayDataset, TokenDataset, eos_starts
from xmoe.train.loader import make_batch
from xmoe.train.mixture import MixtureDataset, PreparedDataset, open_data


def windows_of(tokens: np.ndarray, seq_len: int, max_windows: int = 0) -> np.ndarray:
    """(N, S + 1) int64: consecutive windows with stride S; at most ``max_windows`` (0: all)."""
    count = (len(tokens) - 1) // seq_len
    if max_windows:
        count = min(count, max_windows)
    if count < 1:
        raise ValueError(
            f"{len(tokens)} evaluation tokens are fewer than seq_len + 1 = {seq_len + 1}; use more "
            "data or a shorter seq_len"
        )
    return np.stack([np.asarray(tokens[i * seq_len : i * seq_len + seq_len + 1], dtype=np.int64) for i in range(count)])


def validation_split(dataset: TokenDataset, fraction: float, max_windows: int) -> tuple[TokenDataset, np.ndarray]:
    """(training dataset, validation windows) holding out the last ``fraction`` of a token file, or, for the
    generated source, samples drawn with another seed (fresh text from the same chain)."""
    if not 0 < fraction < 1:
        raise ValueError(f"val_fraction ({fraction}) must be in (0, 1)")
    S = dataset.seq_len
    if isinstance(dataset, MarkovDataset):
        count = max_windows or 64
        return dataset, dataset.source.sample(dataset.seed + 1_000_003, np.arange(count), S + 1)
    if not isinstance(dataset, TokenArrayDataset):
        raise ValueError(
            f"val_fraction holds out the end of one token or text file, and {dataset.name} is not one; prepare "
            "validation data of its own and pass it with --val-data"
        )
    cut = int(len(dataset.tokens) * (1 - fraction))
    if cut < S + 1:
        raise ValueError(
            f"val_fraction ({fraction}) leaves {cut} of the {len(dataset.tokens)} tokens of "
            f"{dataset.name} for training, fewer than seq_len + 1 = {S + 1}; lower val_fraction"
        )
    train = TokenArrayDataset(dataset.tokens[:cut], dataset.name, S, dataset.vocab_size, dataset.seed)
    train.eos_id = dataset.eos_id
    return train, windows_of(dataset.tokens[cut:], S, max_windows)


def fixed_windows(dataset: TokenDataset, max_windows: int, seed: int = 0, documents: bool = False) -> Draw:
    """The evaluation windows of one dataset (the module docstring's; 'markov' draws with its own sample seed) and,
    with ``documents``, where documents start in them."""
    S = dataset.seq_len
    if isinstance(dataset, MarkovDataset):
        return Draw(dataset.source.sample(seed + 1_000_003, np.arange(max_windows or 64), S + 1))
    if isinstance(dataset, PreparedDataset):
        count = min(dataset.epoch_size, max_windows or dataset.epoch_size)
        length = S + 1
        tokens = np.stack([dataset.prepared.read(i * S, length) for i in range(count)])
        starts = np.stack([dataset.prepared.document_starts(i * S, length) for i in range(count)])
        return Draw(tokens, starts if documents else None)
    assert isinstance(dataset, TokenArrayDataset)  # open_data makes one of these, or a mixture of them
    tokens = windows_of(dataset.tokens, S, max_windows)
    if not documents:
        return Draw(tokens)
    assert dataset.eos_id is not None  # the trainer's loader refused documents without boundaries
    return Draw(tokens, eos_starts(tokens, dataset.eos_id))


def validation_sets(
    spec: str,
    seq_len: int,
    vocab_size: int | None,
    max_windows: int,
    seed: int = 0,
    tokenizer: str = "bytes",
    *,
    eos_id: int | None = None,
    documents: bool = False,
) -> dict[str, tuple[float, Draw]]:
    """{source name: (weight, windows)} of a validation spec: one entry named "" for one dataset, one per source
    (up to ``max_windows`` windows each) for a mixture."""
    dataset = open_data(spec, seq_len, vocab_size, seed, tokenizer=tokenizer, eos_id=eos_id)
    if isinstance(dataset, MixtureDataset):
        parts = zip(dataset.source_names, dataset.weights, dataset.sources, strict=True)
        return {name: (float(w), fixed_windows(ds, max_windows, seed, documents)) for name, w, ds in parts}
    return {"": (1.0, fixed_windows(dataset, max_windows, seed, documents))}


def validation_windows(
    spec: str, seq_len: int, vocab_size: int, max_windows: int, seed: int = 0, tokenizer: str = "bytes"
) -> np.ndarray:
    """Windows of a validation data spec (a file, a prepared set, or 'markov...' with its own sample seed)."""
    sets = validation_sets(spec, seq_len, vocab_size, max_windows, seed, tokenizer)
    if len(sets) > 1:
        raise ValueError(f"{spec!r} is a mixture; evaluate its sources one at a time")
    return sets[""][1].tokens_NS1


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    windows_NS1: np.ndarray,
    batch_size: int,
    device: torch.device,
    rank: int = 0,
    world_size: int = 1,
    autocast: bool = False,
    starts_NS1: np.ndarray | None = None,
) -> dict[str, float]:
    """Mean next-token loss (nats) over the windows, with the token count; ``model(inputs, targets)`` must return
    the mean loss over targets != IGNORE_INDEX. ``starts_NS1``: where documents start (documents "mask": the model
    gets ``segments_BS`` and no target crosses into the next document). Collective when torch.distributed is
    initialised: every rank calls it."""
    if batch_size < 1:
        raise ValueError(f"batch_size ({batch_size}) must be >= 1")
    per_rank = len(windows_NS1) // world_size
    if per_rank == 0:
        raise ValueError(
            f"{len(windows_NS1)} evaluation windows cannot be split over {world_size} ranks; evaluate more data"
        )
    mine = windows_NS1[rank * per_rank : (rank + 1) * per_rank]
    my_starts = None if starts_NS1 is None else starts_NS1[rank * per_rank : (rank + 1) * per_rank]
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # nats, tokens
    try:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            for start in range(0, per_rank, batch_size):
                rows = slice(start, start + batch_size)
                starts = None if my_starts is None else my_starts[rows]
                batch = make_batch(Draw(mine[rows], starts), starts is not None)
                targets = batch[1].to(device)
                kwargs = {} if batch.segments_BS is None else {"segments_BS": batch.segments_BS.to(device)}
                loss = model(batch[0].to(device), targets, **kwargs)
                count = (targets != IGNORE_INDEX).sum().double()  # a tensor: no host synchronisation
                sums += torch.stack([loss.double() * count, count])
    finally:
        model.train(was_training)
    if dist.is_initialized():
        dist.all_reduce(sums)
    nats, tokens = sums.tolist()
    return {"loss": nats / tokens, "tokens": int(tokens)}


def bits_per_byte(loss: float, num_tokens: int, num_bytes: int | None) -> float | None:
    """Total bits over the bytes the evaluated tokens stand for (None when unknown)."""
    if not num_bytes:
        return None
    return loss * num_tokens / math.log(2) / num_bytes


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf


def text_bytes_of(windows_NS1: np.ndarray, tokenizer: str | None) -> int | None:
    """Bytes the targets of ``windows`` decode to: one per token for byte-level text; the UTF-8 length of the
    decoded targets with a tokenizers JSON; None when unknown."""
    targets = windows_NS1[:, 1:]
    if tokenizer in (None, "bytes"):
        return int(targets.size)
    if not os.path.isfile(tokenizer):
        return None
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer)
    return sum(len(tok.decode(row.tolist(), skip_special_tokens=False).encode("utf-8")) for row in targets)
