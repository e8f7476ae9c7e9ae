"""GPU correctness of the Triton backend in bf16 against a float64 reference (relative to the reference's norm).

# T tokens, H hidden, F expert ffn, E experts, K top-k, N kept rows

    PYTHONPATH=. python benchmarks/check_gpu.py          # exits 1 on any failure; skips cleanly without a GPU

For each case: the fused ``moe_experts`` and the three-op path (gather_rows -> grouped_swiglu -> combine_rows)
run forward and backward in bf16, with each weight-gradient engine (Triton kernels, torch._grouped_mm); output
and every gradient are compared with the torch backend run in float64
(exact per-expert loop) by ||got - ref|| / ||ref|| < 1e-2. Freed memory is filled with NaN before each run, so an
output element a kernel forgets to write shows up as NaN and fails. The fused path runs twice and must be
bitwise identical with each engine (no atomics). The torch backend's own bf16 error is printed beside ours for scale.

FP8 (``--fp8``; moe.fp8 = "experts", xmoe/kernels/fp8_*.py): the quantisers on the GPU against the float64
reference of tests/fp8_reference.py (bitwise: correctly rounded scales, round-to-nearest-even conversion), and
the FP8 copies AdamW writes in its pass (xmoe/kernels/adamw.py) against its plain pass and quantize_blocks (bitwise);
then
the FP8 fused op (and once the FP8 grouped SwiGLU) forward and backward with bf16 activations and weights
quantised from fp32, on the cases below with row and weight-block magnitudes spread over 100x (a scale read from
the wrong group moves results far beyond rounding): against the float64 emulation of the same FP8 arithmetic,
bf16 stores included (||got - emu|| / ||emu|| < 1e-2: what is left is the FP8 instructions' own accumulation
inside each 128-deep step and fp32 against float64), against the exact float64 layer (< 0.25, a sanity bound:
the FP8 error itself is printed beside the bf16 path's), bitwise deterministic; on the medium shape once more per
round of FP8 tile candidates.

Sizes: a model case whose estimated memory (case_bytes) exceeds what the GPU has free runs with fewer experts (E
halved until it fits, H, F and K kept), and says so; one that cannot fit at any E >= K is skipped, said too. On an
80 GB card the FP8 large_model case runs at E = 16.

Tiles: the checks run with autotuning off, so with the heuristic's tiles (on an H200 candidate 0 of every kernel
in xmoe/kernels/tiles.py). On the three model shapes the fused path then runs once more per further round of
candidates (round r forces candidate r of every kernel), so that every candidate autotuning may pick, the
multi-expert weight-gradient kernels included, is checked on each shape.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without PYTHONPATH

TOLERANCE = 1e-2
# name: (T, H, F, E, K, capacity, routing)
CASES = {
    "odd_shapes": (300, 200, 136, 7, 3, None, "uniform"),
    "k1": (257, 128, 96, 5, 1, None, "uniform"),
    "large_k": (64, 96, 80, 12, 12, None, "uniform"),
    "dropping": (512, 256, 128, 8, 2, 40, "uniform"),
    "empty_experts": (96, 128, 64, 32, 2, None, "few"),
    "one_expert": (333, 64, 48, 4, 1, None, "one"),
    "no_rows": (16, 64, 64, 4, 2, 0, "uniform"),
    "small_model": (2048, 2048, 1408, 64, 6, None, "uniform"),
    # the large preset's H, F and K; E cut from 256 to 32 for the float64 reference, which holds each weight about
    # four times over (inputs, their clones, the gradient buffer and a full-size gradient per expert from the
    # per-expert slice's backward): ~100 bytes per E*H*F element, ~45 GiB at E=32 but ~360 GiB at E=256
    "large_model": (1024, 7168, 2048, 32, 8, None, "uniform"),
    "medium_model": (1024, 5120, 1536, 32, 6, None, "uniform"),  # the medium preset's H, F, K; E cut the same way
}
MODEL_CASES = ("small_model", "medium_model", "large_model")
# bytes a check holds at its peak per element of one E x H x F weight stack (the three stacks and every copy of them):
# the bf16 check ~100 (the float64 reference, see large_model); the FP8 check adds the float64 emulation's copies:
# more than 178 (its large_model ran out of memory on an 80 GB card) and at most 300 (it passed on a 141 GB one)
BYTES_PER_EXPERT_WEIGHT = {"bf16": 100, "fp8": 200}
POISON_BYTES = 1 << 30  # _poison's NaN block, cached by the allocator
FREE_FRACTION = 0.9  # of the free memory a case is sized for: the allocator's rounding and the rest of the process
# the fused backward's weight gradients: the Triton kernels and the Hopper path (torch._grouped_mm over gathered
# rows; where H or F is not a multiple of 8 it falls back to Triton, so those cases check Triton twice)
WGRAD_ENGINES = ("triton", "grouped_mm")


def case_bytes(T, H, Fd, E, K, kind):
    """Bytes a check of ``kind`` ("bf16", "fp8") on this case is estimated to hold at its peak: its expert weight
    stacks (BYTES_PER_EXPERT_WEIGHT) and, per routed row, a float64 copy of every H- and F-wide tensor the
    reference keeps, for the output and its gradient."""
    return BYTES_PER_EXPERT_WEIGHT[kind] * E * H * Fd + 8 * 2 * T * K * (3 * H + 3 * Fd)


def fit_case(name, case, free_bytes, kind):
    """(the case as it can run in ``free_bytes`` of GPU memory, or None; what changed, "" for nothing): a model
    case's experts halved (E stays >= K) until case_bytes fits FREE_FRACTION of the memory left beside the poison
    block; the other cases are small and run as they are."""
    T, H, Fd, E, K, capacity, routing = case
    budget = FREE_FRACTION * (free_bytes - POISON_BYTES)
    if name not in MODEL_CASES or case_bytes(T, H, Fd, E, K, kind) <= budget:
        return case, ""
    smaller = E
    while smaller // 2 >= K and case_bytes(T, H, Fd, smaller, K, kind) > budget:
        smaller //= 2
    need = f"~{case_bytes(T, H, Fd, E, K, kind) / 2**30:.0f} GiB at E={E}"
    if case_bytes(T, H, Fd, smaller, K, kind) > budget:
        return None, f"skipped: needs {need}, more than this GPU's {free_bytes / 2**30:.1f} GiB free at any E >= {K}"
    return (T, H, Fd, smaller, K, capacity, routing), (
        f"E {E} -> {smaller} to fit this GPU's {free_bytes / 2**30:.1f} GiB free (it needs {need})"
    )


def _sized(name, kind):
    """fit_case on this GPU's free memory now, the change printed. The caching allocator's unused blocks go back to
    the device first: mem_get_info counts them as taken, and an earlier case's leave tens of GiB there."""
    torch.cuda.empty_cache()
    case, change = fit_case(name, CASES[name], torch.cuda.mem_get_info()[0], kind)
    if change:
        print(f"     {kind} {name}: {change}", flush=True)
    return case


