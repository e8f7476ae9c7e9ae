"""``train.deterministic``: the same run twice gives the same bits on a GPU too.

On a CPU xmoe's training step is deterministic as it is. On a GPU, torch's default algorithms may add in an order
that varies between processes, so two runs of one command can part in the last bits and drift apart from there;
xmoe's own kernels add in a fixed order (no atomics). The trainer calls ``deterministic_algorithms`` before anything
runs on the device when the setting is on and calls what it returns when the run ends (docs/operations.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch


def deterministic_algorithms() -> Callable[[], None]:
    """``train.deterministic``: torch's deterministic algorithms from here on, as a warning where an op has none
    (on GPUs: cuBLAS with a fixed workspace, flash attention's deterministic backward, the compiler choosing
    kernels without timing them), and SDPA without its cuDNN and memory-efficient kernels, which torch does not
    count as deterministic (it drops cuDNN's itself only where such ops are errors, not warnings). Set before
    anything runs on the GPU (cuBLAS reads its workspace setting once). Returns what restores the previous
    settings."""
    import torch._inductor.config as inductor_config

    cuda = torch.backends.cuda
    algorithms = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    benchmark, compiler = torch.backends.cudnn.benchmark, inductor_config.deterministic
    cudnn_sdp, mem_efficient_sdp = cuda.cudnn_sdp_enabled(), cuda.mem_efficient_sdp_enabled()
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    inductor_config.deterministic = True
    cuda.enable_cudnn_sdp(False)
    cuda.enable_mem_efficient_sdp(False)

    def restore() -> None:
        torch.use_deterministic_algorithms(algorithms, warn_only=warn_only)
        torch.backends.cudnn.benchmark, inductor_config.deterministic = benchmark, compiler
        cuda.enable_cudnn_sdp(cudnn_sdp)
        cuda.enable_mem_efficient_sdp(mem_efficient_sdp)
        if workspace is None:  # cuBLAS has read it already: this only leaves the environment as it was
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)

    return restore
