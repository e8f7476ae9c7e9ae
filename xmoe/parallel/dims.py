"""Parallel degrees -> rank layout -> device meshes: the one place that builds xmoe's meshes, and with them the
process groups of their axes, which everything else asks for by axis name (and RBD's node and side groups,
``rbd_groups``). Besides them, the trainer makes the world
group from the launcher's environment (train/launch.py; a simulated rank's fake world: train/simulate.py) and the
stop vote's gloo group (train/safety.py: off the training collectives' stream), and its watchdog opens a connection
of its own to the launcher's store (train/watchdog.py).

# W world size; dp, ep, tp the data-, expert- and tensor-parallel degrees (W = dp * ep * tp); d, e, t a rank's
# coordinates on those axes

Two meshes, both built here once:
  mesh        ("dp", "ep", "tp"), always all three axes in this order (size-1 axes cost nothing). Expert weights
              are sharded over "ep" and data parallel over "dp" (the ranks holding the same experts). "dp" comes
              before "ep" because older FSDP2 (torch 2.6) slices the root mesh as mesh["dp", "ep"] for such weights.
  dense_mesh  ("dp_ep", "tp"): "dp_ep" = every rank with the same tp coordinate, the group over which dense
              (non-expert) parameters are data parallel; its index of a rank is rank // tp.
Why a second mesh and not mesh["dp", "ep"]._flatten(): under dp_first that flattening lists ranks in the order
0, 2, 1, 3, ... while torch's process groups number their ranks in ascending order, so DTensor's coordinates and
the group's ranks would disagree (all-gathers and checkpoints put shards in the wrong rows; seen on torch 2.13).
Every axis of both meshes therefore lists its ranks in ascending order (checked in ``build_mesh``).

Placement decides which global ranks form a group (``rank_grid`` below; TP is always innermost, it needs the
fastest links):
  ep_first: rank = (d * ep + e) * tp + t   an EP group is ep*tp consecutive ranks, inside one node when ep*tp fits
  dp_first: rank = (e * dp + d) * tp + t   EP peers are dp*tp ranks apart: the EP group is strided across nodes,
                                           while data-parallel replicas sit next to each other
EP-first keeps the all-to-all on intra-node links (NVLink / Infinity Fabric); DP-first spreads an EP group over
nodes (more network all-to-all, but gradient reduction stays in the node). X-MoE (SC'25, section on
topology-aware placement) evaluates both.

Everything above ``build_mesh`` is pure and is tested without a process group.
"""

from __future__ import annotations

import datetime
import os
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from xmoe.config import ParallelConfig
from xmoe.dispatch.base import experts_per_rank

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

AXES = ("dp", "ep", "tp")
DENSE_AXIS = "dp_ep"  # all dp * ep ranks of one TP coordinate: data parallelism of dense parameters


def rank_grid(dp: int, ep: int, tp: int, placement: str) -> torch.Tensor:
    """The (dp, ep, tp) tensor of global ranks: ``grid[d, e, t]`` is the rank at those coordinates."""
    world = dp * ep * tp
    if placement == "ep_first":
        return torch.arange(world).view(dp, ep, tp)
    if placement == "dp_first":
        return torch.arange(world).view(ep, dp, tp).permute(1, 0, 2).contiguous()
    raise ValueError(f"placement ({placement!r}) must be 'ep_first' or 'dp_first'")


def node_of(rank: int, node_size: int) -> int:
    """Launchers number ranks node by node: ranks [n * node_size, (n + 1) * node_size) live on node n."""
    return rank // node_size