def tile_rounds():
    """{label: context} for the extra fused runs on the model shapes: candidate rounds 1, 2, ... (shorter
    candidate lists wrap around)."""
    from xmoe.kernels import tiles

    num_rounds = max(len(c) for c in tiles.CANDIDATES.values())
    return {
        f"tiles{r}": (lambda r=r: tiles.force({k: c[r % len(c)] for k, c in tiles.CANDIDATES.items()}))
        for r in range(1, num_rounds)
    }


def _routing(T, E, K, kind, gen):
    """(T, K) distinct expert ids: uniform, "few" (only experts 0..2 chosen, the rest empty) or "one" (all on 0)."""
    if kind == "one":
        return torch.zeros(T, K, dtype=torch.long, device="cuda")
    scores = torch.rand(T, E, device="cuda", generator=gen)
    if kind == "few":
        scores[:, 3:] = -1
    return scores.topk(K, dim=-1).indices


def _poison():
    """Fill 1 GiB of the caching allocator's free memory with NaN: an output a kernel never writes stays NaN."""
    torch.full((256 << 20,), float("nan"), device="cuda")  # freed at once; the NaN stays in the cached block


def _run(ops, fused, x, w, w1, w3, w2, plan, grad_out, wgrad="auto"):
    """Forward and every gradient of the routed experts through ``ops`` (fused, or its three ops), the weight
    gradients by kernels.wgrad ``wgrad``; untuned tiles (the ops' default: checks need no tuning, the tile rounds
    cover the candidates)."""
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, w1, w3, w2)]
    x_, w_, w1_, w3_, w2_ = leaves
    _poison()
    arrays = (x_, w_, plan.token_ids_N, plan.slot_ids_N, plan.row_of_slot_TK, plan.tokens_per_expert_E, w1_, w3_, w2_)
    from xmoe.kernels import reference

    out = ops.moe_experts(*arrays, wgrad=wgrad) if fused else reference.moe_experts(*arrays, ops=ops, wgrad=wgrad)
    grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype), allow_unused=True)
    return [out] + [g if g is not None else torch.zeros_like(l) for g, l in zip(grads, leaves, strict=False)]


