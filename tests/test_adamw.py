"""xmoe's Triton AdamW (xmoe/kernels/adamw.py, xmoe/train/optim.py: TritonAdamW), in Triton's interpreter: each step
against a float64 AdamW written out here, its state against torch's AdamW (checkpoints load either way), the
clip's divisor folded into its pass, and the copies it writes in the same pass, bf16 or FP8 (the experts' copies as
their owner hands them out: tests/test_expert_weights.py).

The interpreter computes bf16 wrongly (numpy has none): fp16 stands in for the copies' dtype; the kernel casts
to whatever dtype the copy has, and benchmarks/bench_optimizer.py checks the bf16 copies and the step against
torch's fused AdamW on a GPU. FP8 experts' FP8 copies, written in the same pass, are checked here against the plain
pass followed by fp8_quant.quantize_blocks (bitwise), and on a GPU by benchmarks/check_gpu.py --fp8."""

from __future__ import annotations

import math

import pytest
import torch
from test_moe_layer import make_layer

from xmoe.kernels.adamw import adamw_update
from xmoe.moe.experts import use_one_process
from xmoe.train.optim import TritonAdamW, build_optimizer, param_groups
from xmoe.train.step import clip_gradients, folds_clipping, optimizer_step


def adamw_reference(p, g, m, v, *, step, lr, beta1, beta2, eps, weight_decay, divisor=1.0):
    """One AdamW step in float64 (decoupled weight decay, bias-corrected moments); returns new p, m, v."""
    p, g, m, v = (t.double() for t in (p, g, m, v))
    g = g / divisor
    p = p * (1 - lr * weight_decay)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    denom = v.sqrt() / math.sqrt(1 - beta2**step) + eps
    return p - lr / (1 - beta1**step) * m / denom, m, v


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("n", [0, 1, 63, 64, 1000])  # empty, one element, inside / at / past a block
@pytest.mark.parametrize("divide", [False, True])
def test_step_matches_float64_adamw(n, divide):
    gen = torch.Generator().manual_seed(n + 7 * divide)
    p = torch.randn(n, generator=gen)
    m, v = torch.zeros(n), torch.zeros(n)
    want = (p.double(), m.double(), v.double())
    hyper = {"lr": 3e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
    copy = torch.empty(n, dtype=torch.float16)
    for step in range(1, 6):
        g = torch.randn(n, generator=gen) * 10.0 ** (step - 3)  # gradients of several magnitudes
        divisor = torch.tensor(2.5) if divide else None
        adamw_update(p, g, m, v, step=step, divisor=divisor, copy=copy, **hyper)
        want = adamw_reference(*want[:1], g, *want[1:], step=step, divisor=2.5 if divide else 1.0, **hyper)
    if n:
        for got, ref in zip((p, m, v), want, strict=True):
            assert rel(got, ref) < 1e-6
        assert torch.equal(copy, p.half())  # the copy is the updated parameter, cast


def test_update_refuses_what_it_cannot_step():
    p, g = torch.zeros(4, 3), torch.zeros(4, 3)
    hyper = {"step": 1, "lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}
    with pytest.raises(ValueError, match="exp_avg has shape"):
        adamw_update(p, g, torch.zeros(3), torch.zeros(4, 3), **hyper)
    with pytest.raises(ValueError, match="contiguous"):
        adamw_update(p.t(), g.t(), torch.zeros(3, 4).t(), torch.zeros(3, 4), **hyper)
    with pytest.raises(ValueError, match="fp32 parameters"):
        adamw_update(p.half(), g, torch.zeros(4, 3), torch.zeros(4, 3), **hyper)
    with pytest.raises(ValueError, match="counts from 1"):
        adamw_update(p, g, torch.zeros(4, 3), torch.zeros(4, 3), **{**hyper, "step": 0})
    with pytest.raises(ValueError, match="divisor must be one fp32"):
        adamw_update(p, g, torch.zeros(4, 3), torch.zeros(4, 3), divisor=torch.ones(2), **hyper)


def _model_and_grads(seed):
    model = make_layer(seed=seed, hidden_size=32, ffn_hidden_size=24, num_experts=4, top_k=2)
    gen = torch.Generator().manual_seed(seed)
    grads = [[torch.randn(p.shape, generator=gen) for p in model.parameters()] for _ in range(4)]
    return model, grads


def _run(optimizer, model, grads, max_norm=None):
    params = list(model.parameters())
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.clone()
        if max_norm is None:
            optimizer.step()
        else:
            optimizer_step(optimizer, clip_gradients(optimizer, params, max_norm, None)[1])
        optimizer.zero_grad(set_to_none=True)


def test_optimizer_tracks_torch_adamw_and_shares_its_state():
    # param groups with and without decay, four steps, then the state handed over in both directions
    ours_model, grads = _model_and_grads(1)
    torch_model, _ = _model_and_grads(1)
    ours = TritonAdamW(param_groups(ours_model, 0.1), lr=1e-2, betas=(0.9, 0.95))
    theirs = torch.optim.AdamW(param_groups(torch_model, 0.1), lr=1e-2, betas=(0.9, 0.95), foreach=False)
    _run(ours, ours_model, grads[:2])
    _run(theirs, torch_model, grads[:2])
    for a, b in zip(ours_model.parameters(), torch_model.parameters(), strict=True):
        assert rel(a, b) < 1e-6
    # our state into torch's optimizer and torch's into ours: both continue the same run
    swapped_theirs = torch.optim.AdamW(param_groups(ours_model, 0.1), lr=1e-2, foreach=False)
    swapped_theirs.load_state_dict(ours.state_dict())
    swapped_ours = TritonAdamW(param_groups(torch_model, 0.1), lr=1e-2)
    swapped_ours.load_state_dict(theirs.state_dict())
    assert swapped_theirs.param_groups[0]["betas"] == (0.9, 0.95) == swapped_ours.param_groups[0]["betas"]
    _run(swapped_theirs, ours_model, grads[2:])
    _run(swapped_ours, torch_model, grads[2:])
    for a, b in zip(ours_model.parameters(), torch_model.parameters(), strict=True):
        assert rel(a, b) < 1e-6
    state = next(iter(swapped_ours.state.values()))
    assert state["step"].device.type == "cpu" and state["step"].item() == 4


def test_clip_is_folded_into_the_pass():
    # the trainer's clip (max_norm below the gradients' norm) through the optimizer's divisor equals clipping the
    # gradients in place first with torch's AdamW
    ours_model, grads = _model_and_grads(2)
    torch_model, _ = _model_and_grads(2)
    ours = TritonAdamW(param_groups(ours_model, 0.1), lr=1e-2)
    theirs = torch.optim.AdamW(param_groups(torch_model, 0.1), lr=1e-2, foreach=False)
    assert folds_clipping(ours, list(ours_model.parameters())) and not folds_clipping(
        theirs, list(torch_model.parameters())
    )
    _run(ours, ours_model, grads, max_norm=0.5)
    _run(theirs, torch_model, grads, max_norm=0.5)
    for a, b in zip(ours_model.parameters(), torch_model.parameters(), strict=True):
        assert rel(a, b) < 1e-6
    assert not hasattr(ours, "grad_scale")  # the divisor was handed over for the one step only


def test_refusals_and_the_trainers_choice():
    model, _ = _model_and_grads(4)
    with pytest.raises(ValueError, match="fp32 plain tensors"):
        TritonAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.float16))], lr=1e-3)
    opt = TritonAdamW([torch.nn.Parameter(torch.zeros(3))], lr=1e-3)
    opt.param_groups[0]["params"][0].grad = torch.ones(3)
    opt.param_groups[0]["amsgrad"] = True
    with pytest.raises(ValueError, match="amsgrad"):
        opt.step()
    groups = param_groups(model, 0.1)
    assert type(build_optimizer(groups, torch.device("cpu"), lr=1e-3, backend="torch")) is torch.optim.AdamW
    gpu = build_optimizer(
        param_groups(model, 0.1), torch.device("cuda"), lr=1e-3, backend="triton"
    )  # built, not stepped
    assert isinstance(gpu, TritonAdamW)
    torch_backend = build_optimizer(param_groups(model, 0.1), torch.device("cuda"), lr=1e-3, backend="torch")
    assert type(torch_backend) is torch.optim.AdamW and torch_backend.param_groups[0]["fused"]