@dataclass
class ParallelDims:
    """Degrees, placement and node size of one run; ``build_mesh`` turns them into device meshes.

    Build it with ``ParallelDims.from_config``; every other module asks it by axis name:
    ``dims.group("ep")``, ``dims.submesh("dp_ep")``, ``dims.group_ranks("ep")``, ``dims.coord("ep")``.
    """

    dp: int
    ep: int
    tp: int
    world_size: int
    node_size: int
    placement: str
    rank: int = 0
    timeout_s: float | None = None  # every group's collective timeout (None: torch's default)
    grid: torch.Tensor = field(init=False, repr=False)
    mesh: DeviceMesh | None = field(default=None, init=False, repr=False)  # once built
    dense_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)  # ("dp_ep", "tp")
    _rbd_groups: tuple | None = field(default=None, init=False, repr=False)  # (node group, side group), once made

    def __post_init__(self) -> None:
        if self.dp * self.ep * self.tp != self.world_size:
            raise ValueError(
                f"dp * ep * tp = {self.dp} * {self.ep} * {self.tp} = {self.dp * self.ep * self.tp} must equal the "
                f"world size ({self.world_size}); e.g. set dp = world / (ep * tp) = "
                f"{self.world_size / (self.ep * self.tp):g}"
            )
        if self.node_size < 1:
            raise ValueError(f"node_size ({self.node_size}) must be >= 1")
        if self.world_size > self.node_size and self.world_size % self.node_size:
            raise ValueError(
                f"world size ({self.world_size}) must be a multiple of the node size ({self.node_size}): xmoe assumes "
                "every node runs the same number of ranks; fix ParallelConfig.gpus_per_node or the launcher"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank ({self.rank}) must be in [0, world_size={self.world_size})")
        self.grid = rank_grid(self.dp, self.ep, self.tp, self.placement)
        self._warn_on_node_straddling()

    @classmethod
    def from_config(
        cls,
        cfg: ParallelConfig,
        world_size: int | None = None,
        *,
        rank: int | None = None,
        node_size: int | None = None,
        num_experts: int | None = None,
    ) -> ParallelDims:
        """Degrees from ``cfg``; world size, rank and node size from the arguments, else the launcher.

        Node size: ``node_size`` argument, else ``cfg.gpus_per_node``, else LOCAL_WORLD_SIZE (torchrun, or
        SLURM_NTASKS_PER_NODE), else the whole world is taken as one node. ``num_experts``, when given, is checked
        to split evenly over the EP ranks.
        """
        if world_size is None:
            world_size = _env_int("WORLD_SIZE") or (
                torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
            )
        if rank is None:
            rank = _env_int("RANK") or (torch.distributed.get_rank() if torch.distributed.is_initialized() else 0)
        node_size = (
            node_size
            or cfg.gpus_per_node
            or _env_int("LOCAL_WORLD_SIZE")
            or _env_int("SLURM_NTASKS_PER_NODE")
            or world_size
        )
        dims = cls(cfg.dp, cfg.ep, cfg.tp, world_size, node_size, cfg.placement, rank, cfg.timeout)
        if num_experts is not None:
            dims.check_experts(num_experts)
        return dims

    # ---- pure layout queries ------------------------------------------------------------------------------

    def size(self, axis: str) -> int:
        if axis == DENSE_AXIS:
            return self.dp * self.ep
        return getattr(self, _check_axis(axis))

    def coords_of(self, rank: int) -> dict[str, int]:
        """{"dp": d, "ep": e, "tp": t} of a global rank."""
        d, e, t = (int(i) for i in (self.grid == rank).nonzero()[0])
        return {"dp": d, "ep": e, "tp": t}

    def coord(self, axis: str, rank: int | None = None) -> int:
        """This rank's (or ``rank``'s) index along ``axis``. Along "dp_ep" (also: which data shard it reads) it is
        rank // tp, for both placements: TP is innermost, so the ranks of one TP group are consecutive."""
        rank = self.rank if rank is None else rank
        if axis == DENSE_AXIS:
            return rank // self.tp
        return self.coords_of(rank)[_check_axis(axis)]

    def group_ranks(self, axis: str, rank: int | None = None) -> list[int]:
        """Global ranks of the ``axis`` group containing this rank (or ``rank``), in axis order (ascending)."""
        c = self.coords_of(self.rank if rank is None else rank)
        if axis == DENSE_AXIS:
            return list(range(c["tp"], self.world_size, self.tp))
        index: list[int | slice] = [c["dp"], c["ep"], c["tp"]]
        index[AXES.index(_check_axis(axis))] = slice(None)
        return self.grid[tuple(index)].reshape(-1).tolist()

    def all_groups(self, axis: str) -> list[list[int]]:
        """Every ``axis`` group of the world, each in axis order, sorted by first rank."""
        seen = {tuple(self.group_ranks(axis, r)) for r in range(self.world_size)}
        return [list(g) for g in sorted(seen)]

    def node_of(self, rank: int | None = None) -> int:
        return node_of(self.rank if rank is None else rank, self.node_size)

    def nodes_of_group(self, axis: str, rank: int | None = None) -> list[int]:
        """The nodes the ``axis`` group of this rank (or ``rank``) spans, sorted."""
        return sorted({self.node_of(r) for r in self.group_ranks(axis, rank)})

    def check_experts(self, num_experts: int) -> int:
        """Experts per EP rank; rank with EP coordinate e owns experts [e * E_local, (e + 1) * E_local)."""
        return experts_per_rank(num_experts, self.ep)

    def _warn_on_node_straddling(self) -> None:
        if self.tp > 1 and len(self.nodes_of_group("tp", 0)) > 1:
            warnings.warn(
                f"tp ({self.tp}) spans nodes (node size {self.node_size}): TP traffic crosses the network", stacklevel=2
            )
        if self.placement == "ep_first" and self.ep > 1:
            # nodes each EP group (one per (dp, tp) coordinate) spans, for all groups at once: one pass over the
            # grid, not a group lookup per rank (which made `xmoe plan` quadratic in the world size)
            nodes = (self.grid // self.node_size).sort(dim=1).values
            spans = int(((nodes.diff(dim=1) != 0).sum(dim=1) + 1).max())
            ideal = -(-self.ep * self.tp // self.node_size)  # ceil: fewest nodes an EP group can live on
            if spans > ideal:
                warnings.warn(
                    f"ep_first: some EP groups span {spans} nodes where {ideal} would do (ep * tp = "
                    f"{self.ep * self.tp}, node size {self.node_size}); choose ep * tp dividing, or a multiple of, "
                    "the node size",
                    stacklevel=2,
                )

    # ---- process groups -----------------------------------------------------------------------------------

    def build_mesh(self, device_type: str = "cuda") -> ParallelDims:
        """Create the DeviceMesh (a collective call: every rank must call it, once). Returns self."""
        from torch.distributed.device_mesh import DeviceMesh

        if self.mesh is not None:
            raise RuntimeError("ParallelDims.build_mesh called twice; build the mesh once and share the dims")
        if not torch.distributed.is_initialized():
            raise RuntimeError("build_mesh needs torch.distributed.init_process_group() first")
        if torch.distributed.get_world_size() != self.world_size:
            raise ValueError(
                f"ParallelDims was built for world size {self.world_size} but the process group has "
                f"{torch.distributed.get_world_size()} ranks"
            )
        self.rank = torch.distributed.get_rank()
        dense_grid = torch.arange(self.world_size).view(self.dp * self.ep, self.tp)
        for grid in (self.grid, dense_grid):  # see the module docstring: group rank order must be mesh order
            for dim in range(grid.dim()):
                assert bool((grid.diff(dim=dim) > 0).all()), f"mesh axis {dim} is not ascending: {grid.tolist()}"
        self.mesh = DeviceMesh(device_type, self.grid, mesh_dim_names=AXES)
        self.dense_mesh = DeviceMesh(device_type, dense_grid, mesh_dim_names=(DENSE_AXIS, "tp"))
        # DeviceMesh makes its groups with the backend's default timeout; the simulated rank's fake backend has none to
        # set (and no peer to wait for)
        if self.timeout_s is not None and torch.distributed.get_backend() != "fake":
            for mesh in (self.mesh, self.dense_mesh):
                for group in mesh.get_all_groups():
                    set_timeout(group, self.timeout_s)
        return self

    def submesh(self, axis: str):
        """The 1-D DeviceMesh of ``axis`` ("dp", "ep", "tp" or "dp_ep") that contains this rank."""
        if self.mesh is None or self.dense_mesh is None:  # built together
            raise RuntimeError("call ParallelDims.build_mesh() before asking for meshes or groups")
        if axis == DENSE_AXIS:
            return self.dense_mesh[DENSE_AXIS]
        return self.mesh[_check_axis(axis)]

    def group(self, axis: str) -> torch.distributed.ProcessGroup:
        return self.submesh(axis).get_group()

    def rbd_groups(self) -> tuple[torch.distributed.ProcessGroup | None, torch.distributed.ProcessGroup | None]:
        """RBD's two extra groups for this rank: (its node's ranks within its EP group, for the second stage that
        never leaves the node; a twin of its EP group, for the blocking exchange of the routing weights).
        Collectives of one group run in order, so on the EP group itself these would queue behind the rows
        already posted there and wait for them (docs/expert-parallel.md). A collective call the first time:
        every rank makes every group of the world, in one order; later calls return the same pair. (None, None)
        on the simulated rank's fake backend, whose single process has no peers to wait for."""
        if self._rbd_groups is None:
            self.submesh("ep")  # the mesh exists (the same error as the other group queries otherwise)
            dist = torch.distributed
            node_group = side_group = None
            if dist.get_backend() != "fake":
                timeout = None if self.timeout_s is None else datetime.timedelta(seconds=self.timeout_s)
                for ep_ranks in self.all_groups("ep"):
                    by_node: dict[int, list[int]] = {}
                    for r in ep_ranks:
                        by_node.setdefault(self.node_of(r), []).append(r)
                    for ranks in by_node.values():
                        group = dist.new_group(ranks, timeout=timeout)  # every rank calls it, member or not
                        node_group = group if self.rank in ranks else node_group
                    group = dist.new_group(ep_ranks, timeout=timeout)
                    side_group = group if self.rank in ep_ranks else side_group
            self._rbd_groups = (node_group, side_group)
        return self._rbd_groups


def set_timeout(group: torch.distributed.ProcessGroup, seconds: float) -> None:
    """Make ``group``'s collectives time out after ``seconds`` (gloo and NCCL; older torch: the private setter)."""
    timeout = datetime.timedelta(seconds=seconds)
    if hasattr(group, "set_timeout"):
        group.set_timeout(timeout)
    else:
        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(timeout, group)


def _check_axis(axis: str) -> str:
    if axis not in AXES:
        raise ValueError(f"axis ({axis!r}) must be one of {AXES + (DENSE_AXIS,)}")
    return axis


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)  # SLURM writes "4(x2)" for 4 tasks on each of 2 nodes
    return int(value.split("(")[0]) if value else None
