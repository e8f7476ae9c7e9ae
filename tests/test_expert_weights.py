"""The owner of the routed experts' weights (xmoe/moe/weights.py: ExpertWeights): the path the build chooses, the
copies the fused AdamW writes for the next step (taken once, only the latest, dropped by a load), and FP8 experts'
FP8 copies written in the optimizer's pass against a quantising pass (bitwise). How the copies' gradients reach the
fp32 .grad is checked against the autograd path in tests/test_moe_layer.py (bf16) and tests/test_fp8.py (FP8).

The interpreter computes bf16 wrongly (numpy has none): fp16 stands in for the copies' dtype, as in
tests/test_adamw.py."""

from __future__ import annotations

import pytest
import torch
from test_adamw import _model_and_grads, _run

from xmoe.config import ModelConfig, MoEConfig
from xmoe.moe.experts import use_one_process
from xmoe.moe.layer import MoELayer
from xmoe.moe.step import MoEStep
from xmoe.moe.weights import NAMES
from xmoe.parallel.build import build_model
from xmoe.train.optim import TritonAdamW, describe_optimizer, param_groups

CPU = torch.device("cpu")


def _masters(layer):
    return (layer.experts.w1, layer.experts.w3, layer.experts.w2)


def _open_step(layer, dtype):
    """The copies a step opened in ``dtype`` computes with."""
    with MoEStep(layer, 1, CPU, cast_dtype=dtype):
        return layer.moe_step.casts


def _same(a, b) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def test_the_build_chooses_the_path_and_pairs_the_optimizers_writers():
    moe = MoEConfig(hidden_size=16, ffn_hidden_size=8, num_experts=4, top_k=2, kernel_backend="torch")
    cfg = ModelConfig(vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, max_seq_len=8, moe=moe)
    built = build_model(cfg, CPU, param_dtype=torch.float16)
    layers = built.model.moe_layers()
    assert len(layers) == 2 and all(layer.experts.expert_weights.detached for layer in layers)
    # one writer per routed expert weight, in the parameters' order; none for the router or the shared experts
    assert _same([p for p, _ in built.copy_writers], [w for layer in layers for w in _masters(layer)])
    assert {writer.kind for _, writer in built.copy_writers} == {"fp16"}
    optimizer = TritonAdamW(param_groups(built.wrapped, 0.1), lr=1e-3, copies=built.copy_writers)
    assert describe_optimizer(optimizer).endswith("(writes the experts' next fp16 copies)")
    plain = build_model(cfg, CPU)  # no compute dtype: detached copies made at each step, none written
    assert plain.copy_writers == [] and all(layer.experts.expert_weights.detached for layer in plain.model.moe_layers())
    assert not MoELayer(moe).experts.expert_weights.detached  # a layer used alone: autograd casts


def test_a_written_copy_is_taken_once_and_only_the_latest():
    layer, grads = _model_and_grads(3)
    owner, masters = layer.experts.expert_weights, _masters(layer)
    pairs = use_one_process(layer, torch.float16)
    assert _same([p for p, _ in pairs], masters)
    optimizer = TritonAdamW(param_groups(layer, 0.1), lr=1e-2, copies=pairs)
    _run(optimizer, layer, grads[:2])  # two updates, no step opened between: the second's copies replace the first's
    assert owner.num_waiting() == 3
    written = [owner.waiting(name) for name in NAMES]
    assert all(torch.equal(c, w.detach().half()) for c, w in zip(written, masters, strict=True))
    casts = _open_step(layer, torch.float16)  # the step computes with the written copies, as leaves of their own
    assert all(c.data_ptr() == w.data_ptr() and c.is_leaf for c, w in zip(casts, written, strict=True))
    assert owner.num_waiting() == 0
    again = _open_step(layer, torch.float16)  # handed out once: the next step casts
    assert all(a.data_ptr() != c.data_ptr() and torch.equal(a, c) for a, c in zip(again, casts, strict=True))
    # a step in another dtype casts, and drops the copies
    _run(optimizer, layer, grads[2:3])
    other = _open_step(layer, torch.bfloat16)
    assert owner.num_waiting() == 0
    assert all(torch.equal(c, w.detach().bfloat16()) for c, w in zip(other, masters, strict=True))
    # the rule for edits outside the optimizer: invalidate() drops the copies, and the step casts the new weights
    _run(optimizer, layer, grads[3:4])
    with torch.no_grad():
        layer.experts.w1.mul_(2.0)
    layer.experts.expert_weights.invalidate()
    casts = _open_step(layer, torch.float16)
    assert all(torch.equal(c, w.detach().half()) for c, w in zip(casts, masters, strict=True))


