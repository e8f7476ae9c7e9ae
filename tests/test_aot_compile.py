"""Every Triton kernel of xmoe compiles ahead of time for cuda:90, hip:gfx90a and hip:gfx942 (the FP8 kernels for
the two with FP8 matrix instructions) at every shipped tile configuration, without spilling registers
(xmoe/kernels/aot.py says how launches are recorded and resources read, aot_workloads.py what is launched).

The compiles run in one subprocess, benchmarks/aot_report.py, without TRITON_INTERPRET: conftest.py sets it for the
interpreter tests, and Triton picks interpreter or compiler when a kernel is defined. It compiles 431 distinct
launches in parallel processes. With an empty Triton cache the test takes ~255 s of CPU time: 5.7 min on 2 CPU
cores shared with other work (about half that on 2 idle ones); with a warm one ($TRITON_CACHE_DIR, default
~/.triton/cache) ~15 s for the compiles and ~30 s in all, the huge-tile check included. Skipped when the installed
Triton cannot make these compiles.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the compile checks need the triton package (pip install triton)")

# here under the interpreter: only their tables and parsers are used
from xmoe.kernels import aot, aot_workloads

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(aot.unsupported() is not None, reason=str(aot.unsupported()))


def _report(out: Path, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "aot_report.py"),
            "--out",
            str(out),
            "--jobs",
            str(min(os.cpu_count() or 1, 8)),
            *args,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode in (0, 1), proc.stdout[-2000:] + proc.stderr[-4000:]  # 1: problems, checked below
    (path,) = out.glob("aot_triton*.json")
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    report = _report(tmp_path_factory.mktemp("aot"))
    assert report["uncovered"] == [], f"kernels no workload launches: {report['uncovered']}"
    assert report["missed_classes"] == [], f"shipped classes no workload reaches: {report['missed_classes']}"
    return report["rows"]


def _where(r: dict) -> str:
    return f"{r['target']} {r['kernel']} {r['tile']} {r['flags']} ({r['uses'][0]})"


def test_every_launch_compiles(rows):
    failed = [f"{_where(r)}: {r['error'][:300]}" for r in rows if not r["ok"]]
    assert failed == [], "\n".join(failed)


def test_no_shipped_configuration_spills(rows):
    spilled = [_where(r) for r in rows if r["ok"] and r["spills"] and r["shipped"] and not r["known_spill"]]
    assert spilled == [], "new spills (fix the tile, or add them to aot.KNOWN_SPILLS with the numbers):\n" + "\n".join(
        spilled
    )


def test_known_spills_name_shipped_configurations(rows):
    shipped = {(r["target"], r["kernel"], r["tile"]) for r in rows if r["shipped"]}
    assert set(aot.KNOWN_SPILLS) <= shipped, set(aot.KNOWN_SPILLS) - shipped


def test_every_shipped_kernel_compiles_for_every_target(rows):
    everywhere = {w.name for w in aot_workloads.WORKLOADS if w.shipped and not w.fp8}
    wanted = {r["kernel"] for r in rows if any(u.split(" | ")[1] in everywhere for u in r["uses"])}
    for target in aot_workloads.TARGETS:
        assert wanted <= {r["kernel"] for r in rows if r["target"] == target}, target


def test_16_bit_gemms_run_on_matrix_instructions(rows):
    gemms = [
        r
        for r in rows
        if r["ok"] and "BLOCK_N" in r["tile"] and "BLOCK_K" in r["tile"] and "DOT_PRECISION=None" in r["flags"]
    ]
    assert {r["target"] for r in gemms} == set(aot_workloads.TARGETS)
    assert [_where(r) for r in gemms if not r["mma"]] == []


def test_fp8_dot_compiles_to_fp8_matrix_instructions(rows):
    mma = {r["target"]: r["mma"] for r in rows if r["kernel"] == "_fp8_dot_kernel" and r["ok"]}
    assert set(mma) == {"cuda:90", "hip:gfx942"}  # gfx90a has no fp8 matrix instructions
    assert any("e4m3" in m for m in mma["cuda:90"]), mma
    assert any("fp8" in m for m in mma["hip:gfx942"]), mma


def test_fp8_kernels_take_each_targets_format_and_tiles(rows):
    from xmoe.kernels import tiles

    fp8 = [r for r in rows if r["module"] in ("xmoe.kernels.fp8_quant", "xmoe.kernels.fp8_gemm_kernels")]
    flavour = {"cuda:90": ("*fp8e4nv", "FP8_MAX=448.0", "e4m3"), "hip:gfx942": ("*fp8e4b8", "FP8_MAX=240.0", "fp8")}
    assert {r["target"] for r in fp8} == set(flavour)  # gfx90a has no fp8 matrix instructions
    for r in fp8:
        pointer, fp8_max, mma = flavour[r["target"]]
        descriptor = f"tensordesc<{pointer[1:]}["  # the operands fp8_gemm.uses_tma reads by TMA on sm_90
        assert any(v == pointer or v.startswith(descriptor) for v in r["signature"].values()), _where(r)
        assert fp8_max in r["flags"] or "FP8_MAX" not in r["flags"], _where(r)
        if "BLOCK_K" in r["tile"]:
            assert r["ok"] and any(mma in m for m in r["mma"]), _where(r)
    # gfx942 compiles an MI300X's picks, the 64 KB heuristic's (the H200's 128 x 128 x 128 tiles spill there), for
    # experts of fewer than 64 rows and of more, outputs of the model shapes' widths and of the tiny preset's 64
    mi300x = {
        f"BLOCK_M={c.block_m} BLOCK_N={c.block_n} BLOCK_K={c.block_k} GROUP=128 num_stages={c.num_stages} "
        f"num_warps={c.num_warps}"
        for kernel in tiles.FP8_KERNELS
        for n in (1, 64)
        for width in (None, 64)
        for c in [tiles.heuristic(kernel, n, 1, 64 * 1024, width)]
    }
    picked = {r["tile"] for r in fp8 if r["target"] == "hip:gfx942" and r["shipped"] and "BLOCK_K" in r["tile"]}
    assert picked and picked <= mi300x, picked - mi300x
    # tensor descriptors: the grouped GEMM's ungathered operands on sm_90 only, never a gathered one, never on AMD
    for r in fp8:
        by_tma = {k for k, v in r["signature"].items() if v.startswith("tensordesc<")}
        if r["target"] != "cuda:90" or r["kernel"] != "_fp8_grouped_mm_kernel":
            assert not by_tma, _where(r)
        elif "GATHER=True" in r["flags"]:
            assert by_tma == {"b1_ptr", "b2_ptr"}, _where(r)
        else:
            assert by_tma == {"a1_ptr", "a2_ptr", "b1_ptr", "b2_ptr"}, _where(r)


def test_the_spill_check_catches_a_huge_tile(tmp_path):
    # two 256 x 256 fp32 accumulators over 8 warps: 512 registers a thread on NVIDIA (255 at most), 256 VGPRs a
    # lane on AMD (the most a wave of an 8-wave program gets), before any operand
    report = _report(
        tmp_path,
        "--devices",
        "H200,MI300X",
        "--workloads",
        "fused",
        "--shapes",
        "tiny T=512",
        "--force",
        "up_fwd=256,256,16,8,2",
    )
    huge = [r for r in report["rows"] if r["kernel"] == "_swiglu_up_fwd_kernel"]
    assert {r["target"] for r in huge} == {"cuda:90", "hip:gfx942"}
    assert all(r["ok"] and r["spills"] and not r["known_spill"] for r in huge), huge


def test_shapes_and_plan_are_the_packages():
    import torch

    from xmoe.dispatch.routing import build_plan
    from xmoe.model.presets import get_preset

    for name, layer in aot_workloads.PRESET_LAYERS.items():
        moe = get_preset(name).moe
        assert layer == (moe.hidden_size, moe.ffn_hidden_size, moe.num_experts, moe.top_k), name
    shape = aot_workloads.Shape.preset("small", 100)
    meta = torch.device("meta")
    plan = build_plan(
        torch.empty(shape.tokens, shape.top_k, dtype=torch.long, device=meta),
        torch.empty(shape.tokens, shape.top_k, device=meta),
        shape.experts,
    )
    wanted = (plan.token_ids_N, plan.slot_ids_N, plan.row_of_slot_TK, plan.tokens_per_expert_E)
    got = aot_workloads.layer_tensors(shape, torch.bfloat16).plan_args
    assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in wanted]


def test_resource_parsers():
    usage = " Function _k:\n  REG:255 STACK:56 SHARED:0 LOCAL:0 CONSTANT[0]:640 TEXTURE:0 SURFACE:0 SAMPLER:0\n"
    assert aot.nvidia_resources(usage) == {"regs": 255, "local_bytes": 56, "spills": True}
    assert not aot.nvidia_resources(usage.replace("STACK:56", "STACK:0"))["spills"]
    meta = (
        "  - .agpr_count:     4\n    .private_segment_fixed_size: 0\n    .sgpr_spill_count: 12\n"
        "    .vgpr_count:     128\n    .vgpr_spill_count: 0\n"
    )
    amd = aot.amd_resources(meta)
    assert (amd["vgprs"], amd["agprs"], amd["sgpr_spills"], amd["spills"]) == (128, 4, 12, False)  # SGPRs: in VGPRs
    assert aot.amd_resources(meta.replace("vgpr_spill_count: 0", "vgpr_spill_count: 3"))["spills"]
    assert aot.amd_resources(meta.replace("segment_fixed_size: 0", "segment_fixed_size: 16"))["spills"]
    with pytest.raises(ValueError):
        aot.amd_resources("no metadata")
