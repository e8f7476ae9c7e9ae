"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437, section 2.2): D sequential modules after the model, the
one of depth d predicting the token d + 1 positions ahead of each input.

# B sequences, S positions, H hidden, V vocabulary, D depths

Module d (1-based) keeps the complete causal chain:

    h^0         = the main model's final hidden state (after its final RMSNorm: what the head reads)
    x^d_i       = eh_proj([enorm(Emb(t_{i+d})) ; hnorm(h^{d-1}_i)])        eh_proj: (H, 2H), no bias
    h^d         = norm_d(Block_d(x^d))                                     one block of the model's last layer's
                                                                           kind (DeepSeek-V3: MoE), own final norm
    P^d_i       = softmax(head(h^d_i)), the distribution of t_{i+d+1}

with t_j the input token at position j, the embedding and the head the main model's (shared, trained by every
depth), and each block's attention causal over the depth's positions (inside documents with ``segments_BS``). The
order of the concatenation (embedding first) and the norm after each block are those of the published DeepSeek-V3
checkpoints (Hugging Face: ``model.layers.{num_hidden_layers + d - 1}.{enorm, hnorm, eh_proj, shared_head.norm}``).

Every depth runs over all S positions: the embeddings of the tokens d ahead are the main embedding's output shifted
left by d, so the block sees the shapes of the main blocks (compiled regions and the batch's document mask are
shared) and the last d positions, which have no token d ahead, hold the first tokens of the row instead. Attention
is causal, so those positions change nothing before them; their targets are ignored.

Loss (``Transformer.forward`` with targets, in training mode):

    L_d   = mean over positions i with a target at depth d of -log P^d_i[t_{i+d+1}]
    L_MTP = mtp_loss_weight / D * sum_{d=1..D} L_d

A position has a target at depth d when its main target d positions later (``targets[i + d]``) is not ignored and,
with documents, input i + d is in i's document. DeepSeek-V3 writes L_d = -1/T sum_{i=2+d}^{T+1} log P^d_i[t_i] (it
divides by the sequence length T, where xmoe divides by the T - d targets a depth has), and the same weighted mean
over depths (lambda = 0.3, then 0.1). The training objective is L_main + L_MTP; ``Transformer.forward`` returns the
value of L_main with L_MTP's gradient attached (as the MoE auxiliary losses are), and keeps L_MTP's value for the
trainer's log (``Transformer.take_mtp_loss``). Generation and evaluation (eval mode) run no MTP module.
"""

from __future__ import annotations

import torch
from torch import nn

from xmoe.config import ModelConfig
from xmoe.model.documents import Documents
from xmoe.model.layers import RMSNorm
from xmoe.model.loss import IGNORE_INDEX


class MTPModule(nn.Module):
    """One depth: ``enorm``, ``hnorm``, ``eh_proj`` (2H -> H), ``block`` (a transformer Block built by the caller:
    Transformer holds the Block class), ``norm`` (the depth's final RMSNorm, before the shared head)."""

    def __init__(self, cfg: ModelConfig, block: nn.Module) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.enorm = RMSNorm(H, cfg.norm_eps)
        self.hnorm = RMSNorm(H, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.block = block
        self.norm = RMSNorm(H, cfg.norm_eps)

    def forward(
        self,
        h_prev_BSH: torch.Tensor,
        ahead_BSH: torch.Tensor,
        cos_SD2: torch.Tensor,
        sin_SD2: torch.Tensor,
        docs: Documents | None = None,
    ) -> torch.Tensor:
        """h^d from h^{d-1} (``h_prev_BSH``) and the embeddings of the tokens d ahead (``ahead_BSH``)."""
        x_BSH = self.eh_proj(torch.cat((self.enorm(ahead_BSH), self.hnorm(h_prev_BSH)), dim=-1))
        if docs is None:
            return self.norm(self.block(x_BSH, cos_SD2, sin_SD2))
        return self.norm(self.block(x_BSH, cos_SD2, sin_SD2, docs=docs))


def shift_left(x_BS: torch.Tensor, d: int) -> torch.Tensor:
    """Position i holds position i + d's value; the last d positions hold the row's first d (rolled round)."""
    return x_BS.roll(-d, dims=1)


def depth_targets(targets_BS: torch.Tensor, d: int, segments_BS: torch.Tensor | None = None) -> torch.Tensor:
    """Depth d's targets: t_{i+d+1} = ``targets[i + d]`` where position i has one (module docstring), else ignored."""
    S = targets_BS.shape[1]
    ahead_BS = shift_left(targets_BS, d)
    keep_BS = torch.arange(S, device=targets_BS.device) < S - d
    if segments_BS is not None:
        keep_BS = keep_BS & (shift_left(segments_BS, d) == segments_BS)
    return torch.where(keep_BS, ahead_BS, IGNORE_INDEX)
