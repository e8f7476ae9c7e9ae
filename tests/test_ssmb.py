"""SSMB (xmoe/parallel/ssmb.py) on gloo worlds: TP=2, TP=4 and TP=2 x EP=2 against one process (also with sequence
parallelism), TP-peer routers after optimizer steps, saved-activation bytes of the MoE block against
xmoe.plan.terms, and `xmoe train --tp 2`.

The reference is one process on the same data: with several data shards (EP), the mean of the shards' losses, as the
data-parallel ranks average. The balance loss is per sequence over whole sequences (each TP rank gets whole
sequences when tp divides the batch) and the z-loss a mean over tokens, so both are exact under SSMB too; with tp
not dividing the batch the slices cut sequences, so that case runs without the balance loss (see ssmb.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import SMALL as SMALL_MODEL
from dist_utils import run_distributed

TOL = 1e-5  # relative to the reference's norm; fp32 with TP's different summation order
VOCAB, SEQ = 32, 8


def _config(aux_loss_coef: float = 0.01, scope: str = "sequence"):
    from xmoe.config import ModelConfig, MoEConfig

    moe = MoEConfig(
        hidden_size=32,
        ffn_hidden_size=8,
        num_experts=8,
        top_k=3,
        num_shared_experts=1,
        aux_loss_coef=aux_loss_coef,
        balance_scope=scope,
        z_loss_coef=1e-3,
        kernel_backend="torch",
    )
    return ModelConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        moe=moe,
        first_k_dense=1,
        ffn_hidden_size=16,
        max_seq_len=SEQ,
    )


def _model(cfg):
    from xmoe.model.transformer import Transformer

    torch.manual_seed(0)
    return Transformer(cfg, loss_chunk_tokens=0)


def _batches(num_steps: int, num_shards: int, batch: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randint(0, VOCAB, (num_steps, num_shards, batch, SEQ + 1), generator=gen)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _dims(world_size: int, tp: int, ep: int = 1):
    from xmoe.config import ParallelConfig
    from xmoe.parallel.dims import ParallelDims

    par = ParallelConfig(dp=world_size // (tp * ep), ep=ep, tp=tp)
    return ParallelDims.from_config(par, world_size).build_mesh("cpu")


def _parallel_model(cfg, dims, sequence_parallel: bool = False):
    """The trainer's composition: TP -> SSMB -> EP -> FSDP2 (experts over "dp", blocks and root over "dp_ep")."""
    from xmoe.parallel.expert_parallel import apply_expert_parallel
    from xmoe.parallel.ssmb import apply_ssmb
    from xmoe.parallel.tensor import apply_tensor_parallel

    model = _model(cfg)
    apply_tensor_parallel(model, dims, sequence_parallel=sequence_parallel)
    apply_ssmb(model, dims)
    return apply_expert_parallel(model, dims)


def _reference_backward(ref, tokens_SBL: torch.Tensor) -> None:
    """One process's gradient of the mean over data shards: each shard's backward (its auxiliary losses attach with
    gradient 1, whatever the loss is scaled by), then divided by the number of shards, as data parallelism averages."""
    for s in range(tokens_SBL.shape[0]):
        ref(tokens_SBL[s, :, :-1], tokens_SBL[s, :, 1:]).backward()
    for p in ref.parameters():
        p.grad /= tokens_SBL.shape[0]


def _check_one_step(dims, cfg, batch: int, sequence_parallel: bool = False) -> None:
    """Logits, loss and every gradient (as full tensors) equal one process's on the same global batch."""
    shards = dims.dp * dims.ep
    tokens = _batches(1, shards, batch)[0]
    mine = tokens[dims.coord("dp_ep")]
    ref = _model(cfg)
    ref_logits = ref(mine[:, :-1])
    _reference_backward(ref, tokens)
    model = _parallel_model(cfg, dims, sequence_parallel)
    where = f"tp={dims.tp} ep={dims.ep} batch={batch} sp={sequence_parallel} rank={dims.rank}"
    assert rel_err(model(mine[:, :-1]), ref_logits) < TOL, where
    model(mine[:, :-1], mine[:, 1:]).backward()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        err = rel_err(_full(p.grad), ref_params[name].grad)
        assert err < TOL, (where, name, err)
    assert model.layers[1].ssmb_region.num_grad_reductions > 0, where


