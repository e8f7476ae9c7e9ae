"""Node-limited routing in the communication model: each token's K experts drawn from at most M nodes.

# T tokens, E experts, K top-k, M max nodes per token, N_g nodes of the EP group, e_n experts per node

The router's rule (``moe.max_nodes_per_token = M``, DeepSeek-V3's node-limited routing): a node's score for a token
is the sum of the top ceil(K / M) scores among the node's experts; the token's M best nodes are eligible; its K
experts are the top-K of the eligible experts' scores. Nodes are those of the EP group as placed (experts contiguous
per EP rank, an EP rank's node from the launcher's numbering), so each node holds the same number of experts.

Under "uniform" routing every expert is equally likely without the limit; with it, which nodes win depends on the
scores themselves, so the expected rows come from Monte Carlo: logits = log p_e + Gumbel noise (p uniform, or the
per-expert popularity of a skewed or recorded routing), scores = the router's score function (softmax or sigmoid)
of the logits, then the rule above. Without the limit this is exactly ``comm.sample_routing`` (top-K of the same
logits), so the two agree on a seed. Counting the sampled ids with ``comm.count_rows`` gives flat's and RBD's rows:
flat still sends one row per slot (by symmetry, as many cross nodes on average as without the limit); RBD sends one
pilot per distinct remote node, at most M per token.
"""

from __future__ import annotations

import math

import numpy as np


def experts_by_node(expert_to_rank, rank_to_node, max_nodes: int, top_k: int) -> np.ndarray:
    """(N_g, e_n) expert ids of each node the experts live on, lowest node first; refuses layouts the rule cannot
    align (experts split unevenly over nodes, M < 1, K > M * e_n) with the fix."""
    e2r, r2n = np.asarray(expert_to_rank, dtype=np.int64), np.asarray(rank_to_node, dtype=np.int64)
    node_E = r2n[e2r]
    nodes, counts = np.unique(node_E, return_counts=True)
    if max_nodes < 1:
        raise ValueError(f"max_nodes_per_token ({max_nodes}) must be >= 1 (or 0 for no limit)")
    if len(set(counts.tolist())) != 1:
        per = dict(zip(nodes.tolist(), counts.tolist(), strict=True))
        raise ValueError(
            f"experts split unevenly over the EP group's nodes (experts per node: {per}): "
            "node-limited routing needs the same number of experts on every node; use whole nodes per EP group"
        )
    per_node = int(counts[0])
    if top_k > max_nodes * per_node:
        raise ValueError(
            f"top_k ({top_k}) > max_nodes_per_token ({max_nodes}) x experts per node ({per_node}): a token "
            f"cannot find its experts on {max_nodes} node(s); raise max_nodes_per_token"
        )
    return np.stack([np.flatnonzero(node_E == n) for n in nodes])


def _scores(logits_TE: np.ndarray, score_func: str) -> np.ndarray:
    if score_func == "sigmoid":
        return 1.0 / (1.0 + np.exp(-logits_TE))
    if score_func != "softmax":
        raise ValueError(f"score_func ({score_func!r}) must be 'softmax' or 'sigmoid'")
    shifted = np.exp(logits_TE - logits_TE.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def select_node_limited(scores_TE: np.ndarray, nodes_NE: np.ndarray, top_k: int, max_nodes: int) -> np.ndarray:
    """(T, K) expert ids chosen by the node-limited rule from the scores (the router's choice scores)."""
    num_tokens = scores_TE.shape[0]
    per_node = min(nodes_NE.shape[1], math.ceil(top_k / max_nodes))
    by_node_TNe = scores_TE[:, nodes_NE]  # (T, N_g, e_n)
    node_score_TN = -np.sort(-by_node_TNe, axis=2)[:, :, :per_node].sum(axis=2)
    num_nodes = nodes_NE.shape[0]
    if max_nodes < num_nodes:
        best_TM = np.argpartition(-node_score_TN, max_nodes - 1, axis=1)[:, :max_nodes]
        eligible_TN = np.zeros((num_tokens, num_nodes), dtype=bool)
        np.put_along_axis(eligible_TN, best_TM, True, axis=1)
        by_node_TNe = np.where(eligible_TN[:, :, None], by_node_TNe, -np.inf)
    flat_TX = by_node_TNe.reshape(num_tokens, -1)
    pick_TK = np.argpartition(-flat_TX, top_k - 1, axis=1)[:, :top_k]
    return nodes_NE.reshape(-1)[pick_TK]


def sample_node_limited(
    probs_E: np.ndarray | None,
    nodes_NE: np.ndarray,
    top_k: int,
    max_nodes: int,
    num_tokens: int,
    rng: np.random.Generator,
    score_func: str = "softmax",
) -> np.ndarray:
    """(T, K) expert ids of ``num_tokens`` tokens routed by the node-limited rule on random scores (module doc)."""
    num_experts = nodes_NE.size
    if probs_E is None:
        log_p = np.zeros(num_experts)
    else:
        with np.errstate(divide="ignore"):  # an expert nobody routes to gets -inf: never drawn
            log_p = np.log(np.asarray(probs_E, dtype=np.float64))
    logits_TE = log_p[None, :] + rng.gumbel(size=(num_tokens, num_experts))
    with np.errstate(invalid="ignore", over="ignore"):
        scores_TE = _scores(logits_TE, score_func)
    return select_node_limited(scores_TE, nodes_NE, top_k, max_nodes)
