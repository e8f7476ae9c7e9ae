"""What a checkpoint holds, through torch.distributed.checkpoint (DCP): writing a training state (model,
optimizer, per-rank extra state, RNG states) into a checkpoint directory and loading it back. Where checkpoints live
and how a save becomes visible (staging, COMPLETE, ``latest``, pruning, pins, the checks of its files, the choice of
the checkpoint to load) is the run directory's (``rundir.RunDir``): ``save_checkpoint`` hands it the writing of the
state, ``load_checkpoint`` asks it which checkpoint a path names.

One checkpoint, ``OUT/checkpoints/step_000100/``::

    .metadata, __<rank>_0.distcp  DCP files: model + optimizer, each rank writes its own shards
    rank_00000.pt ...             per-rank extra state (data loader, LR scheduler, RNG states)
    meta.json                     step, config, versions, world size, every file's size and crc32
    COMPLETE                      written last; a directory without it is never loaded

Every failure a rank can hit is turned into the same ``CheckpointError`` on all ranks. Model and optimizer
state go through ``get_state_dict`` / ``set_state_dict``, so plain modules, DDP, FSDP2 and torch.compile'd
modules share one key space and a checkpoint can be reloaded under a different wrapper or world size.
Per-rank extra state is loaded with ``torch.load(weights_only=True)``: keep it to tensors, numbers,
strings, None and dicts/lists/tuples of those (LR scheduler and data-loader state dicts are). DCP's metadata and
non-tensor values are read through allow-lists too (``checkpoint_read.py``): reading a checkpoint runs no code
from it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import warnings
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from xmoe._version import __version__
from xmoe.train.checkpoint_dir import CheckpointError, _agree, _all_gather, _rank_world, _suggest_previous, _underlying
from xmoe.train.checkpoint_read import SafeLoadPlanner, SafeReader, read_metadata
from xmoe.train.checkpoint_verify import find_latest as find_latest  # re-exported: callers find and load from here
from xmoe.train.checkpoint_verify import read_meta as read_meta  # re-exported likewise
from xmoe.train.rundir import RunDir

# DCP reports a failed save or load as a CheckpointException, which derives from BaseException, not Exception
FAILURES = (Exception, CheckpointException)


# --------------------------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _dcp_quietly():
    """DCP warns that it 'assumes a single process' when no group exists; that is our intent there."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*torch\.distributed is disabled.*")
        yield


# ------------------------------------------------------------------------------------------ RNG state


def capture_rng_state() -> dict[str, Any]:
    """RNG states of python ``random``, numpy's global generator, torch CPU and the current CUDA device."""
    state: dict[str, Any] = {"python": random.getstate(), "torch_cpu": torch.get_rng_state()}
    try:
        import numpy as np

        # the legacy tuple, get_state's default (numpy's stubs type the default call as the dict form)
        name, keys, pos, has_gauss, cached = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state())
        # Plain ints/lists so torch.load(weights_only=True) accepts it.
        state["numpy"] = (name, keys.tolist(), int(pos), int(has_gauss), float(cached))
    except ImportError:
        pass
    # Only the current device: get_rng_state_all() would create a CUDA context on every visible GPU.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`; generators missing from ``state`` are left untouched."""
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "torch_cpu" in state:
        torch.set_rng_state(state["torch_cpu"])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ------------------------------------------------------------------------------------------ public API


def save_checkpoint(
    out_dir: str | os.PathLike | RunDir,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
    keep_last: int = 2,
    *,
    config: Any = None,
    checksum: bool = True,
) -> Path:
    """Collective (all ranks call it): write ``OUT/checkpoints/step_{step:06d}`` atomically; return its path.

    ``extra`` is this rank's small state (data loader, LR scheduler, ...); RNG states are captured
    automatically. ``config`` (a dataclass or dict) is stored in meta.json. After success only the
    ``keep_last`` newest checkpoints with step <= ``step`` remain (checkpoints with a higher step, left by
    an abandoned timeline, are not deleted). On failure no existing checkpoint is touched and every rank
    raises CheckpointError (which says "disk full" when that is the cause). The directory's part is
    ``RunDir.save``; ``out_dir`` is a run directory's path or the RunDir itself.
    """
    about = {
        "has_optimizer": optimizer is not None,
        "xmoe_version": __version__,
        "torch_version": torch.__version__,
        "config": (
            dataclasses.asdict(config) if dataclasses.is_dataclass(config) and not isinstance(config, type) else config
        ),
    }
    run_dir = out_dir if isinstance(out_dir, RunDir) else RunDir(out_dir)
    return run_dir.save(
        step, lambda tmp: _write(tmp, model, optimizer, extra), about, keep_last=keep_last, checksum=checksum
    )


