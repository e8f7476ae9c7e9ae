"""Pieces every block uses: RMSNorm and rotary position tables.

Legend: B batch, S sequence, N heads, D head (rotary) dim.
"""

from __future__ import annotations

import torch
from torch import nn


def rope_tables(seq_len: int, head_dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (seq_len, head_dim // 2), fp32.

    Angles are formed in float64 and rounded once to fp32: at position 4096 an fp32 product already errs by
    ~2e-4 rad, float64 costs nothing for a one-off table.
    """
    inv_freq_D2 = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles_SD2 = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq_D2)
    return angles_SD2.cos().to(device, torch.float32), angles_SD2.sin().to(device, torch.float32)


def apply_rotary(x_BNSD: torch.Tensor, cos_SD2: torch.Tensor, sin_SD2: torch.Tensor) -> torch.Tensor:
    """Rotate feature pairs (j, j + D/2) of every position s by angle s * theta^(-2j/D).

    Math runs in fp32 (or wider when the input is wider) whatever the activation dtype.
    """
    compute_dtype = torch.promote_types(x_BNSD.dtype, torch.float32)
    x1, x2 = x_BNSD.to(compute_dtype).chunk(2, dim=-1)
    cos, sin = cos_SD2.to(compute_dtype), sin_SD2.to(compute_dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x_BNSD.dtype)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, normalised in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_f = x.float()
        x_f = x_f * torch.rsqrt(x_f.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x_f * self.weight.float()).to(x.dtype)
