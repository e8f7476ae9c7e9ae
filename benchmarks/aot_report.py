"""Ahead-of-time compile report: every Triton kernel of xmoe at every shipped tile configuration, compiled for
cuda:90, hip:gfx90a and hip:gfx942 without a GPU, with its registers / VGPRs, shared memory / LDS and spills.

    PYTHONPATH=. python benchmarks/aot_report.py --out DIR      # DIR/aot_triton<version>.json and .md
    PYTHONPATH=. python benchmarks/aot_report.py --out DIR --devices MI300X --workloads fused \
        --shapes "small T=8192" --force up_fwd=256,256,16,8,2     # one forced tile (block_m, n, k, warps, stages)

A compile report, not a timing: any machine makes it, a CPU one included (Triton compiles for every target
without a GPU). What is compiled: xmoe/kernels/aot_workloads.py; how it is compiled and resources are read:
xmoe/kernels/aot.py. Exit status 1 on a compile error, a kernel no workload launches, a shipped-table class no
workload reaches, or a spill of a shipped configuration not in aot.KNOWN_SPILLS.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without PYTHONPATH

from benchmarks.harness import commit_line, environment, markdown_table
from xmoe.kernels import aot, aot_workloads
from xmoe.kernels.tiles import TileConfig


def _forced(specs: list[str]) -> dict[str, TileConfig]:
    """{"up_fwd": TileConfig(...)} from ["up_fwd=256,256,16,4,2"]."""
    out = {}
    for spec in specs:
        kernel, _, numbers = spec.partition("=")
        out[kernel] = TileConfig(*(int(n) for n in numbers.split(",")))
    return out


def problems(report: dict) -> list[str]:
    """What makes the exit status 1, one line each."""
    rows = report["rows"]
    out = [f"{r['target']} {r['kernel']} {r['tile']} {r['flags']}: {r['error'][:200]}" for r in rows if not r["ok"]]
    out += [
        f"{r['target']} {r['kernel']} {r['tile']} {r['flags']}: spills ({_spill(r)})"
        for r in rows
        if r["ok"] and r["spills"] and r["shipped"] and not r["known_spill"]
    ]
    out += [f"no workload launches {k}" for k in report["uncovered"]]
    out += [f"no workload reaches the shipped class {c}" for c in report["missed_classes"]]
    return out


def _spill(r: dict) -> str:
    if "local_bytes" in r:
        return f"{r['local_bytes']} B local memory" if r["local_bytes"] else "0"
    return f"{r['vgpr_spills']} VGPRs, {r['scratch_bytes']} B scratch" if r["spills"] else "0"


def _used_for(group: list[dict]) -> str:
    """Per device, the tiles.KERNELS names and the number of shape classes a GEMM tile was picked for; for the
    other kernels the shapes (presets) they run at."""
    classes = defaultdict(set)
    for r in group:
        for c in r["classes"]:
            device, key = c.split(": ")
            classes[device].add(key)
    if classes:
        return "; ".join(
            f"{device}: {', '.join(sorted({k.split('|')[0] for k in keys}))} ({_count(keys)})"
            for device, keys in sorted(classes.items())
        )
    return ", ".join(sorted({u.split(" | ")[2].split(" T=")[0] for r in group for u in r["uses"]}))


def _short(instruction: str) -> str:
    """wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 -> wgmma m64n256k16 bf16 (AMD names stay)."""
    m = re.match(r"(wgmma|mma)\.\S*?(m\d+n\d+k\d+)\.(?:row\.col\.)?f32\.(\w+)", instruction)
    return f"{m.group(1)} {m.group(2)} {m.group(3)}" if m else instruction


def _count(keys: set[str]) -> str:
    if all(k.endswith("|fp32") for k in keys):
        return "fp32"
    return "1 class" if len(keys) == 1 else f"{len(keys)} classes"


def condensed(rows: list[dict], target: str) -> str:
    """One line per shipped (kernel, tile) of a target: the worst of its specialisations."""
    groups = defaultdict(list)
    for r in rows:
        if r["target"] == target and r["shipped"] and r["ok"]:
            groups[(r["kernel"], r["tile"])].append(r)
    lines = []
    for (kernel, tile), group in sorted(groups.items()):
        line = {
            "kernel": kernel,
            "tile": tile,
            "variants": len(group),
            "used for": _used_for(group),
            "shared B": max(r["shared"] for r in group),
            "spills": _spill(max(group, key=_spill_size)),
            "matrix instructions": ", ".join(sorted({_short(m) for r in group for m in r["mma"]})) or "none",
        }
        if target.startswith("cuda"):
            line["registers"] = max(r["regs"] for r in group)
        else:
            line.update(
                {
                    "VGPRs": max(r["vgprs"] for r in group),
                    "AGPRs": max(r["agprs"] for r in group),
                    "SGPR spills": max(r["sgpr_spills"] for r in group),
                }
            )
        lines.append(line)
    regs = ["registers"] if target.startswith("cuda") else ["VGPRs", "AGPRs", "SGPR spills"]
    columns = ["kernel", "tile", "variants", "used for", *regs, "shared B", "spills", "matrix instructions"]
    return markdown_table(lines, columns)


def _spill_size(r: dict) -> int:
    return r.get("local_bytes", 0) + r.get("scratch_bytes", 0) + r.get("vgpr_spills", 0)


def full(rows: list[dict], target: str) -> str:
    lines = []
    for r in rows:
        if r["target"] != target:
            continue
        line = {
            "kernel": r["kernel"],
            "tile": r["tile"],
            "specialisation": r["flags"],
            "shipped": "yes" if r["shipped"] else "candidate",
            "ok": r["ok"],
            "shared B": r.get("shared"),
            "spills": _spill(r) if r["ok"] else r["error"][:120],
        }
        line.update({k: r.get(k) for k in ("regs", "vgprs", "agprs", "sgpr_spills")})
        lines.append(line)
    regs = ["regs"] if target.startswith("cuda") else ["vgprs", "agprs", "sgpr_spills"]
    return markdown_table(lines, ["kernel", "tile", "specialisation", "shipped", "ok", *regs, "shared B", "spills"])


def markdown(report: dict) -> str:
    meta, rows = report["meta"], report["rows"]
    out = [
        "# Ahead-of-time compiles of xmoe's Triton kernels: resources per target\n",
        f"{meta['date']}, no GPU (a compile report, not a timing: Triton compiles every target on the CPU), "
        f"torch {meta['torch']}, triton {meta['triton']}\n",
        f"{commit_line(meta)}\n",
        f"Command: `{meta['command']}`\n",
        "Devices stood in for (shared memory per block, shipped tile table): "
        + "; ".join(
            f"{d['name']} ({d['target']}, {d['max_shared'] // 1024} KB, {d['table'] or 'heuristic'})"
            for d in meta["devices"]
        )
        + ". Registers per thread (NVIDIA) from `cuobjdump -res-usage`; "
        "VGPRs / AGPRs per lane (AMD) from the amdgcn metadata; shared B: shared memory / LDS per program. A "
        "spill is local memory (NVIDIA) or VGPR spills / scratch (AMD); SGPRs spilled into VGPR lanes cost no "
        "memory traffic and are listed apart. `variants`: specialisations of one tile (gathered rows or not, "
        "even or ragged tiles, ...), the worst shown.\n",
    ]
    found = problems(report)
    out.append(
        f"{len(rows)} compiles, {sum(not r['ok'] for r in rows)} failed; "
        f"{len(found)} problems" + (":\n\n" + "\n".join(f"* {p}" for p in found) if found else "") + "\n"
    )
    known = [r for r in rows if r["ok"] and r["spills"] and r["shipped"] and r["known_spill"]]
    if known:
        out.append(
            "Known spills of shipped configurations (aot.KNOWN_SPILLS):\n\n"
            + "\n".join(f"* {r['target']} {r['kernel']} {r['tile']} {r['flags']}: {_spill(r)}" for r in known)
            + "\n"
        )
    for target in aot_workloads.TARGETS:
        if any(r["target"] == target for r in rows):
            out.append(f"## {target}: shipped configurations\n\n{condensed(rows, target)}\n")
    for target in aot_workloads.TARGETS:
        if any(r["target"] == target for r in rows):
            out.append(f"## {target}: every compile\n\n{full(rows, target)}\n")
    return "\n".join(out)


def _json(report: dict) -> str:
    """The report as JSON with one row per line."""
    head = json.dumps({k: v for k, v in report.items() if k != "rows"}, indent=1)
    rows = ",\n".join("  " + json.dumps(r, default=str) for r in report["rows"])
    return head[:-2] + ',\n "rows": [\n' + rows + "\n ]\n}\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for aot_triton<version>.json and .md")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiling processes")
    parser.add_argument("--devices", help="comma-separated names of aot_workloads.DEVICES (default: all)")
    parser.add_argument("--workloads", help="comma-separated names of aot_workloads.WORKLOADS (default: all)")
    parser.add_argument(
        "--shapes", help="comma-separated shape names, e.g. 'small T=8192' (default: each workload's own)"
    )
    parser.add_argument(
        "--force",
        action="append",
        default=[],
        metavar="KERNEL=M,N,K,WARPS,STAGES[,GROUP]",
        help="run a tiles.KERNELS kernel with this tile wherever it launches (repeatable)",
    )
    args = parser.parse_args(argv)
    reason = aot.unsupported()
    if reason:
        print(reason, file=sys.stderr)
        return 2
    devices = [d for d in aot_workloads.DEVICES if not args.devices or d.name in args.devices.split(",")]
    workloads = [w for w in aot_workloads.WORKLOADS if w.name in args.workloads.split(",")] if args.workloads else None
    shapes = set(args.shapes.split(",")) if args.shapes else None
    report = aot.check(devices, workloads, shapes, _forced(args.force), args.jobs)
    import triton

    meta = environment()
    meta.update(
        gpu=None,
        triton=triton.__version__,
        devices=[{"name": d.name, "target": d.target, "max_shared": d.max_shared, "table": d.table} for d in devices],
    )
    report = {"meta": meta, **report}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"aot_triton{triton.__version__}"
    (out / f"{stem}.json").write_text(_json(report))
    (out / f"{stem}.md").write_text(markdown(report))
    found = problems(report)
    print("\n".join(found) or f"{len(report['rows'])} compiles, no problems", file=sys.stderr if found else sys.stdout)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
