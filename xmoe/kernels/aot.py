"""Ahead-of-time compiles of every Triton kernel of xmoe for GPUs that need not be present, and the resources each
binary needs: registers (NVIDIA) or VGPRs / AGPRs (AMD), shared memory / LDS, spills.

# T tokens, H hidden, F expert ffn, E experts, K top-k, N kept rows

Where the launches come from: each workload (``WORKLOADS``) runs public ops on meta tensors of one layer shape
while every ``*_kernel`` JIT function of xmoe.kernels is replaced by a recorder and ``tiles.device_budget``
answers for the GPU stood in for (``DEVICES``: its shared memory and shipped tile table), so the tiles are the ones
``tiles.pick`` gives that GPU without tuning. A recorded launch is what the launcher passed: the signature is
specialised the way Triton's runtime specialises a call (pointer dtypes, 16-byte divisibility of pointers and ints,
int32 or int64, ints equal to 1 as constants, AMD's 32-bit pointer ranges), the constexprs and options
(num_warps, num_stages) are the launcher's own. No signature is written down twice: a changed launcher reaches
these compiles by itself, and a ``*_kernel`` that no workload launches is listed as uncovered.

Distinct launches are compiled once per target with ``triton.compile`` (no GPU, no driver). Resources come from
the binary: NVIDIA registers and local memory per thread from ``cuobjdump -res-usage`` (the numbers the driver
reports as n_regs and, in 4-byte words, n_spills); AMD VGPRs, AGPRs, spill counts and scratch from the amdgcn
metadata; shared memory / LDS from the compile's metadata, checked against the target's limit.

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
``*fp8e4b8``, their FP8_MAX and MIN_EXP those of fp8_quant.FORMATS). ``benchmarks/aot_report.py`` writes the table;
``tests/test_aot_compile.py`` fails on a compile error, an uncovered kernel or a spill.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import os
import pkgutil
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import TYPE_CHECKING, Callable, Iterator, Optional

import torch
import triton
import triton.language as tl

from xmoe.kernels import tiles

if TYPE_CHECKING:
    from xmoe.kernels.fp8_quant import Fp8ExpertWeights

META = torch.device("meta")


@dataclass(frozen=True)
class Device:
    """A GPU as the launchers see it: its compile target, shared memory per block, shipped table, fp8 dtype."""

    name: str
    target: str  # a key of TARGETS
    max_shared: int
    table: Optional[str] = None  # xmoe/kernels/tuned/<table>.json
    fp8: Optional[torch.dtype] = None  # the e4m3 dtype of its fp8 matrix instructions; None: it has none


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
    def preset(cls, preset: str, tokens: int) -> "Shape":
        return cls(f"{preset} T={tokens}", tokens, *PRESET_LAYERS[preset])


# (H, F, E, K) of the presets' MoE layers (xmoe/model/presets.py, a layer above this package; the compile test
# holds the two equal)
PRESET_LAYERS = {"tiny": (128, 64, 16, 4), "small": (2048, 1408, 64, 6), "medium": (5120, 1536, 128, 6),
                 "large": (7168, 2048, 256, 8)}


# The three model shapes at the token counts the shipped H200 table was tuned on; tiny's H and F are below one
# tile (masked tiles); small at T=256 has 24 rows per expert (the heuristic's 64-row tiles).
LAYER_SHAPES = (*(Shape.preset(p, t) for p in ("small", "medium", "large") for t in (8192, 16384)),
                Shape.preset("tiny", 512), Shape.preset("small", 256))
# the router kernel's blocks depend on E and K alone: the presets' and its limits (router_topk.MAX_*)
ROUTER_SHAPES = (Shape.preset("tiny", 512), Shape.preset("small", 8192), Shape.preset("medium", 8192),
                 Shape.preset("large", 8192), Shape("router limits", 4096, 0, 0, 512, 16))


@dataclass(frozen=True)
class Workload:
    name: str  # a short key (benchmarks/aot_report.py --workloads); run's docstring says what it launches
    run: Callable[[Shape, Device], None]
    shapes: tuple[Shape, ...]
    fp8: bool = False
    shipped: bool = True  # False: configurations only autotuning may pick (reported; spills do not fail)


WORKLOADS: list[Workload] = []


def workload(name: str, shapes: tuple[Shape, ...] = LAYER_SHAPES, fp8: bool = False,
             shipped: bool = True) -> Callable:
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

    return SimpleNamespace(x_TH=leaf(T, H), weights_TK=leaf(T, K, dt=torch.float32),
                           plan_args=(index(T * K), index(T * K), index(T, K), index(E)),
                           w1=leaf(E, H, F), w3=leaf(E, H, F), w2=leaf(E, F, H))


def _moe_experts(shape: Shape, dtype: torch.dtype) -> None:
    from xmoe.kernels import triton_ops

    t = layer_tensors(shape, dtype)
    out = triton_ops.moe_experts(t.x_TH, t.weights_TK, *t.plan_args, t.w1, t.w3, t.w2)
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
    y_NH = triton_ops.grouped_swiglu(x_NH, t.w1, t.w3, t.w2, counts_E)
    out = triton_ops.combine_rows(y_NH, t.weights_TK, token_ids_N, slot_ids_N, row_of_slot_TK)
    out.backward(torch.empty_like(out))


@workload("fused_fp32", shapes=(Shape.preset("small", 8192), Shape.preset("tiny", 512)))
def _fused_experts_fp32(shape: Shape, device: Device) -> None:
    """moe_experts in fp32 (exact dots, tiles.FP32_CONFIG), forward and backward"""
    _moe_experts(shape, torch.float32)


@workload("router", shapes=ROUTER_SHAPES)
def _router(shape: Shape, device: Device) -> None:
    """router_topk with softmax scores, and with sigmoid scores normalised, forward and backward"""
    from xmoe.kernels.router_topk import router_topk

    for score_func, norm in (("softmax", False), ("sigmoid", True)):
        logits_TE = torch.empty(shape.tokens, shape.experts, device=META, requires_grad=True)
        weights_TK, _, _ = router_topk(logits_TE, None, shape.top_k, score_func, norm, 1.0)
        weights_TK.backward(torch.empty_like(weights_TK))


def fp8_layer(shape: Shape, device: Device) -> tuple[SimpleNamespace, "Fp8ExpertWeights", str]:
    """(layer_tensors in bf16, the FP8 copies of its weights, the device's format name): the copies quantised
    from fp32 weights, as reuse_weight_casts makes them from the parameters once per step (outside it, one process
    quantises them once per forward); the bf16 w1, w3, w2 receive the weight gradients, as make_casts' stand-ins
    do."""
    from xmoe.kernels.fp8_quant import FORMATS, quantize_expert_weights

    t = layer_tensors(shape, torch.bfloat16)
    (fmt,) = (f.name for f in FORMATS.values() if f.dtype == device.fp8)
    params = (torch.empty_like(w, dtype=torch.float32) for w in (t.w1, t.w3, t.w2))
    return t, quantize_expert_weights(*params, fmt), fmt


@workload("fp8_fused", fp8=True)
def _fp8_fused(shape: Shape, device: Device) -> None:
    """moe_experts_fp8 (quantize_rows of x and grad_out, the FP8 GEMMs, the SwiGLU backward pass quantising dh1,
    dh3; weight gradients and combines in bf16), forward and backward"""
    from xmoe.kernels.fp8_experts import moe_experts_fp8

    t, qw, fmt = fp8_layer(shape, device)
    out = moe_experts_fp8(t.x_TH, t.weights_TK, *t.plan_args, t.w1, t.w3, t.w2, qw, fmt)
    out.backward(torch.empty_like(out))


@workload("fp8_grouped", fp8=True)
def _fp8_grouped(shape: Shape, device: Device) -> None:
    """grouped_swiglu_fp8 over a dispatcher's expert-major rows (no gathers, no combine weights, dx unchunked),
    forward and backward"""
    from xmoe.kernels.fp8_experts import grouped_swiglu_fp8

    t, qw, fmt = fp8_layer(shape, device)
    token_ids_N, _, _, counts_E = t.plan_args
    x_NH = torch.empty(token_ids_N.shape[0], shape.hidden, dtype=torch.bfloat16, device=META, requires_grad=True)
    y_NH = grouped_swiglu_fp8(x_NH, t.w1, t.w3, t.w2, counts_E, qw, fmt)
    y_NH.backward(torch.empty_like(y_NH))


@workload("fp8_weights", fp8=True)
def _fp8_weights(shape: Shape, device: Device) -> None:
    """quantize_expert_weights of bf16 weights: FSDP2's gathers under mixed precision, quantised per forward (the
    fp32 parameters' quantisation is fp8_layer's)"""
    from xmoe.kernels.fp8_quant import quantize_expert_weights

    t, _, fmt = fp8_layer(shape, device)
    quantize_expert_weights(t.w1.detach(), t.w3.detach(), t.w2.detach(), fmt)


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


# ---------------------------------------------------------------------------------------------------------------
# Recording


@dataclass(frozen=True)
class Launch:
    """One kernel launch as triton.compile needs it; equal launches compile to the same binary."""

    target: str
    kernel: str  # module:function
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, object], ...]
    attrs: tuple[tuple[int, tuple], ...]  # (argument index, ((attribute, value), ...))
    options: tuple[tuple[str, object], ...]  # num_warps, num_stages, ...

    def tile(self) -> str:
        """The launch's blocks and options in one line, e.g. BLOCK_M=128 BLOCK_N=256 ... num_warps=8."""
        blocks = [f"{k}={v}" for k, v in self.constexprs if k.startswith("BLOCK") or k == "GROUP"]
        return " ".join(blocks + [f"{k}={v}" for k, v in self.options])

    def flags(self) -> str:
        """The other constexprs (GATHER, EVEN_K, ...) and the arguments specialised to 1."""
        return " ".join(f"{k}={v}" for k, v in self.constexprs if not (k.startswith("BLOCK") or k == "GROUP"))


