"""The router: fp32 scores, (group-limited) top-k selection, combine weights and the auxiliary losses.

# T tokens, H hidden, E experts, K top-k, G expert groups, B sequences, S tokens per sequence

Formulas (all in fp32 whatever the activation dtype):
  logits = x @ weight.T                            (T, E)
  scores = softmax(logits) | sigmoid(logits)        (T, E)
  choice = scores + expert_bias                     only for selection (auxiliary-loss-free balancing)
  group-limited: group score = max of the group's choice (softmax, as DeepSeek-V2) or the sum of its top-2
      (sigmoid, as DeepSeek-V3); experts outside the best ``topk_groups`` groups are not eligible
  node-limited (``node_limit`` set from outside under expert parallelism, moe/node_limit.py): node score = the sum
      of the node's top ceil(K / M) choice values; only experts of the M best nodes are eligible, before the groups
  ids = top-k of choice; weights = scores[ids] (/ their sum if norm_topk_prob) * routed_scaling_factor
Losses:
  load balance   coef * E/(K*S) * sum_e count_e * mean_t p_e   per sequence ("seq", DeepSeek-V3's complementary
                 sequence-wise loss) or over the whole batch ("batch", S = T); p = scores, normalised per token
                 when score_func is sigmoid. Equals coef when routing is perfectly uniform.
  z-loss         coef * mean_t logsumexp(logits_t)^2
Aux-loss-free balancing: ``update_bias(load_E)`` moves each bias by rate * sign(mean - load), once per optimizer
step from the step's routed counts summed over all ranks (xmoe/moe/step.py, MoEStep.finish).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from xmoe.config import MoEConfig
from xmoe.dispatch.routing import count_ids
from xmoe.kernels import get_ops
from xmoe.moe.node_limit import NodeLimit


class RouterOutput(NamedTuple):
    """What the router returns. A NamedTuple, not a dataclass: wrappers find the tensors of a module's output by
    pytree flattening, where a dataclass is one opaque leaf. FSDP2 hooks those tensors to gather the router's weight
    again before its backward; with a dataclass, torch 2.11's FSDP2 found none, and a GPU step without recompute
    failed in the router's backward (on storage freed after forward)."""

    weights_TK: torch.Tensor  # fp32 combine weights of the selected experts
    expert_ids_TK: torch.Tensor  # int64
    scores_TK: torch.Tensor  # fp32 raw scores of the selected experts (the capacity rule ranks by these)
    aux_loss: torch.Tensor  # fp32 scalar, already multiplied by its coefficient
    z_loss: torch.Tensor  # fp32 scalar, already multiplied by its coefficient
    counts_E: torch.Tensor  # int64 routed slots per expert (before capacity dropping)


