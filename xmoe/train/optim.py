"""The optimizer and what it is given: the parameter groups (which weights decay), the learning rate of each step,
and the AdamW the trainer builds (``build_optimizer``: xmoe's Triton AdamW where it applies, else torch's)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
from torch import nn

from xmoe.config import TrainConfig
from xmoe.moe.weights import CopyWriter


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices (and expert weight stacks); never norms or other 1-D parameters."""
    decay: list[torch.Tensor] = []
    no_decay: list[torch.Tensor] = []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def lr_at(step: int, t: TrainConfig) -> float:
    """Linear warm-up to lr over warmup_steps, then cosine decay to lr * min_lr_ratio at the last step."""
    if step <= t.warmup_steps:
        return t.lr * step / max(1, t.warmup_steps)
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def steppable(p: torch.Tensor) -> bool:
    """Whether TritonAdamW can step ``p``: a contiguous fp32 plain tensor (not a DTensor)."""
    return p.dtype == torch.float32 and p.is_contiguous() and not hasattr(p, "to_local")


class TritonAdamW(torch.optim.AdamW):
    """torch's AdamW (the same hyperparameters, param groups, state and state_dict, so checkpoints load either
    way) whose step is one Triton pass per parameter (xmoe/kernels/adamw.py). It divides every gradient by the
    ``grad_scale`` tensor a caller sets (the clip's divisor, xmoe/train/step.py), as torch's fused AdamW does, but
    without writing the divided gradient back: 28 bytes per parameter where torch's fused kernel moves 32. With
    ``copies``, (parameter, writer) pairs given once (xmoe/parallel/build.py: BuiltModel.copy_writers), it also
    writes those parameters' compute copies for the next step in the same pass (the routed experts' bf16 casts,
    or FP8 experts' FP8 copies in both layouts: xmoe/moe/weights.py); each writer is matched to its parameter
    here, once. Plain fp32 tensors on a GPU (or on CPU under Triton's interpreter); no amsgrad, maximize or
    found_inf. The step count lives on the host (a CPU tensor, as in torch's default AdamW), so a step reads
    nothing from the device."""

    def __init__(
        self,
        params,
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        copies: Sequence[tuple[torch.Tensor, CopyWriter]] = (),
    ):
        self.copies = list(copies)
        self._writers: list[list[CopyWriter | None]] = []  # each group's, in the order of its params
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
        for group in self.param_groups:
            for p in group["params"]:
                if not steppable(p):
                    raise ValueError(
                        f"TritonAdamW steps contiguous fp32 plain tensors; got {p.dtype} of shape "
                        f"{tuple(p.shape)}{' (a DTensor)' if hasattr(p, 'to_local') else ''}: use torch.optim.AdamW"
                    )
        unmatched = len(self.copies) - sum(w is not None for writers in self._writers for w in writers)
        if unmatched:
            raise ValueError(
                f"TritonAdamW got copy writers of {unmatched} tensors it does not step: pass the pairs of the model "
                "whose parameters it steps (build_model's BuiltModel.copy_writers)"
            )

    def add_param_group(self, param_group: dict) -> None:
        """torch's, and the group's copy writers matched to its parameters (by identity, once)."""
        super().add_param_group(param_group)
        params = self.param_groups[-1]["params"]
        self._writers.append([next((w for q, w in self.copies if q is p), None) for p in params])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if getattr(self, "found_inf", None) is not None:
            raise ValueError("TritonAdamW does not skip on found_inf (a loss scaler's); use torch.optim.AdamW")
        divisor = getattr(self, "grad_scale", None)
        for group, writers in zip(self.param_groups, self._writers, strict=True):
            if group["amsgrad"] or group["maximize"]:
                raise ValueError("TritonAdamW has no amsgrad or maximize; use torch.optim.AdamW")
            for p, writer in zip(group["params"], writers, strict=True):
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                elif state["step"].device.type != "cpu":  # loaded from a fused AdamW's state: read once
                    state["step"] = state["step"].detach().to("cpu", torch.float32)
                state["step"] += 1
                update = functools.partial(_update, p, p.grad, state, group, divisor)
                if writer is None:
                    update()
                else:  # the pass also writes p's next compute copy, into the target the writer gives
                    writer(update)
        return loss


