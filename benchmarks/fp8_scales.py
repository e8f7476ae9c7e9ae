"""FP8 quantisation error of exact scales (amax / max) against power-of-two scales, on CPU, float64.

# R x C a matrix's rows and columns; G = 128

    python benchmarks/fp8_scales.py --out DIR        # fp8_scales.json / .md (default benchmarks/results/fp8)

For each FP8 format, grouping (1 x 128 rows as for activations and gradients, 128 x 128 blocks as for weights) and
a few value distributions (normal; Student-t with 3 degrees of freedom; log-normal row magnitudes; 1% of the
columns 30x larger, as activation outlier channels; SwiGLU outputs), the error ||dequantise(quantise(x)) - x|| /
||x|| of each scaling rule. Both rules round with torch's own conversion. This is the measurement behind
xmoe/kernels/fp8_quant.py's choice of exact scales.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without PYTHONPATH

from benchmarks.harness import RESULTS_ENV, environment, markdown_table, results_dir, write_results

FORMATS = {"e4m3fn": torch.float8_e4m3fn, "e4m3fnuz": torch.float8_e4m3fnuz}
GROUPS = {"1x128": (1, 128), "128x128": (128, 128)}


def distributions(gen: torch.Generator) -> dict:
    shape = (1024, 4096)
    return {
        "normal": torch.randn(shape, generator=gen),
        "student_t3": torch.randn(shape, generator=gen)
        / (torch.randn(3, *shape, generator=gen).square().mean(0)).sqrt(),
        "lognormal_rows": torch.randn(shape, generator=gen) * torch.exp(2 * torch.randn(shape[0], 1, generator=gen)),
        "outlier_columns": torch.randn(shape, generator=gen)
        * torch.where(torch.rand(shape[1], generator=gen) < 0.01, 30.0, 1.0),
        "swiglu": F.silu(torch.randn(shape, generator=gen)) * torch.randn(shape, generator=gen),
    }


def quantisation_error(x: torch.Tensor, dtype: torch.dtype, group: tuple[int, int], pow2: bool) -> float:
    rows, cols = x.shape
    gr, gc = group
    blocks = x.double().reshape(rows // gr, gr, cols // gc, gc)
    scale = blocks.abs().amax(dim=(1, 3), keepdim=True) / torch.finfo(dtype).max
    if pow2:
        scale = 2.0 ** torch.ceil(torch.log2(scale))
    deq = (blocks / scale).float().to(dtype).double() * scale
    return float((deq - blocks).norm() / blocks.norm())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out", default=str(results_dir("fp8")), help="results directory (default benchmarks/results/fp8)"
    )
    args = parser.parse_args()
    os.environ[RESULTS_ENV] = args.out
    rows = []
    for dist, x in distributions(torch.Generator().manual_seed(0)).items():
        for fmt, dtype in FORMATS.items():
            for gname, group in GROUPS.items():
                exact, pow2 = (quantisation_error(x, dtype, group, p) for p in (False, True))
                rows.append(
                    {
                        "format": fmt,
                        "groups": gname,
                        "distribution": dist,
                        "exact_scale_err": exact,
                        "pow2_scale_err": pow2,
                        "pow2_over_exact": pow2 / exact,
                    }
                )
    columns = ["format", "groups", "distribution", "exact_scale_err", "pow2_scale_err", "pow2_over_exact"]
    write_results(
        "fp8_scales",
        rows,
        columns,
        environment(),
        "FP8 quantisation error: exact (amax / max) against power-of-two scales",
        notes="err: ||dequantise(quantise(x)) - x|| / ||x||, float64, 1024 x 4096 values per distribution.",
        topic="fp8",
    )
    print(markdown_table(rows, columns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
