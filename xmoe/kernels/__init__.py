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
(``KernelConfig``), applied through tiles.use_options; choice.py resolves it on a device for the run's records.
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


# (backend, device type) -> ops module, filled by get_ops. A plain dict lookup is what torch.compile traces on a
# hit (it cannot trace the import machinery behind a miss), so call get_ops once eagerly before compiling.
_RESOLVED: dict[tuple[str, str], ModuleType] = {}


def get_ops(backend: str, device: torch.device) -> ModuleType:
    """The module implementing the ops for ``backend`` on ``device``."""
    ops = _RESOLVED.get((backend, device.type))
    if ops is None:
        ops = _RESOLVED[(backend, device.type)] = _resolve(backend, device)
    return ops


def resolve_backend(backend: str, device: torch.device) -> str:
    """ "torch" or "triton": the backend that ``backend`` ("auto" included) names on ``device``."""
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    return backend


def _resolve(backend: str, device: torch.device) -> ModuleType:
    backend = resolve_backend(backend, device)
    if backend == "torch":
        from xmoe.kernels import reference

        return reference
    if backend == "triton":
        if not triton_available():
            raise ValueError("kernel_backend='triton' needs the triton package: pip install triton")
        if device.type != "cuda" and not interpreting():
            raise ValueError(
                f"kernel_backend='triton' on a {device.type} tensor needs a GPU, or TRITON_INTERPRET=1 to run the "
                "kernels in Triton's CPU interpreter (fp32 only); use kernel_backend='torch' or 'auto' on CPU"
            )
        return importlib.import_module("xmoe.kernels.triton_ops")
    raise ValueError(f"kernel_backend ({backend!r}) must be 'auto', 'torch' or 'triton'")
