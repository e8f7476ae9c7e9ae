"""Tensor parallelism (xmoe/parallel/tensor.py) on gloo worlds, without SSMB (MoE blocks replicated over TP): logits
and every gradient against one process, one SGD step, and DCP checkpoints between TP=2 and one plain process.
SSMB on top of it is tested in test_ssmb.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dist_utils import run_distributed

TOL = 1e-5
VOCAB, SEQ, LR = 32, 8, 0.1


def _config():
    from xmoe.config import ModelConfig, MoEConfig

    moe = MoEConfig(
        hidden_size=32,
        ffn_hidden_size=8,
        num_experts=8,
        top_k=3,
        num_shared_experts=1,
        aux_loss_coef=0.01,
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


def _model(seed: int = 0):
    from xmoe.model.transformer import Transformer

    torch.manual_seed(seed)
    return Transformer(_config(), loss_chunk_tokens=0)


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, SEQ + 1), generator=torch.Generator().manual_seed(3))


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _reference_step():
    """One process: logits, loss, gradients, then one SGD step."""
    model = _model()
    tokens = _tokens()
    logits = model(tokens[:, :-1]).detach()
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return model, logits, grads


def _tp_body(rank: int, world_size: int, ckpt_dir: str | None) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.tensor import DTensor

    from xmoe.config import ParallelConfig
    from xmoe.parallel.dims import ParallelDims
    from xmoe.parallel.tensor import apply_tensor_parallel

    tp = world_size
    dims = ParallelDims.from_config(ParallelConfig(tp=tp), world_size).build_mesh("cpu")
    ref, ref_logits, ref_grads = _reference_step()
    model = apply_tensor_parallel(_model(), dims)
    attn = model.layers[0].attn
    assert isinstance(attn.wq.weight, DTensor) and attn.wq.weight.to_local().shape == (32 // tp, 32)
    assert attn.wo.weight.to_local().shape == (32, 32 // tp)
    assert model.layers[0].ffn.w1.weight.to_local().shape == (16 // tp, 32)
    assert not isinstance(model.layers[1].ffn.router.weight, DTensor)  # MoE blocks stay replicated
    with pytest.raises(ValueError, match="already DTensors"):
        apply_tensor_parallel(model, dims)

    tokens = _tokens()
    assert rel_err(model(tokens[:, :-1]), ref_logits) < TOL
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    for name, p in model.named_parameters():
        assert rel_err(_full(p.grad), ref_grads[name]) < TOL, (rank, name)
    # the replicated MoE block computes the same thing on every TP rank: identical gradients, no reduction needed
    router_grad = model.layers[1].ffn.router.weight.grad
    peers = [torch.empty_like(router_grad) for _ in range(tp)]
    torch.distributed.all_gather(peers, router_grad, group=dims.group("tp"))
    assert all(torch.equal(g, peers[0]) for g in peers)
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert rel_err(_full(p), ref_params[name]) < TOL, (rank, name)

    if ckpt_dir is None:
        return
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=ckpt_dir)  # global shapes, one copy per weight
    fresh = apply_tensor_parallel(_model(seed=1), dims)  # and a one-process checkpoint into TP=2
    state = {"model": get_model_state_dict(fresh)}
    dcp.load(state, checkpoint_id=ckpt_dir + "_plain")
    set_model_state_dict(fresh, state["model"])
    for name, p in fresh.named_parameters():
        assert rel_err(_full(p), ref_params[name]) < TOL, (rank, "loaded plain", name)


def test_tp2_matches_one_process_and_checkpoints_reshard(tmp_path):
    import torch.distributed.checkpoint as dcp

    ckpt = str(tmp_path / "ckpt")
    ref, _, _ = _reference_step()
    dcp.save({"model": ref.state_dict()}, checkpoint_id=ckpt + "_plain")  # one process, no process group
    run_distributed(_tp_body, 2, ckpt)
    plain = _model(seed=2)  # the TP=2 checkpoint into one plain process
    state = {"model": plain.state_dict()}
    dcp.load(state, checkpoint_id=ckpt)
    plain.load_state_dict(state["model"])
    for (name, p), q in zip(plain.named_parameters(), ref.parameters(), strict=False):
        assert rel_err(p, q) < TOL, name


def test_tp4_matches_one_process():
    run_distributed(_tp_body, 4, None)


def test_shape_errors_name_the_fix():
    from xmoe.parallel.tensor import check_tensor_parallel

    cfg = _config()
    check_tensor_parallel(cfg, 4)
    with pytest.raises(ValueError, match=r"num_heads \(4\) must be divisible by tp \(3\).*\[1, 2, 4\]"):
        check_tensor_parallel(cfg, 3)
    odd_ffn = dataclasses.replace(cfg, ffn_hidden_size=18)
    with pytest.raises(ValueError, match=r"ffn_hidden_size \(18\) must be divisible by tp \(4\)"):
        check_tensor_parallel(odd_ffn, 4)
    check_tensor_parallel(dataclasses.replace(odd_ffn, first_k_dense=0), 4)  # no dense FFN: width irrelevant
