"""MoELayer against the independent float64 loop reference: outputs, every gradient, routing rules."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from moe_reference import layer_params, reference_forward

from xmoe.config import MoEConfig
from xmoe.dispatch.routing import build_plan
from xmoe.moe.layer import MoELayer


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def make_layer(seed=0, **kw) -> MoELayer:
    base = dict(hidden_size=16, ffn_hidden_size=12, num_experts=8, top_k=2, kernel_backend="torch")
    base.update(kw)
    torch.manual_seed(seed)
    layer = MoELayer(MoEConfig(**base))
    with torch.no_grad():  # larger router weights: decisive, tie-free routing
        layer.router.weight.normal_(0, 0.5)
    return layer


def check_against_reference(layer: MoELayer, x: torch.Tensor, tol: float = 2e-5, dtype=torch.float32):
    """Forward + all gradients of the layer vs the float64 reference, relative to the reference's norm."""
    cfg = layer.cfg
    num_sequences = x.shape[0] if x.dim() == 3 else 1
    params = layer_params(layer)
    ref_params = {k: v.detach().double().requires_grad_(k != "bias") for k, v in params.items()}
    x_ref = x.detach().double().requires_grad_(True)
    out_ref, aux_ref, z_ref, _ = reference_forward(ref_params, x_ref, cfg, num_sequences)
    grad_out = torch.randn_like(out_ref)
    ((out_ref * grad_out).sum() + aux_ref + z_ref).backward()

    layer = layer.to(dtype)
    x_in = x.detach().to(dtype).requires_grad_(True)
    out = layer(x_in)
    assert out.shape == x.shape and out.dtype == dtype
    (out.reshape(-1, cfg.hidden_size).double() * grad_out).sum().backward()

    assert rel_err(out.reshape(-1, cfg.hidden_size), out_ref) < tol
    if cfg.aux_loss_coef:
        assert rel_err(layer.last_stats["aux_loss"], aux_ref) < max(tol, 1e-6)
    if cfg.z_loss_coef:
        assert rel_err(layer.last_stats["z_loss"], z_ref) < max(tol, 1e-6)
    assert rel_err(x_in.grad.reshape(-1, cfg.hidden_size), x_ref.grad.reshape(-1, cfg.hidden_size)) < tol
    for name, p in layer_params(layer).items():
        if name == "bias":
            continue
        ref_grad = ref_params[name].grad
        if ref_grad is None or ref_grad.norm() == 0:
            assert p.grad is None or p.grad.abs().max() == 0, name
        else:
            assert rel_err(p.grad, ref_grad) < tol, (name, rel_err(p.grad, ref_grad))
    return out


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(score_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5),
        dict(num_shared_experts=2, aux_loss_coef=0.1, z_loss_coef=0.01),
        dict(aux_loss_coef=0.3, balance_scope="sequence", score_func="sigmoid", norm_topk_prob=True),
        dict(num_expert_groups=4, topk_groups=2, top_k=3),
        dict(num_expert_groups=4, topk_groups=2, top_k=3, score_func="sigmoid"),
        dict(top_k=1),
        dict(top_k=8, norm_topk_prob=True),  # k = E
        dict(hidden_size=13, ffn_hidden_size=7, num_experts=6, top_k=3),  # odd sizes
    ],
)
def test_layer_matches_float64_reference(kw):
    layer = make_layer(**kw)
    x = torch.randn(3, 7, layer.cfg.hidden_size)  # T = 21, not divisible by E
    check_against_reference(layer, x)


def test_experts_with_no_tokens_get_zero_gradient():
    layer = make_layer(num_experts=16, top_k=2)
    x = torch.randn(3, 16)  # 6 slots over 16 experts: most experts receive nothing
    check_against_reference(layer, x)
    idle = layer.last_stats["tokens_per_expert"] == 0
    assert idle.any()
    assert layer.experts.w1.grad[idle].abs().max() == 0


def test_every_token_on_one_expert():
    layer = make_layer(top_k=1, num_shared_experts=1)
    with torch.no_grad():
        layer.router.expert_bias[5] = 10.0  # selection only: weights still come from the scores
    x = torch.randn(2, 9, 16)
    check_against_reference(layer, x)
    counts = layer.last_stats["tokens_per_expert"]
    assert counts[5] == 18 and counts.sum() == 18


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 1.5])
def test_capacity_dropping_follows_the_rule(capacity_factor):
    layer = make_layer(num_experts=4, top_k=2, capacity_factor=capacity_factor)
    with torch.no_grad():
        layer.router.expert_bias[0] = 0.3  # overload expert 0 so something is dropped
    x = torch.randn(20, 16)
    check_against_reference(layer, x)
    cap = math.ceil(capacity_factor * 20 * 2 / 4)
    counts = layer.last_stats["tokens_per_expert"]
    assert layer.last_stats["num_dropped"] == (counts - cap).clamp(min=0).sum()
    if capacity_factor == 0.5:
        assert layer.last_stats["num_dropped"] > 0


