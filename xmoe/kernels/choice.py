"""A run's kernel choices as they resolve on its device: the backend the MoE layers call, what computes the fused
backward's weight gradients, where the GEMM tiles come from. The trainer runs its steps under its ``kernels``
section (``KernelChoice.applied``), prints ``describe()`` in the run header and stores ``record()`` in
summary.json and in every checkpoint's meta.json, so two runs that differ only in a kernel choice can be told
apart.

# T tokens of a micro-batch on one rank, K top-k, E experts (E_local: on one EP rank), N routed rows of one rank
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from typing import Any

import torch

from xmoe.config import KernelConfig, RunConfig
from xmoe.kernels import resolve_backend, tiles, triton_available


@dataclass(frozen=True)
class KernelChoice:
    config: KernelConfig  # as configured ("auto" and all)
    backend: str  # "torch" or "triton": moe.kernel_backend on the device
    wgrad: str  # "autograd" (no Triton GEMMs: the torch backend, the padded baseline), "triton" or "grouped_mm"
    tiles: str  # "none" (no Triton GEMMs) or tiles.source's words

    def applied(self) -> AbstractContextManager[KernelConfig]:
        """The kernels run under this run's kernels section until the block ends."""
        return tiles.use_options(self.config)

    def record(self) -> dict[str, Any]:
        """The kernels section and what it resolved to: {"wgrad": ..., "autotune": ..., "effective": {...}}."""
        return {**asdict(self.config), "effective": {"backend": self.backend, "wgrad": self.wgrad, "tiles": self.tiles}}

    def describe(self) -> str:
        autotune = "on" if self.config.autotune else "off"
        return (
            f"kernels: backend {self.backend}, weight gradients {self.wgrad} (kernels.wgrad {self.config.wgrad}),"
            f" tiles {self.tiles} (kernels.autotune {autotune})"
        )


def resolve_choice(run: RunConfig, device: torch.device, dtype: torch.dtype) -> KernelChoice:
    """What ``run``'s kernel choices come to on ``device`` with routed rows in ``dtype``. The "auto" weight-gradient
    engine decides per launch by the rows an expert gets; this is its decision for the rows a rank routes on average
    (one rank: exactly, when dropless)."""
    moe, cfg = run.model.moe, run.kernels
    backend = resolve_backend(moe.kernel_backend, device)
    # FP8 experts call the Triton kernels whatever the backend; the padded baseline's experts are torch.bmm's
    triton_gemms = moe.fp8 == "experts" or (backend == "triton" and moe.dispatcher != "padded")
    if not (triton_gemms and triton_available()):
        return KernelChoice(cfg, backend, "autograd", "none")
    from xmoe.kernels.grouped_wgrad import wgrad_engine  # imports triton, which the Triton GEMMs have

    _, micro_batch, _ = run.batch_layout()
    num_tokens = micro_batch * run.train.seq_len // run.parallel.tp  # under TP, SSMB routes 1/tp per rank
    # a rank sends T * K rows (at most E * C kept) and, under EP, receives as many on average
    num_rows = min(num_tokens * moe.top_k, moe.num_experts * moe.capacity(num_tokens))
    with tiles.use_options(cfg):
        wgrad = wgrad_engine(
            torch.empty(0, dtype=dtype, device=device),
            num_rows,
            moe.num_experts // run.parallel.ep,
            moe.hidden_size,
            moe.ffn_hidden_size,
        )
        return KernelChoice(cfg, backend, wgrad, tiles.source(dtype, device))
