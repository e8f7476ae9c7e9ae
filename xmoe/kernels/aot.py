"""Ahead-of-time compiles of every Triton kernel of xmoe for GPUs that need not be present, and the resources each
binary needs: registers (NVIDIA) or VGPRs / AGPRs (AMD), shared memory / LDS, spills.

Where the launches come from: each workload (``aot_workloads.WORKLOADS``, which says how to add one) runs public ops
on meta tensors of one layer shape while every ``*_kernel`` JIT function of xmoe.kernels is replaced by a recorder
and ``tiles.device_budget`` answers for the GPU stood in for (``aot_workloads.DEVICES``: its shared memory and
shipped tile table), so the tiles are the ones ``tiles.pick`` gives that GPU without tuning. A recorded launch is
what the launcher passed: the signature is specialised the way Triton's runtime specialises a call (pointer dtypes,
16-byte divisibility of pointers and ints, int32 or int64, ints equal to 1 as constants, AMD's 32-bit pointer
ranges), the constexprs and options (num_warps, num_stages) are the launcher's own. No signature is written down
twice: a changed launcher reaches these compiles by itself, and a ``*_kernel`` that no workload launches is listed
as uncovered.

Distinct launches are compiled once per target with ``triton.compile`` (no GPU, no driver). Resources come from
the binary: NVIDIA registers and local memory per thread from ``cuobjdump -res-usage`` (the numbers the driver
reports as n_regs and, in 4-byte words, n_spills); AMD VGPRs, AGPRs, spill counts and scratch from the amdgcn
metadata; shared memory / LDS from the compile's metadata, checked against the target's limit.
``benchmarks/aot_report.py`` writes the table; ``tests/test_aot_compile.py`` fails on a compile error, an uncovered
kernel or a spill.
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
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch
import triton

from xmoe.kernels import fp8_gemm, tiles
from xmoe.kernels.aot_workloads import DEVICES, TARGETS, WORKLOADS, Device, Workload

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
    shape_class: str | None = None


@dataclass
class Recording:
    launches: dict[Launch, set[Use]] = field(default_factory=dict)
    picks: set[tuple[str, str]] = field(default_factory=set)  # (device, shape class) picked by a shipped workload
    pending_class: str | None = None


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
        bound = dict(zip(names, args, strict=False))
        bound.update({k: v for k, v in kwargs.items() if k in names})
        options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in names))
        # what Triton's launch refuses, refused here: a wrong argument count, an unknown keyword
        unknown = [k for k, _ in options if k not in vars(self.backend.parse_options(dict(options)))]
        if len(args) > len(names) or len(bound) != len(names) or unknown:
            raise TypeError(
                f"{self.fn.__name__} launched with {len(args)} positional arguments for {len(names)}, "
                f"without {sorted(set(names) - set(bound))}, with unknown keywords {unknown}"
            )
        signature, constexprs, attrs = [], [], []
        for i, p in enumerate(self.fn.params):
            value = bound[p.name]
            if p.is_constexpr:
                kind, key = "constexpr", value
            else:
                kind, key = specialize(
                    self.backend, value, p.is_const, not p.do_not_specialize, not p.do_not_specialize_on_alignment
                )[:2]
            signature.append((p.name, kind))
            if kind == "constexpr":
                constexprs.append((p.name, key))
            elif isinstance(key, str) and self.backend.parse_attr(key):
                attrs.append((i, tuple(tuple(a) for a in self.backend.parse_attr(key))))
        launch = Launch(
            self.target,
            f"{self.fn.__module__}:{self.fn.__name__}",
            tuple(signature),
            tuple(constexprs),
            tuple(attrs),
            options,
        )
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
    """Kernels record instead of launching; tile picks are the device's (untuned: no run is passed to the pick;
    weight gradients by the Triton kernels, which the ops' default "auto" engine takes for the meta device's
    tensors); the FP8 GEMMs read through tensor descriptors on NVIDIA targets (all of them sm_90 here), as
    fp8_gemm.uses_tma has them there."""
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

    def recording_pick(kernel, dtype, dev, depth, width, num_rows, num_experts, run=None, autotune=False):
        key = tiles.shape_class(kernel, depth, width, num_rows, num_experts)
        if use.shipped:
            recording.picks.add((device.name, key))
        recording.pending_class = key if dtype != torch.float32 else f"{kernel}|fp32"
        return pick(kernel, dtype, dev, depth, width, num_rows, num_experts)  # no run: never tuned

    budget_here = (device.max_shared, table)  # every device's budget while standing in
    tiles.pick, tiles.device_budget = recording_pick, lambda device: budget_here  # named as in device_budget
    tiles.clear_memo()
    try:
        with fp8_gemm.forced_tma(device.target.startswith("cuda:")):
            yield
    finally:
        tiles.pick, tiles.device_budget = pick, budget
        tiles.clear_memo()
        for module, name, obj in patched:
            setattr(module, name, obj)


def record(
    devices=DEVICES, workloads: list[Workload] | None = None, shapes: set[str] | None = None, forced: dict | None = None
) -> Recording:
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


def unsupported() -> str | None:
    """Why this Triton cannot run these compiles, or None: they need its call specialisation, both backends and
    the cuobjdump it ships."""
    try:
        _triton_internals()
        import triton.backends
        from triton import knobs

        cuobjdump = knobs.nvidia.cuobjdump.path
    except Exception as e:  # noqa: BLE001 (an older Triton lacks these in several ways)
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

    out = {
        "vgprs": field_("vgpr_count"),
        "agprs": field_("agpr_count"),
        "vgpr_spills": field_("vgpr_spill_count"),
        "sgpr_spills": field_("sgpr_spill_count"),
        "scratch_bytes": field_("private_segment_fixed_size"),
    }
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
        return subprocess.run(
            [knobs.nvidia.cuobjdump.path, "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout


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
        src = ASTSource(
            fn=fn,
            signature=dict(launch.signature),
            constexprs=dict(launch.constexprs),
            attrs={(i,): [list(a) for a in attr] for i, attr in launch.attrs},
        )
        compiled = triton.compile(src, target=gpu_target(launch.target), options=dict(launch.options))
        out = (
            nvidia_resources(_res_usage(compiled.asm["cubin"]))
            if "cubin" in compiled.asm
            else amd_resources(compiled.asm["amdgcn"])
        )
        out.update(shared=int(compiled.metadata.shared), mma=matrix_instructions(compiled))
        threads = int(compiled.metadata.num_warps) * TARGETS[launch.target][2]
        if out["shared"] > max_shared:
            raise RuntimeError(f"needs {out['shared']} bytes of shared memory, the GPU has {max_shared}")
        if threads > MAX_THREADS:
            raise RuntimeError(f"{threads} threads per program, more than {MAX_THREADS}")
        out.update(ok=True, error=None)
    except Exception as e:  # noqa: BLE001 (a compile error is a result here, reported with the launch)
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
    return sorted(
        f"{d.name} {key}"
        for d in devices
        if d.table
        for key in tiles.shipped_table(d.table)
        if (d.name, key) not in recording.picks
    )


# Shipped configurations seen to spill (target, kernel, tile: every flag variant of that tile), with the local
# memory per thread they spilled by Triton version. The compile test fails on any other spill of a shipped
# configuration; docs/kernels.md ("Resources per target") has the table and what would remove them.
KNOWN_SPILLS = {
    (
        "cuda:90",
        "_swiglu_up_fwd_kernel",
        "BLOCK_M=128 BLOCK_N=128 BLOCK_K=32 num_stages=6 num_warps=8",
    ): "Triton 3.6: 56 B, 3.9: none",
    (
        "cuda:90",
        "_fp8_grouped_mm_kernel",
        "BLOCK_M=128 BLOCK_N=256 BLOCK_K=128 GROUP=128 num_stages=3 num_warps=8",
    ): "Triton 3.6: 16 B (g[tok] w2^T, rows gathered), 3.9: none",
}


def check(
    devices=DEVICES,
    workloads: list[Workload] | None = None,
    shapes: set[str] | None = None,
    forced: dict | None = None,
    jobs: int = 1,
) -> dict:
    """Record, compile and report: {"rows": one per distinct launch, "uncovered", "missed_classes"}."""
    recording = record(devices, workloads, shapes, forced)
    launches = sorted(
        recording.launches, key=lambda r: (r.target, r.kernel.split(":")[1], r.tile(), r.flags(), repr(r))
    )
    rows = []
    for launch, result in zip(launches, compile_all(launches, jobs), strict=False):
        uses = recording.launches[launch]
        kernel = launch.kernel.split(":")[1]
        rows.append(
            {
                "target": launch.target,
                "kernel": kernel,
                "module": launch.kernel.split(":")[0],
                "tile": launch.tile(),
                "flags": launch.flags(),
                "shipped": any(u.shipped for u in uses),
                "known_spill": KNOWN_SPILLS.get((launch.target, kernel, launch.tile())),
                "classes": sorted({f"{u.device}: {u.shape_class}" for u in uses if u.shape_class and u.shipped}),
                "uses": sorted(f"{u.device} | {u.workload} | {u.shape}" for u in uses),
                "signature": dict(launch.signature),
                "options": dict(launch.options),
                **result,
            }
        )
    return {
        "rows": rows,
        "uncovered": uncovered(recording) if workloads is None else [],
        "missed_classes": missed_classes(recording, devices) if workloads is None and shapes is None else [],
    }
