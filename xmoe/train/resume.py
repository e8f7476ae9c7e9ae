"""What a resume must match: the data's fingerprint, and the model and schedule fields a checkpoint shares with
the run resuming it, checked before anything is built.

``fingerprint`` and ``resume_mismatches`` say what a checkpoint must share with the run resuming it;
``check_resume`` compares a checkpoint's stored config with a RunConfig without building anything. The checkpoint
a resume picks is the run directory's choice (``RunDir.resume_checkpoint``), which calls ``check_resume``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import zlib
from pathlib import Path
from typing import Any

import torch.distributed as dist

from xmoe.model_config import upgrade_moe_fields
from xmoe.train.mixture import MixtureDataset, PreparedDataset

log = logging.getLogger(__name__)

# train fields a bit-identical continuation depends on (steps, cadences and micro-batching may change freely)
RESUME_TRAIN_FIELDS = (
    "seed",
    "global_batch_size",
    "seq_len",
    "lr",
    "min_lr_ratio",
    "warmup_steps",
    "weight_decay",
    "beta1",
    "beta2",
    "grad_clip",
)


def _file_fingerprint(path: str) -> dict[str, Any]:
    """Size and the crc32 of the whole file, streamed: any edit changes it. It costs one read of the file per
    start, about 0.3 s per GB from the page cache (measured: 20 MB in 0.01 s, 200 MB in 0.06-0.09 s; 2-core
    CPU), the disk's read time otherwise."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return {"size": os.path.getsize(path), "crc32": f"{crc:08x}"}


def _identity(spec: str, dataset: Any) -> dict[str, Any]:
    """What identifies one dataset's content: a prepared set's manifest hash and counts (the manifest holds every
    source's SHA-256 and every shard's crc32, so nothing of the set is read again); a file's size and crc32; for
    a mixture, each source's by name with its weight."""
    if isinstance(dataset, MixtureDataset):
        parts = zip(dataset.source_names, dataset.weights, dataset.sources, strict=True)
        return {"mixture": {n: {"weight": float(w), **_identity(s.name, s)} for n, w, s in parts}}
    if isinstance(dataset, PreparedDataset):
        return dataset.prepared.fingerprint()
    return _file_fingerprint(spec) if os.path.isfile(spec) else {}


def fingerprint(data_spec: str, dataset: Any) -> dict[str, Any]:
    """Collective when torch.distributed is initialised (rank 0 reads the files, the others receive its result).
    What identifies the training data: the dataset's name (markov options and mixture weights included), its
    vocabulary and its content (``_identity``)."""
    info: dict[str, Any] = {"name": dataset.name, "vocab_size": dataset.vocab_size}
    parts = [_identity(data_spec, dataset) if not dist.is_initialized() or dist.get_rank() == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(parts, src=0)
    assert parts[0] is not None  # rank 0's, on every rank
    info.update(parts[0])
    return info


def flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    """``out[prefix.key.subkey] = value`` for every leaf of the nested dict ``value``."""
    if isinstance(value, dict):
        for k, v in value.items():
            flatten(f"{prefix}.{k}" if prefix else k, v, out)
    else:
        out[prefix] = value


def resume_mismatches(saved: dict[str, Any] | None, run: Any, data: dict[str, Any]) -> list[str]:
    """``section.field: checkpoint X, now Y`` for every model field, data property and schedule field
    (RESUME_TRAIN_FIELDS) that differs between a checkpoint's stored config and this run."""
    if not isinstance(saved, dict):
        return []  # written before configs were stored: nothing to compare
    now: dict[str, Any] = {}
    flatten("model", dataclasses.asdict(run.model), now)
    flatten("data", data, now)
    for name in RESUME_TRAIN_FIELDS:
        now[f"train.{name}"] = getattr(run.train, name)
    sections: dict[str, dict[str, Any]] = {
        k: v for k in ("model", "data", "train") if isinstance(v := saved.get(k), dict)
    }
    model = sections.get("model", {})
    if isinstance(model.get("moe"), dict):  # fields older versions named otherwise
        sections["model"] = {**model, "moe": upgrade_moe_fields(model["moe"])}
    then: dict[str, Any] = {}
    flatten("", sections, then)
    return [
        f"{key}: checkpoint {then[key]!r}, now {value!r}"
        for key, value in now.items()
        if key in then and then[key] != value
    ]


def check_resume(ckpt_path: Path, meta: dict[str, Any], run: Any, data: dict[str, Any], allow_changes: bool) -> None:
    """Refuse a checkpoint that has nothing left to do, or (unless ``allow_changes``) a different model, data or
    schedule; ValueError listing the differing fields."""
    step = int(meta["step"])
    if step >= run.train.steps:
        raise ValueError(
            f"nothing to do: checkpoint {ckpt_path} is at step {step} and --steps is {run.train.steps}; "
            "pass a larger --steps to train further"
        )
    differ = resume_mismatches(meta.get("config"), run, data)
    if differ and not allow_changes:
        raise ValueError(
            f"checkpoint {ckpt_path} was saved by a different run ({len(differ)} field(s) differ: "
            f"{'; '.join(differ[:8])}); resume with the same settings, or pass --allow-changes to continue from "
            "it anyway (fine-tuning on new data or with a new schedule)"
        )
    if differ:
        log.info(
            f"--allow-changes: continuing from {ckpt_path} with {len(differ)} changed field(s): {'; '.join(differ[:8])}"
        )
