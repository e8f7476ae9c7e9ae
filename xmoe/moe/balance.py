"""The auxiliary losses over real tokens, in each balance scope, and the global scope's running counts.

# T tokens, E experts, K top-k, G groups of tokens balanced together (sequences), L tokens per group

A real token is one whose target the LM loss counts: the training step marks them (``MoEStep.set_real_tokens``,
``targets != IGNORE_INDEX``), and ``valid_T`` carries the mark to the router (None: every token is real). Padding
and positions without a target add nothing to an expert's load, to its mean probability or to the z-loss.

Over a group g of n_g real tokens, with c_ge the real slots routed to expert e and p_t the token's scores
(renormalised to sum to 1 for sigmoid scores):

    f_ge = E / (K * n_g) * c_ge              (1 for every expert when routing is uniform)
    P_ge = (1 / n_g) * sum_{t in g} p_te
    balance loss = coef * mean over groups with n_g > 0 of sum_e f_ge * P_ge

  "sequence"      g = each sequence of the layer's (B, S, H) input (DeepSeek-V3's complementary sequence-wise loss)
  "micro_batch"   g = the tokens of one forward on one rank (the Switch / GShard loss as most frameworks compute it)
  "global"        f from every real token of the optimizer step on every rank (``GlobalCounts``), P over this
                  micro-batch; the module docstring of xmoe/moe/step.py and docs/routing.md give the scheme
z-loss = coef * (1 / n) * sum over the n real tokens of logsumexp(logits_t)^2, per forward; under "global" n is the
micro-batch's real tokens on every rank, each rank's sum weighted by W / n as the balance loss's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from xmoe.config import MoEConfig
from xmoe.dispatch.routing import count_ids


def balance_probs(scores_TE: torch.Tensor, score_func: str) -> torch.Tensor:
    """The per-token distributions the balance loss averages: softmax scores as they are, sigmoid scores divided by
    their sum."""
    if score_func == "sigmoid":
        return scores_TE / (scores_TE.sum(-1, keepdim=True) + 1e-20)
    return scores_TE


def real_counts(ids_TK: torch.Tensor, valid_T: torch.Tensor | None, num_experts: int) -> torch.Tensor:
    """int64 routed slots per expert of the real tokens (all tokens when ``valid_T`` is None)."""
    if valid_T is None:
        return count_ids(ids_TK, num_experts)
    spare_TK = torch.where(valid_T[:, None], ids_TK, num_experts)  # a padding token's slots go to a spare bin
    return count_ids(spare_TK, num_experts + 1)[:num_experts]


def group_balance_loss(
    probs_TE: torch.Tensor, ids_TK: torch.Tensor, valid_T: torch.Tensor | None, num_groups: int, cfg: MoEConfig
) -> torch.Tensor:
    """The balance loss over ``num_groups`` equal consecutive groups of the T tokens (the "sequence" and
    "micro_batch" scopes); 0 when no token is real."""
    num_tokens, num_experts = probs_TE.shape
    if num_tokens % num_groups:
        raise ValueError(f"{num_tokens} tokens do not split into {num_groups} equal sequences")
    group_len = num_tokens // num_groups
    group_T = torch.arange(num_tokens, device=ids_TK.device).div(group_len, rounding_mode="floor")
    slot_TK = torch.where(valid_T[:, None], ids_TK, num_experts) if valid_T is not None else ids_TK
    flat_TK = group_T[:, None] * (num_experts + 1) + slot_TK
    counts_GE = count_ids(flat_TK, num_groups * (num_experts + 1)).view(num_groups, -1)[:, :num_experts]
    if valid_T is None:
        real_G = torch.full((num_groups,), float(group_len), device=probs_TE.device)
        psum_GE = probs_TE.view(num_groups, group_len, num_experts).sum(1)
    else:
        weight_T = valid_T.to(probs_TE.dtype)
        real_G = weight_T.view(num_groups, group_len).sum(1)
        psum_GE = (probs_TE * weight_T[:, None]).view(num_groups, group_len, num_experts).sum(1)
    n_G = real_G.clamp(min=1.0)  # a group without real tokens has counts and sums of 0: it adds 0
    frac_GE = counts_GE.to(probs_TE.dtype) * (num_experts / cfg.top_k) / n_G[:, None]
    per_group_G = (frac_GE * (psum_GE / n_G[:, None])).sum(-1)
    groups = (real_G > 0).sum().clamp(min=1)
    return cfg.aux_loss_coef * per_group_G.sum() / groups


def z_loss(
    logits_TE: torch.Tensor, valid_T: torch.Tensor | None, coef: float, mean_real: torch.Tensor | None = None
) -> torch.Tensor:
    """coef * (sum over the real tokens of logsumexp(logits)^2) / ``mean_real`` (default: the number of real tokens,
    giving their mean; 0 when none is real)."""
    lse2_T = torch.logsumexp(logits_TE, dim=-1).square()
    if valid_T is not None:
        lse2_T = lse2_T * valid_T.to(lse2_T.dtype)
    if mean_real is None:
        real = valid_T.sum() if valid_T is not None else lse2_T.new_tensor(float(lse2_T.shape[0]))
        mean_real = real.to(lse2_T.dtype).clamp(min=1.0)
    return coef * (lse2_T.sum() / mean_real)


class GlobalCounts:
    """The "global" scope's counts for one MoE layer through one optimizer step (MoEStep makes one per layer).

    ``earlier_E1``: the real slots per expert, then the real tokens, of the step's finished micro-batches summed over
    all ranks (int64, exact). Each forward sums its own counts over the ranks (one all-reduce of E + 1 integers,
    ``over_ranks``) and keeps them as ``current_E1`` (a forward recomputed in backward sums the same again);
    ``end_micro_batch`` adds them to ``earlier_E1``.
    """

    def __init__(self, num_experts: int, device: torch.device):
        self.earlier_E1 = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
        self.current_E1: torch.Tensor | None = None
        self.world = dist.get_world_size() if dist.is_initialized() else 1

    def over_ranks(self, real_counts_E: torch.Tensor, valid_T: torch.Tensor | None, num_tokens: int) -> torch.Tensor:
        """This micro-batch's real slots per expert and real tokens (E + 1), summed over every rank (all of them
        route their own tokens), kept as ``current_E1``. Collective."""
        num_real = valid_T.sum().reshape(1) if valid_T is not None else real_counts_E.new_full((1,), num_tokens)
        total_E1 = torch.cat([real_counts_E, num_real.to(real_counts_E.dtype)])
        if self.world > 1:
            dist.all_reduce(total_E1)
        self.current_E1 = total_E1
        return total_E1

    def mean_real(self, micro_E1: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """N_a / W: the mean number of real tokens per rank in this micro-batch (at least 1 in all)."""
        return micro_E1[-1].to(dtype).clamp(min=1.0) / self.world

    def end_micro_batch(self) -> None:
        if self.current_E1 is not None:
            self.earlier_E1 += self.current_E1
            self.current_E1 = None


def global_balance_loss(
    probs_TE: torch.Tensor,
    valid_T: torch.Tensor | None,
    micro_E1: torch.Tensor,
    counts: GlobalCounts,
    cfg: MoEConfig,
) -> torch.Tensor:
    """This rank's share of the global balance loss of micro-batch a; ``micro_E1``: its counts over the ranks
    (``GlobalCounts.over_ranks``).

    With C_a, N_a this micro-batch's real slots per expert and real tokens summed over the W ranks, and C_<=a, N_<=a
    those of the step's micro-batches so far:

        f_e  = E / K * C_<=a,e / N_<=a                      (the step's frequencies, as far as they are known)
        loss = coef * sum_e f_e * (sum over this rank's real tokens of p_te) / (N_a / W)

    The mean of the W ranks' losses (what data parallelism's gradient average takes) is then coef * sum_e f_e * P_e
    with P_e the mean of p_e over the real tokens of micro-batch a on every rank: the one-process loss of all ranks'
    tokens. Each rank's real tokens weigh 1 / (N_a / W), the mean number of real tokens per rank, not 1 / n_rank.
    """
    num_experts = probs_TE.shape[1]
    step_E1 = counts.earlier_E1 + micro_E1
    step_real = step_E1[num_experts].to(probs_TE.dtype).clamp(min=1.0)
    freq_E = step_E1[:num_experts].to(probs_TE.dtype) * (num_experts / cfg.top_k) / step_real
    psum_E = (probs_TE * valid_T.to(probs_TE.dtype)[:, None]).sum(0) if valid_T is not None else probs_TE.sum(0)
    # the operations of group_balance_loss's in the same order: one process, one micro-batch gives its bits
    return cfg.aux_loss_coef * (freq_E * (psum_E / counts.mean_real(micro_E1, probs_TE.dtype))).sum()
