"""FlexAttention's tile and kernel options for document-masked attention, one attention layer on one GPU, beside
SDPA's causal kernel: what xmoe/model/documents.py picks for bf16 is chosen from this table.

    python benchmarks/bench_flex_options.py                     # skips without a CUDA GPU
    python benchmarks/bench_flex_options.py --seqs 2048 --means 512

Per sequence length (--tokens positions per call, so B = tokens / seq), bf16, 16 heads of 128 (the small preset's
attention): forward + backward of ``flex_attention`` (compiled, as documents.py calls it) with the batch's document
block mask for each candidate of ``OPTIONS``, and of ``scaled_dot_product_attention(is_causal=True)`` on the same
q, k, v (the concatenated path's attention). Documents: lengths drawn from an exponential distribution of mean
--means (seeded), as bench_documents.py draws them. Each candidate's output and gradients are compared with the
default options' (relative to their norm); a candidate that fails to compile is reported, not fatal.
Writes bench_flex_options.json / .md under benchmarks/results/train (or $XMOE_RESULTS_DIR).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without PYTHONPATH

from benchmarks.harness import environment, markdown_table, rel_err, time_ms, write_results

OPTIONS: dict[str, dict | None] = {
    "default": None,
    "rows_safe": {"ROWS_GUARANTEED_SAFE": True},
    "rows_safe_tma": {"ROWS_GUARANTEED_SAFE": True, "USE_TMA": True},
    "rows_safe_contiguous": {"ROWS_GUARANTEED_SAFE": True, "BLOCKS_ARE_CONTIGUOUS": True},
    "fwd_128x128": {"ROWS_GUARANTEED_SAFE": True, "BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
    "fwd_128x64_w8": {"ROWS_GUARANTEED_SAFE": True, "BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
}


def time_case(seq: int, mean: float, tokens: int, names: list[str]) -> list[dict]:
    from benchmarks.bench_documents import random_segments
    from xmoe.model.documents import _compiled_flex, document_block_mask

    device, N, D = torch.device("cuda"), 16, 128
    B = max(1, tokens // seq)
    segments = random_segments(B, seq, mean, 1, device)
    mask = document_block_mask(segments)
    gen = torch.Generator(device).manual_seed(0)
    q, k, v = (
        torch.randn(B, N, seq, D, device=device, generator=gen, dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    grad = torch.randn(B, N, seq, D, device=device, generator=gen, dtype=torch.bfloat16)

    def run(fn):
        out = fn()
        return (out, *torch.autograd.grad(out, (q, k, v), grad))

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    rows = [{"seq": seq, "mean": mean, "options": "sdpa causal", "ms": time_ms(lambda: run(sdpa))}]
    print(rows[-1], flush=True)
    reference = None
    for name in names:
        torch._dynamo.reset()  # each candidate compiles afresh: none runs past the compiler's recompile limit
        opts = OPTIONS[name]

        def flex(opts=opts):
            return _compiled_flex()(q, k, v, block_mask=mask, kernel_options=opts)

        row: dict = {"seq": seq, "mean": mean, "options": name}
        try:
            got = run(flex)
            if reference is None:
                reference = got
            row["max_rel_err"] = max(rel_err(a, b) for a, b in zip(got, reference, strict=True))
            row["ms"] = time_ms(lambda flex=flex: run(flex))
            row["vs_sdpa"] = rows[0]["ms"] / row["ms"]
        except Exception as exc:  # a candidate this GPU or torch cannot build: reported, the sweep goes on
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        rows.append(row)
        print(row, flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16384, help="positions per call (default 16384)")
    p.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--means", type=float, nargs="+", default=[512.0, 2048.0], help="mean document lengths")
    p.add_argument("--options", nargs="+", default=list(OPTIONS), choices=list(OPTIONS))
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_flex_options: skipped, no CUDA GPU")
        return 0
    rows: list[dict] = []
    columns = ["seq", "mean", "options", "ms", "vs_sdpa", "max_rel_err", "error"]
    for seq in args.seqs:
        for mean in args.means:
            rows += time_case(seq, mean, args.tokens, args.options)
            write_results(
                "bench_flex_options",
                rows,
                columns,
                environment() | {"tokens": args.tokens, "options": {n: OPTIONS[n] for n in args.options}},
                "FlexAttention options for document masks, one attention layer, bf16, 16 x 128, forward + backward",
                "vs_sdpa: SDPA causal's time over this row's; max_rel_err: against the default options' output "
                "and gradients. Options of each name: bench_flex_options.json's meta.",
                topic="train",
            )
    print(markdown_table(rows, columns))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
