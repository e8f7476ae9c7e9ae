"""apply_expert_parallel on a small Transformer (EP + FSDP2 over gloo) vs one process training on the global batch,
and DCP checkpoints moved between EP degrees.

One training step is checked end to end: every gradient (as full tensors), the clipped total norm and the
parameters after AdamW. Then a checkpoint saved under (dp=2, ep=2) is loaded under (dp=1, ep=4), (dp=4, ep=1),
(dp=2, ep=2, dp_first) and into a plain single-process model, weights and optimizer state compared with the
reference; and a checkpoint written by one plain process is loaded under (dp=1, ep=4).
"""

from __future__ import annotations

import torch
from dist_utils import run_distributed

TOL = 1e-5  # the LM loss and routing run in fp32 even for a float64 model
LR, MAX_NORM = 1e-2, 0.05  # MAX_NORM well under the gradient norm: clipping is exercised


def _model_config():
    from xmoe.config import ModelConfig, MoEConfig

    moe = MoEConfig(
        hidden_size=16,
        ffn_hidden_size=8,
        num_experts=8,
        top_k=3,
        num_shared_experts=1,
        aux_loss_coef=0.01,
        kernel_backend="torch",
    )
    return ModelConfig(
        vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, moe=moe, first_k_dense=1, max_seq_len=16
    )


def _model(seed: int, chunk: int = 0):
    from xmoe.model.transformer import Transformer

    torch.manual_seed(seed)
    return Transformer(_model_config(), loss_chunk_tokens=chunk).double()


def _batches(num_ranks: int):
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 32, (num_ranks, 2, 9), generator=gen)
    return tokens[..., :-1], tokens[..., 1:]


def _reference_step(num_ranks: int):
    """Single process: mean of the per-rank losses (as the data-parallel ranks average), clip, one AdamW step."""
    model = _model(seed=0)  # the loss unchunked: the reference for chunked layouts too
    inputs, targets = _batches(num_ranks)
    for r in range(num_ranks):  # each rank's backward, summed: aux losses attach per forward, as on the ranks
        model(inputs[r], targets[r]).backward()
    for p in model.parameters():
        p.grad /= num_ranks
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    opt.step()
    return model, opt, grads, norm


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _parallel_model(dp: int, ep: int, placement: str, world_size: int, seed: int, chunk: int = 0):
    from xmoe.config import ParallelConfig
    from xmoe.parallel.dims import ParallelDims
    from xmoe.parallel.expert_parallel import apply_expert_parallel

    cfg = ParallelConfig(dp=dp, ep=ep, placement=placement)
    dims = ParallelDims.from_config(cfg, world_size, num_experts=8).build_mesh("cpu")
    return apply_expert_parallel(_model(seed, chunk), dims), dims


def _train_step_body(rank: int, world_size: int, layouts, ckpt_dir: str | None, chunk: int = 0):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    from xmoe.parallel.expert_parallel import clip_grad_norm_

    ref, ref_opt, ref_grads, ref_norm = _reference_step(world_size)
    inputs, targets = _batches(world_size)
    for i, (dp, ep, placement) in enumerate(layouts):
        where = f"dp={dp} ep={ep} {placement} rank={rank}"
        model, dims = _parallel_model(dp, ep, placement, world_size, seed=0, chunk=chunk)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        r = dims.coord("dp_ep")  # the data shard this rank trains on
        model(inputs[r], targets[r]).backward()
        for name, p in model.named_parameters():
            assert rel_err(_full(p.grad), ref_grads[name]) < TOL, (where, name, rel_err(_full(p.grad), ref_grads[name]))
        norm = clip_grad_norm_(model.parameters(), MAX_NORM, dims=dims)  # one all-reduce over "dp_ep"
        assert abs(norm.item() - ref_norm.item()) < TOL * ref_norm.item(), where
        opt.step()
        ref_params = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            assert rel_err(_full(p), ref_params[name]) < TOL, (where, name)

        if ckpt_dir is None:
            continue
        if i == 0:  # the first layout saves, every later one loads into a freshly initialised model
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt_dir)
            continue
        fresh, _ = _parallel_model(dp, ep, placement, world_size, seed=1)
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=LR)
        fresh(inputs[r], targets[r]).backward()  # populate the optimizer state so it has tensors to load into
        fresh_opt.step()
        msd, osd = get_state_dict(fresh, fresh_opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=ckpt_dir)
        set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        for name, p in fresh.named_parameters():
            assert rel_err(_full(p), ref_params[name]) < TOL, (where, "loaded", name)
            loaded_m = _full(fresh_opt.state[p]["exp_avg"])
            assert rel_err(loaded_m, ref_opt.state[ref_params[name]]["exp_avg"]) < TOL, (where, "exp_avg", name)
        if i == 1:  # and a checkpoint written by one plain process (full (E, H, F) stacks) into this layout
            fresh, _ = _parallel_model(dp, ep, placement, world_size, seed=2)
            state = {"model": get_model_state_dict(fresh)}
            dcp.load(state, checkpoint_id=ckpt_dir + "_plain")
            set_model_state_dict(fresh, state["model"])
            for name, p in fresh.named_parameters():
                assert rel_err(_full(p), ref_params[name]) < TOL, (where, "loaded plain", name)


def test_expert_parallel_training_step_two_ranks():
    run_distributed(_train_step_body, 2, [(1, 2, "ep_first")], None)


def test_chunked_loss_under_fsdp_and_expert_parallel_two_ranks():
    # the loss head over chunks of 5 of each rank's 16 tokens (the last of 1), with the dense weights, the head
    # included, sharded by FSDP2 (dp 2) and with experts sharded (ep 2): gradients and the step as one process's
    run_distributed(_train_step_body, 2, [(2, 1, "ep_first"), (1, 2, "ep_first")], None, 5)


def test_expert_parallel_step_and_checkpoint_across_ep_degrees(tmp_path):
    import torch.distributed.checkpoint as dcp

    ckpt = str(tmp_path / "ckpt")
    ref, _, _, _ = _reference_step(4)
    dcp.save({"model": ref.state_dict()}, checkpoint_id=ckpt + "_plain")  # one process, no process group
    layouts = [(2, 2, "ep_first"), (1, 4, "dp_first"), (4, 1, "ep_first"), (2, 2, "dp_first")]
    run_distributed(_train_step_body, 4, layouts, ckpt)

    # and the EP checkpoint into one process without any process group: plain (E, H, F) expert weights
    plain = _model(seed=1)
    state = {"model": plain.state_dict()}
    dcp.load(state, checkpoint_id=ckpt)
    plain.load_state_dict(state["model"])
    for (name, p), q in zip(plain.named_parameters(), ref.parameters(), strict=False):
        assert rel_err(p, q) < TOL, name
