"""Checks and switches shared by the Triton op files (permute.py, combine.py, grouped_gemm.py)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol, TypeVar, cast

import torch

if TYPE_CHECKING:
    from torch._library.custom_ops import CustomOpDef

_P = ParamSpec("_P")
_R_co = TypeVar("_R_co", covariant=True)

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the launchers (triton.cdiv is a constexpr function: a few µs of host time per call)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


@functools.cache
def interpreting() -> bool:
    """True under TRITON_INTERPRET=1: kernels run on CPU tensors in numpy, so launchers pick tiny blocks. The one
    place xmoe reads the variable, once, like triton itself, which decides when the kernels are defined."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def check_float(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}; the Triton kernels take float32, bfloat16 or float16")


def check_index(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}; index arrays must be int32 or int64")


def check_device(*tensors: torch.Tensor) -> None:
    device = tensors[0].device
    for t in tensors[1:]:
        if t.device != device:
            raise ValueError(f"all tensors must be on one device, got {device} and {t.device}")
    if device.type == "cpu" and not interpreting():
        raise ValueError("the Triton kernels need GPU tensors, or TRITON_INTERPRET=1 for CPU tensors (fp32 only)")


class KernelOp(Protocol[_P, _R_co]):
    """What ``kernel_op`` returns: the launcher's signature, its registered custom op (``.op``) and the op's
    ``.register_fake``."""

    op: CustomOpDef
    register_fake: Callable[[Callable[..., Any]], Callable[..., Any]]

    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _R_co: ...


def kernel_op(name: str, mutates_args: tuple[str, ...] = ()) -> Callable[[Callable[_P, _R_co]], KernelOp[_P, _R_co]]:
    """Register the decorated launcher as the custom op ``xmoe::<name>`` (torch.compile then traces around it as
    an opaque call; attach its shape function with ``.register_fake``) and return a callable that, outside
    compilation, calls the launcher directly: the dispatcher round trip (schema binding, the autograd and
    dynamo-disable wrappers) costs ~40 µs of host time per call, several times a Triton launch's."""

    def wrap(fn: Callable[_P, _R_co]) -> KernelOp[_P, _R_co]:
        op = torch.library.custom_op(f"xmoe::{name}", mutates_args=mutates_args)(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            return op(*args, **kwargs) if torch.compiler.is_compiling() else fn(*args, **kwargs)

        kernel = cast("KernelOp[_P, _R_co]", call)
        kernel.op = op
        kernel.register_fake = op.register_fake
        return kernel

    return wrap
