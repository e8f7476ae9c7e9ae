"""The per-parameter work of one training step on one GPU: gradient clipping and the fused AdamW step, with the
clip folded into AdamW's pass (what the trainer does) against clipping in place first (what it did), side by side.

    python benchmarks/bench_optimizer.py --layers 4 --out results/

The model is the trainer's (`--preset`, `--layers`) in fp32 on the GPU, every parameter given a random gradient;
each variant is timed over repeated steps of the same optimizer (harness.time_ms: median). Also timed alone, for
scale: the gradient norm, the AdamW step without clipping, and the routed experts' bf16 weight copies a step makes
(MoEStep); and the way those copies' bf16 gradients join the fp32 .grad (upcast into a new one, or added into it),
torch's dtype-converting ops against the Triton accumulate_grad the Triton backend uses, checked bitwise equal
first. Writes bench_optimizer.json / .md into --out. Skips without a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without PYTHONPATH

from benchmarks.harness import RESULTS_ENV, environment, time_ms, write_results
from xmoe.kernels.accumulate import accumulate_grad
from xmoe.model.presets import get_preset
from xmoe.model.transformer import Transformer
from xmoe.parallel.expert_parallel import clip_grad_norm_, total_grad_norm
from xmoe.train.optim import param_groups
from xmoe.train.step import clip_gradients, folds_clipping, optimizer_step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small", help="model preset (default small)")
    p.add_argument("--layers", type=int, default=4, help="number of layers (default 4)")
    p.add_argument("--max-norm", type=float, default=1.0, help="clipping threshold (default 1.0, the trainer's)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results"), help="results directory")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_optimizer: skipped, no CUDA GPU")
        return
    os.environ[RESULTS_ENV] = args.out
    cfg = get_preset(args.preset)
    cfg.num_layers = args.layers
    device = torch.device("cuda")
    with torch.device(device):
        model = Transformer(cfg)
    params = [q for q in model.parameters() if q.requires_grad]
    for q in params:
        q.grad = torch.randn_like(q) * 1e-3
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-4, fused=True)
    assert folds_clipping(optimizer, params)
    experts = [q for name, q in model.named_parameters() if ".experts." in name and q.ndim == 3]
    n_params = sum(q.numel() for q in params)

    def in_place():
        clip_grad_norm_(params, args.max_norm)
        optimizer.step()

    def folded():
        optimizer_step(optimizer, clip_gradients(optimizer, params, args.max_norm, None)[1])

    bf16_grads = [torch.randn_like(w, dtype=torch.bfloat16) * 1e-3 for w in experts]
    fp32 = torch.float32
    pairs = list(zip(experts, bf16_grads, strict=True))
    # the Triton accumulation is torch's sum, element by element: checked bitwise before anything is timed
    bitwise = all(torch.equal(accumulate_grad(None, g, fp32), g.to(fp32)) for g in bf16_grads) and all(
        torch.equal(accumulate_grad(w.grad.clone(), g, fp32), w.grad + g) for w, g in pairs
    )
    timings = [  # (row name, call): each torch row is followed by its Triton counterpart
        ("clip in place, then fused AdamW (before)", in_place),
        ("clip folded into fused AdamW (the trainer)", folded),
        ("gradient norm alone", lambda: total_grad_norm(params)),
        ("fused AdamW alone, no clipping", optimizer.step),
        ("routed experts' bf16 copies (once per step)", lambda: [w.detach().to(torch.bfloat16) for w in experts]),
        ("experts' bf16 gradients upcast to a new fp32 .grad, torch", lambda: [g.to(fp32) for g in bf16_grads]),
        ("the same, Triton accumulate_grad", lambda: [accumulate_grad(None, g, fp32) for g in bf16_grads]),
        ("experts' bf16 gradients added into the fp32 .grad, torch", lambda: [w.grad.add_(g) for w, g in pairs]),
        ("the same, Triton accumulate_grad", lambda: [accumulate_grad(w.grad, g, fp32) for w, g in pairs]),
    ]
    optimizer.step()  # AdamW's state allocated before anything is timed
    rows = []
    for name, fn in timings:
        ms = time_ms(fn, warmup_ms=50, rep_ms=400)
        rows.append({"variant": name, "ms": ms})
        print(f"{name:60s} {ms:8.2f} ms", flush=True)
    ms = {r["variant"]: r["ms"] for r in rows}
    meta = {
        **environment(),
        "preset": args.preset,
        "layers": args.layers,
        "parameters": n_params,
        "expert_parameters": sum(w.numel() for w in experts),
        "accumulate_grad_bitwise_equal_to_torch": bitwise,
    }
    before, after = ms["clip in place, then fused AdamW (before)"], ms["clip folded into fused AdamW (the trainer)"]
    notes = (
        f"{args.preset} preset, {args.layers} layers: {n_params / 1e9:.2f}B fp32 parameters "
        f"({meta['expert_parameters'] / 1e9:.2f}B in routed-expert stacks). Folding the clip saves "
        f"{before - after:.1f} ms per step ({before / after:.2f}x the optimizer's part). Triton accumulate_grad "
        f"bitwise equal to torch's upcast and add: {bitwise}."
    )
    write_results("bench_optimizer", rows, ["variant", "ms"], meta, "Clipping and AdamW, one step", notes)


if __name__ == "__main__":
    main()
