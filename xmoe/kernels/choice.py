"""A run's kernel choices as they resolve on its device: the backend the MoE layers call, what computes the fused
backward's weight gradients, where the GEMM tiles come from. The trainer runs its steps under its ``kernels``
section (``KernelChoice.applied``), prints ``describe()`` in the run header and stores ``record()`` in
summary.json and in every checkpoint's meta.json, so two runs that differ only in a kernel choice can be told
apart. The other commands that run the model do the same with theirs: `xmoe plan memory --measure` and `xmoe
bench` with the section of their flags (``resolve_layer``: one MoE layer's tokens), `xmoe eval` and `xmoe
generate` with the one the run they read recorded (``recorded_config``).

# T tokens of a micro-batch on one rank, K top-k, E experts (E_local: on one EP rank), N routed rows of one rank
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from xmoe.config import KernelConfig, MoEConfig, RunConfig, check_fp8_wgrad
from xmoe.kernels import resolve_backend, tiles, triton_available


@dataclass(frozen=True)
class KernelChoice:
    config: KernelConfig  # as configured ("auto" and all)
    backend: str  # "torch" or "triton": moe.kernel_backend on the device
    wgrad: str  # "autograd" (no Triton GEMMs: the torch backend, the padded baseline), "triton", "grouped_mm", "fp8"
    tiles: str  # "none" (no Triton GEMMs) or tiles.source's words

    def applied(self) -> AbstractContextManager[KernelConfig]:
        """The kernels run under this run's kernels section until the block ends."""
        return tiles.use_options(self.config)

    def record(self) -> dict[str, Any]:
        """The kernels section and what it resolved to: {"wgrad": ..., "autotune": ..., "effective": {...}}."""
        return {**asdict(self.config), "effective": {"backend": self.backend, "wgrad": self.wgrad, "tiles": self.tiles}}

    def describe(self) -> str:
        return describe_record(self.record())


def describe_record(record: Mapping[str, Any]) -> str:
    """The run header's line for a choice's ``record()`` (as a measurement or a checkpoint stores it)."""
    effective = record["effective"]
    return (
        f"kernels: backend {effective['backend']}, weight gradients {effective['wgrad']} (kernels.wgrad "
        f"{record['wgrad']}), tiles {effective['tiles']} (kernels.autotune {'on' if record['autotune'] else 'off'})"
    )


def resolve_choice(run: RunConfig, device: torch.device, dtype: torch.dtype) -> KernelChoice:
    """What ``run``'s kernel choices come to on ``device`` with routed rows in ``dtype``, for the tokens one of its
    ranks routes per micro-batch (``resolve_layer``)."""
    _, micro_batch, _ = run.batch_layout()
    num_tokens = micro_batch * run.train.seq_len // run.parallel.tp  # under TP, SSMB routes 1/tp per rank
    return resolve_layer(run.model.moe, run.kernels, num_tokens, device, dtype, ep=run.parallel.ep)


def fp8_refusal(device: torch.device) -> str | None:
    """Why FP8 experts (moe.fp8='experts') cannot run on ``device``, naming the fix; None where they can."""
    if not triton_available():
        return "moe.fp8='experts' runs Triton kernels: pip install triton, or set moe.fp8='off' (--fp8 off)"
    from xmoe.kernels.fp8_quant import fp8_format

    try:
        fp8_format(device)
    except ValueError as e:  # the device has no FP8 matrix instructions
        return str(e)
    return None


def resolve_layer(
    moe: MoEConfig, cfg: KernelConfig, num_tokens: int, device: torch.device, dtype: torch.dtype, *, ep: int = 1
) -> KernelChoice:
    """What the kernel choices ``cfg`` come to on ``device`` for an MoE layer ``moe`` (its experts split over ``ep``
    ranks) that routes ``num_tokens`` tokens on a rank, its rows in ``dtype``. The "auto" weight-gradient engine
    decides per launch by the rows an expert gets; this is its decision for the rows a rank routes on average
    (one rank: exactly, when dropless)."""
    check_fp8_wgrad(moe, cfg)
    if moe.fp8 == "experts":  # refused here, before a trainer builds anything, not at the first forward
        refusal = fp8_refusal(device)
        if refusal:
            raise ValueError(refusal)
    backend = resolve_backend(moe.kernel_backend, device)
    # FP8 experts call the Triton kernels whatever the backend; the padded baseline's experts are torch.bmm's
    triton_gemms = moe.fp8 == "experts" or (backend == "triton" and moe.dispatcher != "padded")
    if not (triton_gemms and triton_available()):
        return KernelChoice(cfg, backend, "autograd", "none")
    from xmoe.kernels.grouped_wgrad import wgrad_engine  # imports triton, which the Triton GEMMs have

    # a rank sends T * K rows (at most E * C kept) and, under EP, receives as many on average
    num_rows = min(num_tokens * moe.top_k, moe.num_experts * moe.capacity(num_tokens))
    with tiles.use_options(cfg):
        wgrad = wgrad_engine(
            torch.empty(0, dtype=dtype, device=device),
            num_rows,
            moe.num_experts // ep,
            moe.hidden_size,
            moe.ffn_hidden_size,
        )
        if cfg.wgrad == "fp8":
            wgrad = "fp8"
        return KernelChoice(cfg, backend, wgrad, tiles.source(dtype, device))


def recorded_config(config: Mapping[str, Any]) -> KernelConfig:
    """The kernels section a run recorded in ``config`` (a checkpoint meta.json's "config": ``record()``'s dict under
    "kernels", whose "effective" part is what it came to on that run's device and is resolved again where it is
    used); the environment's defaults where none was recorded (a checkpoint written before runs recorded theirs)."""
    section = config.get("kernels") or {}
    return KernelConfig(**{f.name: section[f.name] for f in fields(KernelConfig) if f.name in section})