def _rel(got, ref):
    got, ref = got.detach().double(), ref.detach().double()
    if not torch.isfinite(got).all():
        return float("nan")
    denom = ref.norm()
    return float((got - ref).norm() / denom) if denom > 0 else float(got.norm())


def check_case(name, T, H, Fd, E, K, capacity, routing, seed=0):
    from xmoe.dispatch.routing import build_plan
    from xmoe.kernels import reference, triton_ops

    gen = torch.Generator(device="cuda").manual_seed(seed)
    ids = _routing(T, E, K, routing, gen)
    K = ids.shape[1]
    scores = torch.rand(T, K, device="cuda", generator=gen)
    plan = build_plan(ids, scores, E, capacity)
    x = torch.randn(T, H, device="cuda", generator=gen, dtype=torch.float64)
    w = torch.softmax(torch.randn(T, K, device="cuda", generator=gen), -1).double()
    w1 = torch.randn(E, H, Fd, device="cuda", generator=gen, dtype=torch.float64) / H**0.5
    w3 = torch.randn(E, H, Fd, device="cuda", generator=gen, dtype=torch.float64) / H**0.5
    w2 = torch.randn(E, Fd, H, device="cuda", generator=gen, dtype=torch.float64) / Fd**0.5
    grad_out = torch.randn(T, H, device="cuda", generator=gen, dtype=torch.float64)
    ref = _run(reference, False, x, w, w1, w3, w2, plan, grad_out)
    bf = [t.to(torch.bfloat16) for t in (x, w1, w3, w2)]
    xb, w1b, w3b, w2b = bf
    wf = w.float()  # router probabilities stay fp32
    results = {}
    torch_bf16 = _run(reference, False, xb, wf, w1b, w3b, w2b, plan, grad_out)
    names = ["out", "grad_x", "grad_weights", "grad_w1", "grad_w3", "grad_w2"]
    ok = True
    deterministic = True
    for engine in WGRAD_ENGINES:
        for label, fused in (("fused", True), ("ops", False)):
            got = _run(triton_ops, fused, xb, wf, w1b, w3b, w2b, plan, grad_out, engine)
            for n, g, r, tb in zip(names, got, ref, torch_bf16, strict=False):
                err = _rel(g, r)
                passed = err == err and err < TOLERANCE if r.norm() > 0 else err == 0.0
                ok &= passed
                results[f"{label}.{engine}.{n}"] = {"err": err, "torch_bf16_err": _rel(tb, r), "pass": passed}
        runs = [_run(triton_ops, True, xb, wf, w1b, w3b, w2b, plan, grad_out, engine) for _ in range(2)]
        deterministic &= all(torch.equal(a, b) for a, b in zip(*runs, strict=False))
    ok &= deterministic
    for label, context in tile_rounds().items() if name in MODEL_CASES else ():
        try:
            with context():
                got = _run(triton_ops, True, xb, wf, w1b, w3b, w2b, plan, grad_out)
        except Exception as exc:  # a candidate this compiler cannot build: autotuning skips it the same way
            results[f"{label}.skipped"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            print(f"     {name} {label}: candidate skipped, {results[f'{label}.skipped']}")
            continue
        for n, g, r, tb in zip(names, got, ref, torch_bf16, strict=False):
            err = _rel(g, r)
            passed = err == err and err < TOLERANCE if r.norm() > 0 else err == 0.0
            ok &= passed
            results[f"{label}.{n}"] = {"err": err, "torch_bf16_err": _rel(tb, r), "pass": passed}
    return ok, {
        "case": name,
        "shape": [T, H, Fd, E, K, capacity],
        "rows": plan.num_rows,
        "deterministic": deterministic,
        "errors": results,
    }


FP8_EMU_TOLERANCE = 1e-2
FP8_TOLERANCE = 0.25
FP8_CASES = ("odd_shapes", "k1", "dropping", "empty_experts", "no_rows", "small_model", "medium_model", "large_model")


def _spread(t, gen, rows, cols, block=128):
    """t times a factor per (rows, cols) block drawn from 0.1 .. 10 (per row when rows == 1)."""
    shape = t.shape[:-2] + (-(-t.shape[-2] // rows), -(-t.shape[-1] // cols))
    mag = 10.0 ** (torch.rand(shape, device=t.device, generator=gen, dtype=torch.float64) * 2 - 1)
    return t * mag.repeat_interleave(rows, -2).repeat_interleave(cols, -1)[..., : t.shape[-2], : t.shape[-1]]


def _fp8_reference_module():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import fp8_reference

    return fp8_reference


def check_fp8_quantizers(fmt, seed=0):
    """Mismatching elements of the GPU quantisers against the float64 reference (0 expected)."""
    from xmoe.kernels.adamw import adamw_update
    from xmoe.kernels.fp8_quant import BlockCopies, quantize_blocks, quantize_rows

    R = _fp8_reference_module()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = _spread(torch.randn(4099, 7168 + 72, device="cuda", generator=gen, dtype=torch.float64), gen, 1, 128)
    x = x.to(torch.bfloat16)
    q, s = quantize_rows(x, fmt)
    q_ref, s_ref = R.quantize_rows(x, fmt)
    w = _spread(torch.randn(4, 2048 + 40, 1408, device="cuda", generator=gen, dtype=torch.float64), gen, 128, 128)
    qb, qbt, sb = quantize_blocks(w.float(), fmt)
    qb_ref, sb_ref = R.quantize_blocks(w.float(), fmt)
    # AdamW writing the copies in its pass (the second of a side-by-side pair, as w3's): the same as the plain
    # step followed by quantize_blocks of its result, update and copies alike
    p = w.float()
    g, m, v = (torch.randn(p.shape, device="cuda", generator=gen) * 1e-3 for _ in range(3))
    v = v.abs()
    hyper = dict(step=3, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, divisor=torch.tensor(1.3).cuda())
    plain = [t.clone() for t in (p, m, v)]
    adamw_update(plain[0], g, plain[1], plain[2], **hyper)
    pair = BlockCopies.empty(p.shape, 2, fmt, p.device)
    adamw_update(p, g, m, v, copy=pair.member(1), **hyper)
    aq, aqt, asc = quantize_blocks(plain[0], fmt)
    got = pair.member(1)
    adamw_copies = sum(int((a != b).sum()) for a, b in zip((p, m, v), plain, strict=True))
    adamw_copies += int((got.q.view(torch.uint8) != aq.view(torch.uint8)).sum())
    adamw_copies += int((got.qt.view(torch.uint8) != aqt.view(torch.uint8)).sum())
    adamw_copies += int((got.scale != asc).sum())
    return {
        "adamw_copies": adamw_copies,
        "rows_values": int((q.double() != q_ref).sum()),
        "rows_scales": int((s.double() != s_ref).sum()),
        "block_values": int((qb.double() != qb_ref).sum()),
        "block_scales": int((sb.double() != sb_ref).sum()),
        "transposed_copy": int((qbt.view(torch.uint8) != qb.transpose(1, 2).view(torch.uint8)).sum()),
    }


def _run_fp8(fused, x, w, w1, w3, w2, plan, grad_out, fmt, wgrad="auto"):
    from xmoe.kernels import reference
    from xmoe.kernels.fp8_experts import grouped_swiglu_fp8, moe_experts_fp8
    from xmoe.kernels.fp8_quant import quantize_expert_weights

    leaves = [t.detach().clone().requires_grad_() for t in (x, w, w1, w3, w2)]
    x_, w_, w1_, w3_, w2_ = leaves
    _poison()
    qw = quantize_expert_weights(w1, w3, w2, fmt)
    if fused:
        out = moe_experts_fp8(
            x_,
            w_,
            plan.token_ids_N,
            plan.slot_ids_N,
            plan.row_of_slot_TK,
            plan.tokens_per_expert_E,
            w1_,
            w3_,
            w2_,
            qw,
            fmt,
            wgrad=wgrad,
        )
    else:
        x_NH = reference.gather_rows(x_, plan.token_ids_N, plan.row_of_slot_TK)
        y_NH = grouped_swiglu_fp8(x_NH, w1_, w3_, w2_, plan.tokens_per_expert_E, qw, fmt, wgrad=wgrad)
        out = reference.combine_rows(y_NH, w_, plan.token_ids_N, plan.slot_ids_N, plan.row_of_slot_TK)
    grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype), allow_unused=True)
    return [out] + [g if g is not None else torch.zeros_like(l) for g, l in zip(grads, leaves, strict=False)]


def check_fp8_case(name, T, H, Fd, E, K, capacity, routing, fmt, seed=0):
    from xmoe.dispatch.routing import build_plan
    from xmoe.kernels import reference

    R = _fp8_reference_module()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ids = _routing(T, E, K, routing, gen)
    K = ids.shape[1]
    plan = build_plan(ids, torch.rand(T, K, device="cuda", generator=gen), E, capacity)
    x = _spread(torch.randn(T, H, device="cuda", generator=gen, dtype=torch.float64), gen, 1, H)
    w = torch.softmax(torch.randn(T, K, device="cuda", generator=gen), -1).double()
    w1, w3 = (
        _spread(torch.randn(E, H, Fd, device="cuda", generator=gen, dtype=torch.float64), gen, 128, 128) / H**0.5
        for _ in range(2)
    )
    w2 = _spread(torch.randn(E, Fd, H, device="cuda", generator=gen, dtype=torch.float64), gen, 128, 128) / Fd**0.5
    grad_out = torch.randn(T, H, device="cuda", generator=gen, dtype=torch.float64)
    xb, wf = x.to(torch.bfloat16), w.float()
    ref = _run(reference, False, xb.double(), w, w1, w3, w2, plan, grad_out)  # exact, from the inputs the layer sees
    emu = R.moe_experts_fp8(
        xb, wf, plan, w1.float(), w3.float(), w2.float(), grad_out.to(torch.bfloat16), fmt, torch.bfloat16
    )
    bf16 = _run(reference, False, xb, wf, *(t.to(torch.bfloat16) for t in (w1, w3, w2)), plan, grad_out)
    names = ["out", "grad_x", "grad_weights", "grad_w1", "grad_w3", "grad_w2"]
    results, ok = {}, True
    emu_wgrad = R.moe_experts_fp8(
        xb, wf, plan, w1.float(), w3.float(), w2.float(), grad_out.to(torch.bfloat16), fmt, torch.bfloat16, True
    )
    runs = {"fused": lambda: _run_fp8(True, xb, wf, w1.float(), w3.float(), w2.float(), plan, grad_out, fmt)}

    def fp8_wgrad_run():  # kernels.wgrad = "fp8": the weight gradients in FP8 too, against their own emulation
        return _run_fp8(True, xb, wf, w1.float(), w3.float(), w2.float(), plan, grad_out, fmt, "fp8")

    runs["fused.fp8_wgrad"] = fp8_wgrad_run
    if name == "odd_shapes":
        runs["grouped"] = lambda: _run_fp8(False, xb, wf, w1.float(), w3.float(), w2.float(), plan, grad_out, fmt)
    if name == "medium_model":
        for label, context in tile_rounds().items():

            def run(context=context):
                with context():
                    return _run_fp8(True, xb, wf, w1.float(), w3.float(), w2.float(), plan, grad_out, fmt)

            runs[f"fused.{label}"] = run
    deterministic = True
    for label, run in runs.items():
        try:
            got = run()
        except Exception as exc:  # a candidate this compiler cannot build: autotuning skips it the same way
            results[f"{label}.skipped"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            print(f"     {name} {label}: skipped, {results[f'{label}.skipped']}")
            continue
        for n, g, r, e, b in zip(names, got, ref, emu_wgrad if label == "fused.fp8_wgrad" else emu, bf16, strict=False):
            if label == "grouped" and n == "grad_weights":
                e = r  # the grouped path quantises the weighted gradient rows: not the fused emulation's
            err, err_emu = _rel(g, r), _rel(g, e)
            if r.norm() > 0:
                passed = err == err and err < FP8_TOLERANCE and (err_emu < FP8_EMU_TOLERANCE or label == "grouped")
            else:
                passed = err == 0.0
            ok &= passed
            results[f"{label}.{n}"] = {"err": err, "err_vs_emulation": err_emu, "bf16_err": _rel(b, r), "pass": passed}
        if label == "fused":
            again = run()
            deterministic = all(torch.equal(a, b) for a, b in zip(got, again, strict=False))
    return ok and deterministic, {
        "case": name,
        "format": fmt,
        "shape": [T, H, Fd, E, K, capacity],
        "rows": plan.num_rows,
        "deterministic": deterministic,
        "errors": results,
    }


def main_fp8() -> tuple[bool, dict]:
    from xmoe.kernels.fp8_quant import fp8_format

    fmt = fp8_format(torch.device("cuda")).name
    start = time.perf_counter()
    mismatches = check_fp8_quantizers(fmt)
    all_ok = not any(mismatches.values())
    print(f"{'ok  ' if all_ok else 'FAIL'} fp8 quantisers ({fmt}) vs float64, mismatching elements: {mismatches}")
    report = {"format": fmt, "quantizers": mismatches, "cases": []}
    for name in FP8_CASES:
        case = _sized(name, "fp8")
        if case is None:
            report["cases"].append({"case": name, "skipped": "does not fit this GPU"})
            continue
        try:
            ok, info = check_fp8_case(name, *case, fmt)
        except Exception as exc:
            ok, info = False, {"case": name, "error": f"{type(exc).__name__}: {exc}"}
        all_ok &= ok
        report["cases"].append(info)
        if "error" in info:
            print(f"FAIL fp8 {name}: {info['error']}")
            continue
        errors = [v for v in info["errors"].values() if isinstance(v, dict)]
        fused = [
            v for k, v in info["errors"].items() if isinstance(v, dict) and k.startswith("fused.") and "tiles" not in k
        ]
        worst = max(v["err"] for v in errors)
        bf16_worst = max(v["bf16_err"] for v in fused)
        vs_emulation = max(v["err_vs_emulation"] for v in fused)
        print(
            f"{'ok  ' if ok else 'FAIL'} fp8 {name:14s} rows={info['rows']:6d} worst rel err {worst:.2e} "
            f"(bf16 path: {bf16_worst:.2e}), vs emulation {vs_emulation:.2e} "
            f"deterministic={info['deterministic']} [{time.perf_counter() - start:.0f} s]",
            flush=True,
        )
        weight_errs = {
            label: max(info["errors"][f"{label}.grad_w{i}"]["err"] for i in (1, 2, 3))
            for label in ("fused", "fused.fp8_wgrad")
            if f"{label}.grad_w1" in info["errors"]
        }
        if len(weight_errs) == 2:
            print(
                f"     weight gradients vs exact: bf16 {weight_errs['fused']:.2e}, "
                f"FP8 (kernels.wgrad=fp8) {weight_errs['fused.fp8_wgrad']:.2e}"
            )
        if not ok:
            for k, v in info["errors"].items():
                if isinstance(v, dict) and not v["pass"]:
                    print(f"     {k}: {v['err']:.3e} (vs emulation {v['err_vs_emulation']:.3e})")
    return all_ok, report


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fp8", action="store_true", help="also check the FP8 experts (moe.fp8 = 'experts')")
    parser.add_argument("--fp8-only", action="store_true", help="only the FP8 checks")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "check_gpu: skipped, no CUDA device (run it on the GPU machine; CPU coverage: tests/test_triton_kernels.py)"
        )
        return 0
    try:
        import triton  # noqa: F401
    except ImportError:
        print("check_gpu: skipped, triton is not installed")
        return 0
    from benchmarks.harness import environment, out_dir

    all_ok, report = True, []
    start = time.perf_counter()
    for name in () if args.fp8_only else CASES:
        case = _sized(name, "bf16")
        if case is None:
            report.append({"case": name, "skipped": "does not fit this GPU"})
            continue
        try:
            ok, info = check_case(name, *case)  # untuned tiles: the tile rounds cover the candidates
        except Exception as exc:  # report every case, then fail
            ok, info = False, {"case": name, "error": f"{type(exc).__name__}: {exc}"}
        all_ok &= ok
        report.append(info)
        if "error" in info:
            print(f"FAIL {name}: {info['error']}")
            continue
        errors = [v for v in info["errors"].values() if isinstance(v, dict)]
        worst = max(v["err"] for v in errors)
        worst_torch = max(v["torch_bf16_err"] for v in errors)
        print(
            f"{'ok  ' if ok else 'FAIL'} {name:14s} rows={info['rows']:6d} worst rel err {worst:.2e} "
            f"(torch backend bf16: {worst_torch:.2e}) deterministic={info['deterministic']} "
            f"[{time.perf_counter() - start:.0f} s]",
            flush=True,
        )
        if not ok:
            for k, v in info["errors"].items():
                if isinstance(v, dict) and not v["pass"]:
                    print(f"     {k}: {v['err']:.3e}")
    if not args.fp8_only:
        (out_dir("check") / "check_gpu.json").write_text(
            json.dumps({"meta": environment(), "ok": all_ok, "cases": report}, indent=1)
        )
    if args.fp8 or args.fp8_only:
        ok, fp8_report = main_fp8()
        all_ok &= ok
        (out_dir("check") / "check_gpu_fp8.json").write_text(
            json.dumps({"meta": environment(), "ok": ok, **fp8_report}, indent=1)
        )
    print("check_gpu:", "PASS" if all_ok else "FAIL")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
