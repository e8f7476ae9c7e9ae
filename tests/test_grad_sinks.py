"""Weight gradients added straight into the fp32 .grad (MoEStep's gradient targets, moe/step.py): the wgrad kernels'
accumulating epilogue (grouped_wgrad_into) and accumulate_into against float64 references, in Triton's interpreter;
the fused ops' backward with targets against the same backward without; whole optimizer steps against the
detached copies' hook path and autograd's own; torch.compile; and the step's rules (one micro-batch: none;
an exception: the step's .grad dropped; no backward: refused)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_moe_layer import make_layer
from test_triton_kernels import _inputs, _routing, _wgrad_inputs

from xmoe.dispatch.routing import build_plan
from xmoe.kernels import reference, tiles
from xmoe.kernels import triton_ops as tops
from xmoe.kernels.accumulate import accumulate_into
from xmoe.kernels.grouped_wgrad import grouped_wgrad_into
from xmoe.kernels.tiles import TileConfig
from xmoe.moe.step import MoEStep


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _products(a, a_idx, b, b_idx, counts):
    """float64 A_e^T B_e per expert, (E, M, NC)."""
    rows_a = (a[a_idx] if a_idx is not None else a).double()
    rows_b = (b[b_idx] if b_idx is not None else b).double()
    out, start = [], 0
    for n in counts.tolist():
        out.append(rows_a[start : start + n].T @ rows_b[start : start + n])
        start += n
    return torch.stack(out)


@pytest.mark.parametrize("group", [1, 3], ids=["per_expert", "flat"])
@pytest.mark.parametrize("gather", ["a", "b", "none"])
def test_wgrad_into_stores_then_adds(group, gather):
    # experts of 0 to 97 rows; targets start as NaN: the first call must not read them (flag 0), the second adds
    counts = torch.tensor([33, 0, 97, 1, 0, 32, 31])
    a, a_idx, b1, b2, b_idx = _wgrad_inputs(counts, gather, seed=5)
    want1, want2 = _products(a, a_idx, b1, b_idx, counts), _products(a, a_idx, b2, b_idx, counts)
    c1, c2 = (torch.full(want1.shape, float("nan")) for _ in range(2))
    flags = torch.zeros(3, dtype=torch.int32)
    forced = tiles.force({k: TileConfig(32, 32, 16, 4, 1, group) for k in ("wgrad", "wgrad2")})
    with forced if group > 1 else contextlib.nullcontext():
        grouped_wgrad_into(a, a_idx, b1, b2, b_idx, counts, c1, c2, flags, 0, 1)
        assert flags.tolist() == [1, 1, 0]
        assert _rel(c1, want1) < 1e-5 and _rel(c2, want2) < 1e-5
        assert torch.count_nonzero(c1[[1, 4]]) == 0  # experts without rows: zeros written, not NaN kept
        grouped_wgrad_into(a, a_idx, b1, b2, b_idx, counts, c1, c2, flags, 0, 1)
        assert _rel(c1, 2 * want1) < 1e-5 and _rel(c2, 2 * want2) < 1e-5
        single = torch.full(want1.shape, float("nan"))
        grouped_wgrad_into(a, a_idx, b2, None, b_idx, counts, single, None, flags, 2, 2)
        assert flags.tolist() == [1, 1, 1] and _rel(single, want2) < 1e-5


def test_wgrad_into_by_grouped_mm_and_refusals():
    # the grouped_mm engine (this CPU build's kernel where it has one) adds its result by accumulate_into
    counts = torch.tensor([5, 0, 9])
    a, _, b1, b2, _ = _wgrad_inputs(counts, "none", seed=6, M=16, NC=24)
    want = _products(a, None, b1, None, counts)
    c1, c2 = torch.full(want.shape, float("nan")), torch.randn(want.shape)
    before = c2.clone()
    flags = torch.tensor([0, 1], dtype=torch.int32)
    with tiles.use_options(wgrad="grouped_mm"):
        grouped_wgrad_into(a, None, b1, b2, None, counts, c1, c2, flags, 0, 1)
    assert _rel(c1, want) < 1e-5 and _rel(c2, before + _products(a, None, b2, None, counts)) < 1e-5
    with pytest.raises(ValueError, match=r"contiguous float32 tensor of shape \(3, 16, 24\)"):
        grouped_wgrad_into(a, None, b1, None, None, counts, c1.half(), None, flags, 0, 0)
    with pytest.raises(ValueError, match="c2 exactly when it takes b2"):
        grouped_wgrad_into(a, None, b1, b2, None, counts, c1, None, flags, 0, 1)
    with pytest.raises(ValueError, match=r"1-D int32 tensor holding indices \[0, 5\]"):
        grouped_wgrad_into(a, None, b1, b2, None, counts, c1, c2, flags, 0, 5)


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("n", [0, 1, 63, 64, 1000])
def test_accumulate_into_stores_then_adds(backend, n):
    g = torch.Generator().manual_seed(n)
    update = (torch.randn(n, generator=g) * 10).half()
    target, flags = torch.full((n,), float("nan")), torch.zeros(2, dtype=torch.int32)
    add = accumulate_into if backend == "triton" else reference.accumulate_into
    add(target, update, flags, 1)
    assert flags.tolist() == [0, 1] and torch.equal(target, update.float())
    add(target, update, flags, 1)
    assert torch.equal(target, update.float() + update.float())  # fp32 + fp32(narrow), as accumulate_grad


def _fused_inputs(seed=9):
    T, H, Fd, E, K = 8, 16, 16, 3, 2
    expert_ids, scores = _routing(T, E, K, seed=seed)
    plan = build_plan(expert_ids, scores, E)
    plan_args = (plan.token_ids_N, plan.slot_ids_N, plan.row_of_slot_TK, plan.tokens_per_expert_E)
    return plan_args, _inputs(T, H, Fd, E, K, seed=seed)


@pytest.mark.parametrize("engine", ["triton", "grouped_mm"])
def test_fused_backward_adds_into_targets(engine):
    # the same backward with targets: x's and the routing weights' gradients unchanged, the weight gradients in
    # the targets (added to what they held) and none returned for the weights
    plan_args, tensors = _fused_inputs()
    g = torch.randn(tensors[0].shape, generator=torch.Generator().manual_seed(1))
    with tiles.use_options(wgrad=engine):
        leaves = [t.clone().requires_grad_() for t in tensors]
        out = tops.moe_experts(leaves[0], leaves[1], *plan_args, *leaves[2:])
        want = torch.autograd.grad(out, leaves, g)
        held = [torch.randn(w.shape) for w in tensors[2:]]
        sinks = (*(h.clone() for h in held), torch.ones(3, dtype=torch.int32))
        leaves = [t.clone().requires_grad_() for t in tensors]
        tops.moe_experts(leaves[0], leaves[1], *plan_args, *leaves[2:], sinks=sinks).backward(g)
    assert all(w.grad is None for w in leaves[2:])
    for got, ref in zip(leaves[:2], want[:2], strict=True):
        assert _rel(got.grad, ref) < 1e-6
    for target, before, ref in zip(sinks[:3], held, want[2:], strict=True):
        assert _rel(target, before + ref) < 1e-6


def test_fused_backward_into_targets_under_torch_compile():
    # the targets are forward inputs the compiled backward mutates (the custom op declares it): two backwards of
    # the compiled function store, then add, as the eager one does
    plan_args, tensors = _fused_inputs(seed=4)

    def layer(x, w, w1, w3, w2, s1, s3, s2, flags):
        return tops.moe_experts(x, w, *plan_args, w1, w3, w2, sinks=(s1, s3, s2, flags)).square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (compiled, layer):
        sinks = (*(torch.full(w.shape, float("nan")) for w in tensors[2:]), torch.zeros(3, dtype=torch.int32))
        for _ in range(2):
            leaves = [t.clone().requires_grad_() for t in tensors]
            fn(*leaves, *sinks).backward()
        assert sinks[3].tolist() == [1, 1, 1]
        results.append(sinks[:3])
    for got, want in zip(*results, strict=True):
        assert _rel(got, want) < 1e-6


def _step_grads(backend, detach, micro, fail=False, skip_backward=False):
    """The experts' fp32 .grad after one optimizer step of ``micro`` fp16 micro-batches (fp16 stands in for bf16,
    which the interpreter does not compute), and the step's gradient targets."""
    layer = make_layer(seed=3, hidden_size=32, ffn_hidden_size=24, num_experts=4, top_k=2, kernel_backend=backend)
    xs = [torch.randn(12, 32, generator=torch.Generator().manual_seed(i)).half() for i in range(micro)]
    step = MoEStep(layer, micro, torch.device("cpu"), cast_dtype=torch.float16, detach_casts=detach)
    with contextlib.suppress(KeyError), step:
        sinks = layer.moe_step.sinks
        for x in xs:
            out = layer(x).float().square().sum()
            if fail:
                raise KeyError("a failing micro-batch")
            if not skip_backward:
                out.backward()
    return [w.grad for w in (layer.experts.w1, layer.experts.w3, layer.experts.w2)], sinks


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_step_with_targets_matches_autograd(backend):
    # three micro-batches: the targets are the .grad (made when the step opens) and every micro-batch's gradient
    # is in them. Triton: added by the fused backward in fp32, within fp16 rounding of autograd's own cast-back
    # (which rounds each micro-batch's gradient to fp16 first); torch: through the copies' hooks, bitwise autograd's
    want, no_sinks = _step_grads(backend, detach=False, micro=3)
    got, sinks = _step_grads(backend, detach=True, micro=3)
    assert no_sinks is None and sinks is not None
    assert all(g is s for g, s in zip(got, sinks[:3], strict=False)) and sinks[3].tolist() == [1, 1, 1]
    for a, b in zip(got, want, strict=True):
        if backend == "triton":
            assert 0 < _rel(a, b) < 2e-3
        else:
            assert torch.equal(a, b)


def test_step_rules():
    # one micro-batch: no targets (made early they would be held through the forward); the .grad comes from the
    # backward as before
    grads, sinks = _step_grads("triton", detach=True, micro=1)
    assert sinks is None and all(g is not None for g in grads)
    # an exception inside the step: the .grad it made are dropped, not left uninitialised
    grads, sinks = _step_grads("triton", detach=True, micro=2, fail=True)
    assert sinks is not None and all(g is None for g in grads)
    # closed with no backward: refused (on a GPU by a device-side assert, no host sync)
    with pytest.raises(RuntimeError, match="backward did not run"):
        _step_grads("triton", detach=True, micro=2, skip_backward=True)
