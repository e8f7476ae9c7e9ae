"""Kernel backends. Every backend exposes the same ops (see reference.py for their contracts):

  gather_rows(x_TH, token_ids_N, row_of_slot_TK) -> x_NH
  combine_rows(y_NH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK) -> out_TH
  grouped_swiglu(x_NH, w1_EHF, w3_EHF, w2_EFH, tokens_per_expert_E) -> y_NH
  moe_experts(x_TH, weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK, tokens_per_expert_E, w1, w3, w2) -> out_TH
  accumulate_grad(grad, update, dtype) -> grad + update (into grad; None: update in dtype)

The Triton backend also has ``router_topk`` (router_topk.py), which the router uses when its backend provides it.
FP8 experts (``moe.fp8 = "experts"``) call the Triton FP8 ops directly, on GPUs with FP8 matrix instructions:
fp8_experts.py (``moe_experts_fp8``, ``grouped_swiglu_fp8``), with their quantisers in fp8_quant.py. Rows in FP8
with 1 x 128 scales, as FP8 dispatch moves them, are exported here from fp8_rows.py (plain torch, any device):
``quantize_rows``, ``dequantize_rows``, and ``Fp8Rows`` (with ``stand_in_rows``), the form in which
``grouped_swiglu_fp8`` takes rows that arrive quantised.

``torch`` (reference.py) runs anywhere. ``triton`` (triton_ops.py) runs on any Triton backend (NVIDIA, AMD) and
on CPU tensors under TRITON_INTERPRET=1 (fp32 only). ``auto`` picks triton for GPU tensors when Triton imports,
torch otherwise. How the Triton kernels compute (weight-gradient engine, autotuning) is a run's ``kernels`` section
(``KernelConfig``), which the experts ops take as arguments (``wgrad``, ``autotune``); choice.py resolves the
backend and the section once, into the ``Kernels`` value a model's MoE layers are built with, and launches.py counts
what the launchers ran.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch

from xmoe.kernels._common import interpreting
from xmoe.kernels.fp8_rows import Fp8Rows as Fp8Rows
from xmoe.kernels.fp8_rows import dequantize_rows as dequantize_rows
from xmoe.kernels.fp8_rows import quantize_rows as quantize_rows
from xmoe.kernels.fp8_rows import stand_in_rows as stand_in_rows


@functools.cache
def triton_available() -> bool:  # asked on every layer call: look once
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


# (backend, device type, checked) -> ops module, filled by get_ops: each backend module is looked up once per process
_RESOLVED: dict[tuple[str, str, bool], ModuleType] = {}


def get_ops(backend: str, device: torch.device, check_device: bool = True) -> ModuleType:
    """The module implementing the ops for ``backend`` on ``device`` (choice.resolve_kernels asks, once where a
    model is built). ``check_device=False``: a Triton backend is not refused on a device its kernels cannot run on
    (a build on the meta device, whose kernels check their tensors when they launch)."""
    key = (backend, device.type, check_device)
    ops = _RESOLVED.get(key)
    if ops is None:
        ops = _RESOLVED[key] = _resolve(backend, device, check_device)
    return ops


def resolve_backend(backend: str, device: torch.device) -> str:
    """ "torch" or "triton": the backend that ``backend`` ("auto" included) names on ``device``."""
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    return backend


def _resolve(backend: str, device: torch.device, check_device: bool) -> ModuleType:
    backend = resolve_backend(backend, device)
    if backend == "torch":
        from xmoe.kernels import reference

        return reference
    if backend == "triton":
        if not triton_available():
            raise ValueError("kernel_backend='triton' needs the triton package: pip install triton")
        if check_device and device.type != "cuda" and not interpreting():
            raise ValueError(
                f"kernel_backend='triton' on a {device.type} device needs a GPU, or TRITON_INTERPRET=1 to run the "
                "kernels in Triton's CPU interpreter (fp32 only); use kernel_backend='torch' or 'auto' on CPU"
            )
        return importlib.import_module("xmoe.kernels.triton_ops")
    raise ValueError(f"kernel_backend ({backend!r}) must be 'auto', 'torch' or 'triton'")
