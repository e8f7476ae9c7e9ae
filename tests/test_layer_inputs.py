"""MoELayer on unusual inputs: no tokens (with auxiliary losses on), input dtypes other than the weights', and
the opt-in non-finite input check."""

from __future__ import annotations

import math

import pytest
import torch
from moe_reference import layer_params, reference_forward
from test_moe_layer import make_layer, rel_err


@pytest.mark.parametrize("shape", [(0, 16), (2, 0, 16)])
def test_zero_tokens_with_aux_and_z_losses(shape):
    layer = make_layer(
        aux_loss_coef=0.01,
        z_loss_coef=0.001,
        num_shared_experts=1,
        balance_scope="sequence" if len(shape) == 3 else "micro_batch",
    )
    x = torch.zeros(shape, requires_grad=True)
    out = layer(x)
    out.sum().backward()
    assert out.shape == shape and x.grad.shape == shape
    assert layer.last_stats["aux_loss"].item() == 0 and layer.last_stats["z_loss"].item() == 0
    assert int(layer.last_stats["tokens_per_expert"].sum()) == 0


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)])
def test_other_input_dtypes_on_fp32_weights_match_the_reference(dtype, tol):
    # fp32 weights, shared experts included (their nn.Linear layers refused a mixed dtype before)
    layer = make_layer(seed=1, num_shared_experts=1, aux_loss_coef=0.01)
    x = torch.randn(24, 16)
    ref = {k: v.detach().double() for k, v in layer_params(layer).items()}
    out_ref = reference_forward(ref, x.double(), layer.cfg, 1)[0]
    out = layer(x.to(dtype).requires_grad_(True))
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_err(out, out_ref) < tol


def test_non_finite_input_check_is_opt_in():
    layer = make_layer()
    x = torch.randn(6, 16)
    x[2, 3] = math.nan
    assert torch.isnan(layer(x)).any()  # off by default: no host sync in the hot path
    layer.check_finite = True
    with pytest.raises(ValueError, match=r"holds NaN or inf values \(1 of 96\)"):
        layer(x)
    assert torch.isfinite(layer(torch.randn(6, 16))).all()


def _expert_parallel_warnings_body(rank: int, world_size: int):
    import warnings

    from test_expert_parallel import _batches, _parallel_model

    model, _ = _parallel_model(1, 2, "ep_first", world_size, seed=0)
    inputs, targets = _batches(world_size)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(inputs[rank], targets[rank]).backward()
    views = [str(w.message) for w in caught if "view tensor" in str(w.message)]
    assert not views, views


def test_expert_parallel_experts_return_no_view():
    # the expert gradient scaling used to wrap the experts' output in an identity autograd.Function, whose output
    # is a view: FSDP2 warned on every step, and an in-place op on that output would have skipped its hooks
    from dist_utils import run_distributed

    run_distributed(_expert_parallel_warnings_body, 2)