@dataclass(frozen=True)
class Use:
    """Where a launch was recorded: the device, the workload, its shape, and for a tiled GEMM the shape class."""

    device: str
    workload: str
    shape: str
    shipped: bool
    shape_class: Optional[str] = None


@dataclass
class Recording:
    launches: dict[Launch, set[Use]] = field(default_factory=dict)
    picks: set[tuple[str, str]] = field(default_factory=set)  # (device, shape class) picked by a shipped workload
    pending_class: Optional[str] = None


def _triton_internals():
    """Triton's own call specialisation (native_specialize_impl) and backends, or an ImportError naming them."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    return native_specialize_impl, GPUTarget, make_backend


def gpu_target(target: str):
    _, GPUTarget, _ = _triton_internals()
    return GPUTarget(*TARGETS[target])


class _Recorder:
    """Stands in for one JIT function while a workload runs: ``kernel[grid](...)`` records the launch."""

    def __init__(self, fn, backend, target: str, recording: Recording, use: Use):
        self.fn, self.backend, self.target, self.recording, self.use = fn, backend, target, recording, use

    def __getitem__(self, grid):
        return self._record

    def _record(self, *args, **kwargs) -> None:
        specialize = _triton_internals()[0]
        names = [p.name for p in self.fn.params]
        bound = dict(zip(names, args))
        bound.update({k: v for k, v in kwargs.items() if k in names})
        options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in names))
        # what Triton's launch refuses, refused here: a wrong argument count, an unknown keyword
        unknown = [k for k, _ in options if k not in vars(self.backend.parse_options(dict(options)))]
        if len(args) > len(names) or len(bound) != len(names) or unknown:
            raise TypeError(f"{self.fn.__name__} launched with {len(args)} positional arguments for {len(names)}, "
                            f"without {sorted(set(names) - set(bound))}, with unknown keywords {unknown}")
        signature, constexprs, attrs = [], [], []
        for i, p in enumerate(self.fn.params):
            value = bound[p.name]
            if p.is_constexpr:
                kind, key = "constexpr", value
            else:
                kind, key = specialize(self.backend, value, p.is_const, not p.do_not_specialize,
                                       not p.do_not_specialize_on_alignment)[:2]
            signature.append((p.name, kind))
            if kind == "constexpr":
                constexprs.append((p.name, key))
            elif isinstance(key, str) and self.backend.parse_attr(key):
                attrs.append((i, tuple(tuple(a) for a in self.backend.parse_attr(key))))
        launch = Launch(self.target, f"{self.fn.__module__}:{self.fn.__name__}", tuple(signature), tuple(constexprs),
                        tuple(attrs), options)
        use = self.use
        if {"BLOCK_M", "BLOCK_N", "BLOCK_K"} <= set(bound) and self.recording.pending_class:
            use = replace(use, shape_class=self.recording.pending_class)  # a tiled GEMM: its tile's class
            self.recording.pending_class = None
        self.recording.launches.setdefault(launch, set()).add(use)


def kernel_modules() -> list:
    """Every module of xmoe.kernels, imported."""
    import xmoe.kernels as package

    return [importlib.import_module(f"{package.__name__}.{m.name}") for m in pkgutil.iter_modules(package.__path__)]


def jit_kernels() -> dict[str, object]:
    """{module:function: JIT function} of every launched kernel of xmoe (``*_kernel``; the other JIT functions are
    helpers they inline)."""
    found = {}
    for module in kernel_modules():
        for name, obj in vars(module).items():
            if isinstance(obj, triton.runtime.JITFunction) and name.endswith("_kernel"):
                found[f"{obj.fn.__module__}:{obj.fn.__name__}"] = obj
    return found


@contextlib.contextmanager
def _standing_in(device: Device, recording: Recording, use: Use) -> Iterator[None]:
    """Kernels record instead of launching; tile picks are the device's (untuned; weight gradients by the Triton
    kernels, which the Hopper path skips only at some shapes)."""
    _, _, make_backend = _triton_internals()
    backend = make_backend(gpu_target(device.target))
    kernels = {id(fn): fn for fn in jit_kernels().values()}
    patched = []
    for module in kernel_modules():
        for name, obj in list(vars(module).items()):
            if id(obj) in kernels:
                patched.append((module, name, obj))
                setattr(module, name, _Recorder(obj, backend, device.target, recording, use))
    table = tiles.shipped_table(device.table) if device.table else {}
    pick, budget = tiles.pick, tiles.device_budget

    def recording_pick(kernel, dtype, dev, depth, width, num_rows, num_experts, run=None):
        key = tiles.shape_class(kernel, depth, width, num_rows, num_experts)
        if use.shipped:
            recording.picks.add((device.name, key))
        recording.pending_class = key if dtype != torch.float32 else f"{kernel}|fp32"
        return pick(kernel, dtype, dev, depth, width, num_rows, num_experts)  # no run: never tuned

    tiles.pick, tiles.device_budget = recording_pick, lambda dev: (device.max_shared, table)
    tiles.clear_memo()
    try:
        with tiles.use_options(autotune=False, wgrad="triton"):
            yield
    finally:
        tiles.pick, tiles.device_budget = pick, budget
        tiles.clear_memo()
        for module, name, obj in patched:
            setattr(module, name, obj)


def record(devices=DEVICES, workloads: Optional[list[Workload]] = None,
           shapes: Optional[set[str]] = None, forced: Optional[dict] = None) -> Recording:
    """Every launch of the workloads (all, or those given) on each device, at their shapes (or those named)."""
    from xmoe.kernels._common import interpreting

    if interpreting():
        raise RuntimeError("the compile checks need Triton's compiler: run them without TRITON_INTERPRET=1")
    recording = Recording()
    for device in devices:
        for wl in workloads if workloads is not None else WORKLOADS:
            if wl.fp8 and device.fp8 is None:
                continue
            for shape in wl.shapes:
                if shapes is not None and shape.name not in shapes:
                    continue
                use = Use(device.name, wl.name, shape.name, wl.shipped)
                with _standing_in(device, recording, use), tiles.force(forced or {}):
                    wl.run(shape, device)
    return recording


# ---------------------------------------------------------------------------------------------------------------
# Compiling and reading the binaries


def unsupported() -> Optional[str]:
    """Why this Triton cannot run these compiles, or None: they need its call specialisation, both backends and
    the cuobjdump it ships."""
    try:
        _triton_internals()
        import triton.backends
        from triton import knobs

        cuobjdump = knobs.nvidia.cuobjdump.path
    except Exception as e:  # an older Triton
        return f"Triton {triton.__version__} lacks what these compiles use: {type(e).__name__}: {e}"
    missing = [b for b in ("nvidia", "amd") if b not in triton.backends.backends]
    if missing:
        return f"Triton {triton.__version__} has no {' or '.join(missing)} backend"
    return None if os.path.exists(cuobjdump) else f"Triton {triton.__version__} ships no cuobjdump"


def nvidia_resources(res_usage: str) -> dict:
    """Registers and local memory per thread from ``cuobjdump -res-usage`` of a one-kernel cubin. Local memory
    holds spilled registers (Triton kernels have no other stack use); the driver's n_spills is it in 4-byte words."""
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", res_usage)
    if m is None:
        raise ValueError(f"no resource line in cuobjdump's output: {res_usage!r}")
    regs, stack, local = map(int, m.groups())
    return {"regs": regs, "local_bytes": stack + local, "spills": stack + local > 0}


