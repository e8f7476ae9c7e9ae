"""`xmoe bench`: forward + backward time, TFLOP/s and memory of one MoE layer, PFT vs the padded baseline.

PFT runs dropless; the padded (GShard / DeepSpeed-MoE) baseline runs with capacity factor 1.25, as it is used.

TFLOP/s counts the routed experts' work only, as 3 x 2·T·K·H·3F (forward + twice that for backward; the
router, shared experts and data movement are overhead the layer must hide). On CUDA, times are CUDA-event
medians after warm-up and memory is the allocator's peak above the inputs; on CPU, host-timer medians and the
bytes of tensors saved for backward (the layer's activation memory, counted through saved-tensor hooks).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from xmoe.bench_cli import add_arguments, check_args
from xmoe.config import KernelConfig, MoEConfig, kernel_config
from xmoe.model.presets import PRESETS, get_preset
from xmoe.model_config import DispatcherName, KernelBackend

# the layer shapes `xmoe bench` and the benchmarks time: each preset's MoE layer (tiny for CPUs, then the paper's)
LAYER_SHAPES = tuple(PRESETS)


def layer_shape(preset: str) -> tuple[int, int, int, int]:
    """(hidden, expert ffn, experts, top-k) of the MoE layer of preset ``preset``."""
    moe = get_preset(preset).moe
    return moe.hidden_size, moe.ffn_hidden_size, moe.num_experts, moe.top_k


def saved_activation_bytes(fn) -> int:
    """Bytes of distinct storages autograd saves for backward while running ``fn()`` (parameters excluded)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        # parameters and views of them (the torch backend saves each expert's slice w[e]) are not activations
        if not isinstance(t, torch.nn.Parameter) and not isinstance(t._base, torch.nn.Parameter):
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def time_ms(
    fn: Callable[[], object],
    device: torch.device,
    repeats: int,
    calls: int = 1,
    before: Callable[[], object] | None = None,
) -> float:
    """Median over ``repeats`` of the milliseconds per call of ``calls`` back-to-back ``fn()``: CUDA events on a GPU,
    the host clock on a CPU. ``before`` runs ahead of each repeat, untimed (a barrier, for code with collectives).
    The one timing loop of xmoe's benchmarks; warm-up is the caller's."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / calls)
        else:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(times)


def bench_layer(
    shape: str,
    num_tokens: int,
    dispatcher: DispatcherName,
    device: torch.device,
    dtype: torch.dtype,
    backend: KernelBackend = "auto",
    warmup: int = 2,
    repeats: int = 5,
    seed: int = 0,
    kernels: KernelConfig | None = None,
) -> dict:
    """One row of the table: the layer of ``shape`` on ``num_tokens`` tokens, built with the kernels section
    ``kernels`` (None: the environment's defaults) resolved for ``device`` as a run's is, and timed; ``kernels`` in
    the row is its record (KernelChoice.record), ``launches`` what its Triton GEMMs launched (launches.py)."""
    from xmoe.kernels import launches
    from xmoe.kernels.choice import resolve_kernels, resolve_layer
    from xmoe.moe.layer import MoELayer

    hidden, ffn, experts, top_k = layer_shape(shape)
    # the padded baseline runs as GShard / DeepSpeed-MoE are used, with capacity factor 1.25 (C = T would need a
    # T x E x T mask); PFT runs dropless, so it computes every routed row the baseline computes and more
    cfg = MoEConfig(
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_experts=experts,
        top_k=top_k,
        dispatcher=dispatcher,
        kernel_backend=backend,
        capacity_factor=1.25 if dispatcher == "padded" else None,
    )
    torch.manual_seed(seed)
    kernels = kernels or KernelConfig()
    layer = MoELayer(cfg, kernels=resolve_kernels(backend, kernels, device)).to(device=device, dtype=dtype)
    x = torch.randn(num_tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(num_tokens, hidden, device=device, dtype=dtype)

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).backward(grad)

    result: dict[str, Any] = {
        "shape": shape,
        "tokens": num_tokens,
        "dispatcher": dispatcher,
        "dtype": str(dtype).split(".")[-1],
        "device": device.type,
        "backend": backend,
    }
    result["kernels"] = resolve_layer(cfg, kernels, num_tokens, device, dtype).record()
    before = launches.snapshot()
    try:
        _measure(result, layer, x, step, device, warmup, repeats, f"{dispatcher} {shape} T={num_tokens}")
        result["launches"] = launches.since(before)
    except torch.OutOfMemoryError:
        result["error"] = "out of memory"
        return result
    flops = 3 * 2 * num_tokens * top_k * hidden * 3 * ffn
    result["tflops"] = flops / (result["ms"] * 1e-3) / 1e12
    return result


def _measure(out: dict, layer, x, step: Callable[[], None], device, warmup: int, repeats: int, desc: str) -> None:
    """Into ``out`` as each is measured: saved_bytes (tensors one forward saves for backward), on a GPU
    peak_extra_bytes (the peak above what was allocated before), ms (median of ``repeats`` calls of ``step`` after
    ``warmup``)."""
    from tqdm import tqdm

    out["saved_bytes"] = saved_activation_bytes(lambda: layer(x))
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    # one CPU call of a paper-sized layer takes seconds: show each warm-up and timed call as it finishes
    progress = tqdm(total=warmup + repeats, desc=desc, unit="call", leave=False, disable=device.type == "cuda")

    def counted():
        step()
        progress.update()

    for _ in range(warmup):
        counted()
    ms = time_ms(counted, device, repeats)
    progress.close()
    if device.type == "cuda":
        out["peak_extra_bytes"] = torch.cuda.max_memory_allocated() - base
    out["ms"] = ms


def format_table(rows: list[dict]) -> str:
    lines = [
        "| shape | T | dispatcher | dtype | ms fwd+bwd | TFLOP/s | saved act. MiB | peak extra MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['tokens']} | {r['dispatcher']} | {r['dtype']} | {r['error']} | | | |")
            continue
        peak = f"{r['peak_extra_bytes'] / 2**20:.0f}" if "peak_extra_bytes" in r else "-"
        lines.append(
            f"| {r['shape']} | {r['tokens']} | {r['dispatcher']} | {r['dtype']} | {r['ms']:.2f} | "
            f"{r['tflops']:.3f} | {r['saved_bytes'] / 2**20:.1f} | {peak} |"
        )
    return "\n".join(lines)


def memory_need(shape: str, num_tokens: int, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes of the layer's expert and router weights with their gradients, a lower bound of one call's activations:
    the input, the routed rows and their two SwiGLU halves, T x (H + K (H + 2F)) elements)."""
    hidden, ffn, experts, top_k = layer_shape(shape)
    weights = 2 * experts * (3 * hidden * ffn + hidden) * dtype.itemsize
    return weights, num_tokens * (hidden + top_k * (hidden + 2 * ffn)) * dtype.itemsize


def device_memory(device: torch.device) -> int:
    """The memory a layer can have on ``device``: the GPU's, else the host's."""
    import os

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(shape: str, num_tokens: int, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse a layer whose weights, gradients and one call's activations exceed the device's memory, before
    anything is allocated (it could only end in the allocator's error or the kernel's OOM killer), naming a shape
    that fits or telling to lower --tokens."""
    weights, acts = memory_need(shape, num_tokens, dtype)
    have = device_memory(device)
    if weights + acts <= have:
        return
    if weights < have:
        fix = "lower --tokens"
    else:
        fitting = [(s, sum(memory_need(s, num_tokens, dtype))) for s in LAYER_SHAPES]
        smaller = [(s, need) for s, need in fitting if need <= have]
        fix = f"try --shape {smaller[-1][0]} ({smaller[-1][1] / 2**30:.3g} GiB)" if smaller else "lower --tokens"
    raise ValueError(
        f"--shape {shape} with --tokens ({num_tokens}) needs at least {(weights + acts) / 2**30:.3g} GiB ("
        f"{weights / 2**30:.3g} GiB of weights and their gradients, {acts / 2**30:.3g} GiB of one call's "
        f"activations), more than this {device.type} device's {have / 2**30:.0f} GiB; {fix}"
    )


def run(args: argparse.Namespace) -> list[dict]:
    check_args(args)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no GPU; use --device cpu")
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        args.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32
    )
    check_fits(args.shape, args.tokens, device, dtype)
    from xmoe.kernels.choice import describe_record

    kernels = kernel_config(args)
    rows = [
        bench_layer(args.shape, args.tokens, d, device, dtype, args.backend, repeats=args.repeats, kernels=kernels)
        for d in ("pft", "padded")
    ]
    print(format_table(rows))
    print(f"PFT {describe_record(rows[0]['kernels'])}")
    if all("ms" in r for r in rows):
        pft, padded = rows
        print(
            f"PFT vs padded: {padded['ms'] / pft['ms']:.2f}x the speed, "
            f"{padded['saved_bytes'] / max(pft['saved_bytes'], 1):.2f}x less saved activation memory"
        )
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="xmoe bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
