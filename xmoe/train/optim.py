"""What the optimizer is given: the parameter groups (which weights decay) and the learning rate of each step."""

from __future__ import annotations

import math

import torch
from torch import nn

from xmoe.config import TrainConfig


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
