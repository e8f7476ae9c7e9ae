"""Weight gradients of a narrower dtype added into fp32 .grad (xmoe/kernels/accumulate.py, Triton interpreter)
against torch's own dtype-converting ops: bitwise, as both add fp32 + fp32(narrow) once per element."""

from __future__ import annotations

import pytest
import torch

from xmoe.kernels import reference, triton_ops
from xmoe.kernels.accumulate import accumulate_grad
from xmoe.moe.weights import _leaf_into

# the interpreter computes bf16 wrongly (numpy has no bf16): fp16 stands in for the narrow dtype here; the kernel
# converts whatever narrow float it reads the same way, and benchmarks/bench_optimizer.py checks bf16 on a GPU
# (bitwise against torch, beside the timings)


@pytest.mark.parametrize("n", [0, 1, 63, 64, 1000])  # empty, one element, inside / at / past a block
def test_upcast_and_add_are_torchs(n):
    g = torch.Generator().manual_seed(n)
    update = (torch.randn(n, generator=g) * 10).half()
    first = accumulate_grad(None, update, torch.float32)
    assert first.dtype == torch.float32 and torch.equal(first, update.float())
    grad = torch.randn(n, generator=g)
    expected = grad + update.float()
    out = accumulate_grad(grad, update, torch.float32)
    assert out is grad and torch.equal(grad, expected)  # in place, bitwise


def test_expert_stack_shapes_and_fallbacks():
    g = torch.Generator().manual_seed(0)
    update = torch.randn(3, 17, 5, generator=g).half()
    grad = torch.randn(3, 17, 5, generator=g)
    expected = grad + update.float()
    assert torch.equal(accumulate_grad(grad, update, torch.float32), expected)
    strided = torch.randn(5, 17, generator=g).half().t()  # not contiguous: torch's path, same result
    assert torch.equal(accumulate_grad(None, strided, torch.float32), strided.float())
    assert accumulate_grad(None, update, torch.float64).dtype == torch.float64  # another target dtype: torch's
    with pytest.raises(ValueError, match=r"shape \(3, 17, 5\) cannot add into one of \(3, 17\)"):
        accumulate_grad(torch.zeros(3, 17), update, torch.float32)


@pytest.mark.parametrize("ops", [reference, triton_ops], ids=["torch", "triton"])
def test_compute_copy_gradients_reach_the_fp32_parameter(ops):
    # the routed experts' detached copies (ExpertWeights.step_copies): each backward's gradient of the copy is added
    # into the fp32 parameter's .grad by the backend's accumulate_grad, and the copy's own .grad is dropped
    param = torch.nn.Parameter(torch.randn(2, 8, 4))
    copy = _leaf_into(param, param.detach().half(), ops)
    grads = [torch.randn(2, 8, 4).half() for _ in range(3)]
    for grad in grads:  # three micro-batches
        copy.backward(grad)
        assert copy.grad is None
    expected = grads[0].float() + grads[1].float() + grads[2].float()
    assert param.grad is not None and torch.equal(param.grad, expected)