def amd_resources(amdgcn: str) -> dict:
    """VGPRs, AGPRs, spill counts and scratch bytes per lane from the kernel metadata of an amdgcn listing. A spill
    is a VGPR spill or any scratch (the driver's n_spills is scratch in 4-byte words); SGPRs spilled into VGPR
    lanes cost no memory traffic and are reported, not counted."""

    def field_(name: str) -> int:
        m = re.search(rf"^\s*-?\s*\.{name}:\s+(\d+)", amdgcn, re.MULTILINE)
        if m is None:
            raise ValueError(f"no .{name} in the amdgcn metadata")
        return int(m.group(1))

    out = {"vgprs": field_("vgpr_count"), "agprs": field_("agpr_count"), "vgpr_spills": field_("vgpr_spill_count"),
           "sgpr_spills": field_("sgpr_spill_count"), "scratch_bytes": field_("private_segment_fixed_size")}
    out["spills"] = out["vgpr_spills"] + out["scratch_bytes"] > 0
    return out


def matrix_instructions(compiled) -> list[str]:
    """The distinct tensor-core / matrix-core instructions of a binary (wgmma, mma; v_mfma), empty for none."""
    if "ptx" in compiled.asm:
        found = re.findall(r"\b(wgmma\.mma_async\.[\w.]+|mma\.sync\.aligned\.[\w.]+)", compiled.asm["ptx"])
    else:
        found = re.findall(r"\b(v_mfma_\w+)", compiled.asm["amdgcn"])
    return sorted(set(found))


