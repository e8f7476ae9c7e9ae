"""Expert parallelism applied from outside the model, then data parallelism through FSDP2.

# E experts, E_local = E / ep experts per EP rank, H hidden, F expert ffn

``apply_expert_parallel(model, dims)`` does, in this fixed order:
  1. every MoELayer keeps only its EP rank's experts: ``experts.w1/w3/w2`` become DTensors of global shape
     (E, H, F) / (E, F, H) placed ``Shard(0)`` on the "ep" mesh axis (local slice: experts
     [e * E_local, (e + 1) * E_local) on the rank with EP coordinate e), and its dispatcher becomes an
     ``AllToAllDispatcher`` over the "ep" group (``HierarchicalDispatcher``, RBD, when cfg.dispatcher == "rbd"),
     both told the node of each EP rank; with ``moe.max_nodes_per_token`` its router gets the node of each expert
     (moe/node_limit.py);
  2. FSDP2 ``fully_shard`` of each routed-experts module over "dp" (the ranks that hold the same experts),
     of each transformer block and of the root over "dp_ep" (every rank: dense weights are replicated
     across EP ranks too); on GPUs in mixed precision (bf16 weights gathered, fp32 gradients reduced, the
     router and embedding kept fp32: ``mixed_precision_policies``).

Gradient scale. An expert's local gradient already SUMS the contributions of the ep ranks of its EP group (the
backward all-to-all brings them home) and FSDP averages it over "dp" only, so ``shard_experts`` scales the experts'
weight gradients by 1 / ep inside the autograd graph (``grads.scale_weight_grads``; ``grads.py`` tabulates every
scale a gradient receives and why FSDP2's divide factor is not used for this).

Checkpoints. With DTensor parameters a state dict (``get_state_dict``) holds each expert stack under its usual
key (``...experts.w1``) with its GLOBAL shape, each rank owning the rows of its shard. DCP saves by global
offsets and loads into any other layout: another EP degree, another dp, or one process with plain tensors.
No key mapping is needed; optimizer state (also DTensors) reshards the same way.

The one thing the model must do for this: RoutedExperts.forward computes on ``w.to_local()`` when a weight is a
DTensor (FSDP2 hands it the unsharded DTensor on the "ep" axis; the grouped GEMM wants the local slice).
Gradient clipping must group gradients by mesh (``clip_grad_norm_`` below): torch's own mixes meshes and fails.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from xmoe.dispatch.alltoall import AllToAllDispatcher
from xmoe.dispatch.hierarchical import HierarchicalDispatcher
from xmoe.dispatch.padded import PaddedAllToAllDispatcher
from xmoe.kernels.choice import Kernels
from xmoe.moe.layer import moe_layers
from xmoe.moe.node_limit import node_limit
from xmoe.parallel.dims import DENSE_AXIS, ParallelDims
from xmoe.parallel.grads import scale_weight_grads

EXPERT_WEIGHTS = ("w1", "w3", "w2")


def rbd_dispatcher(dims: ParallelDims, num_experts: int, kernels: Kernels) -> HierarchicalDispatcher:
    """RBD over the "ep" group of a built ``ParallelDims``, nodes from its node size (launcher numbering), with the
    layer's ``kernels``; its second stage on the node's own group, its routing weights on a twin of the EP group
    (``ParallelDims.rbd_groups``: a collective call the first time, made by every rank alike)."""
    nodes = [dims.node_of(r) for r in dims.group_ranks("ep")]
    node_group, side_group = dims.rbd_groups()
    return HierarchicalDispatcher(dims.group("ep"), num_experts, nodes, kernels, node_group, side_group)


def ep_group_nodes(dims: ParallelDims) -> list[int]:
    """The node (0, 1, ... in rank order) of each rank of an EP group, the same for every EP group of the world;
    refused where the groups lie differently over the nodes, since a node limit would then route differently (or
    refuse) on some ranks only. Every rank computes it from the layout alone, so all agree."""
    groups = dims.grid.permute(0, 2, 1).reshape(-1, dims.ep) // dims.node_size  # each row: one EP group's nodes
    # ranks grow along the "ep" axis (build_mesh checks it), so each row's nodes do too: number them 0, 1, ...
    compact = torch.cat([torch.zeros_like(groups[:, :1]), (groups.diff(dim=1) != 0).long().cumsum(dim=1)], dim=1)
    if not bool((compact == compact[0]).all()):
        differ = compact[(compact != compact[0]).any(dim=1)][0].tolist()
        raise ValueError(
            f"moe.max_nodes_per_token: the expert-parallel groups lie differently over the nodes (node of each EP "
            f"rank: {compact[0].tolist()} in one group, {differ} in another; ep * tp = {dims.ep * dims.tp}, node "
            f"size {dims.node_size}); choose ep * tp dividing, or a multiple of, the node size"
        )
    return compact[0].tolist()


def shard_experts(model: nn.Module, dims: ParallelDims, ep_overlap: str = "off", ep_chunks: int = 2) -> nn.Module:
    """Step 1 only: slice every MoELayer's experts over "ep" (DTensor Shard(0)) and install the all-to-all dispatcher,
    built with the layer's kernels (``layer.kernels``), with what overlaps its all-to-alls (``ep_overlap``,
    ``ep_chunks``: moe/routed.py).

    Works on real or meta tensors (no communication: every rank slices the full weights it holds, so real ones must
    be identical on all ranks, e.g. from one seed; xmoe/parallel/build.py shards meta tensors and initialises each
    shard). A no-op when ep == 1.
    """
    from torch.distributed.tensor import DTensor, Shard

    layers = moe_layers(model)
    if dims.ep == 1 or not layers:
        return model
    ep_mesh, ep_rank = dims.submesh("ep"), dims.coord("ep")
    nodes = [dims.node_of(r) for r in dims.group_ranks("ep")]
    limited = any(layer.cfg.max_nodes_per_token for layer in layers)
    limit_nodes = ep_group_nodes(dims) if limited else []
    for layer in layers:
        cfg = layer.cfg
        num_local = dims.check_experts(cfg.num_experts)
        if limit_nodes:  # the expert -> node map: experts are contiguous per EP rank
            layer.router.node_limit = node_limit(cfg, [limit_nodes[e // num_local] for e in range(cfg.num_experts)])
        rows = slice(ep_rank * num_local, (ep_rank + 1) * num_local)
        for name in EXPERT_WEIGHTS:
            full = getattr(layer.experts, name)
            if isinstance(full, DTensor):
                raise ValueError(f"experts.{name} is already a DTensor: apply expert parallelism once")
            if full.shape[0] != cfg.num_experts:
                raise ValueError(f"experts.{name} has {full.shape[0]} experts on dim 0, config says {cfg.num_experts}")
            local = full.detach()[rows].clone()
            sharded = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            setattr(layer.experts, name, nn.Parameter(sharded, requires_grad=full.requires_grad))
        if cfg.dispatcher == "rbd":  # two-stage hierarchical dispatch over the nodes the EP group spans
            layer.dispatcher = rbd_dispatcher(dims, cfg.num_experts, layer.kernels)
        elif cfg.dispatcher == "padded":  # the capacity-buffer baseline, DeepSpeed-MoE style
            layer.dispatcher = PaddedAllToAllDispatcher(dims.group("ep"))
        else:
            layer.dispatcher = AllToAllDispatcher(dims.group("ep"), cfg.num_experts, layer.kernels, nodes)
        if cfg.dispatch_dtype == "fp8" and not isinstance(layer.dispatcher, PaddedAllToAllDispatcher):
            layer.dispatcher.use_fp8(to_experts=cfg.fp8 == "experts")  # FP8 experts take the rows as they arrive
        # the padded baseline moves its buffers whole (nothing of it overlaps, as in the systems it stands for)
        layer.set_overlap("off" if cfg.dispatcher == "padded" else ep_overlap, ep_chunks)
        scale_weight_grads(layer.experts, 1.0 / dims.ep)
    return model


def _expert_placement(dp: int):
    """FSDP2 shards a parameter on dim 0 by default; an expert stack whose E_local experts do not split over the dp
    ranks (E_local < dp, e.g. one expert per EP rank) would leave some ranks with no experts and others with whole
    ones, so such stacks are sharded on dim 1 (H of w1/w3, F of w2) instead: every rank holds 1/dp of each."""
    from torch.distributed.tensor import Shard

    def placement(param: nn.Parameter):
        local = param.to_local() if hasattr(param, "to_local") else param  # this EP rank's E_local experts
        return Shard(0) if local.ndim < 3 or local.shape[0] % dp == 0 else Shard(1)

    return placement


def _placement_kwarg(fully_shard, dp: int) -> dict:
    """``shard_placement_fn`` where this torch's FSDP2 has it (newer than 2.6), else dim 0 as before."""
    import inspect

    if dp == 1 or "shard_placement_fn" not in inspect.signature(fully_shard).parameters:
        return {}
    return {"shard_placement_fn": _expert_placement(dp)}