def test_plan_kept_set_matches_reference_rule():
    torch.manual_seed(1)
    ids = torch.randint(0, 5, (30, 3))
    scores = torch.rand(30, 3)
    cap = 7
    plan = build_plan(ids, scores, 5, cap)
    for e in range(5):
        slots = [(t, k) for t in range(30) for k in range(3) if ids[t, k] == e]
        slots.sort(key=lambda s: (-scores[s].item(), s[0] * 3 + s[1]))
        expected = {s[0] * 3 + s[1] for s in slots[:cap]}
        got = set(plan.slot_ids_N[plan.expert_ids_N == e].tolist())
        assert got == expected
    assert torch.equal(plan.token_ids_N, plan.slot_ids_N // 3)
    assert (plan.expert_ids_N[1:] >= plan.expert_ids_N[:-1]).all()
    kept = plan.row_of_slot_TK.reshape(-1) >= 0
    assert torch.equal(plan.row_of_slot_TK.reshape(-1)[plan.slot_ids_N], torch.arange(plan.num_rows))
    assert kept.sum() == plan.num_rows == plan.tokens_per_expert_E.sum() == plan.offsets_E[-1]


def test_dropless_plan_is_a_permutation():
    ids = torch.randint(0, 7, (50, 4))
    plan = build_plan(ids, torch.rand(50, 4), 7)
    assert plan.num_rows == 200 and plan.num_dropped == 0
    assert torch.equal(torch.sort(plan.slot_ids_N).values, torch.arange(200))
    assert torch.equal(plan.tokens_per_expert_E, torch.bincount(ids.reshape(-1), minlength=7))


@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_padded_baseline_equals_pft(capacity_factor):
    pft = make_layer(num_shared_experts=1, capacity_factor=capacity_factor, aux_loss_coef=0.01)
    padded = make_layer(num_shared_experts=1, capacity_factor=capacity_factor, aux_loss_coef=0.01, dispatcher="padded")
    padded.load_state_dict(pft.state_dict())
    x = torch.randn(4, 6, 16)
    outs, grads = [], []
    for layer in (pft, padded):
        xi = x.clone().requires_grad_(True)
        out = layer(xi)
        out.square().sum().backward()
        outs.append(out)
        grads.append([xi.grad] + [p.grad for p in layer.parameters()])
    assert rel_err(outs[1], outs[0]) < 1e-6
    for a, b in zip(*grads, strict=False):
        assert rel_err(b, a) < 1e-5


def test_bf16_within_tolerance_of_reference():
    layer = make_layer(num_shared_experts=1, hidden_size=32, ffn_hidden_size=24)
    x = torch.randn(40, 32)
    check_against_reference(layer, x, tol=3e-2, dtype=torch.bfloat16)


def test_deterministic_bitwise():
    results = []
    for _ in range(2):
        layer = make_layer(seed=3, num_shared_experts=1, aux_loss_coef=0.01)
        torch.manual_seed(7)
        x = torch.randn(5, 11, 16, requires_grad=True)
        out = layer(x)
        out.pow(3).sum().backward()
        results.append([out, x.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*results, strict=False):
        assert torch.equal(a, b)


def test_aux_loss_reaches_router_gradient_without_caller():
    layer = make_layer(aux_loss_coef=1.0)
    x = torch.randn(10, 16)
    out = layer(x)
    (out * 0).sum().backward()  # the output carries no signal: only the attached aux loss reaches the router
    assert layer.router.weight.grad.abs().sum() > 0
    assert layer.experts.w1.grad.abs().sum() == 0


def test_aux_loss_free_bias_update_balances_selection():
    from xmoe.moe.step import MoEStep

    layer = make_layer(bias_update_rate=0.05)
    with torch.no_grad():
        layer.router.expert_bias[2] = 1.0  # start heavily unbalanced towards expert 2
    x = torch.randn(64, 16)
    first = None
    for _ in range(40):
        with MoEStep(layer, 1, torch.device("cpu")) as step:
            layer(x)
            step.end_micro_batch()
        counts = step.finish().load_LE[0].float()  # the load the bias moved by
        first = counts if first is None else first
    assert counts.max() / counts.mean() < first.max() / first.mean()
    assert layer.router.expert_bias[2] < 1.0


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(top_k=9), "top_k"),
        (dict(score_func="relu"), "score_func"),
        (dict(num_expert_groups=3), "num_expert_groups"),
        (dict(num_expert_groups=4, topk_groups=1, top_k=3), "topk_groups"),
        (dict(capacity_factor=0.0), "capacity_factor"),
        (dict(aux_loss_coef=float("nan")), "aux_loss_coef"),
        (dict(kernel_backend="cuda"), "kernel_backend"),
        (dict(hidden_size=0), "hidden_size"),
    ],
)
def test_bad_configs_raise(kw, match):
    base = dict(hidden_size=16, ffn_hidden_size=12, num_experts=8, top_k=2)
    base.update(kw)
    with pytest.raises(ValueError, match=match):
        MoEConfig(**base)


