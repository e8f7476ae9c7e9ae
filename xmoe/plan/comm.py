"""Traffic and time of one MoE layer's dispatch: flat all-to-all vs RBD (redundancy-bypassing dispatch).

# T tokens per GPU, K top-k, E experts, P ranks in the EP group (E / P experts each, contiguous), H hidden

Rows a source GPU sends for its T tokens (each (token, expert) slot is routed to the GPU owning the expert):
  flat  one all-to-all; every slot whose expert is on another GPU is one row (xmoe's AllToAllDispatcher):
        intra = slots to other GPUs of the source's node, inter = slots to GPUs of other nodes.
  RBD   stage 1 (inter-node): one pilot row per distinct (token, remote node) the token's experts touch;
        stage 2 (intra-node): the pilot's GPU replicates it to the other GPUs of its node that host the
        token's other experts (one row per distinct (token, GPU); a GPU holding several of the token's experts
        expands it locally). Rows for the source's own node are sent as flat sends them: RBD changes only what
        crosses nodes, so with the EP group inside one node (or K = 1) RBD is exactly flat.
  Redundancy rate R = redundant slots / dispatched slots, a slot being redundant when an earlier slot of the
  same token goes to the same node: R = 1 - distinct (token, node) pairs / slots (the paper's R).
Expected counts under uniform routing (each token's K experts a uniform K-subset of E) are exact: a set of m
experts is hit by a token with probability 1 - C(E-m, K) / C(E, K) (hypergeometric), so distinct pairs are
T * sum over nodes (or GPUs) of that probability. Skewed or recorded routing is estimated by Monte Carlo
(k distinct experts per token drawn with the per-expert probabilities; seeded), using ``count_rows``.

Node-limited routing (``max_nodes_per_token`` M: each token's experts on at most M nodes) is counted by Monte Carlo
of the router's rule (node_limit.py). step_time.py turns these rows into a step time with overlap and FP8 dispatch.

Time (per GPU, microseconds): stage = latency + bytes / bandwidth, bandwidths per GPU (the inter-node one is
the GPU's share of its node's NICs). Flat: intra- and inter-node transfers of the one collective overlap:
max(intra, inter). RBD: stage 1 sends pilots over the network while the source's own-node rows go over the
intra-node links, then stage 2 replicates: max(inter pilots, intra own-node) + intra replicas (a stage with
nothing to send costs nothing, so one node gives RBD = flat). Combine is the
same exchange reversed, so a layer's forward costs twice the dispatch, forward + backward four times.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from xmoe.config import ModelConfig, MoEConfig
from xmoe.dispatch.base import experts_per_rank
from xmoe.parallel.dims import node_of, rank_grid
from xmoe.plan.node_limit import experts_by_node, sample_node_limited

GPU_COUNTS = (8, 16, 32, 64, 128, 256, 512, 1024)
SKEW_EXPONENT = 1.0  # "skewed" routing: expert popularity ~ 1 / rank^SKEW_EXPONENT (Zipf)


@dataclass(frozen=True)
class RowCounts:
    """Rows one source GPU sends in one dispatch (counts from a routing, or expectations)."""

    tokens: float
    slots: float  # kept (token, expert) slots
    flat_local: float  # slots whose expert is on the source GPU itself (no transfer)
    flat_intra: float  # flat rows to other GPUs of the source's node
    flat_inter: float  # flat rows to other nodes
    rbd_inter: float  # RBD pilots: distinct (token, remote node)
    rbd_replicas: float  # RBD stage-2 copies on remote nodes: distinct (token, remote GPU) - pilots
    token_nodes: float  # distinct (token, node) pairs, the source's node included

    @property
    def redundancy_rate(self) -> float:
        return 1.0 - self.token_nodes / self.slots if self.slots else 0.0

    @property
    def inter_saving(self) -> float:
        """Fraction of flat inter-node rows RBD does not send."""
        return 1.0 - self.rbd_inter / self.flat_inter if self.flat_inter else 0.0

    def scaled(self, factor: float) -> RowCounts:
        return RowCounts(*(getattr(self, f.name) * factor for f in fields(self)))

    @staticmethod
    def mean(counts: Sequence[RowCounts]) -> RowCounts:
        return RowCounts(*(sum(getattr(c, f.name) for c in counts) / len(counts) for f in fields(RowCounts)))


def _as_numpy(x) -> np.ndarray:
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


def count_rows(expert_ids_TK, expert_to_rank, rank_to_node, src_rank: int) -> RowCounts:
    """Exact rows ``src_rank`` sends for a concrete routing (numpy arrays, lists or torch tensors).

    expert_ids_TK: (T, K) global expert ids, -1 for a dropped slot; expert_to_rank[e]: the rank owning expert e;
    rank_to_node[r]: the node of rank r. Counts follow the module docstring (flat per slot; RBD pilots per
    distinct (token, remote node), replicas per distinct (token, remote GPU) minus the pilots).
    """
    ids_TK = _as_numpy(expert_ids_TK).astype(np.int64)
    if ids_TK.ndim != 2:
        raise ValueError(f"expert_ids_TK must be (T, K), got shape {ids_TK.shape}")
    e2r, r2n = _as_numpy(expert_to_rank).astype(np.int64), _as_numpy(rank_to_node).astype(np.int64)
    if ids_TK.size and ids_TK.max() >= len(e2r):
        raise ValueError(f"expert id {ids_TK.max()} has no rank: expert_to_rank has {len(e2r)} entries")
    num_tokens = ids_TK.shape[0]
    kept = ids_TK >= 0
    token_S = np.broadcast_to(np.arange(num_tokens)[:, None], ids_TK.shape)[kept]
    rank_S = e2r[ids_TK[kept]]
    node_S = r2n[rank_S]
    src_node = r2n[src_rank]
    num_nodes, num_ranks = int(r2n.max()) + 1, len(r2n)
    local_S, home_S = rank_S == src_rank, node_S == src_node
    # distinct (token, node) and (token, GPU) pairs by unique keys
    token_node = np.unique(token_S * num_nodes + node_S)
    token_gpu = np.unique(token_S * num_ranks + rank_S)
    pair_home = r2n[token_gpu % num_ranks] == src_node
    pilots = int(np.count_nonzero(token_node % num_nodes != src_node))
    return RowCounts(
        tokens=num_tokens,
        slots=int(kept.sum()),
        flat_local=int(local_S.sum()),
        flat_intra=int(np.count_nonzero(home_S & ~local_S)),
        flat_inter=int(np.count_nonzero(~home_S)),
        rbd_inter=pilots,
        rbd_replicas=int(np.count_nonzero(~pair_home)) - pilots,
        token_nodes=token_node.size,
    )


def hit_probability(num_experts: int, top_k: int, m: int) -> float:
    """P(a token's K distinct uniform experts include at least one of a given m): 1 - C(E-m, K) / C(E, K)."""
    return 1.0 - math.comb(num_experts - m, top_k) / math.comb(num_experts, top_k)


def expected_rows_uniform(
    num_experts: int, top_k: int, expert_to_rank, rank_to_node, src_rank: int, num_tokens: float
) -> RowCounts:
    """Exact expectation of ``count_rows`` when every token picks a uniform K-subset of the E experts."""
    e2r, r2n = _as_numpy(expert_to_rank).astype(np.int64), _as_numpy(rank_to_node).astype(np.int64)
    if len(e2r) != num_experts:
        raise ValueError(f"expert_to_rank has {len(e2r)} entries for {num_experts} experts")
    per_rank = np.bincount(e2r, minlength=len(r2n))
    per_node = np.bincount(r2n, weights=per_rank).astype(np.int64)
    src_node = r2n[src_rank]
    p = {m: hit_probability(num_experts, top_k, int(m)) for m in set(per_rank) | set(per_node)}
    T, K, E = num_tokens, top_k, num_experts
    home = r2n == src_node
    gpu_hits = np.array([p[m] for m in per_rank])
    node_hits = np.array([p[m] for m in per_node])
    pilots = T * (node_hits.sum() - node_hits[src_node])
    return RowCounts(
        tokens=T,
        slots=T * K,
        flat_local=T * K * per_rank[src_rank] / E,
        flat_intra=T * K * (per_node[src_node] - per_rank[src_rank]) / E,
        flat_inter=T * K * (E - per_node[src_node]) / E,
        rbd_inter=pilots,
        rbd_replicas=T * gpu_hits[~home].sum() - pilots,
        token_nodes=T * node_hits.sum(),
    )


def sample_routing(
    probs_E: np.ndarray | None, num_experts: int, top_k: int, num_tokens: int, rng: np.random.Generator
) -> np.ndarray:
    """(T, K) expert ids, K distinct per token, drawn successively with probabilities ``probs_E`` (uniform when
    None) by the Gumbel-top-k trick: the K largest of log p_e + Gumbel noise."""
    if probs_E is None:
        log_p = np.zeros(num_experts)
    else:
        with np.errstate(divide="ignore"):  # log(0) = -inf: an expert nobody routes to is never drawn
            log_p = np.log(np.asarray(probs_E, dtype=np.float64))
    keys = log_p[None, :] + rng.gumbel(size=(num_tokens, num_experts))
    return np.argpartition(-keys, top_k - 1, axis=1)[:, :top_k]


def routing_probs(spec: str, num_experts: int, top_k: int, seed: int = 0) -> np.ndarray | None:
    """'uniform' -> None; 'skewed' -> Zipf popularity over a seeded permutation of the experts (hot experts
    land on random GPUs); a path to a .json file -> the recorded tokens-per-expert histogram, as a list of E
    counts, {"tokens_per_expert": [...]}, or per-layer rows [[...], ...] (summed)."""
    if spec == "uniform":
        return None
    if spec == "skewed":
        weights = 1.0 / np.arange(1, num_experts + 1) ** SKEW_EXPONENT
        return np.random.default_rng(seed).permutation(weights) / weights.sum()
    path = Path(spec)
    if path.suffix != ".json":
        raise ValueError(f"routing ({spec!r}) must be 'uniform', 'skewed' or a .json tokens-per-expert histogram")
    data = json.loads(path.read_text())
    if isinstance(data, dict):
        if "tokens_per_expert" not in data:
            raise ValueError(f"{path}: a JSON object needs a 'tokens_per_expert' key")
        data = data["tokens_per_expert"]
    counts = np.asarray(data, dtype=np.float64)
    counts = counts.sum(0) if counts.ndim == 2 else counts
    if counts.ndim != 1 or counts.shape[0] != num_experts:
        raise ValueError(f"{path}: histogram has shape {counts.shape}, expected {num_experts} experts")
    if (counts < 0).any() or np.count_nonzero(counts) < top_k:
        raise ValueError(f"{path}: counts must be >= 0 with at least top_k ({top_k}) experts non-zero")
    return counts / counts.sum()


def ep_layout(
    num_experts: int, gpus: int, ep: int, gpus_per_node: int, placement: str = "ep_first", tp: int = 1
) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(expert_to_rank_E, rank_to_node_W, group) of the EP group holding global rank 0 (xmoe's rank grid)."""
    experts_per_rank(num_experts, ep)
    if gpus % (ep * tp):
        raise ValueError(f"ep * tp ({ep * tp}) must divide gpus ({gpus})")
    if gpus > gpus_per_node and gpus % gpus_per_node:
        raise ValueError(f"gpus ({gpus}) must be a multiple of gpus per node ({gpus_per_node}); use whole nodes")
    group = rank_grid(gpus // (ep * tp), ep, tp, placement)[0, :, 0].tolist()
    expert_to_rank = np.repeat(np.asarray(group), num_experts // ep)  # rank j of the group: a contiguous block
    rank_to_node = np.array([node_of(r, gpus_per_node) for r in range(gpus)])
    return expert_to_rank, rank_to_node, group


@dataclass(frozen=True)
class Network:
    intra_bw: float = 300.0  # GB/s per GPU, intra-node links (NVLink / Infinity Fabric)
    inter_bw: float = 25.0  # GB/s per GPU: its share of the node's NICs
    intra_lat: float = 5.0  # us per stage
    inter_lat: float = 10.0

    def stage_us(self, nbytes: float, inter: bool) -> float:
        if nbytes <= 0:
            return 0.0  # nothing to send: the stage is skipped
        bw, lat = (self.inter_bw, self.inter_lat) if inter else (self.intra_bw, self.intra_lat)
        return lat + nbytes / (bw * 1e9) * 1e6


@dataclass(frozen=True)
class CommEstimate:
    gpus: int
    ep: int
    group_nodes: int  # nodes the EP group spans
    hidden: int
    bytes_per_elem: int
    rows: RowCounts  # per source GPU, averaged over the EP group's ranks
    method: str  # "closed form" or "monte carlo (N tokens x M sources, seed S)"
    network: Network
    max_nodes_per_token: int = 0  # node-limited routing's M (0: off; also 0 when M >= group_nodes: no effect)

    def nbytes(self, rows: float) -> float:
        return rows * self.hidden * self.bytes_per_elem

    @property
    def flat_us(self) -> float:
        r, n = self.rows, self.network
        return max(n.stage_us(self.nbytes(r.flat_intra), False), n.stage_us(self.nbytes(r.flat_inter), True))

    @property
    def rbd_us(self) -> float:
        r, n = self.rows, self.network
        stage1 = max(n.stage_us(self.nbytes(r.rbd_inter), True), n.stage_us(self.nbytes(r.flat_intra), False))
        return stage1 + n.stage_us(self.nbytes(r.rbd_replicas), False)

    @property
    def speedup(self) -> float:
        return self.flat_us / self.rbd_us if self.rbd_us else 1.0


def estimate_comm(
    cfg: ModelConfig,
    gpus: int,
    *,
    gpus_per_node: int = 8,
    ep: int | None = None,
    tp: int = 1,
    placement: str = "ep_first",
    routing: str | np.ndarray | None = "uniform",
    tokens_per_gpu: int | None = None,
    network: Network = Network(),
    bytes_per_elem: int = 2,
    method: str = "auto",
    mc_tokens: int = 4096,
    mc_sources: int = 8,
    seed: int = 0,
    max_nodes_per_token: int = 0,
) -> CommEstimate:
    """Per-GPU rows, bytes and time of one dispatch of ``cfg``'s MoE layer on ``gpus`` GPUs.

    ep defaults to min(E, gpus / tp). ``routing``: 'uniform', 'skewed', a .json histogram path, or per-expert
    probabilities. method "auto" uses the closed form for uniform routing, Monte Carlo otherwise; "mc" forces
    Monte Carlo (``mc_tokens`` tokens from each of up to ``mc_sources`` evenly spaced ranks of the group,
    scaled to ``tokens_per_gpu``). ``max_nodes_per_token`` M > 0: node-limited routing (node_limit.py; Monte
    Carlo of the router's rule with ``cfg.moe.score_func``) where the group spans more than M nodes.
    """
    moe = cfg.moe
    E, K = moe.num_experts, moe.top_k
    ep = ep or math.gcd(E, gpus // tp)
    tokens = tokens_per_gpu or cfg.max_seq_len
    probs = routing_probs(routing, E, K, seed) if isinstance(routing, str) else routing
    e2r, r2n, group = ep_layout(E, gpus, ep, gpus_per_node, placement, tp)
    if method not in ("auto", "mc"):
        raise ValueError(f"method ({method!r}) must be 'auto' or 'mc'")
    group_nodes = len({int(r2n[r]) for r in group})
    nodes_NE = experts_by_node(e2r, r2n, max_nodes_per_token, K) if max_nodes_per_token else None
    limit = max_nodes_per_token if nodes_NE is not None and max_nodes_per_token < group_nodes else 0
    draw = _sampler(moe, probs, nodes_NE, limit, mc_tokens)
    if probs is None and method == "auto" and not limit:
        rows = RowCounts.mean([expected_rows_uniform(E, K, e2r, r2n, s, tokens) for s in group])
        how = "closed form"
    else:
        rng = np.random.default_rng(seed)
        sources = group[:: max(1, len(group) // mc_sources)][:mc_sources]
        rows = RowCounts.mean([count_rows(draw(rng), e2r, r2n, s) for s in sources]).scaled(tokens / mc_tokens)
        how = f"monte carlo ({mc_tokens} tokens x {len(sources)} sources, seed {seed})"
    return CommEstimate(gpus, ep, group_nodes, cfg.hidden_size, bytes_per_elem, rows, how, network, limit)


def _sampler(
    moe: MoEConfig, probs: np.ndarray | None, nodes_NE: np.ndarray | None, limit: int, mc_tokens: int
) -> Callable[[np.random.Generator], np.ndarray]:
    """One Monte Carlo draw of ``mc_tokens`` tokens' expert choices: node-limited routing's rule where it binds
    (``limit`` > 0), else plain top-k sampling."""
    E, K = moe.num_experts, moe.top_k
    if limit:  # the rule binds: expected rows by Monte Carlo of it

        def draw(rng: np.random.Generator) -> np.ndarray:
            assert nodes_NE is not None
            return sample_node_limited(probs, nodes_NE, K, limit, mc_tokens, rng, moe.score_func)

    else:

        def draw(rng: np.random.Generator) -> np.ndarray:
            return sample_routing(probs, E, K, mc_tokens, rng)

    return draw


def scaling_table(cfg: ModelConfig, gpu_counts: Sequence[int] = GPU_COUNTS, **kwargs) -> list[CommEstimate]:
    """estimate_comm at each GPU count where the layout is valid (ep must divide E and the GPU count)."""
    out = []
    for g in gpu_counts:
        ep = kwargs.get("ep")
        if ep is not None and (g % (ep * kwargs.get("tp", 1))):
            continue
        out.append(estimate_comm(cfg, g, **kwargs))
    return out
