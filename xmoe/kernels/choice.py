"""A run's kernel choices as values, resolved once where a model is built.

``Kernels`` is what the MoE layers run: the backend's ops module (``moe.kernel_backend`` as it resolves on the
device: reference.py or triton_ops.py), what computes the Triton backward's weight gradients (``kernels.wgrad``)
and whether tiles are autotuned (``kernels.autotune``). ``resolve_kernels`` makes one for a device;
``build_model`` (xmoe/parallel/build.py) makes one from the run's ``KernelConfig`` and hands it to every MoE layer,
which builds its router, experts and dispatcher with it, and xmoe/parallel/expert_parallel.py installs parallel
dispatchers with the layer's. The experts pass ``wgrad`` and ``autotune`` to the custom ops as arguments, so a layer
runs under the choice it was built with wherever it runs, a user's own loop included, and nothing in a forward or
backward reads a module-level option. What actually launched is counted by the launchers (launches.py).

``KernelChoice`` is what a run says and records of its choice: the section as configured and what it comes to on
the device (``describe()`` in the run header, ``record()`` in summary.json and every checkpoint's meta.json, so two
runs that differ only in a kernel choice can be told apart). The trainer resolves its run's (``resolve_choice``);
`xmoe plan memory --measure` and `xmoe bench` theirs from their flags (``resolve_layer``: one MoE layer's tokens);
`xmoe eval` and `xmoe generate` build their model with the section the run they read recorded
(``recorded_config``).

# T tokens of a micro-batch on one rank, K top-k, E experts (E_local: on one EP rank), N routed rows of one rank
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from types import ModuleType
from typing import Any

import torch

from xmoe.config import KernelConfig, MoEConfig, RunConfig, check_fp8_wgrad
from xmoe.kernels import get_ops, resolve_backend, tiles, triton_available


@dataclass(frozen=True)
class Kernels:
    """The kernels an MoE layer runs, resolved for one device type (``resolve_kernels``). Frozen: torch.compile
    takes its fields as constants of the code it traces."""

    requested: str  # moe.kernel_backend as configured: "auto", "torch" or "triton"
    backend: str  # what it names on ``device_type``: "torch" or "triton"
    ops: ModuleType  # that backend's ops (xmoe/kernels/__init__.py lists them)
    device_type: str  # the device type it was resolved for ("meta": shapes only, never run)
    wgrad: str  # kernels.wgrad: "auto" (decided per launch by the rows each expert gets), "triton", "grouped_mm", "fp8"
    autotune: bool  # kernels.autotune

    def __deepcopy__(self, memo: dict) -> Kernels:
        return self  # immutable, and its ops module cannot be copied: a copied layer shares it

    def __reduce__(self):
        # pickled by the ops module's name (a module itself does not pickle)
        return _rebuild, (self.requested, self.backend, self.ops.__name__, self.device_type, self.wgrad, self.autotune)

    def check_device(self, device: torch.device) -> None:
        """ValueError where ``device`` would resolve ``requested`` to another backend than this value's: a layer
        built for one device and moved to another runs the kernels it was built with, so a move that changes what
        "auto" means is refused, naming the fix, rather than run silently on the other backend."""
        if device.type == self.device_type or device.type == "meta":
            return
        if self.requested == "auto" and resolve_backend("auto", device) != self.backend:
            raise ValueError(
                f"this MoE layer's kernels were resolved for {self.device_type} (kernel_backend 'auto' -> "
                f"{self.backend}) but it runs on {device.type}, where 'auto' names "
                f"{resolve_backend('auto', device)}: build it for {device.type} (build_model(cfg, device), "
                f"MoELayer(cfg, kernels=resolve_kernels(cfg.kernel_backend, device={device.type!r})), or under "
                f"torch.device({device.type!r})), or set kernel_backend to 'torch' or 'triton'"
            )


def _rebuild(requested: str, backend: str, ops: str, device_type: str, wgrad: str, autotune: bool) -> Kernels:
    return Kernels(requested, backend, importlib.import_module(ops), device_type, wgrad, autotune)


def resolve_kernels(
    backend: str = "auto", config: KernelConfig | None = None, device: torch.device | str | None = None
) -> Kernels:
    """``Kernels`` for ``backend`` (a moe.kernel_backend: "auto", "torch" or "triton") under the kernels section
    ``config`` (None: ``KernelConfig()``, the environment's defaults, read now) on ``device`` (None: the default
    device, ``torch.get_default_device()``). A ValueError names a backend that cannot run there (Triton without
    the package, or on a CPU without its interpreter); the meta device resolves without running anything."""
    device = torch.device(device) if device is not None else torch.get_default_device()
    config = config if config is not None else KernelConfig()
    # the meta device builds shapes only: its kernels are those of a CPU, and a Triton backend is taken on trust
    # (a GPU run builds on meta with its own device's kernels: build_model)
    ops = get_ops(backend, device if device.type != "meta" else torch.device("cpu"), check_device=device.type != "meta")
    resolved = resolve_backend(backend, device)
    return Kernels(backend, resolved, ops, device.type, config.wgrad, config.autotune)


@dataclass(frozen=True)
class KernelChoice:
    config: KernelConfig  # as configured ("auto" and all)
    backend: str  # "torch" or "triton": moe.kernel_backend on the device
    wgrad: str  # "autograd" (no Triton GEMMs: the torch backend, the padded baseline), "triton", "grouped_mm", "fp8"
    tiles: str  # "none" (no Triton GEMMs) or tiles.source's words

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
    probe = torch.empty(0, dtype=dtype, device=device)
    wgrad = wgrad_engine(probe, num_rows, moe.num_experts // ep, moe.hidden_size, moe.ffn_hidden_size, cfg.wgrad)
    if cfg.wgrad == "fp8":
        wgrad = "fp8"
    return KernelChoice(cfg, backend, wgrad, tiles.source(dtype, device, cfg.autotune))


def recorded_config(config: Mapping[str, Any]) -> KernelConfig:
    """The kernels section a run recorded in ``config`` (a checkpoint meta.json's "config": ``record()``'s dict under
    "kernels", whose "effective" part is what it came to on that run's device and is resolved again where it is
    used); the environment's defaults where none was recorded (a checkpoint written before runs recorded theirs)."""
    section = config.get("kernels") or {}
    return KernelConfig(**{f.name: section[f.name] for f in fields(KernelConfig) if f.name in section})