def _update(
    p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, divisor: torch.Tensor | None, copy=None
) -> None:
    """TritonAdamW's pass over one parameter (its step counted up already), writing its next compute copy into
    ``copy`` where given (a tensor, or an fp8_quant.BlockCopy)."""
    from xmoe.kernels.adamw import adamw_update

    beta1, beta2 = group["betas"]
    adamw_update(
        p,
        grad if grad.is_contiguous() else grad.contiguous(),
        state["exp_avg"],
        state["exp_avg_sq"],
        step=int(state["step"].item()),
        lr=float(group["lr"]),
        beta1=beta1,
        beta2=beta2,
        eps=group["eps"],
        weight_decay=group["weight_decay"],
        divisor=divisor,
        copy=copy,
    )


def _check_triton_choice(params: list[torch.Tensor], plain: bool, device: torch.device) -> None:
    """train.optimizer = "triton" refused, saying why, where xmoe's AdamW cannot step these parameters here."""
    from xmoe.kernels._common import interpreting

    if not plain:
        sharded = any(hasattr(p, "to_local") for p in params)
        what = "DTensors (FSDP2, expert or tensor parallelism)" if sharded else "other dtypes or layouts"
        raise ValueError(
            f"train.optimizer='triton' steps contiguous fp32 plain tensors, and this run's parameters include "
            f"{what}: use train.optimizer='auto' or 'torch'"
        )
    if device.type != "cuda" and not interpreting():
        raise ValueError(
            f"train.optimizer='triton' runs on a GPU (or CPU tensors under TRITON_INTERPRET=1), not on "
            f"{device.type}: use train.optimizer='auto' or 'torch'"
        )


def build_optimizer(
    groups: list[dict],
    device: torch.device,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    backend: str,
    copies: Sequence[tuple[torch.Tensor, CopyWriter]] = (),
    choice: str = "auto",
) -> torch.optim.Optimizer:
    """The trainer's AdamW (``choice``: train.optimizer). "auto": ``TritonAdamW`` on a GPU with the Triton backend
    (``backend``: the run's moe.kernel_backend as resolved for ``device``, "torch" or "triton": its KernelChoice's)
    and plain tensors (one process, or DDP), else torch's (fused on a GPU: FSDP2 and expert parallelism hold
    DTensors). "torch": torch's. "triton": xmoe's, or a ValueError saying why it cannot step these parameters
    here. ``copies`` (BuiltModel.copy_writers) only reach the Triton one."""

    if backend not in ("torch", "triton"):  # a setting such as "auto" is resolved once, by the caller's choice
        raise ValueError(f"backend ({backend!r}) must be a resolved one, 'torch' or 'triton' (KernelChoice.backend)")
    params = [p for g in groups for p in g["params"]]
    plain = all(steppable(p) for p in params)
    if choice == "triton":
        _check_triton_choice(params, plain, device)
    elif choice not in ("auto", "torch"):
        raise ValueError(f"optimizer choice ({choice!r}) must be 'auto', 'torch' or 'triton'")
    auto = choice == "auto" and device.type == "cuda" and plain and backend == "triton"
    optimizer: torch.optim.Optimizer
    if choice == "triton" or auto:
        optimizer = TritonAdamW(groups, lr=lr, betas=betas, copies=copies)
    else:
        optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, fused=device.type == "cuda")
    # a loaded state's groups bring the saving optimizer's fused / foreach flags (a checkpoint of one GPU's
    # TritonAdamW resumed under FSDP2 would turn torch's fused AdamW into its per-tensor loop): keep this one's
    flags = [(group.get("fused"), group.get("foreach")) for group in optimizer.param_groups]

    def keep_implementation(loaded: torch.optim.Optimizer) -> None:
        for group, (fused, foreach) in zip(loaded.param_groups, flags, strict=True):
            group["fused"], group["foreach"] = fused, foreach

    optimizer.register_load_state_dict_post_hook(keep_implementation)
    return optimizer


def describe_optimizer(optimizer: torch.optim.Optimizer) -> str:
    """What a run's header says of its optimizer."""
    if isinstance(optimizer, TritonAdamW):
        kinds = sorted({writer.kind for _, writer in optimizer.copies}, key=lambda kind: (kind == "FP8", kind))
        writes = f" (writes the experts' next {' and '.join(kinds)} copies)" if kinds else ""
        return "optimizer xmoe Triton AdamW" + writes
    fused = all(group.get("fused") for group in optimizer.param_groups)
    return f"optimizer torch {type(optimizer).__name__}{' (fused)' if fused else ''}"