def _res_usage(cubin: bytes) -> str:
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([knobs.nvidia.cuobjdump.path, "-res-usage", f.name], capture_output=True, text=True,
                              check=True).stdout


MAX_THREADS = 1024


def compile_launch(launch: Launch) -> dict:
    """Compile one launch for its target: {"ok", "error", resources, "shared", "mma", "seconds"}. Shared memory
    above the target's GPUs' and more than MAX_THREADS threads count as errors: such a binary would not launch."""
    from triton.compiler import ASTSource

    module, name = launch.kernel.split(":")
    fn = getattr(importlib.import_module(module), name)
    max_shared = max(d.max_shared for d in DEVICES if d.target == launch.target)
    start = time.perf_counter()
    try:
        src = ASTSource(fn=fn, signature=dict(launch.signature), constexprs=dict(launch.constexprs),
                        attrs={(i,): [list(a) for a in attr] for i, attr in launch.attrs})
        compiled = triton.compile(src, target=gpu_target(launch.target), options=dict(launch.options))
        out = (nvidia_resources(_res_usage(compiled.asm["cubin"])) if "cubin" in compiled.asm
               else amd_resources(compiled.asm["amdgcn"]))
        out.update(shared=int(compiled.metadata.shared), mma=matrix_instructions(compiled))
        threads = int(compiled.metadata.num_warps) * TARGETS[launch.target][2]
        if out["shared"] > max_shared:
            raise RuntimeError(f"needs {out['shared']} bytes of shared memory, the GPU has {max_shared}")
        if threads > MAX_THREADS:
            raise RuntimeError(f"{threads} threads per program, more than {MAX_THREADS}")
        out.update(ok=True, error=None)
    except Exception as e:  # a compile error is a result here, reported with the launch
        out = {"ok": False, "error": f"{type(e).__name__}: {str(e).strip()[-2000:]}", "spills": False}
    out["seconds"] = round(time.perf_counter() - start, 2)
    return out


