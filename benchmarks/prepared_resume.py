"""A corpus prepared, trained on, killed and resumed: the losses must equal an uninterrupted run's, step for step.

1. a synthetic JSONL corpus of --mb MiB (bench_prepare.make_corpus) prepared with the bytes tokenizer by --workers
   processes (timed);
2. `xmoe train --data SET --steps N` uninterrupted;
3. the same run SIGKILLed once its log passes --kill-at (after its checkpoint at N/2), then `--resume`d to N;
4. every step's loss of 3 against 2, bit for bit. Results: benchmarks/results/data/prepared_resume{tag}.{json,md}.

Every run trains with --deterministic (train.deterministic) unless --nondeterministic: torch's default GPU algorithms
are not all deterministic (SDPA's cuDNN attention among them), so two uninterrupted runs may already differ in the
last bits (the "again" run, 2 once more, shows whether they do).

    PYTHONPATH=. python benchmarks/prepared_resume.py --mb 1024 --steps 100 --workers 16
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_prepare import make_corpus
from harness import environment, write_results

from xmoe.data.prepare import prepare


def _losses(out: Path) -> dict[int, float]:
    lines = (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def _train(out: Path, data: Path, steps: int, extra: list[str], kill_at: int | None = None) -> float:
    """Seconds the run took; with ``kill_at`` it is SIGKILLed once its log holds that step."""
    every = max(1, steps // 2)
    cmd = [sys.executable, "-m", "xmoe", "train", "--out", str(out), "--data", str(data), "--steps", str(steps)]
    cmd += ["--log-every", "1", "--ckpt-every", str(every), *extra]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if kill_at is None:
        _, err = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"training failed: {err[-2000:]}")
        return time.perf_counter() - start
    saved = out / "checkpoints" / f"step_{every:06d}" / "COMPLETE"
    while proc.poll() is None and not (saved.exists() and max(_losses(out), default=0) >= kill_at):
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--tag", default="")
    parser.add_argument(
        "--nondeterministic", action="store_true", help="train without --deterministic (torch's default algorithms)"
    )
    parser.add_argument("train_args", nargs="*", help="more `xmoe train` flags (after --)")
    args = parser.parse_args()
    if not args.nondeterministic:
        args.train_args = ["--deterministic", *args.train_args]
    kill_at = args.steps // 2 + max(1, args.steps // 10)  # past the checkpoint at half-way
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        make_corpus(work / "corpus.jsonl", args.mb)
        start = time.perf_counter()
        m = prepare([str(work / "corpus.jsonl")], work / "set", workers=args.workers, progress=False)
        prepare_s = time.perf_counter() - start
        full_s = _train(work / "full", work / "set", args.steps, args.train_args)
        _train(work / "again", work / "set", args.steps, args.train_args)  # control: is the device deterministic?
        killed_s = _train(work / "part", work / "set", args.steps, args.train_args, kill_at=kill_at)
        reached = max(_losses(work / "part"), default=0)
        resumed_s = _train(work / "part", work / "set", args.steps, [*args.train_args, "--resume"])
        full, part, again = _losses(work / "full"), _losses(work / "part"), _losses(work / "again")
    equal = sorted(full) == sorted(part) == list(range(1, args.steps + 1)) and all(full[s] == part[s] for s in full)
    first_diff = min((s for s in full if part.get(s) != full[s]), default=None)
    control_diff = min((s for s in full if again.get(s) != full[s]), default=None)
    row = {
        "corpus_MiB": args.mb,
        "tokens_M": m["tokens"] / 1e6,
        "documents": m["documents"],
        "prepare_s": prepare_s,
        "workers": args.workers,
        "steps": args.steps,
        "killed_after_step": reached,
        "losses_equal_bitwise": equal,
        "first_differing_step": first_diff,
        "uninterrupted_twice_first_differing_step": control_diff,
        "max_abs_diff": max(abs(full[s] - part.get(s, float("nan"))) for s in full),
        "train_s": full_s,
        "killed_plus_resumed_s": killed_s + resumed_s,
    }
    print(row, flush=True)
    flags = " ".join(args.train_args) or "(defaults: the tiny preset)"
    notes = f"train flags: {flags}; a checkpoint every {args.steps // 2} steps; SIGKILL after step {kill_at}"
    write_results(
        f"prepared_resume{args.tag}",
        [row],
        list(row),
        environment(),
        "Prepared, trained, killed, resumed",
        notes,
        topic="data",
    )
    if not equal:
        raise SystemExit("the resumed run's losses differ from the uninterrupted run's")


if __name__ == "__main__":
    main()