def _check_router_identical_after_steps(dims, cfg, batch: int, sequence_parallel: bool = False, steps: int = 3) -> None:
    """A few clipped AdamW steps: every parameter follows the one-process run, and the MoE block's router is
    bit-identical on all TP peers."""
    from xmoe.parallel.expert_parallel import clip_grad_norm_

    shards = dims.dp * dims.ep
    tokens = _batches(steps, shards, batch)
    ref = _model(cfg)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    model = _parallel_model(cfg, dims, sequence_parallel)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        _reference_backward(ref, tokens[step])
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)  # well under the gradient norm: clipping acts
        ref_opt.step()
        ref_opt.zero_grad()
        mine = tokens[step, dims.coord("dp_ep")]
        model(mine[:, :-1], mine[:, 1:]).backward()
        clip_grad_norm_(model.parameters(), 0.05)  # torch's own cannot mix meshes
        opt.step()
        opt.zero_grad()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert rel_err(_full(p), ref_params[name]) < 10 * TOL, (dims.rank, name)
    router = _full(model.layers[1].ffn.router.weight).detach()
    peers = [torch.empty_like(router) for _ in range(dims.tp)]
    torch.distributed.all_gather(peers, router, group=dims.group("tp"))
    assert all(torch.equal(peer, peers[0]) for peer in peers), f"TP peers' routers differ (rank {dims.rank})"


def _check_masked_global_step(dims, batch: int, sequence_parallel: bool = False) -> None:
    """Positions without a target, and the global balance scope, over the TP slices: the real-token mask is cut as the
    tokens are and the balance loss takes every slice's counts, so every gradient is the one process's on the whole
    micro-batch, whether the slices cut sequences or not. One data shard (the TP group is the world)."""
    from xmoe.model.loss import IGNORE_INDEX
    from xmoe.moe.step import MoEStep

    cfg = _config(scope="global")
    tokens = _batches(1, 1, batch)[0, 0]
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    targets[0, 1::3] = IGNORE_INDEX
    targets[-1, -3:] = IGNORE_INDEX

    def step(model) -> None:
        with MoEStep(model, 1, torch.device("cpu")) as moe:
            moe.set_real_tokens(targets != IGNORE_INDEX)
            model(inputs, targets).backward()
            moe.end_micro_batch()

    # the reference runs on every rank with the same tokens: its global counts, summed over the ranks, have the
    # one-process frequencies and mean tokens per rank
    ref, model = _model(cfg), _parallel_model(cfg, dims, sequence_parallel)
    step(ref)
    step(model)
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        err = rel_err(_full(p.grad), ref_params[name].grad)
        assert err < TOL, (dims.rank, batch, sequence_parallel, name, err)


