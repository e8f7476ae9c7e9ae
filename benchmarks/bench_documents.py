"""Document-masked attention and multi-token prediction on one GPU: the FlexAttention path checked against the dense
mask, then whole-model forward + backward time beside the plain causal model.

    PYTHONPATH=. python benchmarks/bench_documents.py            # skips without a CUDA GPU
    PYTHONPATH=. python benchmarks/bench_documents.py --check-only
    PYTHONPATH=. python benchmarks/bench_documents.py --seqs 4096 --means 2048   # one length, some rows

1. Check (xmoe/model/documents.py): multi-head (16 x 128), grouped-query (16 query, 4 key/value heads) and latent
   attention's widths (q/k 192, v 128), S = 2085 (not a multiple of the 128-position block) in rows of random
   documents (mean 300 positions): ``document_attention`` with the batch's FlexAttention block mask against the dense
   (B, 1, S, S) mask through SDPA on the same GPU, output and q / k / v gradients, fp32 (TF32 off) and bf16, relative
   to the dense result's norm; exits 1 past the tolerances.
2. Whole model: the small preset's shape (H 2048, 64 experts of width 1408, top-6) with --layers layers, compiled
   regions and bf16 autocast as `xmoe train` runs them, --tokens tokens per micro-batch at seq 2048 and 4096:
   forward + backward of the loss (no optimizer step), median over timed calls (harness.time_ms), for
   * concat: no segments (the causal path),
   * mask, documents of mean 512 and of mean 2048 positions (lengths drawn from an exponential distribution,
     seeded, cut at the row's end),
   * MTP depth 1 (concat) beside its FLOP count: xmoe's formula for depth 1 over depth 0 (model/flops.py).
Writes bench_documents.json / .md under benchmarks/results/train (or $XMOE_RESULTS_DIR). Targets (docs/architecture.md):
mask >= 0.97x the concat throughput, MTP depth 1's time ratio within 5% of its FLOP ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without PYTHONPATH

from benchmarks.harness import environment, rel_err, time_ms, write_results

ATTENTION = {  # name: (query heads, key/value heads, q/k width, v width)
    "mha": (16, 16, 128, 128),
    "gqa": (16, 4, 128, 128),
    "mla_widths": (16, 16, 192, 128),
}
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def random_segments(batch: int, seq: int, mean: float, seed: int, device) -> torch.Tensor:
    """(batch, seq) int32 document indices: lengths ~ exponential(mean) (at least 1), cut at each row's end."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        lengths = (torch.empty(seq).exponential_(1 / mean, generator=gen).ceil().long()).clamp(min=1)
        starts = lengths.cumsum(0)
        rows.append(torch.bucketize(torch.arange(seq), starts, right=True))
    return torch.stack(rows).to(device, torch.int32)


def check_attention() -> list[dict]:
    from xmoe.model.documents import Documents, document_attention, document_visible, rotary_positions

    torch.backends.cuda.matmul.allow_tf32 = False
    device, B, S = torch.device("cuda"), 2, 2085
    segments = random_segments(B, S, 300, 0, device)
    dense = Documents(rotary_positions(segments), visible_B1SS=document_visible(segments))
    flex = Documents.build(segments, segments)  # (the second argument stands for the tokens: their shape, device)
    assert flex.block_mask is not None, "CUDA documents take the FlexAttention path"
    rows = []
    for name, (N, G, D, Dv) in ATTENTION.items():
        for dtype in (torch.float32, torch.bfloat16):
            gen = torch.Generator(device).manual_seed(1)
            q, k, v = (
                torch.randn(B, n, S, d, device=device, generator=gen, dtype=dtype, requires_grad=True)
                for n, d in ((N, D), (G, D), (G, Dv))
            )
            grad = torch.randn(B, N, S, Dv, device=device, generator=gen, dtype=dtype)
            results = []
            for docs in (flex, dense):
                out = document_attention(q, k, v, docs)
                results.append((out, *torch.autograd.grad(out, (q, k, v), grad)))
            errors = [rel_err(got, want) for got, want in zip(*results, strict=True)]
            row = {"attention": name, "dtype": str(dtype).removeprefix("torch."), "out": errors[0]}
            row.update(dq=errors[1], dk=errors[2], dv=errors[3], ok=max(errors) < TOLERANCE[dtype])
            rows.append(row)
            print(row, flush=True)
    return rows


