"""A run's data: the training dataset and its fingerprint, the validation windows, the loader and a mixture's
per-source loss counters, made from ``run.data`` and ``run.train``; and the validation losses of a run.

# N windows, S seq_len
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from xmoe.config import RunConfig
from xmoe.train.data import Draw, TokenDataset, eos_starts
from xmoe.train.evaluate import evaluate, validation_sets, validation_split
from xmoe.train.loader import TokenLoader
from xmoe.train.mixture import open_data
from xmoe.train.resume import fingerprint
from xmoe.train.source_loss import SourceLosses


@dataclass
class RunData:
    """``info``: what checkpoints store and a resume compares (the data's fingerprint, the documents mode and end
    token); ``val_sets``: {source name ("" for one dataset): (its weight in val_loss, its windows)}, None without
    validation; ``source_losses``: None unless the data is a mixture."""

    dataset: TokenDataset
    info: dict[str, Any]
    val_sets: dict[str, tuple[float, Draw]] | None
    loader: TokenLoader
    source_losses: SourceLosses | None


def load_run_data(run: RunConfig, micro_batch: int, dp_rank: int, dp_size: int, device: torch.device) -> RunData:
    """Collective when torch.distributed is initialised (the fingerprint is read on rank 0)."""
    t, data = run.train, run.data
    vocab, masked = run.model.vocab_size, data.documents == "mask"
    dataset = open_data(
        data.path, seq_len=t.seq_len, vocab_size=vocab, seed=t.seed, tokenizer=data.tokenizer, eos_id=data.eos_id
    )
    info = {**fingerprint(data.path, dataset), "documents": data.documents, "eos_id": data.eos_id}
    val_sets = None
    if data.val_path is not None and t.val_fraction > 0:
        raise ValueError(
            f"data.val_path ({data.val_path}) and val_fraction ({t.val_fraction}) both choose "
            "validation data; pass one of them"
        )
    if data.val_path is not None:
        val_sets = validation_sets(
            data.val_path, t.seq_len, vocab, t.val_windows, t.seed, data.tokenizer, eos_id=data.eos_id, documents=masked
        )
    elif t.val_fraction > 0:
        dataset, windows_NS1 = validation_split(dataset, t.val_fraction, t.val_windows)
        starts_NS1 = eos_starts(windows_NS1, dataset.eos_id) if masked and dataset.eos_id is not None else None
        val_sets = {"": (1.0, Draw(windows_NS1, starts_NS1))}
    loader = TokenLoader(dataset, micro_batch * dp_size, rank=dp_rank, world_size=dp_size, documents=data.documents)
    names = dataset.source_names
    return RunData(dataset, info, val_sets, loader, SourceLosses(names, device) if len(names) > 1 else None)


def validate(
    model: torch.nn.Module,
    val_sets: dict[str, tuple[float, Draw]],
    micro_batch: int,
    device: torch.device,
    dp_rank: int,
    dp_size: int,
    autocast: bool,
) -> dict[str, float]:
    """val_loss (for a mixture: its sources' losses by their weights) and, for a mixture, val_loss/SOURCE."""
    values, total = {}, 0.0
    for name, (weight, windows) in val_sets.items():
        loss = evaluate(
            model,
            windows.tokens_NS1,
            micro_batch,
            device,
            dp_rank,
            dp_size,
            autocast=autocast,
            starts_NS1=windows.starts_NS1,
        )["loss"]
        total += weight * loss
        if name:
            values[f"val_loss/{name}"] = loss
    return {"val_loss": total, **values}


def keep_imported_files(hf_dir: str, out: Path) -> None:
    """Copy the imported config.json (export reuses its other fields) and tokenizer.json (text data, eval and
    generate use it) into the run directory."""
    import shutil

    from xmoe.hf.checkpoint import RUN_HF_CONFIG, RUN_TOKENIZER

    shutil.copy(Path(hf_dir) / "config.json", out / RUN_HF_CONFIG)
    if (Path(hf_dir) / RUN_TOKENIZER).is_file():
        shutil.copy(Path(hf_dir) / RUN_TOKENIZER, out / RUN_TOKENIZER)
