"""The per-parameter work of one training step on one GPU: gradient clipping and the AdamW step, side by side:
torch's fused AdamW with the clip in place first (what the trainer did) or folded into its pass, and xmoe's Triton
AdamW (what the trainer now runs) with the clip folded, alone and writing the routed experts' bf16 copies of the
next step in its pass (against those copies made by a pass of their own); with ``--fp8``, also writing FP8 experts'
FP8 copies (both layouts, 128 x 128 block scales) in its pass, at each ``--fp8-tiles`` setting of that kernel
(rows of a block per pass x warps), against the quantising pass the experts otherwise make once per step.

    python benchmarks/bench_optimizer.py --layers 4
    python benchmarks/bench_optimizer.py --layers 4 --fp8 --fp8-tiles 16x8,32x16,32x8,16x4

The model is the trainer's (`--preset`, `--layers`) in fp32 on the GPU, every parameter given a random gradient;
each variant is timed over repeated steps of the same optimizer (harness.time_ms: median). Also timed alone, for
scale: the gradient norm, the AdamW step without clipping, and the routed experts' bf16 weight copies a step makes
(MoEStep); and the way those copies' bf16 gradients join the fp32 .grad (upcast into a new one, or added into it),
torch's dtype-converting ops against the Triton accumulate_grad the Triton backend uses, checked bitwise equal
first. Before anything is timed, the Triton AdamW is also checked against torch's fused AdamW over three clipped
steps of copies of the largest parameters (relative difference of the weights and moments) and its bf16 copies
against the updated weights cast by torch (bitwise), and with ``--fp8`` the FP8 copies written in its pass against
quantize_expert_weights of the updated weights (bitwise). Writes bench_optimizer.json / .md (bench_optimizer_fp8
with ``--fp8``) into --out. Skips without a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without PYTHONPATH

from benchmarks.harness import RESULTS_ENV, environment, results_dir, time_ms, write_results
from xmoe.kernels import adamw
from xmoe.kernels.accumulate import accumulate_grad
from xmoe.model.presets import get_preset
from xmoe.model.transformer import Transformer
from xmoe.moe.experts import use_one_process
from xmoe.moe.weights import CopyWriter
from xmoe.parallel.expert_parallel import clip_grad_norm_, total_grad_norm
from xmoe.train.optim import TritonAdamW, param_groups
from xmoe.train.step import clip_gradients, folds_clipping, optimizer_step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small", help="model preset (default small)")
    p.add_argument("--layers", type=int, default=4, help="number of layers (default 4)")
    p.add_argument("--max-norm", type=float, default=1.0, help="clipping threshold (default 1.0, the trainer's)")
    p.add_argument("--fp8", action="store_true", help="FP8 experts: also time the FP8 copies written in AdamW's pass")
    p.add_argument(
        "--fp8-tiles",
        default=f"{adamw.QUANT_CHUNK}x{adamw.QUANT_WARPS}",
        help="settings of that pass to time, ROWSxWARPS comma-separated (default: the shipped one)",
    )
    p.add_argument(
        "--out", default=str(results_dir("train")), help="results directory (default benchmarks/results/train)"
    )
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_optimizer: skipped, no CUDA GPU")
        return
    os.environ[RESULTS_ENV] = args.out
    cfg = get_preset(args.preset)
    cfg.num_layers = args.layers
    if args.fp8:
        cfg.moe.fp8 = "experts"
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
    agreement = _check_triton_adamw(model, args.max_norm)
    print(f"Triton AdamW against torch's fused AdamW: {agreement}", flush=True)
    triton_opt = TritonAdamW(param_groups(model, 0.1), lr=1e-4)
    # every expert weight's bf16 copy (FP8 experts' too: the row times the copies' write)
    triton_copies = TritonAdamW(param_groups(model, 0.1), lr=1e-4, copies=_bf16_writers(experts)[0])
    assert folds_clipping(triton_opt, params)

    def folded_with(opt):
        return lambda: optimizer_step(opt, clip_gradients(opt, params, args.max_norm, None)[1])

    timings = [  # (row name, call): each torch row is followed by its Triton counterpart
        ("clip in place, then fused AdamW (before)", in_place),
        ("clip folded into fused AdamW", folded),
        ("clip folded into Triton AdamW", folded_with(triton_opt)),
        ("gradient norm alone", lambda: total_grad_norm(params)),
        ("fused AdamW alone, no clipping", optimizer.step),
        ("Triton AdamW alone, no clipping", triton_opt.step),
        ("routed experts' bf16 copies (once per step)", lambda: [w.detach().to(torch.bfloat16) for w in experts]),
        ("clip folded into Triton AdamW, writing the experts' bf16 copies (the trainer)", folded_with(triton_copies)),
        ("experts' bf16 gradients upcast to a new fp32 .grad, torch", lambda: [g.to(fp32) for g in bf16_grads]),
        ("the same, Triton accumulate_grad", lambda: [accumulate_grad(None, g, fp32) for g in bf16_grads]),
        ("experts' bf16 gradients added into the fp32 .grad, torch", lambda: [w.grad.add_(g) for w, g in pairs]),
        ("the same, Triton accumulate_grad", lambda: [accumulate_grad(w.grad, g, fp32) for w, g in pairs]),
    ]
    optimizers = [optimizer, triton_opt, triton_copies]
    fp8_rows, fp8_check = _fp8_variants(model, params, args) if args.fp8 else ([], {})
    timings += [(name, fn) for name, fn, _ in fp8_rows]
    optimizers += [opt for _, _, opt in fp8_rows if opt is not None]
    for opt in optimizers:
        opt.step()  # AdamW's state allocated before anything is timed
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
        "triton_adamw_against_fused": agreement,
        **({"fp8_copies_bitwise": fp8_check} if args.fp8 else {}),
    }
    fused_ms, triton_ms = ms["clip folded into fused AdamW"], ms["clip folded into Triton AdamW"]
    separate = triton_ms + ms["routed experts' bf16 copies (once per step)"]
    together = ms["clip folded into Triton AdamW, writing the experts' bf16 copies (the trainer)"]
    notes = (
        f"{args.preset} preset, {args.layers} layers: {n_params / 1e9:.2f}B fp32 parameters "
        f"({meta['expert_parameters'] / 1e9:.2f}B in routed-expert stacks). Clip folded: torch's fused AdamW "
        f"{fused_ms:.1f} ms, Triton AdamW {triton_ms:.1f} ms ({fused_ms / triton_ms:.2f}x); with the experts' bf16 "
        f"copies: {separate:.1f} ms as two passes, {together:.1f} ms in one. Triton AdamW against torch's fused one "
        f"(three clipped steps): {agreement}. Triton accumulate_grad bitwise equal to torch's upcast and add: "
        f"{bitwise}."
    )
    if args.fp8:
        quant = ms["routed experts' FP8 copies, a quantising pass (once per step)"]
        best = min(
            (r for r in rows if r["variant"].startswith("clip folded into Triton AdamW, writing the experts' FP8")),
            key=lambda r: r["ms"],
        )
        notes += (
            f" FP8 experts: AdamW then the quantising pass {triton_ms + quant:.1f} ms, the copies written in AdamW's "
            f"pass {best['ms']:.1f} ms at best ({best['variant'].rsplit('(', 1)[-1].rstrip(')')}); those copies "
            f"bitwise quantize_expert_weights' of the updated weights: {fp8_check}."
        )
    write_results(
        "bench_optimizer_fp8" if args.fp8 else "bench_optimizer",
        rows,
        ["variant", "ms"],
        meta,
        "Clipping and AdamW, one step",
        notes,
        topic="train",
    )


def _fp8_variants(model, params, args) -> tuple[list, dict]:
    """([(row name, call, optimizer to warm up)], {tile: copies bitwise}): the FP8 experts' quantising pass, and
    the clip folded into Triton AdamW writing their FP8 copies at each --fp8-tiles setting (each setting checked
    first: one step from copies of the weights and state, its copies against quantize_expert_weights')."""
    from xmoe.kernels.fp8_quant import fp8_format, quantize_block_pair, quantize_blocks, quantize_expert_weights
    from xmoe.moe.layer import moe_layers

    fmt = fp8_format(params[0].device).name
    stacks = [(layer.experts.w1, layer.experts.w3, layer.experts.w2) for layer in moe_layers(model)]
    rows: list = [
        (
            "routed experts' FP8 copies, a quantising pass (once per step)",
            lambda: [quantize_expert_weights(*ws, fmt) for ws in stacks],
            None,
        )
    ]
    checks = {}
    for spec in args.fp8_tiles.split(","):
        chunk, warps = (int(n) for n in spec.split("x"))
        opt = TritonAdamW(param_groups(model, 0.1), lr=1e-4, copies=use_one_process(model, torch.bfloat16))

        def step(opt=opt, chunk=chunk, warps=warps):
            adamw.QUANT_CHUNK, adamw.QUANT_WARPS = chunk, warps
            optimizer_step(opt, clip_gradients(opt, params, args.max_norm, None)[1])

        saved = [w.detach().clone() for ws in stacks for w in ws]
        step()
        bitwise = True
        for layer, (w1, w3, w2) in zip(moe_layers(model), stacks, strict=True):
            if layer.experts.expert_weights.num_waiting() < 3:
                bitwise = False
                continue
            taken = layer.experts.step_copies(torch.bfloat16)[3]  # the copies the next step computes with
            want = (*quantize_block_pair(w1, w3, fmt), *quantize_blocks(w2, fmt))
            got = (taken.w13_EHF, taken.w1_EFH, taken.w3_EFH, taken.scale13, taken.w2_EFH, taken.w2_EHF, taken.scale2)
            bitwise &= all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        with torch.no_grad():  # the weights as they were, so every variant times steps from the same place
            for w, s in zip((w for ws in stacks for w in ws), saved, strict=True):
                w.copy_(s)
        checks[spec] = bitwise
        rows.append((f"clip folded into Triton AdamW, writing the experts' FP8 copies ({spec})", step, None))
    return rows, checks


def _check_triton_adamw(model, max_norm: float) -> dict:
    """Three clipped AdamW steps of copies of the model's three largest parameters by torch's fused AdamW and by
    the Triton one (writing bf16 copies), from the same gradients: the largest relative difference (norm of the
    difference over the norm) of the weights and of the moments, and whether every bf16 copy is bitwise the
    updated weight cast by torch."""
    largest = sorted(model.parameters(), key=lambda q: q.numel())[-3:]
    ref = [torch.nn.Parameter(q.detach().clone()) for q in largest]
    got = [torch.nn.Parameter(q.detach().clone()) for q in largest]
    fused = torch.optim.AdamW([{"params": ref, "weight_decay": 0.1}], lr=1e-3, fused=True)
    writers, copies = _bf16_writers(got)  # every weight here gets a copy, as the experts' do
    ours = TritonAdamW([{"params": got, "weight_decay": 0.1}], lr=1e-3, copies=writers)
    gen = torch.Generator(device=got[0].device).manual_seed(0)
    copies_equal = True
    for _ in range(3):
        for a, b in zip(ref, got, strict=True):
            a.grad = torch.randn(a.shape, device=a.device, generator=gen) * 1e-3
            b.grad = a.grad.clone()
        for opt, qs in ((fused, ref), (ours, got)):
            optimizer_step(opt, clip_gradients(opt, qs, max_norm, None)[1])
        copies_equal &= all(torch.equal(c, q.detach().to(torch.bfloat16)) for c, q in zip(copies, got, strict=True))

    def worst(pairs) -> float:
        return max(((x.double() - y.double()).norm() / y.double().norm()).item() for x, y in pairs)

    pairs = zip(ref, got, strict=True)
    moments = [(ours.state[b][k], fused.state[a][k]) for a, b in pairs for k in ("exp_avg", "exp_avg_sq")]
    return {
        "weights_rel_diff": worst(zip(got, ref, strict=True)),
        "moments_rel_diff": worst(moments),
        "bf16_copies_bitwise": copies_equal,
    }


def _bf16_writers(tensors: list[torch.Tensor]) -> tuple[list[tuple[torch.Tensor, CopyWriter]], list[torch.Tensor]]:
    """(pairs, copies): a copy writer for each tensor that writes its bf16 copy into a new tensor, as the experts'
    owner does (xmoe/moe/weights.py), kept in ``copies`` at the tensor's index."""
    copies: list[torch.Tensor] = [torch.empty(0) for _ in tensors]

    def writer(i: int, t: torch.Tensor) -> CopyWriter:
        def refresh(update) -> None:
            copy = torch.empty(t.shape, dtype=torch.bfloat16, device=t.device)
            update(copy)
            copies[i] = copy

        return CopyWriter(refresh, "bf16")

    return [(t, writer(i, t)) for i, t in enumerate(tensors)], copies


if __name__ == "__main__":
    main()
