"""The Triton router kernel (xmoe/kernels/router_topk.py) against a float64 loop reference and the torch router.

# T tokens, H hidden, E experts, K top-k

Runs on CPU through Triton's interpreter (TRITON_INTERPRET=1, fp32); the launcher uses 4-row blocks there, so
T = 9 spans partial blocks, and odd E leaves masked expert columns.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by conftest.py, before anything imports triton

import pytest
import torch
import triton  # noqa: F401  a declared test dependency (pip install -e ".[test]"): missing, this file fails
from test_moe_layer import check_against_reference, make_layer

from xmoe.config import MoEConfig
from xmoe.kernels.router_topk import router_topk
from xmoe.moe.router import Router


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def reference_router(logits_TE, bias_E, top_k, score_func, norm, scale):
    """Per-token float64 loop straight from router.py's formulas: (weights_TK, ids_TK, scores_TK)."""
    weights, ids, chosen_scores = [], [], []
    for logits in logits_TE.double():
        if score_func == "softmax":
            scores = torch.exp(logits - logits.max())
            scores = scores / scores.sum()
        else:
            scores = 1 / (1 + torch.exp(-logits))
        choice = [scores[e].item() + bias_E[e].item() for e in range(len(scores))]
        chosen = sorted(range(len(scores)), key=lambda e: -choice[e])[:top_k]
        sel = torch.stack([scores[e] for e in chosen])
        weights.append(sel / sel.sum() * scale if norm else sel * scale)
        ids.append(torch.tensor(chosen))
        chosen_scores.append(sel)
    return torch.stack(weights), torch.stack(ids), torch.stack(chosen_scores)


# (T, E, K, score_func, norm_topk_prob, routed_scaling_factor, bias std): odd E, k=1, k=E, large k
CASES = {
    "softmax": (9, 7, 2, "softmax", False, 1.0, 0.0),
    "softmax_norm_scaled": (9, 13, 4, "softmax", True, 2.5, 0.05),
    "sigmoid_v3": (9, 13, 3, "sigmoid", True, 2.5, 0.05),
    "sigmoid_k1": (9, 7, 1, "sigmoid", False, 1.0, 0.0),
    "softmax_k_eq_E": (6, 7, 7, "softmax", True, 1.0, 0.0),
    "sigmoid_k_eq_E": (5, 13, 13, "sigmoid", False, 0.5, 0.0),
    "large_k": (5, 40, 16, "softmax", True, 1.0, 0.01),
}


def _inputs(T, E, bias_std, seed=0):
    g = torch.Generator().manual_seed(seed)
    return 2 * torch.randn(T, E, generator=g), bias_std * torch.randn(E, generator=g)


@pytest.mark.parametrize("case", CASES)
def test_router_topk_matches_float64_reference(case):
    T, E, K, score_func, norm, scale, bias_std = CASES[case]
    logits, bias = _inputs(T, E, bias_std)
    x = logits.clone().requires_grad_(True)
    weights, ids, scores = router_topk(x, bias, K, score_func, norm, scale)
    assert weights.dtype == scores.dtype == torch.float32 and ids.dtype == torch.int64
    assert weights.shape == ids.shape == scores.shape == (T, K)

    x_ref = logits.double().requires_grad_(True)
    w_ref, ids_ref, s_ref = reference_router(x_ref, bias, K, score_func, norm, scale)
    assert torch.equal(ids, ids_ref)
    assert rel_err(weights, w_ref) < 1e-5 and rel_err(scores, s_ref) < 1e-5
    grad_w = torch.randn(T, K, generator=torch.Generator().manual_seed(1))
    (weights * grad_w).sum().backward()
    (w_ref * grad_w.double()).sum().backward()
    assert rel_err(x.grad, x_ref.grad) < 1e-5, rel_err(x.grad, x_ref.grad)


