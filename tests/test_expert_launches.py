"""What the routed experts' ops launch, in which order, and when their buffers come and go, against a record kept in
tests/data/expert_launches.json: the fused and grouped ops, bf16 and FP8, with each weight-gradient engine.

The record was written from the four autograd Functions these ops were before they became one Function over two
GEMM sets (xmoe/kernels/experts_fn.py), so it holds that the one Function launches the same kernels with the same
shapes, flags and aliasing, runs the same torch ops, and allocates and frees the same buffers at the same points
(a GPU's peak memory follows from that sequence). A deliberate change of any of these rewrites the record
(``XMOE_WRITE_LAUNCHES=1 pytest tests/test_expert_launches.py``) in the commit that makes it, which says why.

Per op call, one line per event: ``K`` a Triton launch (kernel, grid, each tensor argument's dtype, shape and strides
and the first argument sharing its storage, the flags), ``A`` a torch op outside the kernels that is neither a view
nor an allocation, ``+`` / ``-`` a buffer of that many bytes allocated / freed (a storage dying, or emptied by
``resize_``); frees between the same two other events are sorted.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # also set by conftest.py, before anything imports triton

import gc
import json
import weakref
from pathlib import Path

import pytest
import torch
import triton.runtime.interpreter as interpreter
from torch.utils._python_dispatch import TorchDispatchMode

from xmoe.dispatch.routing import build_plan
from xmoe.kernels import triton_ops
from xmoe.kernels.fp8_experts import grouped_swiglu_fp8, moe_experts_fp8
from xmoe.kernels.fp8_quant import quantize_expert_weights

RECORD = Path(__file__).parent / "data" / "expert_launches.json"
# (T, H, F, E, K): H crosses a 128-column scale group (two column chunks of y and dx); F = 128, whole groups, as
# the model shapes have it; expert 3 gets no rows
SHAPE = (8, 160, 128, 4, 2)
CASES = [
    f"{prec}-{path}-{wgrad}"
    for prec, engines in (("bf16", ("triton", "grouped_mm")), ("fp8", ("triton", "grouped_mm", "fp8")))
    for path in ("fused", "grouped")
    for wgrad in engines
]
NO_KERNEL = {"empty", "empty_strided", "new_empty", "empty_like", "slice", "transpose", "view", "select", "t"}
NO_KERNEL |= {"expand", "alias", "unsqueeze", "_unsafe_view", "as_strided", "detach", "resize_"}


def _tensor(t: torch.Tensor) -> str:
    return f"{str(t.dtype)[6:]}{list(t.shape)}/{list(t.stride())}".replace(" ", "")


class Recorder(TorchDispatchMode):
    """Records the events of the module docstring; Triton launches through the interpreter's run."""

    def __init__(self):
        super().__init__()
        self.events: list[str] = []
        self.in_kernel = 0
        self.active = False  # inside ``with recorder``: the inputs are made outside
        self.seen: weakref.WeakSet = weakref.WeakSet()

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)

    def _buffer(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage in self.seen or storage.nbytes() == 0:
            return
        self.seen.add(storage)
        size = storage.nbytes()
        self.events.append(f"+ {size}")
        weakref.finalize(storage, self.events.append, f"- {size}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.in_kernel:
            return out
        for a in args:  # buffers made before the record (inputs, weights): a view of one is no allocation
            if isinstance(a, torch.Tensor):
                self.seen.add(a.untyped_storage())
        name = func.overloadpacket.__name__
        if name not in NO_KERNEL:
            shapes = [_tensor(a) for a in args if isinstance(a, torch.Tensor)]
            self.events.append(f"A {name} {' '.join(shapes)}")
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self._buffer(t)
        return out

    def launch(self, kernel, args, grid, kwargs) -> None:
        first: dict[int, int] = {}
        parts = []
        for i, a in enumerate(args):
            t = getattr(a, "base", a)  # a tensor descriptor's tensor
            if isinstance(t, torch.Tensor):
                alias = first.setdefault(t.untyped_storage().data_ptr(), i)
                parts.append(_tensor(t) + (f"={alias}" if alias != i else ""))
        flags = [f"{k}={int(v)}" for k, v in sorted(kwargs.items()) if isinstance(v, bool)]
        self.events.append(f"K {kernel} {list(grid)} {' '.join(parts)} {' '.join(flags)}")

    def finished(self) -> list[str]:
        out, frees = [], []
        for e in self.events:
            if e.startswith("-"):
                frees.append(e)
                continue
            out += sorted(frees)
            frees = []
            out.append(e)
        return out + sorted(frees)


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    run = interpreter.InterpretedFunction.run

    def recorded_run(self, *args, grid, warmup, **kwargs):
        if rec.active and not warmup:
            rec.launch(self.fn.__name__, args, grid, kwargs)
        rec.in_kernel += 1
        try:
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            rec.in_kernel -= 1
            gc.collect(0)  # the interpreter leaves cycles that hold the arguments: a GPU launch holds none

    resize = torch.UntypedStorage.resize_

    def recorded_resize(storage, size):
        if rec.active and size == 0 and storage.nbytes() and not rec.in_kernel:
            rec.events.append(f"- {storage.nbytes()}")
        return resize(storage, size)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", recorded_run)
    monkeypatch.setattr(torch.UntypedStorage, "resize_", recorded_resize)
    return rec


def _call(case: str, rec: Recorder) -> list[str]:
    """Forward and backward of one case, recorded (the inputs made outside the record)."""
    prec, path, wgrad = case.split("-")
    T, H, Fd, E, K = SHAPE
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(T)])
    plan = build_plan(ids, torch.rand(T, K, generator=g), E, None)
    counts = plan.tokens_per_expert_E
    w1, w3 = (torch.randn(E, H, Fd, generator=g) / H**0.5 for _ in range(2))
    w2 = torch.randn(E, Fd, H, generator=g) / Fd**0.5
    qw = quantize_expert_weights(w1, w3, w2, "e4m3fn") if prec == "fp8" else None
    rows = T if path == "fused" else plan.num_rows
    x, grad = torch.randn(rows, H, generator=g).requires_grad_(), torch.randn(rows, H, generator=g)
    weights = torch.rand(T, K, generator=g).requires_grad_()
    leaves = [x, *(w.requires_grad_() for w in (w1, w3, w2))] + ([weights] if path == "fused" else [])
    routing = (plan.token_ids_N, plan.slot_ids_N, plan.row_of_slot_TK)
    with rec:  # the engine is the ops' argument, as a layer passes its kernels section's
        if path == "fused" and prec == "bf16":
            out = triton_ops.moe_experts(x, weights, *routing, counts, w1, w3, w2, wgrad=wgrad)
        elif path == "fused":
            out = moe_experts_fp8(x, weights, *routing, counts, w1, w3, w2, qw, "e4m3fn", wgrad=wgrad)
        elif prec == "bf16":
            out = triton_ops.grouped_swiglu(x, w1, w3, w2, counts, wgrad=wgrad)
        else:
            out = grouped_swiglu_fp8(x, w1, w3, w2, counts, qw, "e4m3fn", wgrad=wgrad)
        rec.events.append("backward")
        grads = torch.autograd.grad(out, leaves, grad)
        del out, grads  # the results' buffers go too, inside the record
    return rec.finished()


@pytest.mark.parametrize("case", CASES)
def test_launches_and_buffers_are_as_recorded(case, recorder):
    got = _call(case, recorder)
    assert any(e.startswith("K ") for e in got) and any(e.startswith("- ") for e in got)
    if os.environ.get("XMOE_WRITE_LAUNCHES") == "1":
        record = json.loads(RECORD.read_text()) if RECORD.exists() else {}
        record[case] = got
        RECORD.parent.mkdir(exist_ok=True)
        RECORD.write_text(json.dumps(dict(sorted(record.items())), indent=1) + "\n")
        return
    want = json.loads(RECORD.read_text())[case]
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        assert a == b, f"event {i}: got {a!r}, the record has {b!r}"
    assert len(got) == len(want)