class Router(nn.Module):
    expert_bias: torch.Tensor  # a buffer (register_buffer below)

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        # persistent: checkpoints (DCP) save and restore it with the weights
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
        # node-limited routing's tables, installed with the expert-parallel layout (parallel/expert_parallel.py); an
        # attribute, not a buffer: a checkpoint does not carry a layout (another one may load it)
        self.node_limit: NodeLimit | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.cfg.init_std)

    def _select(self, choice_TE: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        if self.node_limit is not None:  # nodes first; groups (inside nodes) then choose among the eligible ones
            choice_TE = self.node_limit.restrict(choice_TE)
        if cfg.num_expert_groups > 1:
            num_tokens = choice_TE.shape[0]
            grouped_TGe = choice_TE.view(num_tokens, cfg.num_expert_groups, -1)
            if cfg.score_func == "sigmoid" and grouped_TGe.shape[-1] >= 2:
                group_score_TG = grouped_TGe.topk(2, dim=-1).values.sum(-1)
            else:
                group_score_TG = grouped_TGe.max(dim=-1).values
            best_TG = group_score_TG.topk(cfg.topk_groups, dim=-1).indices
            allowed_TG = torch.zeros_like(group_score_TG, dtype=torch.bool).scatter_(1, best_TG, True)
            choice_TE = grouped_TGe.masked_fill(~allowed_TG[..., None], float("-inf")).view(num_tokens, -1)
        return choice_TE.topk(cfg.top_k, dim=-1).indices

    def _scores(self, logits_TE: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits_TE, dim=-1) if self.cfg.score_func == "softmax" else torch.sigmoid(logits_TE)

    def forward(self, x_TH: torch.Tensor, num_sequences: int = 1) -> RouterOutput:
        cfg = self.cfg
        with torch.autocast(device_type=x_TH.device.type, enabled=False):
            logits_TE = F.linear(x_TH.float(), self.weight.float())
        # The Triton backend ("triton", or "auto" on a GPU) fuses scores, selection and weights in one kernel each
        # way (kernels/router_topk.py) within its limits (router_topk_supports); the torch path below is the
        # reference and the fallback (its speed against the torch path: benchmarks/results/bench_router.md); the
        # kernel has no node limit.
        ops = get_ops(cfg.kernel_backend, logits_TE.device)
        kernel = self.node_limit is None and hasattr(ops, "router_topk")
        if kernel and ops.router_topk_supports(cfg.num_experts, cfg.top_k, cfg.num_expert_groups):
            weights_TK, ids_TK, scores_TK = ops.router_topk(
                logits_TE, self.expert_bias, cfg.top_k, cfg.score_func, cfg.norm_topk_prob, cfg.routed_scaling_factor
            )
            # the balance loss gets its own scores: its gradient reaches logits_TE through them, the weights'
            # through the kernel's backward, so neither is counted twice
            scores_TE = self._scores(logits_TE) if cfg.aux_loss_coef > 0 else None
        else:
            scores_TE = self._scores(logits_TE)
            ids_TK = self._select(scores_TE.detach() + self.expert_bias)
            scores_TK = scores_TE.gather(1, ids_TK)
            weights_TK = scores_TK
            if cfg.norm_topk_prob:
                weights_TK = weights_TK / (weights_TK.sum(-1, keepdim=True) + 1e-20)
            weights_TK = weights_TK * cfg.routed_scaling_factor

        counts_E = count_ids(ids_TK, cfg.num_experts)
        zero = logits_TE.new_zeros(())
        empty = logits_TE.shape[0] == 0  # no tokens (a rank's empty shard): no loss rather than 0 / 0
        aux_loss = zero
        if cfg.aux_loss_coef > 0 and not empty:
            assert scores_TE is not None  # both paths compute the scores whenever the balance loss is on
            aux_loss = self._balance_loss(scores_TE, ids_TK, num_sequences)
        z_loss = (
            cfg.z_loss_coef * torch.logsumexp(logits_TE, dim=-1).square().mean()
            if cfg.z_loss_coef > 0 and not empty
            else zero
        )
        return RouterOutput(weights_TK, ids_TK, scores_TK.detach(), aux_loss, z_loss, counts_E)

    def _balance_loss(self, scores_TE: torch.Tensor, ids_TK: torch.Tensor, num_sequences: int) -> torch.Tensor:
        cfg = self.cfg
        num_tokens, num_experts = scores_TE.shape
        if cfg.aux_loss_type == "batch" or num_sequences <= 1:
            num_sequences = 1
        elif num_tokens % num_sequences:
            raise ValueError(f"{num_tokens} tokens do not split into {num_sequences} equal sequences")
        seq_len = num_tokens // num_sequences
        probs_TE = scores_TE
        if cfg.score_func == "sigmoid":
            probs_TE = scores_TE / (scores_TE.sum(-1, keepdim=True) + 1e-20)
        mean_prob_BE = probs_TE.view(num_sequences, seq_len, num_experts).mean(1)
        seq_of_slot = torch.arange(num_tokens, device=ids_TK.device).div(seq_len, rounding_mode="floor")
        flat = (seq_of_slot[:, None] * num_experts + ids_TK).reshape(-1)
        counts_BE = count_ids(flat, num_sequences * num_experts).view(num_sequences, num_experts)
        frac_BE = counts_BE.float() * (num_experts / (cfg.top_k * seq_len))
        return cfg.aux_loss_coef * (frac_BE * mean_prob_BE).sum(-1).mean()

    @torch.no_grad()
    def update_bias(self, load_E: torch.Tensor) -> None:
        """One auxiliary-loss-free balancing step from ``load_E``, the routed slots per expert of an optimizer step
        (summed over all ranks, so that the bias stays identical everywhere); nothing when bias_update_rate is 0."""
        if self.cfg.bias_update_rate <= 0:
            return
        self.expert_bias += self.cfg.bias_update_rate * torch.sign(load_E.mean() - load_E)