def test_distributed_checkpoint_state_loads_into_a_fresh_optimizer():
    # the trainer's checkpoints go through DCP's state-dict helpers, which first step a fresh optimizer at lr 0 to
    # allocate its state: the loaded step counts and moments are the saved ones, and the weights are untouched
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, grads = _model_and_grads(5)
    optimizer = TritonAdamW(param_groups(model, 0.1), lr=1e-2)
    _run(optimizer, model, grads[:2])
    model_sd, optim_sd = get_state_dict(model, optimizer)
    fresh, _ = _model_and_grads(6)
    loaded = TritonAdamW(param_groups(fresh, 0.1), lr=1e-2)
    set_state_dict(fresh, loaded, model_state_dict=model_sd, optim_state_dict=optim_sd)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True))
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        saved, got = optimizer.state[a], loaded.state[b]
        assert got["step"].item() == saved["step"].item() == 2
        assert torch.equal(got["exp_avg"], saved["exp_avg"]) and torch.equal(got["exp_avg_sq"], saved["exp_avg_sq"])


def test_a_loaded_state_keeps_the_optimizers_implementation():
    # the saving optimizer's fused / foreach flags come with its state: each built optimizer keeps its own, so a
    # Triton AdamW's checkpoint resumed where torch's fused AdamW runs (FSDP2) stays fused, and the other way round
    model, grads = _model_and_grads(7)
    ours = build_optimizer(
        param_groups(model, 0.1), torch.device("cuda"), lr=1e-2, backend="triton"
    )  # built, not stepped
    theirs = build_optimizer(param_groups(model, 0.1), torch.device("cuda"), lr=1e-2, backend="torch")
    source = TritonAdamW(param_groups(model, 0.1), lr=1e-2)
    _run(source, model, grads[:1])
    theirs.load_state_dict(source.state_dict())
    assert all(group["fused"] and not group["foreach"] for group in theirs.param_groups)
    fused_source = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2, fused=True)
    ours.load_state_dict(fused_source.state_dict())
    assert isinstance(ours, TritonAdamW) and all(group["fused"] is None for group in ours.param_groups)


