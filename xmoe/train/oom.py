"""Running out of memory, told in one line: which errors are out-of-memory errors (a GPU's torch.OutOfMemoryError,
the host's MemoryError and the CPU allocator's RuntimeError), in which phase of a training step one was raised, the
peak the process reached, the training loop's line (``stop_message``: the step, the planner's advice, the last
checkpoint) and the one `xmoe` prints for an error outside a training loop (``one_line``).
"""

from __future__ import annotations

import contextlib
import resource
import traceback
from pathlib import Path

import torch

from xmoe.config import RunConfig
from xmoe.plan import fit
from xmoe.plan.fit import gib

# the allocators' words for a failed allocation: CUDA / HIP ("CUDA out of memory", "HIP out of memory", "CUDA error:
# out of memory") and torch's CPU allocator ("DefaultCPUAllocator: can't allocate memory", "... not enough memory")
_ALLOCATOR_WORDS = ("out of memory", "defaultcpuallocator", "can't allocate memory", "cannot allocate memory")


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(words in text for words in _ALLOCATOR_WORDS)


def phase(exc: BaseException) -> str:
    """The phase of a training step that raised ``exc``, from the functions on its traceback (innermost first):
    the validation, a checkpoint save, the optimizer step (clipping included), the backward, else the forward."""
    names = [frame.f_code.co_name for frame, _ in traceback.walk_tb(exc.__traceback__)]
    for name in reversed(names):
        if name == "_validate":
            return "validation"
        if name == "save":
            return "checkpoint save"
        if name in ("optimizer_step", "clip_gradients"):
            return "optimizer step"
        if name in ("backward", "_engine_run_backward", "run_backward"):  # torch's, around autograd's engine
            return "backward"
    return "forward"


def release(exc: BaseException, device: torch.device, optimizer: torch.optim.Optimizer) -> str:
    """Free what a failed training step held (the locals of the traceback's frames, which itself stays for --debug;
    the gradients; on a GPU the allocator's cached blocks) and return the phase it failed in."""
    failed_in = phase(exc)  # read from the frames before they are cleared
    traceback.clear_frames(exc.__traceback__)
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return failed_in


def peak_reached(device: torch.device) -> str:
    """The peak this process reached on ``device``, in words: allocated GPU memory, or resident host memory."""
    if device.type == "cuda":
        return f"{gib(torch.cuda.max_memory_allocated(device))} allocated on {device}"
    return f"{gib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)} resident"


def stop_message(
    run: RunConfig,
    device: torch.device,
    step: int,
    phase: str,
    planned: tuple[float, float] | None,
    last_checkpoint: Path | None,
) -> str:
    """The line of a run out of memory at ``step`` in ``phase``: the peak reached, the planner's peak and its
    changes a resume can continue with, predicted at least 10% below the planned peak that did not fit (``planned``:
    the pre-flight's (peak, free bytes); None: predicted now), and the last checkpoint."""
    advice = ""
    with contextlib.suppress(ValueError):  # a layout the planner does not model: no advice
        peak, free = planned or (fit.predict_train_peak(run, device.type), float("inf"))
        fixes = fit.train_fixes(run, device.type, 0.9 * min(peak, free), same_model=True)
        shown = ", ".join(f"{f.flags} ({gib(f.peak)})" for f in fixes[:3])
        advice = f"; the planner's peak was {gib(peak)}" + (f": try {shown}" if shown else "")
    where = (
        f"the last checkpoint, {last_checkpoint}, is whole: continue from it with --resume"
        if last_checkpoint
        else "no checkpoint was saved before it"
    )
    return (
        f"out of memory at step {step} of {run.train.steps}, in the {phase} (peak {peak_reached(device)}){advice}; "
        f"{where}"
    )


def one_line(exc: BaseException) -> str:
    """The line for an out-of-memory error outside a training loop (building a model, eval, generate, bench)."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return (
        f"out of memory ({first[:200]}); the planner's pre-flight (`xmoe plan memory`, --fit) says what fits, "
        "--debug shows where it ran out"
    )
