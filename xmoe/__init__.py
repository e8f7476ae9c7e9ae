"""xmoe: train expert-specialized Mixture-of-Experts models, padding-free, from one CPU to many GPUs.

The public API; everything else is reachable by its module path (``xmoe.parallel.dims.ParallelDims``, ...).
``MoELayer``, ``Transformer``, ``build_model`` (the trainer's construction pipeline: meta build, parallel layout,
then each rank's shards), ``resolve_kernels`` (kernel choices as the value a layer is built with) and ``Trainer``
are imported on first use, so that ``import xmoe`` (which every
``xmoe.*`` import runs first) loads no torch: ``xmoe --help`` starts in a fraction of a second.
"""

from xmoe._version import __version__
from xmoe.config import DataConfig, KernelConfig, ModelConfig, MoEConfig, ParallelConfig, RunConfig, TrainConfig
from xmoe.model.presets import get_preset

__all__ = [
    "DataConfig",
    "KernelConfig",
    "MoEConfig",
    "MoELayer",
    "ModelConfig",
    "ParallelConfig",
    "RunConfig",
    "TrainConfig",
    "Trainer",
    "Transformer",
    "__version__",
    "build_model",
    "get_preset",
    "resolve_kernels",
]


def __getattr__(name: str):
    if name == "Trainer":
        from xmoe.train.trainer import Trainer

        return Trainer
    if name == "Transformer":
        from xmoe.model.transformer import Transformer

        return Transformer
    if name == "MoELayer":
        from xmoe.moe.layer import MoELayer

        return MoELayer
    if name == "build_model":
        from xmoe.parallel.build import build_model

        return build_model
    if name == "resolve_kernels":
        from xmoe.kernels.choice import resolve_kernels

        return resolve_kernels
    raise AttributeError(f"module 'xmoe' has no attribute {name!r}")