def test_the_optimizer_setting_chooses_or_refuses(monkeypatch):
    from xmoe.kernels import _common
    from xmoe.train.optim import describe_optimizer

    model, _ = _model_and_grads(8)
    cuda = torch.device("cuda")  # built, not stepped
    assert (
        type(build_optimizer(param_groups(model, 0.1), cuda, lr=1e-3, backend="triton", choice="torch"))
        is torch.optim.AdamW
    )
    mine = build_optimizer(
        param_groups(model, 0.1), torch.device("cpu"), lr=1e-3, backend="torch", choice="triton"
    )  # interpreter
    assert isinstance(mine, TritonAdamW) and describe_optimizer(mine) == "optimizer xmoe Triton AdamW"
    cached = TritonAdamW(param_groups(model, 0.1), lr=1e-3, copies=use_one_process(model, torch.float16))
    assert "next fp16 copies" in describe_optimizer(cached)
    assert describe_optimizer(torch.optim.AdamW(model.parameters(), fused=True)) == "optimizer torch AdamW (fused)"
    sharded = torch.nn.Parameter(torch.zeros(4))
    sharded.to_local = lambda: sharded  # what marks a DTensor here
    with pytest.raises(ValueError, match=r"include DTensors.*'auto' or 'torch'"):
        build_optimizer([{"params": [sharded]}], cuda, lr=1e-3, backend="triton", choice="triton")
    assert type(build_optimizer([{"params": [sharded]}], cuda, lr=1e-3, backend="triton")) is torch.optim.AdamW  # auto
    half = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    with pytest.raises(ValueError, match="other dtypes or layouts"):
        build_optimizer([{"params": [half]}], cuda, lr=1e-3, backend="triton", choice="triton")
    monkeypatch.setattr(_common, "interpreting", lambda: False)
    with pytest.raises(ValueError, match=r"runs on a GPU.*not on cpu"):
        build_optimizer(param_groups(model, 0.1), torch.device("cpu"), lr=1e-3, backend="torch", choice="triton")
    with pytest.raises(ValueError, match="must be 'auto', 'torch' or 'triton'"):
        build_optimizer(param_groups(model, 0.1), cuda, lr=1e-3, backend="triton", choice="sgd")
    with pytest.raises(ValueError, match=r"backend \('auto'\) must be a resolved one"):
        build_optimizer(param_groups(model, 0.1), cuda, lr=1e-3, backend="auto")  # resolved once, by the caller