def _saved_bytes(fn, module: torch.nn.Module) -> int:
    """Bytes of the distinct storages autograd saves while running ``fn()``, parameters' storages excluded.

    Like xmoe.bench.saved_activation_bytes, except that it also skips views of parameters: the torch backend's
    grouped SwiGLU saves each expert's weight slice w[e], which that function counts as an activation.
    """
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def _moe_saved_bytes(cfg, dims, num_tokens: int, ssmb: bool, dtype: torch.dtype) -> int:
    """Bytes autograd saves for one MoE block's ffn part (ffn norm + MoE layer) on this TP rank."""
    from xmoe.model.transformer import Block
    from xmoe.parallel.ssmb import apply_ssmb

    torch.manual_seed(0)
    block = Block(cfg, layer_id=1).to(dtype)
    if ssmb:
        apply_ssmb(block, dims)
    h = torch.randn(num_tokens // 64, 64, cfg.hidden_size, dtype=dtype, requires_grad=True)
    return _saved_bytes(lambda: block.ffn(block.ffn_norm(h)), block)


def _check_memory(dims, cfg) -> None:
    """SSMB divides the MoE block's saved activations by tp (up to the per-layer constants), as the plan predicts."""
    from xmoe.plan.terms import moe_activations

    T = 256 * dims.tp
    for dtype in (torch.float32, torch.bfloat16):
        b = dtype.itemsize
        off, on = (_moe_saved_bytes(cfg, dims, T, ssmb, dtype) for ssmb in (False, True))
        predicted_off, predicted_on = (
            sum(moe_activations(cfg.moe, n, kernel="torch", b=b).values()) for n in (T, T // dims.tp)
        )
        constant = sum(moe_activations(cfg.moe, 0, kernel="torch", b=b).values())  # fp32 weight copies
        assert off == pytest.approx(predicted_off, rel=0.01), (dtype, off, predicted_off)
        assert on == pytest.approx(predicted_on, rel=0.01), (dtype, on, predicted_on)
        assert (off - constant) / (on - constant) == pytest.approx(dims.tp, rel=0.01), (dtype, off, on, constant)


def _tp_body(rank: int, world_size: int, tp: int, ep: int) -> None:
    dims = _dims(world_size, tp, ep)
    cfg = _config()
    _check_one_step(dims, cfg, batch=tp)  # whole sequences per TP rank: balance loss exact
    # tp does not divide the batch: slices cut through sequences (token-level split), no balance loss
    _check_one_step(dims, _config(aux_loss_coef=0.0), batch=tp // 2 if tp > 2 else 1)
    _check_router_identical_after_steps(dims, cfg, batch=tp)
    # sequence parallelism: the MoE blocks get this rank's positions of every sequence (no balance loss: partial
    # sequences) and the residual stream stays sharded
    _check_one_step(dims, _config(aux_loss_coef=0.0), batch=1, sequence_parallel=True)
    _check_router_identical_after_steps(dims, _config(aux_loss_coef=0.0), batch=2, sequence_parallel=True)
    if ep == 1:
        for batch, sequence_parallel in ((tp, False), (1, False), (2, True)):
            _check_masked_global_step(dims, batch, sequence_parallel)
        _check_memory(dims, cfg)
        model = _parallel_model(cfg, dims)
        with pytest.raises(ValueError, match=rf"over tp \({tp}\)"):
            model(torch.zeros(1, tp + 1, dtype=torch.long))


def test_ssmb_tp2():
    run_distributed(_tp_body, 2, 2, 1)


def test_ssmb_tp4():
    run_distributed(_tp_body, 4, 4, 1)


def test_ssmb_tp2_ep2():
    run_distributed(_tp_body, 4, 2, 2)


# ----------------------------------------------------------------------------------------------------- CLI

SMALL = [
    *SMALL_MODEL,
    "--steps",
    "6",
    "--log-every",
    "1",
    "--ckpt-every",
    "100",
    "--device",
    "cpu",
]


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def test_train_cli_tp2_tracks_single_process(tmp_path):
    from xmoe.cli import main

    single = tmp_path / "single"
    main(["train", "--out", str(single), *SMALL])
    for name, extra in (("tp", []), ("tp_sp", ["--sequence-parallel"])):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "xmoe",
            "train",
            "--out",
            str(tmp_path / name),
            "--tp",
            "2",
            *extra,
            *SMALL,
        ]
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        a, b = _losses(single), _losses(tmp_path / name)
        for step in range(1, 7):
            # same batch; only TP's summation order and the per-slice batch balance loss differ
            assert abs(a[step] - b[step]) < 2e-3 * abs(a[step]), (name, step, a[step], b[step])