def compile_all(launches: list[Launch], jobs: int = 1) -> list[dict]:
    """compile_launch over every launch, in ``jobs`` processes; results in the launches' order."""
    if jobs <= 1:
        return [compile_launch(launch) for launch in launches]
    with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(compile_launch, launches, chunksize=1))


def uncovered(recording: Recording) -> list[str]:
    """Kernels of xmoe that no workload launched on any device."""
    reached = {launch.kernel for launch in recording.launches}
    return sorted(set(jit_kernels()) - reached)


def missed_classes(recording: Recording, devices=DEVICES) -> list[str]:
    """Shipped-table classes that the workloads never picked on the device shipping them."""
    return sorted(f"{d.name} {key}" for d in devices if d.table for key in tiles.shipped_table(d.table)
                  if (d.name, key) not in recording.picks)


# Shipped configurations seen to spill (target, kernel, tile: every flag variant of that tile), with the local
# memory per thread they spilled by Triton version. The compile test fails on any other spill of a shipped
# configuration; docs/kernels.md ("Resources per target") has the table and what would remove them.
KNOWN_SPILLS = {
    ("cuda:90", "_router_topk_bwd_kernel", "BLOCK_T=64 BLOCK_E=64 num_warps=4"): "Triton 3.6: 56-120 B, 3.9: 64-136 B",
    ("cuda:90", "_swiglu_up_fwd_kernel", "BLOCK_M=128 BLOCK_N=128 BLOCK_K=32 num_stages=6 num_warps=8"):
        "Triton 3.6: 56 B, 3.9: none",
    ("cuda:90", "_grouped_mm_kernel", "BLOCK_M=128 BLOCK_N=256 BLOCK_K=64 num_stages=4 num_warps=8"):
        "Triton 3.6: 8 B (dx, a ragged column tile), 3.9: none",
    ("cuda:90", "_grouped_mm_kernel", "BLOCK_M=64 BLOCK_N=64 BLOCK_K=32 num_stages=3 num_warps=4"):
        "Triton 3.6: 16 B (dx in fp32), 3.9: none",
    ("cuda:90", "_fp8_up_fwd_kernel", "BLOCK_M=128 BLOCK_N=128 BLOCK_K=128 GROUP=128 num_stages=3 num_warps=16"):
        "Triton 3.6: 8 B, 3.9: 8 B (the grouped path at the tiny preset: rows not gathered, F = 64 a ragged tile)",
}