def test_bad_inputs_raise():
    layer = make_layer()
    with pytest.raises(ValueError, match="hidden_size=16"):
        layer(torch.randn(4, 15))
    with pytest.raises(ValueError, match="floating-point"):
        layer(torch.ones(4, 16, dtype=torch.long))


def test_aux_loss_scale_scales_only_the_aux_gradient():
    # an optimizer step of A micro-batches gives the attached aux losses gradient 1 / A; outside a step they get 1
    from xmoe.moe.step import MoEStep

    grads = []
    for micro_batches in (None, 1, 4):
        layer = make_layer(aux_loss_coef=1.0, z_loss_coef=0.1)
        x = torch.randn(10, 16, generator=torch.Generator().manual_seed(0))
        step = MoEStep(layer, micro_batches, torch.device("cpu")) if micro_batches else contextlib.nullcontext()
        with step:
            (layer(x) * 0).sum().backward()
        grads.append(layer.router.weight.grad)
    assert torch.equal(grads[0], grads[1])
    assert torch.allclose(grads[2], 0.25 * grads[0], rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "kw",
    [
        dict(num_shared_experts=1, aux_loss_coef=0.1),
        dict(hidden_size=13, ffn_hidden_size=7, num_experts=6, top_k=3, capacity_factor=0.5),  # odd, drops
        dict(num_experts=16, top_k=1, score_func="sigmoid"),  # most experts empty
    ],
)
def test_layer_with_triton_backend_matches_float64_reference(kw):
    """The fused Triton path (Triton's CPU interpreter, fp32) against the same float64 loop reference."""
    layer = make_layer(kernel_backend="triton", **kw)
    with torch.no_grad():  # skew the routing towards expert 0
        layer.router.expert_bias[0] = 0.2
    check_against_reference(layer, torch.randn(2, 9, layer.cfg.hidden_size), tol=1e-4)


def test_bench_pft_saves_less_activation_memory_than_padded():
    import argparse

    from xmoe.bench import run
    from xmoe.bench_cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    rows = run(parser.parse_args(["--shape", "tiny", "--tokens", "512", "--repeats", "1", "--device", "cpu"]))
    saved = {r["dispatcher"]: r["saved_bytes"] for r in rows}  # bytes of tensors saved for backward
    # PFT keeps N*H rows; the padded baseline also keeps its (T, E, C) masks and E*C*H buffers
    assert saved["pft"] < saved["padded"]


def test_weight_casts_reused_across_micro_batches():
    # bf16 compute on fp32 weights, two micro-batches accumulating into .grad: inside an optimizer step (MoEStep) the
    # experts are cast once, when it opens (the same tensors serve both), and the accumulated fp32 gradients are
    # bitwise those of casting per micro-batch; outside a step, and in one opened under no_grad, every call casts
    from xmoe.moe.experts import use_one_process
    from xmoe.moe.step import MoEStep

    torch.manual_seed(0)
    xs = [torch.randn(12, 32).bfloat16() for _ in range(2)]

    def step_casts(layer):
        return layer.moe_step.casts if layer.moe_step is not None else None

    def run(scoped, detach=False):
        layer = make_layer(seed=3, hidden_size=32, ffn_hidden_size=24, num_experts=4, top_k=2)
        if detach:  # the one-process path the build chooses: detached copies (none written by an optimizer here)
            assert use_one_process(layer, None) == []
        step = MoEStep(layer, len(xs), torch.device("cpu"), cast_dtype=torch.bfloat16)
        with step if scoped else contextlib.nullcontext():
            casts = []
            for x in xs:
                casts.append(layer.experts.expert_weights.compute(torch.bfloat16, step_casts(layer)))
                layer(x).float().square().mean().backward()
        return [p.grad.clone() for p in layer.parameters() if p.grad is not None], casts, layer

    want, casts_plain, _ = run(False)
    got, casts_scoped, layer = run(True)
    assert len(got) == len(want) > 0 and all(torch.equal(a, b) for a, b in zip(got, want, strict=False))
    assert all(a is b for a, b in zip(*casts_scoped, strict=False)) and all(
        w.dtype == torch.bfloat16 for w in casts_scoped[0]
    )
    assert not any(a is b for a, b in zip(*casts_plain, strict=False))
    assert layer.moe_step is None  # the step let go of the layer, and its casts, on exit
    # detached casts: each backward adds its bf16 gradient into the fp32 .grad itself - bitwise the same sums
    got_detached, casts_detached, _ = run(True, detach=True)
    assert all(torch.equal(a, b) for a, b in zip(got_detached, want, strict=False))
    assert all(c.grad is None and c.is_leaf for c in casts_detached[0])
    with torch.no_grad(), MoEStep(layer, 1, torch.device("cpu"), cast_dtype=torch.bfloat16):
        assert layer.moe_step is not None and layer.moe_step.casts is None
