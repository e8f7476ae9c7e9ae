"""SSMB on GPUs: peak memory and step time of a Small-shaped model under TP, with and without SSMB and against
activation recomputation of the MoE blocks, beside xmoe.plan.memory's prediction.

# T tokens per micro-batch (micro-batch x seq), H hidden, E experts, K top-k, F expert ffn, S = TP degree

    torchrun --nproc-per-node 2 benchmarks/bench_ssmb.py        # H 2048, E 64, top-6, F 1408, 4 layers, seq 4096
    torchrun --nproc-per-node 2 benchmarks/bench_ssmb.py --micro-batch 1 2 4 --layers 8

Skips (exit 0, with the reason) without CUDA GPUs or when not launched on >= 2 ranks. ``--cpu`` runs the same code
on CPU processes over gloo (tiny shape, host timers, no allocator peak): a smoke test of the script only.

TP = the world size (dp = ep = 1); every setting is the same model from one seed, bf16 weights (no fp32 master copy,
so the experts' kernels read the parameters themselves), all layers MoE, no shared experts (the paper's Small), the
default kernels (Triton on GPUs). One step = forward + backward of the LM loss; no optimizer (its state is the same
in every setting). Settings:
  tp                  attention split over TP, MoE blocks replicated: every rank runs them on all T tokens (the
                      X-MoE paper's baseline)
  tp+ssmb             SSMB: each rank runs its MoE blocks on T/S tokens, one all-gather per block and direction
  tp+recompute        no SSMB; every MoE block (ffn norm + MoE layer) under torch.utils.checkpoint, keeping only its
                      input and recomputing it in backward (dispatch included)
  tp+ssmb+recompute   both
Columns: step_ms (median over trials of CUDA-event time / iterations, ranks in lockstep), tokens/s (all ranks, each
token counted once), tflops (useful training FLOPs per GPU, xmoe.model.flops formula (a): replicated MoE compute
is not counted twice), act_peak_gib (peak allocated during a step above what is allocated before it: parameters and
gradients excluded), pred_peak_gib (``predicted``: the saved activations and the backward's transient), moe_mib (bytes
autograd saves for one MoE block, xmoe.bench.saved_activation_bytes) and pred_moe_mib (the plan's per-block terms).
Results: rank 0 writes bench_ssmb.json / bench_ssmb.md under $XMOE_RESULTS_DIR or benchmarks/results/ssmb/.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere without PYTHONPATH

from benchmarks.harness import collective_time_ms, distributed_skip_reason, init_distributed, peak_extra_bytes

GIB, MIB = 2**30, 2**20
SETTINGS = {
    "tp": (False, False),
    "tp+ssmb": (True, False),
    "tp+recompute": (False, True),
    "tp+ssmb+recompute": (True, True),
}


class RecomputedFFN(nn.Module):
    """A block's ffn norm + MoE layer under activation checkpointing (the block's ffn_norm becomes the identity)."""

    def __init__(self, norm: nn.Module, ffn: nn.Module):
        super().__init__()
        self.norm, self.ffn = norm, ffn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(lambda t: self.ffn(self.norm(t)), x, use_reentrant=False)


def model_config(args):
    from xmoe.config import ModelConfig, MoEConfig

    moe = MoEConfig(hidden_size=args.hidden, ffn_hidden_size=args.ffn, num_experts=args.experts, top_k=args.top_k)
    return ModelConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        moe=moe,
        max_seq_len=args.seq,
    )


def build(cfg, dims, device, dtype, kernels, ssmb: bool, recompute: bool):
    """TP then SSMB by hand, not through xmoe.parallel.build: the recompute baseline wraps each MoE block between
    the two (so that SSMB's scatter runs before the checkpoint), a layout the trainer does not build. ``kernels``:
    the resolved kernel choice every MoE layer is built with."""
    from xmoe.model.transformer import Transformer
    from xmoe.parallel.ssmb import apply_ssmb
    from xmoe.parallel.tensor import apply_tensor_parallel

    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(cfg, kernels=kernels)
    model.to(dtype)
    model.rope_cos, model.rope_sin = model.rope_cos.float(), model.rope_sin.float()  # angles stay fp32
    apply_tensor_parallel(model, dims)
    if recompute:
        for block in model.layers:
            block.ffn, block.ffn_norm = RecomputedFFN(block.ffn_norm, block.ffn), nn.Identity()
    if ssmb:  # after the checkpoint wrapper: SSMB's scatter runs before it, so it keeps only T/S input rows
        apply_ssmb(model, dims)
    return model


def predicted(cfg, world: int, micro_batch: int, seq: int, ssmb: bool, recompute: bool, kernel: str, b: int) -> dict:
    """This script's layout from the per-layer terms of xmoe.plan.terms: a bf16 module (no autocast, no FSDP2), so not
    estimate_memory, which models the trainer's. Saved: every layer's attention and MoE block (or the block's kept
    input), the final norm and the head's input; plus the largest backward transient, a layer's activations again
    (and its MoE block rebuilt) or the loss chunk (the head is replicated over TP: all V logits)."""
    from xmoe.plan.terms import LOSS_CHUNK_TOKENS, attention_activations, moe_activations, norm_activations

    T, H = micro_batch * seq, cfg.hidden_size
    T_moe = T // world if ssmb else T
    attn = sum(attention_activations(T, H, cfg.num_heads, world, b).values())
    terms = moe_activations(cfg.moe, T_moe, kernel=kernel, b=b)
    if kernel == "triton":  # one EP rank: the fused path keeps the tokens it reads, no dispatch or combine buffer
        terms.update(dispatch_buffer=b * T_moe * H, combine_buffer=0.0)
    block = sum(terms.values())
    kept = b * T_moe * H if recompute else block  # the checkpoint keeps the block's input (T/S rows under SSMB)
    saved = cfg.num_layers * (attn + kept) + norm_activations(T, H) + b * T * H
    working = max(attn + block * (1 + recompute), 12 * min(T, LOSS_CHUNK_TOKENS) * cfg.vocab_size)
    return {"pred_peak_gib": (saved + working) / GIB, "pred_moe_mib": kept / MIB}


def run_setting(name: str, cfg, dims, device, args, micro_batch: int) -> dict:
    from xmoe.bench import saved_activation_bytes
    from xmoe.kernels.choice import resolve_kernels
    from xmoe.model.flops import FlopDims, train_flops

    ssmb, recompute = SETTINGS[name]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    world, T = dist.get_world_size(), micro_batch * args.seq
    kernels = resolve_kernels(cfg.moe.kernel_backend, device=device)  # the model's, resolved once
    row = {
        "setting": name,
        "tp": world,
        "micro_batch": micro_batch,
        "tokens": T,
        **predicted(cfg, world, micro_batch, args.seq, ssmb, recompute, kernels.backend, dtype.itemsize),
    }
    model = step = None
    try:
        model = build(cfg, dims, device, dtype, kernels, ssmb, recompute)
        gen = torch.Generator(device=device).manual_seed(1)  # the same tokens on every TP rank: one data shard
        tokens = torch.randint(0, cfg.vocab_size, (micro_batch, args.seq + 1), device=device, generator=gen)
        losses = []

        def step():
            loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()  # gradients accumulate across steps: allocated once, like a training run's
            losses.append(loss.detach())

        for _ in range(args.warmup):
            step()
        block = model.layers[-1]
        h_BSH = torch.randn(micro_batch, args.seq, cfg.hidden_size, device=device, dtype=dtype, requires_grad=True)
        row["moe_mib"] = saved_activation_bytes(lambda: block.ffn(block.ffn_norm(h_BSH))) / MIB
        if device.type == "cuda":
            row["act_peak_gib"] = peak_extra_bytes(step) / GIB
        ms = collective_time_ms(step, device, args.iters, args.trials, warmup=False)
        step_flops = train_flops(FlopDims.from_model_config(cfg, args.seq), micro_batch)
        row.update(
            loss=losses[0].float().item(),
            step_ms=ms,
            tokens_per_s=T / (ms / 1e3),
            tflops=step_flops / (ms / 1e3) / world / 1e12,
        )
    except torch.OutOfMemoryError:  # every rank runs the same shapes, so all of them land here together
        row["error"] = "out of memory"
    model = step = None  # the closure holds the model too
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=None, help="default 2048 (64 with --cpu)")
    parser.add_argument("--ffn", type=int, default=None, help="expert ffn width; default 1408 (32 with --cpu)")
    parser.add_argument("--experts", type=int, default=None, help="default 64 (8 with --cpu)")
    parser.add_argument("--top-k", type=int, default=None, help="default 6 (2 with --cpu)")
    parser.add_argument("--heads", type=int, default=None, help="default 16 (4 with --cpu)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=None, help="default 32768 (256 with --cpu)")
    parser.add_argument("--seq", type=int, default=None, help="default 4096 (64 with --cpu)")
    parser.add_argument("--micro-batch", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--cpu", action="store_true", help="gloo smoke test of this script on CPU processes")
    args = parser.parse_args(argv)
    small = {"hidden": 2048, "ffn": 1408, "experts": 64, "top_k": 6, "heads": 16, "vocab": 32768, "seq": 4096}
    tiny = {"hidden": 64, "ffn": 32, "experts": 8, "top_k": 2, "heads": 4, "vocab": 256, "seq": 64}
    for key, value in (tiny if args.cpu else small).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    reason = distributed_skip_reason("benchmarks/bench_ssmb.py", args.cpu)
    if reason:
        print(f"bench_ssmb: skipped: {reason}")
        return
    device = init_distributed(args.cpu)
    from benchmarks.harness import environment, markdown_table, write_results
    from xmoe.config import ParallelConfig
    from xmoe.parallel.dims import ParallelDims

    world = dist.get_world_size()
    dims = ParallelDims.from_config(ParallelConfig(tp=world), world).build_mesh(device.type)
    cfg = model_config(args)
    rows = [run_setting(name, cfg, dims, device, args, mb) for mb in args.micro_batch for name in args.settings]
    if dist.get_rank() == 0:
        cols = [
            "setting",
            "tp",
            "micro_batch",
            "tokens",
            "loss",
            "step_ms",
            "tokens_per_s",
            "tflops",
            "act_peak_gib",
            "pred_peak_gib",
            "moe_mib",
            "pred_moe_mib",
            "error",
        ]
        notes = (
            f"Model: H {args.hidden}, E {args.experts}, top-{args.top_k}, F {args.ffn}, {args.heads} heads, "
            f"{args.layers} MoE layers, vocab {args.vocab}, seq {args.seq}; TP {world}; "
            f"{'fp32 CPU smoke test' if args.cpu else 'bf16 weights'}. Rank 0's numbers."
        )
        if args.cpu:  # xmoe.bench.saved_activation_bytes skips parameters but not views of them
            notes += " moe_mib also counts the expert weights: the torch backend saves per-expert views w[e]."
        write_results(
            "bench_ssmb",
            rows,
            cols,
            {**environment(), "args": vars(args)},
            "SSMB vs replicated MoE blocks vs recomputation under TP",
            notes,
            topic="ssmb",
        )
        print(notes)
        print(markdown_table(rows, cols))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