def mixed_precision_policies(param_dtype: torch.dtype | None) -> tuple[dict, dict]:
    """FSDP2 keyword arguments (cast units, fp32 units). With ``param_dtype`` (bf16 on GPUs) the units all-gather
    their fp32 shards as ``param_dtype`` and reduce gradients in fp32, so the matmuls save FSDP's own unsharded
    weights for backward (freed after forward, gathered again for backward) instead of autocast's bf16 copies,
    which would hold every layer's unsharded weights until backward. fp32 units: the router (routing math in fp32)
    and the embedding (the residual stream starts in fp32, as on one process). Without ``param_dtype``: plain."""
    if param_dtype is None:
        return {}, {}
    from torch.distributed.fsdp import MixedPrecisionPolicy

    cast = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    return {"mp_policy": cast}, {"mp_policy": MixedPrecisionPolicy(reduce_dtype=torch.float32)}


def apply_expert_parallel(
    model: nn.Module,
    dims: ParallelDims,
    *,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
    ep_overlap: str = "off",
    ep_chunks: int = 2,
) -> nn.Module:
    """EP (``shard_experts``) then FSDP2 with the right mesh per parameter group; returns the model (now an
        FSDPModule). FSDP units: each routed-experts module ("dp"; sharded on dim 1 when its experts do not split over
        dp), each ``model.layers[i]`` if the model has ``layers`` and each ``model.mtp[d]`` (multi-token prediction)
    ("dp_ep"), the root ("dp_ep"). ``param_dtype``: the
        compute dtype of the units' gathered weights (``mixed_precision_policies``), or None for fp32 throughout.

        Works on a model built on the meta device (nothing is allocated; ``to_empty`` then allocates only the shards).
        With tp > 1 call it after tensor parallelism and SSMB (xmoe/parallel/tensor.py, ssmb.py): TP weights then
        become 2-D ("dp_ep", "tp") DTensors, and SSMB has already arranged the "tp" reduction of the replicated
        MoE parameters (experts included); nothing here depends on tp.
    """
    from torch.distributed.fsdp import fully_shard

    shard_experts(model, dims, ep_overlap, ep_chunks)
    cast, fp32 = mixed_precision_policies(param_dtype)
    dp_mesh, dense_mesh = dims.submesh("dp"), dims.submesh(DENSE_AXIS)
    for layer in moe_layers(model):
        fully_shard(
            layer.experts,
            mesh=dp_mesh,
            reshard_after_forward=reshard_after_forward,
            **_placement_kwarg(fully_shard, dims.dp),
            **cast,
        )
        if fp32:
            fully_shard(layer.router, mesh=dense_mesh, reshard_after_forward=reshard_after_forward, **fp32)
    embed, head = getattr(model, "embed", None), getattr(model, "head", None)
    tied = embed is not None and head is not None and head.weight is embed.weight
    if fp32 and embed is not None and not tied:
        fully_shard(embed, mesh=dense_mesh, reshard_after_forward=reshard_after_forward, **fp32)
    # each block a unit, and each multi-token-prediction module (its block, projection and norms)
    for block in [*getattr(model, "layers", []), *getattr(model, "mtp", [])]:
        fully_shard(block, mesh=dense_mesh, reshard_after_forward=reshard_after_forward, **cast)
    # the root's parameters (final norm, head; the embedding when tied) are used last in forward, first in
    # backward: keeping them unsharded after forward saves one all-gather per step. A tied embedding keeps the root
    # in fp32, so that the residual stream starts in fp32 either way.
    fully_shard(model, mesh=dense_mesh, reshard_after_forward=False, **(fp32 if tied else cast))
    return model


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0, dims: ParallelDims | None = None
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for gradients that live on different meshes (experts on ("dp", "ep"),
    dense weights on "dp_ep"), plain tensors included: ``total_grad_norm``, then each gradient scaled in place.
    Returns the total norm as a plain tensor. Every rank must call it."""
    groups = _by_mesh(parameters)
    total = _total_norm(groups, norm_type, dims)
    for group in groups.values():  # per group: the scale is a plain scalar, fine next to any DTensor
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def _by_mesh(parameters: Iterable[torch.Tensor]) -> dict[tuple | None, list[torch.Tensor]]:
    """The parameters that have gradients, grouped by their gradients' (mesh, placements); None: plain tensors."""
    from torch.distributed.tensor import DTensor

    groups: dict[tuple | None, list[torch.Tensor]] = defaultdict(list)
    for p in parameters:
        if p.grad is not None:
            key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
            groups[key].append(p)
    return groups


