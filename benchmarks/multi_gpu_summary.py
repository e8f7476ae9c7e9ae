"""The summary of benchmarks/run_multi_gpu.sh: one markdown and one JSON file with what the parts' own files do not
hold (date, GPUs, commit, the command, each part's exit code / time / cap / command, every comparison with the
targets the parts printed, the loss comparison, the predictions, the log tails of failed parts). The script rewrites
it after every part, so a run stopped early still leaves one.

    python benchmarks/multi_gpu_summary.py RESULTS SCRATCH --command "..." --world W --gpus-per-node G [--cpu]

RESULTS: the results folder (the parts' json / md files are read from it); SCRATCH: the script's scratch folder
(parts.tsv: name, exit code, seconds, cap, command per line; NAME.log; plans.log; loss.md).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import commit, commit_line

# the parts' result files, in the order they run (a part of several files: each)
FILES = {
    "ep": "bench_ep_ep*",
    "rbd": "bench_rbd",
    "overlap": "train_multi_gpu_overlap",
    "table": "train_multi_gpu_table",
    "ssmb": "train_multi_gpu_ssmb",
}


def _gpus(cpu: bool) -> str:
    if cpu:
        return "none (--cpu smoke test: gloo CPU processes)"
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
        )
    except OSError:
        return "unknown (no nvidia-smi)"
    names = [n.strip() for n in out.stdout.splitlines() if n.strip()]
    return ", ".join(f"{names.count(n)} x {n}" for n in dict.fromkeys(names)) or "unknown"


def _parts(scratch: Path) -> list[dict]:
    path = scratch / "parts.tsv"
    rows = [line.split("\t") for line in path.read_text().splitlines()] if path.exists() else []
    return [dict(name=r[0], exit=int(r[1]), seconds=int(r[2]), cap=int(r[3]), command=r[4]) for r in rows]


def _results(results: Path) -> list[tuple[str, dict, str]]:
    """(file stem, its json, its markdown) of every part's result present, in the parts' order."""
    found = []
    for pattern in FILES.values():
        for path in sorted(results.glob(f"{pattern}.json")):
            md = path.with_suffix(".md")
            found.append((path.stem, json.loads(path.read_text()), md.read_text() if md.exists() else ""))
    return found


def _text(path: Path) -> str:
    return path.read_text().strip() if path.exists() else "(not run)"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", type=Path)
    p.add_argument("scratch", type=Path)
    p.add_argument("--command", required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--cpu", action="store_true")
    args = p.parse_args(argv)
    parts = _parts(args.scratch)
    results = _results(args.results)
    targets = {stem: data.get("meta", {}).get("targets", []) for stem, data, _ in results}
    summary = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "gpus": _gpus(args.cpu),
        "world": args.world,
        "gpus_per_node_for_rbd": args.gpus_per_node,
        **commit(),
        "command": args.command,
        "parts": parts,
        "targets": targets,
        "files": sorted(p.name for p in args.results.iterdir() if p.is_file()),
    }
    (args.results / "multi_gpu_summary.json").write_text(json.dumps(summary, indent=1))
    lines = [
        f"# Multi-GPU benchmarks, {summary['date']}",
        "",
        f"GPUs: {summary['gpus']}; world {args.world}, RBD virtual nodes of {args.gpus_per_node}",
        "",
        commit_line(summary),
        "",
        f"Command: `{args.command}`",
        "",
        "## Parts",
        "",
        "| part | exit | seconds | cap | command |",
        "|---|---|---|---|---|",
        *(
            f"| {r['name']} | {r['exit']}{' (timeout)' if r['exit'] == 124 else ''} | {r['seconds']} | {r['cap']} | "
            f"`{r['command']}` |"
            for r in parts
        ),
        "",
        "## Against the targets",
        "",
    ]
    for stem, found in targets.items():
        lines += [f"{stem}:", "", *(f"- {t}" for t in found), ""] if found else []
    lines += ["## Loss curves (multi_gpu_loss.json)", "", _text(args.scratch / "loss.md"), ""]
    for stem, _, md in results:
        lines += [f"## {stem}.md (its first 60 lines)", "", *md.splitlines()[:60], ""]
    lines += ["## Predictions", "", "```", _text(args.scratch / "plans.log"), "```"]
    failed = [r for r in parts if r["exit"] != 0]
    for r in failed:
        log = args.scratch / f"{r['name']}.log"
        tail = log.read_text().splitlines()[-30:] if log.exists() else []
        lines += ["", f"### {r['name']}: exit {r['exit']}, last lines of its log", "", "```", *tail, "```"]
    (args.results / "multi_gpu_summary.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
