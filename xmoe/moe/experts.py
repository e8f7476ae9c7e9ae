"""Routed experts (grouped SwiGLU over uneven groups) and the dense SwiGLU used for shared experts.

# N rows, H hidden, F expert ffn, E experts held by this module, C capacity (padded baseline only)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xmoe.kernels import get_ops


def _local(w: torch.Tensor) -> torch.Tensor:
    """Under expert parallelism the weights are DTensors sharded over the EP ranks: compute on this rank's slice."""
    return w.to_local() if hasattr(w, "to_local") else w


class RoutedExperts(nn.Module):
    """E SwiGLU experts: y = (silu(x w1_e) * (x w3_e)) w2_e, weights w1/w3 (E, H, F) and w2 (E, F, H)."""

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, init_std: float = 0.02,
                 kernel_backend: str = "auto"):
        super().__init__()
        self.kernel_backend = kernel_backend
        self.init_std = init_std
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_size, ffn_hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in (self.w1, self.w3, self.w2):
            nn.init.normal_(w, std=self.init_std)

    def local_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, w3, w2) of the experts on this rank, in the compute dtype."""
        return tuple(_local(w).to(dtype) for w in (self.w1, self.w3, self.w2))

    def forward(self, x_NH: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        w1, w3, w2 = self.local_weights(x_NH.dtype)
        if x_NH.dim() == 3:  # the padded baseline: equal-capacity groups, one batched matmul per weight
            return torch.bmm(F.silu(torch.bmm(x_NH, w1)) * torch.bmm(x_NH, w3), w2)
        ops = get_ops(self.kernel_backend, x_NH.device)
        return ops.grouped_swiglu(x_NH, w1, w3, w2, tokens_per_expert_E)


class SwiGLU(nn.Module):
    """A dense SwiGLU FFN: w2(silu(w1 x) * w3 x). Shared experts are one of these, num_shared x ffn wide."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, init_std: float = 0.02):
        super().__init__()
        self.init_std = init_std
        self.w1 = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.w3 = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.w2 = nn.Linear(ffn_hidden_size, hidden_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for lin in (self.w1, self.w3, self.w2):
            nn.init.normal_(lin.weight, std=self.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