def check(devices=DEVICES, workloads: Optional[list[Workload]] = None, shapes: Optional[set[str]] = None,
          forced: Optional[dict] = None, jobs: int = 1) -> dict:
    """Record, compile and report: {"rows": one per distinct launch, "uncovered", "missed_classes"}."""
    recording = record(devices, workloads, shapes, forced)
    launches = sorted(recording.launches,
                      key=lambda l: (l.target, l.kernel.split(":")[1], l.tile(), l.flags(), repr(l)))
    rows = []
    for launch, result in zip(launches, compile_all(launches, jobs)):
        uses = recording.launches[launch]
        kernel = launch.kernel.split(":")[1]
        rows.append({
            "target": launch.target, "kernel": kernel, "module": launch.kernel.split(":")[0],
            "tile": launch.tile(), "flags": launch.flags(), "shipped": any(u.shipped for u in uses),
            "known_spill": KNOWN_SPILLS.get((launch.target, kernel, launch.tile())),
            "classes": sorted({f"{u.device}: {u.shape_class}" for u in uses if u.shape_class and u.shipped}),
            "uses": sorted(f"{u.device} | {u.workload} | {u.shape}" for u in uses),
            "signature": dict(launch.signature), "options": dict(launch.options), **result})
    return {"rows": rows, "uncovered": uncovered(recording) if workloads is None else [],
            "missed_classes": missed_classes(recording, devices) if workloads is None and shapes is None else []}