def _write(
    tmp: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, extra: dict[str, Any] | None
) -> None:
    """Every rank writes its extra-state file into the staged directory ``tmp``, then ``dcp.save`` writes model +
    optimizer shards (step 2 of ``RunDir.save``)."""
    rank, world = _rank_world()
    exc: BaseException | None = None
    state: dict[str, Any] | None = None
    prints: dict[str, tuple[tuple[int, ...], float]] | None = None
    try:
        blob = {"rank": rank, "extra": dict(extra or {}), "rng": capture_rng_state()}
        with open(tmp / f"rank_{rank:05d}.pt", "wb") as f:
            torch.save(blob, f)
            f.flush()
            os.fsync(f.fileno())
        state = _state_dicts(model, optimizer)
        prints = _fingerprints(state) if world > 1 else {}
    except Exception as e:  # noqa: BLE001 - re-raised on every rank by _agree
        exc = e
    _agree(exc, f"writing checkpoint {tmp}", tmp)
    assert state is not None and prints is not None  # made, or _agree raised
    _warn_unsynced_replicas(prints)
    try:
        with _dcp_quietly():
            dcp.save(state, checkpoint_id=str(tmp))
    except FAILURES as e:  # re-raised on every rank by _agree
        exc = e
    _agree(exc, f"writing checkpoint {tmp}", tmp)


def _state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _fingerprints(state: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], float]]:
    """Shape and float64 sum of every plain (non-DTensor) tensor in the model / optimizer state."""
    from torch.distributed.tensor import DTensor

    tensors = dict(state["model"])
    for fqn, per_param in state.get("optim", {}).get("state", {}).items():
        tensors.update({f"optim.{fqn}.{k}": v for k, v in per_param.items()})
    plain = {k: v for k, v in tensors.items() if isinstance(v, torch.Tensor) and not isinstance(v, DTensor)}
    sums = [v.detach().sum(dtype=torch.float64) for v in plain.values()]
    on_device = [i for i, x in enumerate(sums) if x.device.type != "cpu"]
    if on_device:  # one device-to-host copy for all of them, not one (and one host sync) per tensor
        for i, x in zip(on_device, torch.stack([sums[i] for i in on_device]).cpu(), strict=False):
            sums[i] = x
    return {k: (tuple(v.shape), float(x)) for (k, v), x in zip(plain.items(), sums, strict=False)}


def _warn_unsynced_replicas(prints: dict[str, tuple[tuple[int, ...], float]]) -> None:
    """Collective. DCP stores a plain tensor once, from one rank, assuming every rank holds the same copy.
    Weights sharded by hand (e.g. expert-parallel experts kept as local nn.Parameters) would silently
    lose all other ranks' values, so say so loudly."""
    if _rank_world()[1] == 1:
        return
    reference, *others = _all_gather(prints)
    differ = sorted(
        {
            k
            for other in others
            for k, (shape, total) in other.items()
            if k in reference and (reference[k][0] != shape or not _same(reference[k][1], total))
        }
    )
    if differ:
        warnings.warn(
            f"{len(differ)} plain (non-DTensor) tensors differ across ranks, e.g. {', '.join(differ[:4])}; "
            "DCP saves one rank's copy of each and every rank reloads that copy. Keep sharded weights as "
            "DTensors (FSDP2, distribute_tensor) and replicated ones identical.",
            stacklevel=2,
        )


def _same(a: float, b: float) -> bool:
    return a == b or (a != a and b != b)  # NaN sums compare equal to each other


