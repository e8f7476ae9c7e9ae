"""ParallelDims: rank layouts (pure, no process group) for EP-first and DP-first placement, validation, and one real
DeviceMesh on 4 gloo ranks whose groups must match the pure layout."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_distributed

from xmoe.config import ParallelConfig
from xmoe.parallel.dims import ParallelDims, rank_grid


def dims_of(world, node, dp=1, ep=1, tp=1, placement="ep_first", rank=0):
    return ParallelDims.from_config(
        ParallelConfig(dp=dp, ep=ep, tp=tp, placement=placement), world, rank=rank, node_size=node
    )


def groups(world, node, axis, **kw):
    return dims_of(world, node, **kw).all_groups(axis)


# ---- layouts ------------------------------------------------------------------------------------------------


def test_eight_ranks_two_nodes():
    # ep_first: each EP group is one node; gradient reduction of experts crosses nodes
    assert groups(8, 4, "ep", dp=2, ep=4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups(8, 4, "dp", dp=2, ep=4) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # dp_first: data-parallel replicas are neighbours, each EP group spans both nodes
    assert groups(8, 4, "ep", dp=2, ep=4, placement="dp_first") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups(8, 4, "dp", dp=2, ep=4, placement="dp_first") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims_of(8, 4, dp=2, ep=4).nodes_of_group("ep", 5) == [1]
    assert dims_of(8, 4, dp=2, ep=4, placement="dp_first").nodes_of_group("ep", 5) == [0, 1]


def test_sixteen_ranks_nodes_of_eight():
    ep_first = dims_of(16, 8, dp=2, ep=8)
    assert ep_first.all_groups("ep") == [list(range(8)), list(range(8, 16))]
    assert all(len(ep_first.nodes_of_group("ep", r)) == 1 for r in range(16))
    dp_first = dims_of(16, 8, dp=2, ep=8, placement="dp_first")
    assert dp_first.all_groups("ep") == [list(range(0, 16, 2)), list(range(1, 16, 2))]
    assert all(dp_first.nodes_of_group("ep", r) == [0, 1] for r in range(16))
    # every rank sits at the coordinates its rank formula says
    for r in range(16):
        c = dp_first.coords_of(r)
        assert (c["ep"] * 2 + c["dp"]) == r and ep_first.coords_of(r) == {"dp": r // 8, "ep": r % 8, "tp": 0}


def test_thirty_two_ranks_ep_larger_than_a_node():
    # ep = 16 > node size 8: EP-first packs a group into the fewest (2) whole nodes, DP-first spreads it over all 4
    assert dims_of(32, 8, dp=2, ep=16).nodes_of_group("ep", 0) == [0, 1]
    assert dims_of(32, 8, dp=2, ep=16).nodes_of_group("ep", 31) == [2, 3]
    assert dims_of(32, 8, dp=2, ep=16, placement="dp_first").nodes_of_group("ep", 0) == [0, 1, 2, 3]
    assert groups(32, 8, "dp", dp=2, ep=16) == [[r, r + 16] for r in range(16)]


def test_tensor_parallel_is_innermost_for_both_placements():
    ep_first = dims_of(16, 8, dp=2, ep=4, tp=2)
    assert ep_first.group_ranks("tp", 5) == [4, 5]
    assert ep_first.group_ranks("ep", 0) == [0, 2, 4, 6]
    assert ep_first.group_ranks("dp", 0) == [0, 8]
    dp_first = dims_of(16, 8, dp=2, ep=4, tp=2, placement="dp_first")
    assert dp_first.group_ranks("tp", 5) == [4, 5]
    assert dp_first.group_ranks("ep", 0) == [0, 4, 8, 12]
    assert dp_first.group_ranks("dp", 0) == [0, 2]
    for d in (ep_first, dp_first):  # dense data parallelism: every rank of the same TP coordinate, ascending
        assert d.group_ranks("dp_ep", 3) == [1, 3, 5, 7, 9, 11, 13, 15]
        assert [d.coord("dp_ep", r) for r in range(16)] == [r // 2 for r in range(16)]


@pytest.mark.parametrize(
    "world,node,kw",
    [(8, 4, dict(dp=2, ep=4)), (16, 8, dict(dp=2, ep=4, tp=2)), (32, 8, dict(dp=4, ep=8, placement="dp_first"))],
)
def test_every_axis_partitions_the_world(world, node, kw):
    d = dims_of(world, node, **kw)
    for axis in ("dp", "ep", "tp", "dp_ep"):
        flat = sorted(r for g in d.all_groups(axis) for r in g)
        assert flat == list(range(world)), axis
        assert all(g == sorted(g) for g in d.all_groups(axis)), axis  # ascending: see dims.py on group order
        assert all(len(g) == d.size(axis) for g in d.all_groups(axis)), axis


def test_rank_grid_shapes():
    assert rank_grid(2, 3, 1, "ep_first").tolist() == [[[0], [1], [2]], [[3], [4], [5]]]
    assert rank_grid(2, 3, 1, "dp_first").tolist() == [[[0], [2], [4]], [[1], [3], [5]]]


# ---- validation -----------------------------------------------------------------------------------------------


def test_degrees_must_multiply_to_the_world():
    with pytest.raises(ValueError, match=r"dp \* ep \* tp = 2 \* 2 \* 1 = 4 must equal the world size \(8\)"):
        dims_of(8, 8, dp=2, ep=2)


def test_world_must_fill_whole_nodes():
    with pytest.raises(ValueError, match=r"world size \(6\) must be a multiple of the node size \(4\)"):
        dims_of(6, 4, ep=6)
    assert dims_of(2, 8, ep=2).node_size == 8  # fewer ranks than one node: fine


def test_experts_must_split_evenly():
    d = dims_of(8, 8, dp=2, ep=4)
    assert d.check_experts(64) == 16
    with pytest.raises(ValueError, match=r"num_experts \(6\) must be divisible by the expert-parallel degree ep \(4\)"):
        d.check_experts(6)
    with pytest.raises(ValueError, match="num_experts"):
        ParallelDims.from_config(ParallelConfig(ep=4), 4, node_size=4, num_experts=10)


def test_bad_axis_and_placement():
    with pytest.raises(ValueError, match="axis"):
        dims_of(4, 4, ep=4).group_ranks("pp")
    with pytest.raises(ValueError, match="placement"):
        rank_grid(2, 2, 1, "random")


def test_warns_when_groups_straddle_nodes():
    with pytest.warns(UserWarning, match="span"):
        dims_of(12, 4, dp=4, ep=3)  # EP groups of 3 on nodes of 4: [3, 4, 5] crosses a node boundary
    with pytest.warns(UserWarning, match="tp"):
        dims_of(16, 4, dp=2, tp=8)


def test_node_size_from_the_launcher(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "4(x2)")
    assert ParallelDims.from_config(ParallelConfig(dp=2, ep=4), 8, rank=0).node_size == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert ParallelDims.from_config(ParallelConfig(dp=2, ep=4), 8, rank=0).node_size == 2
    assert ParallelDims.from_config(ParallelConfig(dp=2, ep=4, gpus_per_node=8), 8, rank=0).node_size == 8


# ---- a real mesh ------------------------------------------------------------------------------------------------


def _mesh_body(rank: int, world_size: int):
    import torch.distributed as dist

    for cfg in (
        ParallelConfig(dp=2, ep=2),
        ParallelConfig(dp=2, ep=2, placement="dp_first"),
        ParallelConfig(ep=2, tp=2),
        ParallelConfig(dp=2, tp=2, placement="dp_first"),
    ):
        dims = ParallelDims.from_config(cfg, world_size).build_mesh("cpu")
        assert dims.node_size == 2  # LOCAL_WORLD_SIZE from run_distributed
        for axis in ("dp", "ep", "tp", "dp_ep"):
            want = dims.group_ranks(axis)
            assert dist.get_process_group_ranks(dims.group(axis)) == want, (cfg, axis)
            assert dims.submesh(axis).get_local_rank() == dims.coord(axis) == want.index(rank), (cfg, axis)
            # collectives return members in mesh order (what DTensor and FSDP assume)
            out = torch.empty(len(want), dtype=torch.long)
            dist.all_gather_into_tensor(out, torch.tensor([rank]), group=dims.group(axis))
            assert out.tolist() == want, (cfg, axis)


def test_real_mesh_matches_layout():
    run_distributed(_mesh_body, 4, local_world_size=2)