def test_bias_shifts_selection_but_not_weights():
    logits, _ = _inputs(9, 13, 0.0)
    bias = torch.zeros(13)
    bias[5] = 10.0  # expert 5 wins every token's first slot whatever its score
    weights, ids, scores = router_topk(logits, bias, 3, "sigmoid", False, 1.0)
    assert (ids[:, 0] == 5).all()
    assert torch.equal(ids, reference_router(logits, bias, 3, "sigmoid", False, 1.0)[1])
    assert torch.equal(weights, scores) and rel_err(scores[:, 0], torch.sigmoid(logits[:, 5])) < 1e-6


@pytest.mark.parametrize(
    "kw",
    [
        dict(score_func="softmax", aux_loss_coef=0.1, z_loss_coef=0.01),
        dict(score_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5, top_k=3, aux_loss_coef=0.1),
        dict(num_experts=7, top_k=7, norm_topk_prob=True),
    ],
)
def test_router_triton_matches_torch_router(kw):
    """The wired router (kernel for selection + weights, torch for the losses) against the torch router."""
    base = dict(hidden_size=16, ffn_hidden_size=12, num_experts=13, top_k=2)
    base.update(kw)
    routers = []
    for backend in ("torch", "triton"):
        torch.manual_seed(0)
        router = Router(MoEConfig(**base, kernel_backend=backend))
        with torch.no_grad():
            router.weight.normal_(0, 0.5)
            router.expert_bias.copy_(0.05 * torch.randn(base["num_experts"]))
        routers.append(router)
    x = torch.randn(2 * 9, 16, generator=torch.Generator().manual_seed(2))
    grad_w = torch.randn(2 * 9, base["top_k"], generator=torch.Generator().manual_seed(3))
    outs = []
    for router in routers:
        out = router(x, num_sequences=2)
        ((out.weights_TK * grad_w).sum() + out.aux_loss + out.z_loss).backward()
        outs.append(out)
    ref, got = outs
    assert type(got.weights_TK.grad_fn).__name__ == "RouterTopkFnBackward"  # the kernel did run
    assert torch.equal(got.expert_ids_TK, ref.expert_ids_TK) and torch.equal(got.counts_E, ref.counts_E)
    assert rel_err(got.weights_TK, ref.weights_TK) < 1e-5 and rel_err(got.scores_TK, ref.scores_TK) < 1e-5
    assert not got.scores_TK.requires_grad
    for name in ("aux_loss", "z_loss"):
        assert rel_err(getattr(got, name), getattr(ref, name)) < 1e-6
    # the losses' gradient flows through the torch scores, the weights' through the kernel: each once
    assert rel_err(routers[1].weight.grad, routers[0].weight.grad) < 1e-5


def test_layer_with_triton_router_matches_float64_reference():
    """The whole layer on the Triton backend (router kernel included) against the float64 loop reference."""
    layer = make_layer(
        kernel_backend="triton",
        num_experts=7,
        top_k=3,
        score_func="sigmoid",
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        aux_loss_coef=0.1,
        z_loss_coef=0.01,
    )
    with torch.no_grad():  # skew the routing towards expert 0
        layer.router.expert_bias[0] = 0.2
    check_against_reference(layer, torch.randn(2, 9, layer.cfg.hidden_size), tol=1e-4)


def test_rejects_unsupported_shapes():
    with pytest.raises(ValueError, match="top_k"):
        router_topk(torch.randn(3, 40), None, 17)
    with pytest.raises(ValueError, match="num_experts"):
        router_topk(torch.randn(3, 513), None, 2)
    with pytest.raises(ValueError, match="float32"):
        router_topk(torch.randn(3, 8, dtype=torch.float64), None, 2)
    weights, ids, _ = router_topk(torch.randn(0, 8), None, 2)  # no tokens: empty outputs, no launch
    assert weights.shape == ids.shape == (0, 2)


def test_nan_logits_give_ids_in_range() -> None:
    """A diverged step's NaN logits must not send rows to an expert that does not exist."""
    from xmoe.kernels.router_topk import router_topk

    logits = torch.randn(8, 12)
    logits[2:5] = float("nan")
    _, ids, _ = router_topk(logits, torch.zeros(12), 3, "softmax", True, 1.0)
    assert int(ids.min()) >= 0 and int(ids.max()) < 12