def _check_compatible(ckpt: Path, state: dict[str, Any]) -> None:
    """Compare tensor keys and global shapes with the DCP metadata; ValueError naming the first offenders."""
    stored = read_metadata(ckpt).state_dict_metadata
    wanted: dict[str, Any] = {f"model.{k}": v for k, v in state["model"].items()}
    for fqn, per_param in state.get("optim", {}).get("state", {}).items():
        wanted.update({f"optim.state.{fqn}.{k}": v for k, v in per_param.items()})
    prefixes = ("model.", "optim.state.") if "optim" in state else ("model.",)
    missing = [k for k in wanted if k not in stored]
    unexpected = [k for k in stored if k.startswith(prefixes) and k not in wanted]
    mismatched = []
    for k, v in wanted.items():
        size = getattr(stored.get(k), "size", None)
        if isinstance(v, torch.Tensor) and size is not None and tuple(v.shape) != tuple(size):
            mismatched.append(f"{k}: model {list(v.shape)} vs checkpoint {list(size)}")
    if missing or unexpected or mismatched:
        parts = []
        if mismatched:
            parts.append(f"shape mismatch: {', '.join(mismatched[:5])}")
        if missing:
            parts.append(f"missing from checkpoint: {', '.join(missing[:5])}")
        if unexpected:
            parts.append(f"not in model: {', '.join(unexpected[:5])}")
        raise ValueError(
            f"model/optimizer do not match checkpoint {ckpt} ({len(mismatched)} shape mismatches, "
            f"{len(missing)} missing, {len(unexpected)} unexpected keys): {'; '.join(parts)}. "
            "Build the model with the config stored in its meta.json."
        )


def load_checkpoint(
    path_or_out_dir: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    verify: bool = True,
    restore_rng: bool = True,
    restore_extra: bool = True,
) -> dict[str, Any]:
    """Collective: load a checkpoint dir, or the latest one under a run dir, into model (+ optimizer).

    Returns this rank's ``extra`` dict as saved, with ``"step"`` set from meta.json if absent, and
    restores the RNG states (``restore_rng``). ``verify`` checks every file's crc32 (sizes are always
    checked). The world size may differ from the one that saved (DCP reshards model + optimizer) only with
    ``restore_extra=False`` (per-rank extra state cannot be remapped); then ``{"step": step}`` is returned.
    Raises FileNotFoundError (nothing there), CheckpointError (incomplete/corrupt), ValueError (mismatch).
    """
    path, meta = RunDir.locate(Path(path_or_out_dir), checksums=verify)
    rank, world = _rank_world()
    if restore_extra and meta["world_size"] != world:
        raise ValueError(
            f"checkpoint {path} was saved by {meta['world_size']} ranks, this run has {world}: per-rank state "
            "(data loader, RNG) cannot be remapped; pass restore_extra=False to load only model + optimizer"
        )
    if optimizer is not None and not meta["has_optimizer"]:
        raise ValueError(f"checkpoint {path} holds no optimizer state; pass optimizer=None")

    state = _state_dicts(model, optimizer)
    _check_compatible(path, state)
    try:
        with _dcp_quietly():
            dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner(path))
    except CheckpointError:  # a refusal of what the checkpoint holds: already one line naming the file
        raise
    except FAILURES as e:  # DCP raises many types; name the dir and the way out
        cause = _underlying(e)
        raise CheckpointError(
            f"reading checkpoint {path} failed ({type(cause).__name__}: {cause}). {_suggest_previous(path)}"
        ) from e
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    if not restore_extra:
        return {"step": meta["step"]}
    blob = _read_rank_blob(path, rank)
    if restore_rng:
        restore_rng_state(blob["rng"])
    extra = blob["extra"]
    extra.setdefault("step", meta["step"])
    return extra


def _read_rank_blob(path: Path, rank: int) -> dict[str, Any]:
    try:
        return torch.load(path / f"rank_{rank:05d}.pt", map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"extra state rank_{rank:05d}.pt in {path} is unreadable ({e}). {_suggest_previous(path)}"
        ) from e


def read_extra(ckpt: str | os.PathLike, rank: int = 0) -> dict[str, Any]:
    """The ``extra`` dict one rank saved (no RNG restore): for state that is the same on every rank (the data
    position, the step) when resuming at a different world size."""
    return _read_rank_blob(Path(ckpt), rank)["extra"]
