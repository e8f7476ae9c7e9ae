"""Where one training step's time goes: torch.profiler over a few steps of a small-shaped model on one GPU.

    python benchmarks/profile_step.py --layers 4 --backend triton

Prints the top operators by GPU time and by host time, and the step's wall time vs the GPU's busy time
(a large gap means the host, not the GPU, sets the pace). Skips without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from xmoe.model.presets import small
from xmoe.model.transformer import Transformer
from xmoe.train.data import TokenLoader, build_dataset


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--backend", default="triton")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("profile_step: skipped, no CUDA GPU")
        return
    cfg = small()
    cfg = dataclasses.replace(cfg, num_layers=args.layers, moe=dataclasses.replace(cfg.moe, kernel_backend=args.backend))
    model = Transformer(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    loader = TokenLoader(build_dataset("markov", args.seq_len), args.micro_batch_size)

    def step():
        x, y = next(loader)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x.cuda(), y.cuda())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) / 5 * 1e3
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu_ms = sum(e.self_device_time_total for e in events) / 1e3 / 2
    print(f"step wall {wall_ms:.1f} ms, GPU busy {gpu_ms:.1f} ms per step (backend {args.backend})")
    print(events.table(sort_by="self_device_time_total", row_limit=15))
    print(events.table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
