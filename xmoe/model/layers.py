"""Pieces every block uses: RMSNorm and rotary position tables.

Legend: B batch, S sequence, N heads, D head (rotary) dim.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from xmoe.config import ModelConfig, yarn_mscale


def yarn_inv_freq(inv_freq_D2: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071), as Hugging Face computes it: (inverse frequencies, cos/sin magnitude).

    1. frequencies that turn fewer than beta_slow times over the original context are interpolated (divided by
       the factor), those that turn more than beta_fast times are kept, a linear ramp over the feature index
       (bounds floored / ceiled) blends the two in between;
    2. cos and sin are scaled by yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim), or
       yarn_mscale(factor) without those two.
    """
    dim, base, factor = 2 * inv_freq_D2.numel(), cfg.rope_theta, cfg.rope_factor

    def correction_dim(rotations: float) -> float:
        return dim * math.log(cfg.rope_original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(cfg.rope_beta_fast)), 0)
    high = min(math.ceil(correction_dim(cfg.rope_beta_slow)), dim - 1)
    ramp_D2 = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    keep_D2 = 1 - ramp_D2  # 1: extrapolate (keep the frequency), 0: interpolate
    inv_freq_D2 = inv_freq_D2 / factor * (1 - keep_D2) + inv_freq_D2 * keep_D2
    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        magnitude = yarn_mscale(factor, cfg.rope_mscale) / yarn_mscale(factor, cfg.rope_mscale_all_dim)
    else:
        magnitude = yarn_mscale(factor)
    return inv_freq_D2, magnitude


def rope_tables(
    seq_len: int, head_dim: int, theta: float, device=None, cfg: ModelConfig | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (seq_len, head_dim // 2), fp32; with ``cfg.rope_scaling == "yarn"``, YaRN's.

    Angles are formed in float64 and rounded once to fp32: at position 4096 an fp32 product already errs by
    ~2e-4 rad, float64 costs nothing for a one-off table.
    """
    inv_freq_D2 = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    magnitude = 1.0
    if cfg is not None and cfg.rope_scaling == "yarn":
        inv_freq_D2, magnitude = yarn_inv_freq(inv_freq_D2, cfg)
    angles_SD2 = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq_D2)
    return (
        (angles_SD2.cos() * magnitude).to(device, torch.float32),
        (angles_SD2.sin() * magnitude).to(device, torch.float32),
    )


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
