"""A trainer's process: the process group and device from the launcher's environment (RANK, WORLD_SIZE,
LOCAL_RANK, as torchrun and Slurm set them), with the run's collective timeout."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def init_distributed(device: str = "auto", timeout_s: float | None = None) -> tuple[int, int, torch.device]:
    """Join the process group the launcher describes (if any), its collectives timing out after ``timeout_s``
    (torch's default: None); return (rank, world_size, device)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() if device == "auto" else device.startswith("cuda")
    if device not in ("auto", "cpu") and not device.startswith("cuda"):
        raise ValueError(f"--device ({device!r}) must be auto, cpu or cuda")
    if use_cuda and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no GPU; use --device cpu")
    dev = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(
            "nccl" if use_cuda else "gloo",
            device_id=dev if use_cuda else None,
            timeout=None if timeout_s is None else datetime.timedelta(seconds=timeout_s),
        )
    rank = dist.get_rank() if dist.is_initialized() else 0
    return rank, world, dev