def test_written_copies_train_bitwise_as_casts_at_each_step():
    # three steps of two fp16 micro-batches with the copies the optimizer writes, and with the step casting them
    # (the same detached path, no writers): the copies change where the cast happens, not what is computed
    xs = [torch.randn(12, 32, generator=torch.Generator().manual_seed(50 + i)).half() for i in range(3)]
    runs = []
    for copy_dtype in (None, torch.float16):
        layer, _ = _model_and_grads(10)
        optimizer = TritonAdamW(param_groups(layer, 0.1), lr=1e-2, copies=use_one_process(layer, copy_dtype))
        losses = []
        for x in xs:
            with MoEStep(layer, 2, CPU, cast_dtype=torch.float16):
                for half in x.chunk(2):
                    loss = layer(half).float().square().mean()
                    loss.backward()
                    losses.append(loss.detach())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        assert layer.experts.expert_weights.num_waiting() == (3 if copy_dtype else 0)
        runs.append((torch.stack(losses), [p.detach().clone() for p in layer.parameters()]))
    (want_losses, want), (got_losses, got) = runs
    assert torch.equal(got_losses, want_losses) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_load_drops_the_waiting_copies():
    layer, grads = _model_and_grads(4)
    source, _ = _model_and_grads(5)
    owner = layer.experts.expert_weights
    optimizer = TritonAdamW(param_groups(layer, 0.1), lr=1e-2, copies=use_one_process(layer, torch.float16))
    _run(optimizer, layer, grads[:1])
    assert owner.num_waiting() == 3
    layer.load_state_dict(source.state_dict())  # the layer's load: the experts' hook runs as a submodule's
    assert owner.num_waiting() == 0
    casts = _open_step(layer, torch.float16)
    assert all(torch.equal(c, w.detach().half()) for c, w in zip(casts, _masters(source), strict=True))
    _run(optimizer, layer, grads[1:2])
    layer.experts.reset_parameters()
    assert owner.num_waiting() == 0


def test_a_resume_drops_the_copies_of_the_state_loading_step():
    # DCP's set_state_dict steps a fresh optimizer at lr 0 to make its state (which writes copies of the weights
    # before the load), then loads the model: the trainer's first step after a resume casts the loaded weights
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, grads = _model_and_grads(6)
    optimizer = TritonAdamW(param_groups(model, 0.1), lr=1e-2)
    _run(optimizer, model, grads[:2])
    model_sd, optim_sd = get_state_dict(model, optimizer)
    fresh, _ = _model_and_grads(7)
    loaded = TritonAdamW(param_groups(fresh, 0.1), lr=1e-2, copies=use_one_process(fresh, torch.float16))
    set_state_dict(fresh, loaded, model_state_dict=model_sd, optim_state_dict=optim_sd)
    assert fresh.experts.expert_weights.num_waiting() == 0
    casts = _open_step(fresh, torch.float16)
    assert all(torch.equal(c, w.detach().half()) for c, w in zip(casts, _masters(model), strict=True))


def _fp8_layer(seed):
    torch.manual_seed(seed)
    cfg = MoEConfig(hidden_size=64, ffn_hidden_size=48, num_experts=3, top_k=2, kernel_backend="triton", fp8="experts")
    return MoELayer(cfg)


def _fp8_train(layer, optimizer, xs):
    """Steps of two micro-batches each, as the trainer takes them (MoEStep, then the optimizer)."""
    for x in xs:
        with MoEStep(layer, 2, CPU, cast_dtype=torch.float32):
            for half in x.chunk(2):
                layer(half).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_fp8_experts_take_the_copies_the_optimizer_wrote(monkeypatch):
    from xmoe.kernels import fp8_quant

    xs = [torch.randn(8, 64, generator=torch.Generator().manual_seed(40 + i)) for i in range(2)]
    calls = []
    real = fp8_quant.quantize_expert_weights
    monkeypatch.setattr(fp8_quant, "quantize_expert_weights", lambda *a: calls.append(1) or real(*a))
    # the same steps with copies written by the optimizer and quantised at each step's start: bitwise one run
    runs = {}
    for written in (False, True):
        layer = _fp8_layer(9)
        pairs = use_one_process(layer, torch.bfloat16 if written else None)
        optimizer = TritonAdamW(param_groups(layer, 0.1), lr=1e-2, copies=pairs)
        calls.clear()
        _fp8_train(layer, optimizer, xs)
        assert len(calls) == (1 if written else 2)  # with the copies written only the first step quantises
        runs[written] = (layer, optimizer)
    for a, b in zip(runs[False][0].parameters(), runs[True][0].parameters(), strict=True):
        assert torch.equal(a, b)
    layer, optimizer = runs[True]
    owner, masters = layer.experts.expert_weights, _masters(layer)
    assert describe_optimizer(optimizer).endswith("(writes the experts' next FP8 copies)")
    assert owner.num_waiting() == 3

    def step_copies():
        return _open_step(layer, torch.float32)[3]

    calls.clear()
    taken = step_copies()  # the copies written by the last step: the weights' block quantisation
    assert not calls and owner.num_waiting() == 0
    for got, want in zip(taken, real(*masters, "e4m3fn"), strict=True):
        assert torch.equal(got, want)
    step_copies()  # handed out once: the next step quantises
    assert len(calls) == 1
    _fp8_train(layer, optimizer, xs[:1])
    layer.load_state_dict(_fp8_layer(10).state_dict())  # loaded weights: the copies waiting are dropped
    calls.clear()
    fresh = step_copies()
    assert len(calls) == 1 and torch.equal(fresh.scale2, real(*masters, "e4m3fn").scale2)
    # a weight the optimizer skipped (no gradient) leaves its pair incomplete: quantised at the step's start
    layer.experts.w3.requires_grad_(False)
    _fp8_train(layer, optimizer, xs[:1])
    assert owner.num_waiting() == 2
    calls.clear()
    step_copies()
    assert len(calls) == 1


def test_the_optimizer_refuses_writers_of_tensors_it_does_not_step():
    layer, _ = _model_and_grads(8)
    other, _ = _model_and_grads(9)
    with pytest.raises(ValueError, match="copy writers of 3 tensors it does not step"):
        TritonAdamW(param_groups(layer, 0.1), lr=1e-3, copies=use_one_process(other, torch.float16))
