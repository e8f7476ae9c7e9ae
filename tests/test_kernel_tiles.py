"""Tile-config classes, the multi-expert weight-gradient kernel and the lean fused backward, against float64.

# T tokens, H hidden, F expert ffn, E experts, K top-k, N kept rows

CPU, Triton interpreter, fp32. Each tile-config class the GPU can pick (tiles.CANDIDATES: row tiles of 64 or 128,
reduction steps that do or do not divide H and F, one or several experts per weight-gradient program) is run
here scaled down to interpreter sizes through tiles.force, on odd T and with empty experts.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by conftest.py, before anything imports triton

import gc
import json
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton", reason="the Triton backend needs the triton package (pip install triton)")

from test_triton_kernels import _check_wgrad, _inputs, _loop_reference, _rel, _routing, _wgrad_inputs

from xmoe.dispatch.routing import build_plan
from xmoe.kernels import get_ops, launches, tiles
from xmoe.kernels.grouped_wgrad import grouped_wgrad
from xmoe.kernels.tiles import TileConfig

tops = get_ops("triton", torch.device("cpu"))

# interpreter-sized stand-ins for the GPU classes: (row tile, column tile, reduction step, group)
CLASSES = {
    "base": {},  # tiles.INTERPRETER_CONFIG everywhere
    "short_rows": {k: TileConfig(16, 32, 32, 4, 1) for k in ("up_fwd", "mm", "dx", "down_bwd")},
    "odd_steps": {k: TileConfig(32, 16, 16, 4, 1) for k in tiles.KERNELS},  # 16-deep steps: H=72, F=40 ragged
    "grouped_wgrad": {"wgrad": TileConfig(32, 32, 16, 4, 1, 2), "wgrad2": TileConfig(32, 32, 16, 4, 1, 3)},
}


def _fused(x, w, w1, w3, w2, plan, grad_out):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, w1, w3, w2)]
    out = tops.moe_experts(
        leaves[0],
        leaves[1],
        plan.token_ids_N,
        plan.slot_ids_N,
        plan.row_of_slot_TK,
        plan.tokens_per_expert_E,
        *leaves[2:],
    )
    return [out] + list(torch.autograd.grad(out, leaves, grad_out))


@pytest.mark.parametrize("cls", sorted(CLASSES))
def test_fused_layer_per_tile_class(cls):
    # T odd (not a multiple of any tile); E=9 of which experts 1, 4 and 6 get no rows; H=72 spans three column
    # chunks of the lean path (32, 32, 8) and F=40 a ragged column tile
    T, H, Fd, E, K = 17, 72, 40, 9, 3
    assert tops.column_chunks(H, T * K, T) == [(0, 32), (32, 64), (64, 72)]
    ids, scores = _routing(T, 6, K, seed=21)
    ids = torch.tensor([0, 2, 3, 5, 7, 8])[ids]
    plan = build_plan(ids, scores, E)
    assert plan.tokens_per_expert_E[[1, 4, 6]].tolist() == [0, 0, 0]
    x, w, w1, w3, w2 = _inputs(T, H, Fd, E, K, seed=21)
    grad_out = torch.randn(T, H, generator=torch.Generator().manual_seed(22))
    ref_out, leaves64 = _loop_reference(x, w, w1, w3, w2, ids, plan.row_of_slot_TK)
    ref = [ref_out] + list(torch.autograd.grad(ref_out, leaves64, grad_out.double()))
    with tiles.force(CLASSES[cls]):
        got = _fused(x, w, w1, w3, w2, plan, grad_out)
    for name, g, r in zip(["out", "grad_x", "grad_weights", "grad_w1", "grad_w3", "grad_w2"], got, ref, strict=False):
        assert _rel(g, r) < 1e-5, (cls, name, _rel(g, r))


def test_lean_backward_with_drops_matches_float64_and_is_deterministic():
    T, H, Fd, E, K = 23, 72, 24, 5, 3
    ids, scores = _routing(T, E, K, seed=5)
    plan = build_plan(ids, scores, E, capacity=12)  # some slots dropped
    assert int(plan.num_dropped) > 0
    x, w, w1, w3, w2 = _inputs(T, H, Fd, E, K, seed=5)
    grad_out = torch.randn(T, H, generator=torch.Generator().manual_seed(6))
    lean = [_fused(x, w, w1, w3, w2, plan, grad_out) for _ in range(2)]
    ref_out, leaves64 = _loop_reference(x, w, w1, w3, w2, ids, plan.row_of_slot_TK)
    ref = [ref_out] + list(torch.autograd.grad(ref_out, leaves64, grad_out.double()))
    for a, b, r in zip(lean[0], lean[1], ref, strict=False):
        assert torch.equal(a, b)  # bitwise, run to run
        assert _rel(a, r) < 1e-5


def test_second_backward_through_overwritten_saves_fails_loudly():
    # the lean backward writes gradients over the saved h1/h3; retain_graph cannot reuse them silently
    T, H, Fd, E, K = 7, 16, 16, 3, 2
    ids, scores = _routing(T, E, K, seed=8)
    plan = build_plan(ids, scores, E)
    x, w, w1, w3, w2 = [t.requires_grad_() for t in _inputs(T, H, Fd, E, K, seed=8)]
    out = tops.moe_experts(
        x, w, plan.token_ids_N, plan.slot_ids_N, plan.row_of_slot_TK, plan.tokens_per_expert_E, w1, w3, w2
    ).sum()
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        out.backward()


COUNTS_WITH_EMPTY_GROUPS = [0, 0, 33, 97, 1, 0, 0, 32, 31]  # groups of 2 and of 3 both hold an all-empty group


@pytest.mark.parametrize("group", [2, 3])
@pytest.mark.parametrize("gather", ["a", "b", "none"])
def test_flat_wgrad_groups_with_empty_experts(gather, group):
    # several experts per program: accumulators stored and reset at each expert's last row tile, experts with no
    # rows (inside a group and whole groups) written as zeros, E not a multiple of the group, M and NC ragged
    counts = torch.tensor(COUNTS_WITH_EMPTY_GROUPS)
    a, a_idx, b1, b2, b_idx = _wgrad_inputs(counts, gather, seed=12)
    cfg = TileConfig(32, 32, 32, 4, 1, group)
    with tiles.force({"wgrad": cfg, "wgrad2": cfg}):
        c1, c2 = grouped_wgrad(a, a_idx, b1, b2, b_idx, counts)
        single, _ = grouped_wgrad(a, a_idx, b1, None, b_idx, counts)
    for got, b in ((c1, b1), (c2, b2), (single, b1)):
        _check_wgrad(got, a, a_idx, b, b_idx, counts)


def test_shape_class_and_pick_order():
    assert tiles.shape_class("wgrad2", 7168, 2048, 131072, 256) == "wgrad2|k8192|n2048|r512"
    assert tiles.shape_class("mm", 1408, 1000, 5, 64) == "mm|k2048|n1024|r1"  # fewer rows than experts
    forced = TileConfig(16, 16, 16, 4, 1)
    before = launches.snapshot()
    with tiles.force({"mm": forced}):
        assert tiles.pick("mm", torch.float32, torch.device("cpu"), 64, 64, 100, 4) == forced
    assert tiles.pick("mm", torch.float32, torch.device("cpu"), 64, 64, 100, 4) == tiles.INTERPRETER_CONFIG
    assert launches.since(before) == {"tiles": {"forced": 1, "interpreter": 1}}  # each pick counts its source
    with pytest.raises(ValueError, match="unknown kernel"):
        with tiles.force({"nope": forced}):
            pass


def test_shipped_tables_are_valid_candidates(tmp_path):
    # every shipped table (one per GPU model) names real kernels, well-formed classes and configs that fit
    tables = sorted(tiles.SHIPPED_DIR.glob("*.json"))
    assert tables, "xmoe/kernels/tuned/ ships no table"
    for path in tables:
        table = tiles.shipped_table(path.stem)
        assert table, path
        for key, cfg in table.items():
            kernel, depth, width, rows = key.split("|")
            assert kernel in tiles.KERNELS and depth[0] == "k" and width[0] == "n" and rows[0] == "r", key
            assert cfg in tiles.CANDIDATES[kernel] or cfg == tiles.BASE[kernel], (key, cfg)
            assert tiles.smem_bytes(kernel, cfg) <= 227 * 1024, (key, cfg)
    assert tiles.shipped_table("No_Such_GPU") == {}
    (tmp_path / "Broken_GPU.json").write_text("{not json")
    assert tiles.shipped_table("Broken_GPU", tmp_path) == {}


def test_a_class_the_table_lacks_takes_its_neighbours_entry(monkeypatch):
    a, b, c, d = (
        TileConfig(128, 256, 64, 8, 4),
        TileConfig(128, 128, 64, 8, 3),
        TileConfig(64, 128, 64, 4, 4),
        TileConfig(128, 128, 32, 4, 6),
    )
    table = {
        "mm|k2048|n2048|r2048": a,
        "mm|k2048|n1024|r4096": b,
        "mm|k2048|n128|r512": c,
        "wgrad|k2048|n2048|r1024": d,
    }
    assert tiles.neighbour(table, "mm|k2048|n2048|r4096") == a  # rows one power of two away come before width
    assert tiles.neighbour(table, "mm|k2048|n2048|r1024") == a
    assert tiles.neighbour(table, "mm|k2048|n1024|r2048") == b  # its rows neighbour, before a at twice the width
    assert tiles.neighbour(table, "mm|k2048|n4096|r2048") == a  # no rows neighbour: the narrower width's
    assert tiles.neighbour(table, "mm|k2048|n2048|r8192") is None  # two powers of two away
    assert tiles.neighbour(table, "mm|k2048|n4096|r4096") is None  # one away in both
    assert tiles.neighbour(table, "mm|k4096|n2048|r2048") is None  # another reduction length
    assert tiles.neighbour(table, "dx|k2048|n2048|r2048") is None  # another kernel
    assert tiles.neighbour(table, "mm|k2048|n128|r64") is None  # few rows per expert: the heuristic's 64-row tiles
    assert tiles.neighbour(table, "mm|k2048|n128|r1024") == c
    assert tiles.neighbour({"mm|k2048|n256|r1024": a}, "mm|k2048|n128|r1024") is None  # a tile wider than the output
    # pick: the table's own class, else a neighbour's entry, else the heuristic
    monkeypatch.setattr(tiles, "interpreting", lambda: False)
    monkeypatch.setattr(tiles, "device_budget", lambda device: (227 * 1024, table))
    monkeypatch.setattr(tiles, "_PICKED", {})
    gpu = torch.device("cuda", 0)
    before = launches.snapshot()
    assert tiles.pick("mm", torch.bfloat16, gpu, 1408, 2048, 2048 * 64, 64) == a
    assert tiles.pick("mm", torch.bfloat16, gpu, 1408, 2048, 4096 * 64, 64) == a
    assert tiles.pick("wgrad", torch.bfloat16, gpu, 1408, 2048, 2048 * 64, 64) == d
    assert tiles.pick("dx", torch.bfloat16, gpu, 1408, 2048, 2048 * 64, 64) == tiles.heuristic(
        "dx", 2048 * 64, 64, 227 * 1024, 2048
    )
    assert tiles.pick("mm", torch.bfloat16, gpu, 1408, 2048, 2048 * 64, 64) == a  # remembered, with its source
    assert launches.since(before) == {"tiles": {"heuristic": 1, "neighbour": 2, "table": 2}}


def test_heuristic_fits_the_gpu():
    h200, a100, amd = 227 * 1024, 164 * 1024, 64 * 1024
    # H200: the sweep winners; experts with < 64 rows each: 64-row tiles
    assert tiles.heuristic("mm", 16384 * 6, 64, h200) == tiles.BASE["mm"]
    assert tiles.heuristic("up_fwd", 1000, 64, h200).block_m == 64
    # no tile wider than the output (at least 64 columns); the FP8 up kernel keeps its 128 columns, in 64-row tiles
    # where F is under 128
    assert tiles.heuristic("dx", 16384, 16, h200, width=128).block_n == 128 < tiles.BASE["dx"].block_n
    assert tiles.heuristic("mm", 16384, 16, h200, width=40).block_n == 64
    assert tiles.heuristic("dx", 16384, 16, h200, width=4096) == tiles.heuristic("dx", 16384, 16, h200)
    assert tiles.heuristic("fp8_up", 16384, 16, h200, width=64).block_m == 64
    assert tiles.heuristic("fp8_up", 16384, 16, h200, width=1536) == tiles.FP8_BASE["fp8_up"]
    for kernel in tiles.KERNELS:
        for smem in (h200, a100, amd):
            cfg = tiles.heuristic(kernel, 16384, 64, smem)
            assert tiles.smem_bytes(kernel, cfg) <= smem, (kernel, smem, cfg)
            assert cfg.num_stages >= 2
    assert tiles.heuristic("mm", 16384, 64, a100).num_stages == 3  # 4 x 48 KB does not fit 164 KB
    for kernel, cands in tiles.CANDIDATES.items():
        assert cands[0] == tiles.base_config(kernel) and len(set(cands)) == len(cands)
    for kernel in tiles.FP8_KERNELS:  # FP8: steps inside one 128-wide scale group; AMD: the tiles that do not spill
        for smem in (h200, a100, amd):
            cfg = tiles.heuristic(kernel, 16384, 64, smem)
            assert 128 % cfg.block_k == 0 and (kernel != "fp8_up" or cfg.block_n == 128), (kernel, cfg)
        cfg = tiles.heuristic(kernel, 16384 * 6, 64, amd)
        assert (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps) == (64, 128, 64, 4), (kernel, cfg)


def test_autotune_keeps_the_fastest_candidate_that_runs(tmp_path):
    times = {c: 3.0 - i for i, c in enumerate(tiles.CANDIDATES["wgrad"])}  # later candidates faster...
    broken = tiles.CANDIDATES["wgrad"][-1]  # ...but the fastest fails to compile

    def run(cfg):
        if cfg == broken:
            raise RuntimeError("PassManager::run failed")
        return cfg

    def timer(fn):
        return times[fn()]

    best = tiles._tune("wgrad", run, 227 * 1024, timer)
    assert best == tiles.CANDIDATES["wgrad"][-2]
    assert tiles._tune("wgrad", lambda cfg: 1 / 0, 227 * 1024, timer) is None  # nothing runs: caller keeps its pick
    # the on-disk cache: one JSON per GPU and Triton version, merged with what other processes wrote meanwhile
    path = tmp_path / "tiles-NVIDIA_H200-triton3.6.0.json"
    cache = tiles._DiskCache(path)
    assert cache.get("wgrad|k2048|n8192|r512") is None
    path.write_text(json.dumps({"mm|k2048|n1024|r512": [128, 256, 64, 8, 4, 1]}))
    cache.put("wgrad|k2048|n8192|r512", best)
    again = tiles._DiskCache(path)
    assert again.get("wgrad|k2048|n8192|r512") == best
    assert again.get("mm|k2048|n1024|r512") == TileConfig(128, 256, 64, 8, 4, 1)


class _LiveBytes(TorchDispatchMode):
    """Peak bytes of tensor storage alive, counting the tensors ops return (views and in-place results excepted)
    until they are freed, and leaving out tensors of the shapes in ``skip_shapes`` (the weight gradients)."""

    def __init__(self, skip_shapes=()):
        super().__init__()
        self.tracked = {}  # storage data_ptr -> weak reference to the tensor that owns it
        self.skip_shapes = set(skip_shapes)
        self.peak = 0

    def live(self):
        for ptr, ref in list(self.tracked.items()):
            if ref() is None:
                del self.tracked[ptr]
        return sum(
            ref().untyped_storage().nbytes()
            for ref in self.tracked.values()
            if tuple(ref().shape) not in self.skip_shapes
        )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not (func.is_view or func._schema.is_mutable):
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0:
                    ptr = t.untyped_storage().data_ptr()
                    old = self.tracked.get(ptr)
                    old = old() if old is not None else None
                    # a new storage at the address of one freed (or resized to 0 bytes) while its tensor lives on
                    if old is None or old.untyped_storage().data_ptr() != ptr:
                        self.tracked[ptr] = weakref.ref(t)
        self.peak = max(self.peak, self.live())
        return out


def _backward_transient(wgrad="auto"):
    """Peak bytes the fused backward holds above what was alive when it started, weight gradients left out."""
    T, H, Fd, E, K = 64, 128, 48, 4, 4
    ids, scores = _routing(T, E, K, seed=13)
    plan = build_plan(ids, scores, E)
    leaves = [t.requires_grad_() for t in _inputs(T, H, Fd, E, K, seed=13)]
    grad_out = torch.randn(T, H)
    with _LiveBytes({(E, H, Fd), (E, Fd, H)}) as mem:
        out = tops.moe_experts(
            leaves[0],
            leaves[1],
            plan.token_ids_N,
            plan.slot_ids_N,
            plan.row_of_slot_TK,
            plan.tokens_per_expert_E,
            *leaves[2:],
            wgrad=wgrad,
        )
        gc.collect()
        mem.peak = start = mem.live()
        torch.autograd.grad(out, leaves, grad_out)
    return mem.peak - start, T * K, T, H, Fd


def test_lean_backward_allocates_one_nf_buffer_and_one_column_chunk():
    # fp32 bytes: da (N, F), then, once dW2 is made and h1's storage (N, F) freed, one dx column chunk (N, 32) and
    # dx (T, H), plus per-row vectors (a backward keeping every buffer would hold dh1, dh3 and the whole (N, H) dx)
    lean, N, T, H, Fd = _backward_transient()
    expected = 4 * max(N * Fd, N * 32 + T * H)  # da alone; then the chunk and dx with h1's N * F freed
    assert N * Fd < N * 32 + T * H  # so the dx step is the peak, and only with h1 freed is it this low
    assert expected <= lean <= expected + 4 * 8 * N, (lean, expected)


def _cpu_grouped_mm_wgrad_runs():
    try:
        a, b = torch.ones(8, 8), torch.ones(8, 8)
        return bool(torch._grouped_mm(a.t(), b, offs=torch.tensor([3, 8], dtype=torch.int32))[1, 0, 0] == 5)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


needs_cpu_grouped_mm = pytest.mark.skipif(
    not _cpu_grouped_mm_wgrad_runs(), reason="this torch build has no CPU torch._grouped_mm for 2-D operands"
)


def test_wgrad_engine_rules():
    from xmoe.kernels.grouped_wgrad import wgrad_engine

    x = torch.zeros(4, 16)
    assert wgrad_engine(x, 64, 8, 16, 16, "auto") == "triton"  # auto: only sm_90 GPUs in bf16 take torch._grouped_mm
    assert wgrad_engine(x, 64, 8, 16, 16, "fp8") == "triton"  # as auto, for the bf16 gradients it does not concern
    assert wgrad_engine(x, 64, 8, 16, 16, "grouped_mm") == "grouped_mm"
    assert wgrad_engine(x, 64, 8, 12, 16, "grouped_mm") == "triton"  # H not a multiple of 8: its stride rule
    assert wgrad_engine(x, 64, 8, 16, 20, "grouped_mm") == "triton"
    assert wgrad_engine(x, 0, 8, 16, 16, "grouped_mm") == "triton"  # no rows
    assert wgrad_engine(x.half(), 64, 8, 16, 16, "grouped_mm") == "triton"  # fp16: _grouped_mm takes bf16 (CPU fp32)


@needs_cpu_grouped_mm
@pytest.mark.parametrize("path", ["fused", "ops"])
def test_grouped_mm_wgrad_engine_matches_float64(path, monkeypatch):
    # the Hopper path's weight gradients (torch._grouped_mm over gathered rows), run here on CPU in fp32: T odd,
    # experts 1, 4 and 6 empty, capacity drops; H and F multiples of 8 as the engine requires
    from test_triton_kernels import _run

    from xmoe.kernels import grouped_wgrad as wgrad_module

    calls = []
    real = wgrad_module.grouped_mm_wgrad
    monkeypatch.setattr(wgrad_module, "grouped_mm_wgrad", lambda *a: calls.append(1) or real(*a))
    T, H, Fd, E, K = 17, 72, 40, 9, 3
    ids, scores = _routing(T, 6, K, seed=31)
    ids = torch.tensor([0, 2, 3, 5, 7, 8])[ids]
    plan = build_plan(ids, scores, E, capacity=7)
    assert plan.tokens_per_expert_E[[1, 4, 6]].tolist() == [0, 0, 0] and int(plan.num_dropped) > 0
    x, w, w1, w3, w2 = _inputs(T, H, Fd, E, K, seed=31)
    grad_out = torch.randn(T, H, generator=torch.Generator().manual_seed(32))
    ref_out, leaves64 = _loop_reference(x, w, w1, w3, w2, ids, plan.row_of_slot_TK)
    ref = [ref_out] + list(torch.autograd.grad(ref_out, leaves64, grad_out.double()))
    got = _run(tops, path, x, w, w1, w3, w2, plan, grad_out, wgrad="grouped_mm")
    assert len(calls) == 3  # dW2, dW1, dW3
    for name, g, r in zip(["out", "grad_x", "grad_weights", "grad_w1", "grad_w3", "grad_w2"], got, ref, strict=False):
        assert _rel(g, r) < 1e-5, (path, name, _rel(g, r))
    for e in (1, 4, 6):  # experts with no rows get exact zeros
        assert torch.count_nonzero(got[3][e]) == 0 and torch.count_nonzero(got[5][e]) == 0


@needs_cpu_grouped_mm
def test_grouped_mm_engine_holds_one_gathered_buffer_at_a_time():
    # fp32 bytes: grad_out's gathered rows (N, H) and da (N, F) for dW2, freed (with h1's storage) before dx
    # (T, H) and its column chunk, then x's gathered rows (N, H) beside dx for dW1 and dW3
    peak, N, T, H, Fd = _backward_transient(wgrad="grouped_mm")
    expected = 4 * max(N * H + N * Fd, N * 32 + T * H, T * H + N * H)  # the three steps, h1's N * F freed after dW2
    assert expected <= peak <= expected + 4 * 8 * N, (peak, expected)
