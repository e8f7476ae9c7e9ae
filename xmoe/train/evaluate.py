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

from xmoe.train.data import MarkovDataset, TokenArrayDataset, TokenDataset, build_dataset


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
        raise ValueError(f"val_fraction needs a token dataset, not {type(dataset).__name__}")
    cut = int(len(dataset.tokens) * (1 - fraction))
    if cut < S + 1:
        raise ValueError(
            f"val_fraction ({fraction}) leaves {cut} of the {len(dataset.tokens)} tokens of "
            f"{dataset.name} for training, fewer than seq_len + 1 = {S + 1}; lower val_fraction"
        )
    train = TokenArrayDataset(dataset.tokens[:cut], dataset.name, S, dataset.vocab_size, dataset.seed)
    return train, windows_of(dataset.tokens[cut:], S, max_windows)


def validation_windows(
    spec: str, seq_len: int, vocab_size: int, max_windows: int, seed: int = 0, tokenizer: str = "bytes"
) -> np.ndarray:
    """Windows of a validation data spec (a file, or 'markov...' with its own sample seed)."""
    dataset = build_dataset(spec, seq_len, vocab_size, seed, tokenizer=tokenizer)
    if isinstance(dataset, MarkovDataset):
        return dataset.source.sample(seed + 1_000_003, np.arange(max_windows or 64), seq_len + 1)
    assert isinstance(dataset, TokenArrayDataset)  # build_dataset makes one of the two
    return windows_of(dataset.tokens, seq_len, max_windows)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    windows_NS1: np.ndarray,
    batch_size: int,
    device: torch.device,
    rank: int = 0,
    world_size: int = 1,
    autocast: bool = False,
) -> dict[str, float]:
    """Mean next-token loss (nats) over the windows, with the token count; ``model(inputs, targets)`` must return
    the mean loss. Collective when torch.distributed is initialised: every rank calls it."""
    if batch_size < 1:
        raise ValueError(f"batch_size ({batch_size}) must be >= 1")
    per_rank = len(windows_NS1) // world_size
    if per_rank == 0:
        raise ValueError(
            f"{len(windows_NS1)} evaluation windows cannot be split over {world_size} ranks; evaluate more data"
        )
    mine = windows_NS1[rank * per_rank : (rank + 1) * per_rank]
    was_training = model.training
    model.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # nats, tokens
    try:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            for start in range(0, per_rank, batch_size):
                batch = torch.from_numpy(mine[start : start + batch_size]).to(device)
                loss = model(batch[:, :-1], batch[:, 1:])
                count = batch[:, 1:].numel()
                sums += torch.stack([loss.double() * count, torch.tensor(count, dtype=torch.float64, device=device)])
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