@torch.no_grad()
def total_grad_norm(
    parameters: Iterable[torch.Tensor], norm_type: float = 2.0, dims: ParallelDims | None = None
) -> torch.Tensor:
    """The norm of all gradients together, as a plain tensor, for gradients on different meshes.

    DTensor refuses to mix meshes in one op, so norms are taken per (mesh, placements) group, each reduced to a
    plain scalar, then combined. With ``dims``, every group sharded (no replicated mesh dimension) over exactly the
    ranks of this rank's "dp_ep" group adds its local sum of |g|^p to one tensor that a single all-reduce over
    "dp_ep" completes: one collective for the dense and the expert gradients together, where ``full_tensor`` on the
    2-D expert mesh alone would run two in sequence. Other groups reduce over their own mesh (``full_tensor``).
    Every rank must call it.
    """
    return _total_norm(_by_mesh(parameters), norm_type, dims)


def _total_norm(
    groups: dict[tuple | None, list[torch.Tensor]], norm_type: float, dims: ParallelDims | None
) -> torch.Tensor:
    """total_grad_norm over parameters already grouped by ``_by_mesh``."""
    from torch.distributed.tensor import DTensor, Shard

    partitions: tuple[type, ...] = (Shard,)
    try:  # FSDP2 over an EP-sharded dimension: strided, still a partition (not a Shard subclass in torch 2.13)
        from torch.distributed.tensor.placement_types import _StridedShard

        partitions = (Shard, _StridedShard)
    except ImportError:
        pass
    if not groups:
        return torch.zeros(())
    dense_ranks = sorted(dims.group_ranks(DENSE_AXIS)) if dims is not None and dims.mesh is not None else None
    fusable = math.isfinite(norm_type) and dims is not None and dense_ranks is not None and dims.dp * dims.ep > 1
    norms, partial_sum = [], None
    for key, params in groups.items():
        grads = [p.grad for p in params if p.grad is not None]  # all of them: only those were grouped
        if (
            fusable
            and key is not None
            and all(isinstance(pl, partitions) for pl in key[1])
            and sorted(key[0].mesh.flatten().tolist()) == dense_ranks
        ):
            shards = [g.to_local() for g in grads if isinstance(g, DTensor)]  # all of them: the group has a mesh
            local = torch.nn.utils.get_total_norm(shards, norm_type) ** norm_type
            partial_sum = local if partial_sum is None else partial_sum + local.to(partial_sum.device)
            continue
        norm = torch.nn.utils.get_total_norm(grads, norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if partial_sum is not None:
        assert dims is not None  # partial sums are taken only when fusable
        dist.all_reduce(partial_sum, group=dims.group(DENSE_AXIS))
        norms.append(partial_sum ** (1.0 / norm_type))
    device = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]), norm_type)
