"""What the ahead-of-time compiles launch (``aot.py`` records the launches and compiles them): the GPUs stood in for
(``DEVICES``, with their compile targets ``TARGETS``), the layer shapes, and the workloads (``WORKLOADS``), each a
function that runs public ops on meta tensors of one shape for one device.

# T tokens, H hidden, F expert ffn, E experts, K top-k, N kept rows

Adding a kernel: launch it from a workload (an existing one if a public op already reaches it), as the FP8 fused
path's does:

    @workload("fp8_fused", fp8=True)
    def _fp8_fused(shape: Shape, device: Device) -> None:
        "moe_experts_fp8 (...), forward and backward"
        from xmoe.kernels.fp8_experts import moe_experts_fp8

        t, qw, fmt = fp8_layer(shape, device)
        out = moe_experts_fp8(t.x_TH, t.weights_TK, *t.plan_args, t.w1, t.w3, t.w2, qw, fmt)
        out.backward(torch.empty_like(out))

``fp8=True`` runs it only on devices with fp8 matrix instructions, whose ``device.fp8`` is the e4m3 dtype they
take (float8_e4m3fn on sm_90, float8_e4m3fnuz on gfx942; the FP8 kernels' pointers are then ``*fp8e4nv`` and
``*fp8e4b8``, their FP8_MAX and MIN_EXP those of fp8_quant.FORMATS).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from xmoe.kernels import tiles

if TYPE_CHECKING:
    from xmoe.kernels.fp8_quant import Fp8ExpertWeights

META = torch.device("meta")
# the weight-gradient engine the workloads' ops are called with: the Triton kernels, which are what is compiled here
# (the Hopper path's torch._grouped_mm has nothing to compile ahead of time); untuned tiles, the ops' default
WGRAD = "triton"


@dataclass(frozen=True)
class Device:
    """A GPU as the launchers see it: its compile target, shared memory per block, shipped table, fp8 dtype."""

    name: str
    target: str  # a key of TARGETS
    max_shared: int
    table: str | None = None  # xmoe/kernels/tuned/<table>.json
    fp8: torch.dtype | None = None  # the e4m3 dtype of its fp8 matrix instructions; None: it has none


# (backend, arch, warp size) of triton's GPUTarget
TARGETS = {"cuda:90": ("cuda", 90, 32), "hip:gfx90a": ("hip", "gfx90a", 64), "hip:gfx942": ("hip", "gfx942", 64)}

DEVICES = (
    Device("H200", "cuda:90", 227 * 1024, "NVIDIA_H200", torch.float8_e4m3fn),
    # another sm_90 GPU (an H100): same budget, no shipped table, so the heuristic's tiles
    Device("sm_90 untuned", "cuda:90", 227 * 1024, None, torch.float8_e4m3fn),
    Device("MI250X", "hip:gfx90a", 64 * 1024),  # no fp8 matrix instructions
    Device("MI300X", "hip:gfx942", 64 * 1024, None, torch.float8_e4m3fnuz),
)


@dataclass(frozen=True)
class Shape:
    name: str
    tokens: int
    hidden: int
    ffn: int
    experts: int
    top_k: int

    @classmethod
    def preset(cls, preset: str, tokens: int) -> Shape:
        return cls(f"{preset} T={tokens}", tokens, *PRESET_LAYERS[preset])


# (H, F, E, K) of the presets' MoE layers (xmoe/model/presets.py, a layer above this package; the compile test
# holds the two equal)
PRESET_LAYERS = {
    "tiny": (128, 64, 16, 4),
    "small": (2048, 1408, 64, 6),
    "medium": (5120, 1536, 128, 6),
    "large": (7168, 2048, 256, 8),
}


# The three model shapes at the token counts the shipped H200 table was tuned on; tiny's H and F are below one
# tile (masked tiles); small at T=256 has 24 rows per expert (the heuristic's 64-row tiles).
LAYER_SHAPES = (
    *(Shape.preset(p, t) for p in ("small", "medium", "large") for t in (8192, 16384)),
    Shape.preset("small", 32768),  # a training micro-batch of 16 x 2048 (its FP8 fp8_mm class is in the table)
    Shape.preset("tiny", 512),
    Shape.preset("small", 256),
)
# the router kernel's blocks depend on E and K alone: the presets' and its limits (router_topk.MAX_*)
ROUTER_SHAPES = (
    Shape.preset("tiny", 512),
    Shape.preset("small", 8192),
    Shape.preset("medium", 8192),
    Shape.preset("large", 8192),
    Shape("router limits", 4096, 0, 0, 512, 16),
)


@dataclass(frozen=True)
class Workload:
    name: str  # a short key (benchmarks/aot_report.py --workloads); run's docstring says what it launches
    run: Callable[[Shape, Device], None]
    shapes: tuple[Shape, ...]
    fp8: bool = False
    shipped: bool = True  # False: configurations only autotuning may pick (reported; spills do not fail)


WORKLOADS: list[Workload] = []


def workload(name: str, shapes: tuple[Shape, ...] = LAYER_SHAPES, fp8: bool = False, shipped: bool = True) -> Callable:
    """Register ``run(shape, device)``: launches on meta tensors whose kernels are to compile for every device
    (for devices with fp8 matrix instructions only, when ``fp8``)."""

    def add(run: Callable[[Shape, Device], None]) -> Callable[[Shape, Device], None]:
        WORKLOADS.append(Workload(name, run, shapes, fp8, shipped))
        return run

    return add


def layer_tensors(shape: Shape, dtype: torch.dtype) -> SimpleNamespace:
    """Meta tensors of one MoE layer call (dropless routing), as the layer passes them: x_TH, weights_TK (fp32,
    the router's), the plan's int64 index arrays (``plan_args``: token_ids_N, slot_ids_N, row_of_slot_TK,
    tokens_per_expert_E, as dispatch/routing.py's build_plan makes them; the compile test holds the two equal), w1,
    w3, w2; x, the combine weights and the expert weights require grad."""
    T, H, F, E, K = shape.tokens, shape.hidden, shape.ffn, shape.experts, shape.top_k

    def leaf(*size, dt=dtype):
        return torch.empty(*size, dtype=dt, device=META, requires_grad=True)

    def index(*size):
        return torch.empty(*size, dtype=torch.long, device=META)

    return SimpleNamespace(
        x_TH=leaf(T, H),
        weights_TK=leaf(T, K, dt=torch.float32),
        plan_args=(index(T * K), index(T * K), index(T, K), index(E)),
        w1=leaf(E, H, F),
        w3=leaf(E, H, F),
        w2=leaf(E, F, H),
    )


def _moe_experts(shape: Shape, dtype: torch.dtype) -> None:
    from xmoe.kernels import triton_ops

    t = layer_tensors(shape, dtype)
    token_ids_N, slot_ids_N, row_of_slot_TK, counts_E = t.plan_args
    out = triton_ops.moe_experts(
        t.x_TH, t.weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK, counts_E, t.w1, t.w3, t.w2, wgrad=WGRAD
    )
    out.backward(torch.empty_like(out))


@workload("fused")
def _fused_experts(shape: Shape, device: Device) -> None:
    """moe_experts (gather, experts and combine fused), forward and backward"""
    _moe_experts(shape, torch.bfloat16)


@workload("three_ops")
def _three_ops(shape: Shape, device: Device) -> None:
    """gather_rows, grouped_swiglu, combine_rows, forward and backward"""
    from xmoe.kernels import triton_ops

    t = layer_tensors(shape, torch.bfloat16)
    token_ids_N, slot_ids_N, row_of_slot_TK, counts_E = t.plan_args
    x_NH = triton_ops.gather_rows(t.x_TH, token_ids_N, row_of_slot_TK)
    y_NH = triton_ops.grouped_swiglu(x_NH, t.w1, t.w3, t.w2, counts_E, wgrad=WGRAD)
    out = triton_ops.combine_rows(y_NH, t.weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK)
    out.backward(torch.empty_like(out))


@workload("fused_fp32", shapes=(Shape.preset("small", 8192), Shape.preset("tiny", 512)))
def _fused_experts_fp32(shape: Shape, device: Device) -> None:
    """moe_experts in fp32 (exact dots, tiles.FP32_CONFIG), forward and backward"""
    _moe_experts(shape, torch.float32)


@workload("grad_accumulate", shapes=(Shape.preset("small", 8192),))
def _grad_accumulate(shape: Shape, device: Device) -> None:
    """accumulate_grad: a bf16 expert weight gradient upcast into a new fp32 .grad, and added into one"""
    from xmoe.kernels.accumulate import accumulate_grad

    update = torch.empty(shape.experts, shape.hidden, shape.ffn, dtype=torch.bfloat16, device=META)
    grad = accumulate_grad(None, update, torch.float32)
    accumulate_grad(grad, update, torch.float32)


@workload("adamw", shapes=(Shape.preset("small", 8192),))
def _adamw(shape: Shape, device: Device) -> None:
    """adamw_update: an expert weight stack's AdamW step, plain, and with the clip's divisor and a bf16 copy"""
    from xmoe.kernels.adamw import adamw_update

    p, g, m, v = (torch.empty(shape.experts, shape.hidden, shape.ffn, device=META) for _ in range(4))
    for divisor, copy in ((None, None), (torch.empty((), device=META), torch.empty_like(p, dtype=torch.bfloat16))):
        adamw_update(
            p, g, m, v, step=1, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, divisor=divisor, copy=copy
        )


@workload("router", shapes=ROUTER_SHAPES)
def _router(shape: Shape, device: Device) -> None:
    """router_topk with softmax scores, and with sigmoid scores normalised, forward and backward"""
    from xmoe.kernels.router_topk import router_topk

    for score_func, norm in (("softmax", False), ("sigmoid", True)):
        logits_TE = torch.empty(shape.tokens, shape.experts, device=META, requires_grad=True)
        weights_TK, _, _ = router_topk(logits_TE, None, shape.top_k, score_func, norm, 1.0)
        weights_TK.backward(torch.empty_like(weights_TK))


def fp8_layer(shape: Shape, device: Device) -> tuple[SimpleNamespace, Fp8ExpertWeights, str]:
    """(layer_tensors in bf16, the FP8 copies of its weights, the device's format name): the copies quantised
    from fp32 weights, as ExpertWeights.step_copies makes them from the parameters once per step (outside it, one
    process quantises them once per forward); the bf16 w1, w3, w2 receive the weight gradients, as its stand-ins
    do."""
    from xmoe.kernels.fp8_quant import FORMATS, quantize_expert_weights

    t = layer_tensors(shape, torch.bfloat16)
    (fmt,) = (f.name for f in FORMATS.values() if f.dtype == device.fp8)
    w1, w3, w2 = (torch.empty_like(w, dtype=torch.float32) for w in (t.w1, t.w3, t.w2))
    return t, quantize_expert_weights(w1, w3, w2, fmt), fmt


@workload("fp8_fused", fp8=True)
def _fp8_fused(shape: Shape, device: Device, wgrad: str = WGRAD) -> None:
    """moe_experts_fp8 (quantize_rows of x and grad_out, the FP8 GEMMs, the SwiGLU backward pass quantising dh1,
    dh3; weight gradients and combines in bf16), forward and backward"""
    from xmoe.kernels.fp8_experts import moe_experts_fp8

    t, qw, fmt = fp8_layer(shape, device)
    token_ids_N, slot_ids_N, row_of_slot_TK, counts_E = t.plan_args
    out = moe_experts_fp8(
        t.x_TH, t.weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK, counts_E, t.w1, t.w3, t.w2, qw, fmt, wgrad=wgrad
    )
    out.backward(torch.empty_like(out))


@workload("fp8_grouped", fp8=True)
def _fp8_grouped(shape: Shape, device: Device, wgrad: str = WGRAD) -> None:
    """grouped_swiglu_fp8 over a dispatcher's expert-major rows (no gathers, no combine weights, dx unchunked),
    forward and backward"""
    from xmoe.kernels.fp8_experts import grouped_swiglu_fp8

    t, qw, fmt = fp8_layer(shape, device)
    token_ids_N, _, _, counts_E = t.plan_args
    x_NH = torch.empty(token_ids_N.shape[0], shape.hidden, dtype=torch.bfloat16, device=META, requires_grad=True)
    y_NH = grouped_swiglu_fp8(x_NH, t.w1, t.w3, t.w2, counts_E, qw, fmt, wgrad=wgrad)
    y_NH.backward(torch.empty_like(y_NH))


@workload("fp8_wgrad", fp8=True)
def _fp8_wgrad(shape: Shape, device: Device) -> None:
    """the FP8 fused and grouped paths with FP8 weight gradients (kernels.wgrad = "fp8": quantize_cols of the
    wgrad operands, fp8_wgrad), forward and backward"""
    _fp8_fused(shape, device, "fp8")
    _fp8_grouped(shape, device, "fp8")


@workload("fp8_weights", fp8=True)
def _fp8_weights(shape: Shape, device: Device) -> None:
    """quantize_expert_weights of bf16 weights: FSDP2's gathers under mixed precision, quantised per forward (the
    fp32 parameters' quantisation is fp8_layer's)"""
    from xmoe.kernels.fp8_quant import quantize_expert_weights

    t, _, fmt = fp8_layer(shape, device)
    quantize_expert_weights(t.w1.detach(), t.w3.detach(), t.w2.detach(), fmt)


@workload("fp8_adamw", shapes=(Shape.preset("small", 8192),), fp8=True)
def _fp8_adamw(shape: Shape, device: Device) -> None:
    """adamw_update writing an expert weight stack's FP8 copies (a member of a side-by-side pair, as w1's and w3's
    are written), with and without the clip's divisor"""
    from xmoe.kernels.adamw import adamw_update
    from xmoe.kernels.fp8_quant import FORMATS, BlockCopies

    (fmt,) = (f.name for f in FORMATS.values() if f.dtype == device.fp8)
    p, g, m, v = (torch.empty(shape.experts, shape.hidden, shape.ffn, device=META) for _ in range(4))
    copy = BlockCopies.empty(p.shape, 2, fmt, META).member(1)
    for divisor in (None, torch.empty((), device=META)):
        adamw_update(
            p, g, m, v, step=1, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, divisor=divisor, copy=copy
        )


@workload("candidates", shapes=(Shape.preset("medium", 8192),), shipped=False)
def _candidates(shape: Shape, device: Device) -> None:
    """every autotuning candidate (XMOE_AUTOTUNE=1) that fits the GPU, in the fused and the three-op paths, and in
    the FP8 fused and grouped paths where FP8 candidates fit (none fits AMD's 64 KB: autotuning keeps the
    heuristic's FP8 tiles there)"""
    fitting = {kernel: tiles.candidates(kernel, device.max_shared) for kernel in tiles.KERNELS}
    fp8 = device.fp8 is not None and any(fitting[kernel] for kernel in tiles.FP8_KERNELS)
    for i in range(max(map(len, fitting.values()))):
        with tiles.force({kernel: c[i] for kernel, c in fitting.items() if i < len(c)}):
            _fused_experts(shape, device)
            _three_ops(shape, device)
            if fp8:
                _fp8_fused(shape, device)
                _fp8_grouped(shape, device)


@triton.jit
def _fp8_dot_kernel(a_ptr, b_ptr, c_ptr, BLOCK: tl.constexpr):
    """c = a @ b for one (BLOCK, BLOCK) tile of e4m3 inputs, fp32 out: proof that a target takes fp8 dots."""
    offs = tl.arange(0, BLOCK)
    tile = offs[:, None] * BLOCK + offs[None, :]
    c = tl.dot(tl.load(a_ptr + tile), tl.load(b_ptr + tile))
    tl.store(c_ptr + tile, c)


@workload("fp8_dot", shapes=(Shape("64 x 64 tile", 64, 64, 64, 1, 1),), fp8=True)
def _fp8_dot(shape: Shape, device: Device) -> None:
    """one e4m3 tl.dot, in the target's fp8 flavour"""
    a, b = (torch.empty(shape.tokens, shape.hidden, dtype=device.fp8, device=META) for _ in range(2))
    _fp8_dot_kernel[(1,)](a, b, torch.empty(shape.tokens, shape.hidden, device=META), BLOCK=shape.hidden)