@pytest.mark.parametrize("shape", [(2, 136, 200), (1, 128, 128), (3, 40, 260)])  # uneven, whole, narrow blocks
@pytest.mark.parametrize("divide", [False, True])
def test_fp8_copies_written_with_the_update_are_the_two_passes_bitwise(shape, divide):
    # the FP8 variant's update and copies against the plain pass followed by quantize_blocks of its result, for
    # the second member of a side-by-side pair (w3's place), over three steps of moments
    from xmoe.kernels import fp8_quant

    gen = torch.Generator().manual_seed(sum(shape) + divide)
    p = torch.randn(shape, generator=gen) * 0.02
    m, v = torch.zeros(shape), torch.zeros(shape)
    ref = [p.clone(), m.clone(), v.clone()]
    hyper = {"lr": 3e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
    for step in range(1, 4):
        g = torch.randn(shape, generator=gen) * 10.0 ** (step - 3)
        g[0, :3] = 0.0  # rows of zero gradient beside others
        divisor = torch.tensor(1.7) if divide else None
        pair = fp8_quant.BlockCopies.empty(p.shape, 2, "e4m3fn", p.device)
        adamw_update(p, g, m, v, step=step, divisor=divisor, copy=pair.member(1), **hyper)
        adamw_update(*ref[:1], g, *ref[1:], step=step, divisor=divisor, **hyper)
        assert all(torch.equal(a, b) for a, b in zip((p, m, v), ref, strict=True))
        q, qt, scale = fp8_quant.quantize_blocks(ref[0], "e4m3fn")
        got = pair.member(1)
        assert torch.equal(got.q, q) and torch.equal(got.qt, qt) and torch.equal(got.scale, scale)
    # and the copy dequantises to the weight within e4m3's rounding (relative to the block's largest value)
    deq = got.q * scale.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, : shape[1], : shape[2]]
    assert 0 < rel(deq, p) < 0.05


def test_fp8_copy_layouts_are_checked():
    from xmoe.kernels import fp8_quant

    p, g, m, v = (torch.zeros(2, 130, 260) for _ in range(4))
    hyper = {"step": 1, "lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}
    good = fp8_quant.BlockCopies.empty(p.shape, 1, "e4m3fn", p.device).member(0)
    with pytest.raises(ValueError, match=r"FP8 copy qt is \(2, 130, 260\).*needs \(2, 260, 130\)"):
        adamw_update(p, g, m, v, copy=good._replace(qt=good.q), **hyper)
    with pytest.raises(ValueError, match=r"FP8 copy scale .*torch.float16"):
        adamw_update(p, g, m, v, copy=good._replace(scale=good.scale.half()), **hyper)
    with pytest.raises(ValueError, match="must be one of"):
        adamw_update(p, g, m, v, copy=good._replace(fmt="e5m2"), **hyper)
    with pytest.raises(ValueError, match=r"\(E, R, C\) weight"):
        flat = torch.zeros(8)
        adamw_update(flat, flat, flat.clone(), flat.clone(), copy=good, **hyper)