def time_model(args, seq: int, mean: float | None, mtp_depth: int) -> dict:
    from xmoe.model.flops import FlopDims, train_flops
    from xmoe.model.presets import get_preset
    from xmoe.parallel.build import build_model

    cfg = get_preset("small")
    cfg = dataclasses.replace(cfg, num_layers=args.layers, max_seq_len=max(seq, cfg.max_seq_len), mtp_depth=mtp_depth)
    device = torch.device("cuda")
    # the previous case's model: the compiler's caches hold its compiled regions (and through them its weights)
    # until reset; then its caching blocks go back too
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = build_model(cfg, device, compile="on").model
    batch = args.tokens // seq
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), device=device)
    segments = None if mean is None else random_segments(batch, seq, mean, 1, device)

    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], tokens[:, 1:], segments_BS=segments)
        loss.backward()

    ms = time_ms(step, warmup_ms=2000, rep_ms=3000)
    flops = train_flops(FlopDims.from_model_config(cfg, seq), batch)
    row = {"seq": seq, "documents": "concat" if mean is None else f"mask, mean {mean:g}", "mtp_depth": mtp_depth}
    row.update(ms=ms, tokens_per_s=batch * seq / ms * 1e3, model_tflops=flops / ms / 1e9)
    row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(row, flush=True)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4, help="layers of the small preset's shape (default 4)")
    p.add_argument("--tokens", type=int, default=16384, help="tokens per micro-batch (default 16384)")
    p.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096], help="sequence lengths (default 2048 4096)")
    p.add_argument(
        "--means", type=float, nargs="*", default=[512.0, 2048.0], help="mean document lengths (default 512 2048)"
    )
    p.add_argument("--no-mtp", action="store_true", help="leave out the MTP depth 1 row (the concat row stays)")
    p.add_argument("--check-only", action="store_true", help="only the attention check")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_documents: skipped, no CUDA GPU (FlexAttention's fused kernels and the timing need one)")
        return 0
    checks = check_attention()
    rows: list[dict] = []
    meta = environment() | {"layers": args.layers, "tokens": args.tokens, "checks": checks}
    _write(rows, meta, checks)
    for seq in [] if args.check_only else args.seqs:
        base = time_model(args, seq, None, 0)
        rows.append(base)
        for mean in args.means:
            rows.append(time_model(args, seq, mean, 0))
            rows[-1]["vs_concat"] = base["ms"] / rows[-1]["ms"]  # throughput against the causal path
            _write(rows, meta, checks)  # after each row: a run cut short keeps what it measured
        if not args.no_mtp:
            mtp = time_model(args, seq, None, 1)
            # its time over depth 0's, beside its FLOPs over depth 0's (xmoe's formula, the same seq and batch)
            mtp["time_ratio"] = mtp["ms"] / base["ms"]
            mtp["flop_ratio"] = mtp["model_tflops"] * mtp["ms"] / (base["model_tflops"] * base["ms"])
            rows.append(mtp)
        _write(rows, meta, checks)
    return 0 if all(c["ok"] for c in checks) else 1


def _write(rows: list[dict], meta: dict, checks: list[dict]) -> None:
    columns = ["seq", "documents", "mtp_depth", "ms", "tokens_per_s", "model_tflops", "vs_concat", "time_ratio"]
    columns += ["flop_ratio", "peak_gib"]
    notes = "Check (flex vs dense mask, relative errors): " + "; ".join(
        f"{c['attention']} {c['dtype']} out {c['out']:.1e} dq {c['dq']:.1e}" for c in checks
    )
    write_results(
        "bench_documents", rows, columns, meta, "Document masking and multi-token prediction", notes, topic="train"
    )


if __name__ == "__main__":
    raise SystemExit(main())
