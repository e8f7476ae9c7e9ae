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
Losses (over real tokens only, xmoe/moe/balance.py, which has the formulas):
  load balance   coef * sum_e f_e * P_e, f_e = E/(K*n) * count_e and P_e = mean_t p_e over a group of n real tokens:
                 each sequence ("sequence"), this forward ("micro_batch"), or, inside an optimizer step, the step's
                 micro-batches on every rank ("global"); p = scores, normalised per token when score_func is sigmoid.
                 Equals coef when routing is perfectly uniform.
  z-loss         coef * mean over real tokens of logsumexp(logits_t)^2
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
from xmoe.kernels.choice import Kernels, resolve_kernels
from xmoe.moe.balance import GlobalCounts, balance_probs, global_balance_loss, group_balance_loss, real_counts, z_loss
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
    real_counts_E: torch.Tensor  # int64 routed slots per expert of the real tokens (counts_E itself when all are)


class Router(nn.Module):
    """``kernels``: the layer's (xmoe/kernels/choice.py), whose backend may fuse the selection (``router_topk``);
    None: resolved for ``cfg.kernel_backend`` on the default device under the environment's kernels section."""

    expert_bias: torch.Tensor  # a buffer (register_buffer below)

    def __init__(self, cfg: MoEConfig, kernels: Kernels | None = None):
        super().__init__()
        self.cfg = cfg
        self.kernels = kernels if kernels is not None else resolve_kernels(cfg.kernel_backend)
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

    def forward(
        self,
        x_TH: torch.Tensor,
        num_sequences: int = 1,
        valid_T: torch.Tensor | None = None,
        global_counts: GlobalCounts | None = None,
    ) -> RouterOutput:
        """Route ``x_TH``, ``num_sequences`` equal sequences of tokens. ``valid_T``: which tokens are real (None:
        all); ``global_counts``: the optimizer step's counts, for the "global" balance scope (None outside a step:
        the forward's own tokens are the scope, as "micro_batch")."""
        cfg = self.cfg
        with torch.autocast(device_type=x_TH.device.type, enabled=False):
            logits_TE = F.linear(x_TH.float(), self.weight.float())
        # The Triton backend ("triton", or "auto" on a GPU) fuses scores, selection and weights in one kernel each
        # way (kernels/router_topk.py) within its limits (router_topk_supports); the torch path below is the
        # reference and the fallback (its speed against the torch path: benchmarks/results/layer/bench_router.md); the
        # kernel has no node limit.
        ops = self.kernels.ops
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
        real_E = counts_E if valid_T is None else real_counts(ids_TK, valid_T, cfg.num_experts)
        aux_loss, z = self._losses(logits_TE, scores_TE, ids_TK, real_E, num_sequences, valid_T, global_counts)
        return RouterOutput(weights_TK, ids_TK, scores_TK.detach(), aux_loss, z, counts_E, real_E)

    def _losses(
        self,
        logits_TE: torch.Tensor,
        scores_TE: torch.Tensor | None,
        ids_TK: torch.Tensor,
        real_E: torch.Tensor,
        num_sequences: int,
        valid_T: torch.Tensor | None,
        global_counts: GlobalCounts | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(balance loss, z-loss) over the real tokens, each times its coefficient (moe/balance.py)."""
        cfg = self.cfg
        zero = logits_TE.new_zeros(())
        num_tokens = logits_TE.shape[0]
        aux_loss = z = zero
        probs_TE = balance_probs(scores_TE, cfg.score_func) if scores_TE is not None else None
        if cfg.balance_scope == "global" and global_counts is not None:
            # collective (even with no tokens): this micro-batch's counts over every rank; the z-loss is then the
            # mean over every rank's real tokens too
            micro_E1 = global_counts.over_ranks(real_E, valid_T, num_tokens)
            if cfg.aux_loss_coef > 0:
                assert probs_TE is not None  # both paths compute the scores whenever the balance loss is on
                aux_loss = global_balance_loss(probs_TE, valid_T, micro_E1, global_counts, cfg)
            if cfg.z_loss_coef > 0:
                z = z_loss(logits_TE, valid_T, cfg.z_loss_coef, global_counts.mean_real(micro_E1, logits_TE.dtype))
            return aux_loss, z
        if num_tokens == 0:  # a rank's empty shard: no loss rather than 0 / 0
            return aux_loss, z
        if cfg.aux_loss_coef > 0:
            assert probs_TE is not None
            groups = num_sequences if cfg.balance_scope == "sequence" else 1
            aux_loss = group_balance_loss(probs_TE, ids_TK, valid_T, groups, cfg)
        if cfg.z_loss_coef > 0:
            z = z_loss(logits_TE, valid_T, cfg.z_loss_coef)
        return aux_loss, z

    @torch.no_grad()
    def update_bias(self, load_E: torch.Tensor) -> None:
        """One auxiliary-loss-free balancing step from ``load_E``, the routed slots per expert of an optimizer step
        (summed over all ranks, so that the bias stays identical everywhere); nothing when bias_update_rate is 0."""
        if self.cfg.bias_update_rate <= 0:
            return
        self.expert_bias += self.cfg.bias_update_rate * torch.sign(load_E.mean() - load_E)
