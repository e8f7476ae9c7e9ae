"""Node-limited routing: each token's K experts drawn from at most M nodes of its expert-parallel group as placed.

# T tokens, E experts, K top-k, M max nodes per token, N_g nodes holding the EP group's experts, e_n experts per node

The rule (DeepSeek-V3's; xmoe/plan/node_limit.py models the same rule for the planner), on the router's selection
scores (choice = scores + expert_bias):
  1. a node's score for a token = the sum of the ceil(K / M) largest choice values among the node's experts
  2. the token's M best nodes are eligible; every other node's experts are masked to -inf
  3. group-limited routing, where configured, then picks its ``topk_groups`` groups among the eligible nodes' groups
     (each group must lie inside one node: a group's score is then -inf exactly when its node is not eligible)
  4. top-K of what is left (Router._select)
The combine weights are the chosen experts' scores as without the limit, and the balance losses are unchanged.

The node of each expert comes from outside (xmoe/parallel/expert_parallel.py, from the EP group's ranks and the
launcher's node numbering): it is a layout, not model state, so it is an attribute of the router, never saved in a
checkpoint (which another layout may load). Without one (one process, ep == 1) nothing is limited.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch

from xmoe.config import MoEConfig


class NodeLimit:
    """The rule's tables for one layout: ``nodes_NE[n]`` the experts of node n (sorted), ``max_nodes`` M."""

    def __init__(self, node_of_expert: Sequence[int], max_nodes: int, top_k: int):
        labels = sorted(set(node_of_expert))
        self.node_of_expert = [labels.index(n) for n in node_of_expert]  # compact: nodes 0 .. N_g - 1
        self.nodes_NE = [[e for e, n in enumerate(self.node_of_expert) if n == m] for m in range(len(labels))]
        self.max_nodes = max_nodes
        self.per_node = math.ceil(top_k / max_nodes)  # <= e_n: checked by node_limit()
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def num_nodes(self) -> int:
        return len(self.nodes_NE)

    def _device_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(nodes_NE, node_of_expert_E) on ``device``, copied there once (a copy per call would cost a sync)."""
        if device not in self._tables:
            self._tables[device] = (
                torch.tensor(self.nodes_NE, dtype=torch.long).to(device),
                torch.tensor(self.node_of_expert, dtype=torch.long).to(device),
            )
        return self._tables[device]

    def restrict(self, choice_TE: torch.Tensor) -> torch.Tensor:
        """Steps 1-2: ``choice_TE`` with the experts outside each token's M best nodes set to -inf."""
        nodes_NE, node_of_E = self._device_tables(choice_TE.device)
        by_node_TNe = choice_TE[:, nodes_NE]
        node_score_TN = by_node_TNe.topk(self.per_node, dim=-1).values.sum(-1)
        best_TM = node_score_TN.topk(self.max_nodes, dim=-1).indices
        eligible_TN = torch.zeros_like(node_score_TN, dtype=torch.bool).scatter_(1, best_TM, True)
        return choice_TE.masked_fill(~eligible_TN[:, node_of_E], float("-inf"))


def node_limit(cfg: MoEConfig, node_of_expert: Sequence[int]) -> NodeLimit | None:
    """The node limit of ``cfg.max_nodes_per_token`` on a layout (``node_of_expert[e]``: the node of expert e), or
    None where it is off or cannot bind (one node, or M at least the nodes: said in a warning). Layouts the rule
    cannot align are refused with the fix: experts split unevenly over the nodes, K > M x experts per node, expert
    groups (num_expert_groups) that straddle nodes."""
    max_nodes, top_k = cfg.max_nodes_per_token, cfg.top_k
    if max_nodes == 0:
        return None
    if len(node_of_expert) != cfg.num_experts:
        raise ValueError(f"node_of_expert has {len(node_of_expert)} entries for {cfg.num_experts} experts")
    limit = NodeLimit(node_of_expert, max_nodes, top_k)
    per_node = {n: len(experts) for n, experts in enumerate(limit.nodes_NE)}
    if len(set(per_node.values())) != 1:
        raise ValueError(
            f"max_nodes_per_token ({max_nodes}): the experts split unevenly over the expert-parallel group's nodes "
            f"(experts per node: {per_node}), so nodes cannot be compared; give every node the same number of the "
            "group's ranks (ep * tp a multiple or a divisor of --gpus-per-node), or set max_nodes_per_token 0"
        )
    experts_per_node = per_node[0]
    if top_k > max_nodes * experts_per_node:
        raise ValueError(
            f"top_k ({top_k}) > max_nodes_per_token ({max_nodes}) x experts per node ({experts_per_node}): a token "
            f"cannot find its {top_k} experts on {max_nodes} node(s); raise max_nodes_per_token"
        )
    if limit.num_nodes <= max_nodes:
        where = "one node" if limit.num_nodes == 1 else f"{limit.num_nodes} nodes"
        warnings.warn(
            f"max_nodes_per_token ({max_nodes}) does nothing here: the expert-parallel group's experts live on "
            f"{where}, so no token can reach more; it limits routing where the group spans more than {max_nodes} "
            "nodes",
            stacklevel=2,
        )
        return None
    if cfg.num_expert_groups > 1:
        size = cfg.num_experts // cfg.num_expert_groups
        straddling = [
            g
            for g in range(cfg.num_expert_groups)
            if len({limit.node_of_expert[e] for e in range(g * size, (g + 1) * size)}) > 1
        ]
        if straddling:
            raise ValueError(
                f"max_nodes_per_token ({max_nodes}) with group-limited routing needs each expert group inside one "
                f"node; group(s) {straddling[:4]} of {size} experts straddle nodes of {experts_per_node} experts: "
                "choose num_expert_groups a multiple of the group's nodes, or num_expert_groups 1"
            )
    return limit
