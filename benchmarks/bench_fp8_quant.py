"""The FP8 weight quantiser (``fp8_quant.quantize_expert_weights``: every expert weight in 128 x 128 blocks, in its
own layout and transposed, once per optimizer step) at the model shapes, per launch configuration of
``_quant_blocks_kernel`` (``fp8_quant._quantize_blocks_into``'s chunk and warps), side by side in one run.

    python benchmarks/bench_fp8_quant.py --out benchmarks/results/fp8 [--shapes small medium] [--configs 32x4 128x16]

A configuration is CHUNK x num_warps (rows of a block per pass, warps per program); the shipped one is what
``quantize_expert_weights`` launches. Every configuration's output is checked bitwise against the shipped one's
(the same block scales and values by construction). Effective rate: the 6 bytes per weight the copies need at
least (4 read, 2 written). Writes bench_fp8_quant.json / .md into --out. Needs a GPU with FP8 (sm_89+, gfx942+).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without PYTHONPATH

from benchmarks.harness import RESULTS_ENV, environment, time_ms, write_results
from xmoe.kernels import fp8_quant
from xmoe.model.presets import PRESETS


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="directory for bench_fp8_quant.json / .md (default: print only)")
    p.add_argument("--shapes", nargs="+", default=["small", "medium", "large"], help="model presets")
    p.add_argument("--configs", nargs="+", default=["32x4", "64x8", "128x8", "128x16"], help="CHUNKxWARPS")
    args = p.parse_args()
    interpret = os.environ.get("TRITON_INTERPRET") == "1"  # a CPU check of this script: small shapes only
    if not torch.cuda.is_available() and not interpret:
        print("bench_fp8_quant: skipped, no GPU")
        return
    dev = torch.device("cpu" if interpret else "cuda")
    form = fp8_quant.fp8_format(dev)
    fmt = form.name
    rows = []
    for shape in args.shapes:
        m = PRESETS[shape]()
        E, H, F = m.moe.num_experts, m.moe.hidden_size, m.moe.ffn_hidden_size
        gen = torch.Generator(device=dev).manual_seed(0)
        w1, w3, w2 = (torch.randn(E, a, b, device=dev, generator=gen) for a, b in ((H, F), (H, F), (F, H)))

        def shipped(w1=w1, w3=w3, w2=w2):
            return fp8_quant.quantize_expert_weights(w1, w3, w2, fmt)

        ms = time_ms(shipped, warmup_ms=50, rep_ms=300)
        gb = 3 * w1.numel() * 6 / 1e9
        rows.append({"shape": shape, "config": "shipped (quantize_expert_weights)", "ms": ms, "tb_s": gb / ms})
        print(f"{shape} shipped {ms:.3f} ms {gb / ms:.2f} TB/s", flush=True)
        for w in (w1, w2):  # per kernel: w1 and w3 share a shape
            e, r, c = w.shape
            ref = fp8_quant.quantize_blocks(w, fmt)
            for config in args.configs:
                chunk, warps = (int(v) for v in config.split("x"))
                out = [torch.empty_like(t) for t in ref]
                fp8_quant._quantize_blocks_into(w, *out, form, chunk, warps)
                same = all(torch.equal(_bits(a), _bits(b)) for a, b in zip(out, ref, strict=True))
                ms = time_ms(
                    lambda w=w, out=out, chunk=chunk, warps=warps: fp8_quant._quantize_blocks_into(
                        w, *out, form, chunk, warps
                    )
                )
                row = {"shape": shape, "config": f"({e}, {r}, {c}) CHUNK={chunk} num_warps={warps}", "ms": ms}
                rows.append({**row, "tb_s": w.numel() * 6 / 1e9 / ms, "bitwise_equal_to_shipped": same})
                print(f"{shape} {row['config']} {ms:.3f} ms {rows[-1]['tb_s']:.2f} TB/s same={same}", flush=True)
    if args.out:
        os.environ[RESULTS_ENV] = args.out
        meta = {**environment(), "format": fmt}
        write_results(
            "bench_fp8_quant",
            rows,
            ["shape", "config", "ms", "tb_s", "bitwise_equal_to_shipped"],
            meta,
            "FP8 weight quantiser: 128 x 128 blocks, both layouts, per launch configuration",
            topic="fp8",
        )


if __name__ == "__main__":
    main()
