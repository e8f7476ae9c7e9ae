"""Checks and switches shared by the Triton op files (permute.py, combine.py, grouped_gemm.py)."""

from __future__ import annotations

import os

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1: kernels run on CPU tensors in numpy, so launchers pick tiny blocks."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_float(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}; the Triton kernels take float32, bfloat16 or float16")


def check_index(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}; index arrays must be int32 or int64")


def check_device(*tensors: torch.Tensor) -> None:
    device = tensors[0].device
    for t in tensors[1:]:
        if t.device != device:
            raise ValueError(f"all tensors must be on one device, got {device} and {t.device}")
    if device.type == "cpu" and not interpreting():
        raise ValueError("the Triton kernels need GPU tensors, or TRITON_INTERPRET=1 for CPU tensors (fp32 only)")
