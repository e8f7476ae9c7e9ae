"""Gradient clipping folded into a fused AdamW's own pass (xmoe/train/step.py) against clipping in place."""

from __future__ import annotations

import math

import pytest
import torch

from xmoe.parallel.expert_parallel import clip_grad_norm_
from xmoe.train.step import clip_divisor, clip_gradients, folds_clipping, optimizer_step


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(4, 24, 16), (32, 16), (16,), (7,)]  # an expert stack, a matrix, norms
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _grads(step: int, params: list[torch.nn.Parameter]) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = (1.0 + 2 * step) * torch.randn(p.shape, generator=g)  # norms that differ per step: Adam sees the clip


def _adamw(params, fused: bool) -> torch.optim.AdamW:
    groups = [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), fused=fused)


@pytest.mark.parametrize("max_norm", [0.5, 1e9, math.inf])  # clipping acts; norm below the limit; measure only
def test_folded_clipping_matches_clipping_in_place(max_norm):
    reference, folded = _params(0), _params(0)
    ref_opt, opt = _adamw(reference, fused=False), _adamw(folded, fused=True)
    assert folds_clipping(opt, folded) and not folds_clipping(ref_opt, reference)
    for step in range(4):
        _grads(step, reference)
        _grads(step, folded)
        ref_norm = torch.nn.utils.clip_grad_norm_(reference, max_norm)  # torch's own, in place
        ref_opt.step()
        norm, divisor = clip_gradients(opt, folded, max_norm, None)
        assert divisor is not None and torch.allclose(norm, ref_norm, rtol=1e-6)
        if max_norm > 1e8:
            assert divisor.item() == 1.0  # the norm is far below the limit: nothing is scaled
        else:
            assert divisor.item() == pytest.approx((ref_norm.item() + 1e-6) / max_norm, rel=1e-6)
        optimizer_step(opt, divisor)
        assert not hasattr(opt, "grad_scale")  # handed to this step only
        for r, f in zip(reference, folded, strict=True):
            scale = r.detach().abs().max().item()
            assert (r.detach() - f.detach()).abs().max().item() <= 1e-5 * scale


def test_unfused_optimizer_clips_in_place():
    params = _params(1)
    opt = _adamw(params, fused=False)
    _grads(0, params)
    expected = [p.grad.clone() for p in params]
    total = torch.sqrt(sum((g.double() ** 2).sum() for g in expected))
    norm, divisor = clip_gradients(opt, params, 0.25, None)
    assert divisor is None and norm.item() == pytest.approx(total.item(), rel=1e-6)
    for p, g in zip(params, expected, strict=True):  # scaled by max_norm / (norm + 1e-6)
        torch.testing.assert_close(p.grad.double(), g.double() * 0.25 / (total + 1e-6), rtol=1e-6, atol=0)


def test_clip_divisor_is_the_reciprocal_of_torchs_coefficient():
    for norm in (0.0, 0.3, 1.0, 7.5):
        coef = min(1.0, 1.0 / (norm + 1e-6))
        assert clip_divisor(torch.tensor(norm), 1.0).item() == pytest.approx(1 / coef, rel=1e-6)
    assert clip_divisor(torch.tensor(5.0), math.inf).item() == 1.0
    assert math.isnan(clip_divisor(torch.tensor(math.nan), 1.0).item())  # a bad norm reaches the update


def test_mesh_aware_clip_equals_torchs():
    a, b = _params(2), _params(2)
    _grads(0, a)
    _grads(0, b)
    torch.testing.assert_close(clip_grad_norm_(a, 0.5), torch.nn.utils.clip_grad_norm_(b, 0.5), rtol=1e-6, atol=0)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-6, atol=0)


def test_the_folding_is_decided_once_and_again_when_the_optimizer_changes(monkeypatch):
    from xmoe.train import step

    decided = []
    decide = step._decide_folding
    monkeypatch.setattr(step, "_decide_folding", lambda opt, params: decided.append(1) or decide(opt, params))
    params = _params(3)
    opt = _adamw(params, fused=True)
    for s in range(3):  # the trainer's steps: one decision, the clip folded into every step
        _grads(s, params)
        divisor = clip_gradients(opt, params, 0.5, None)[1]
        assert divisor is not None
        optimizer_step(opt, divisor)
    assert len(decided) == 1
    opt.param_groups[1]["fused"] = False  # a changed group: decided again, and now clipped in place
    _grads(3, params)
    assert clip_gradients(opt, params, 0.5, None)[1] is None and len(decided) == 2
    opt.param_groups[1]["fused"] = True
    extra = torch.nn.Parameter(torch.zeros(3))
    opt.add_param_group({"params": [extra], "fused": False})  # a new group that does not fuse
    assert not folds_clipping(opt, params) and len(decided) == 3
    assert not folds_clipping(opt, params) and len(decided) == 3
    fused = _adamw(params, fused=True)  # another optimizer, and another parameter list, are decided for themselves
    assert folds_clipping(fused, params) and folds_clipping(fused, list(params)) and len(decided) == 5
    assert not folds_clipping(torch.optim.SGD(params, lr=0.1), params) and len(decided) == 6
