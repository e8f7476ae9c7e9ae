"""xmoe: train expert-specialized Mixture-of-Experts models, padding-free, from one CPU to many GPUs.

The public API; everything else is reachable by its module path (``xmoe.parallel.dims.ParallelDims``, ...).
``Trainer`` is imported on first use, so that ``import xmoe`` does not load the training stack.
"""

from xmoe._version import __version__
from xmoe.config import ModelConfig, MoEConfig, ParallelConfig, RunConfig, TrainConfig
from xmoe.model.presets import get_preset
from xmoe.model.transformer import Transformer
from xmoe.moe.layer import MoELayer

__all__ = [
    "MoEConfig",
    "MoELayer",
    "ModelConfig",
    "ParallelConfig",
    "RunConfig",
    "TrainConfig",
    "Trainer",
    "Transformer",
    "__version__",
    "get_preset",
]


def __getattr__(name: str):
    if name == "Trainer":
        from xmoe.train.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'xmoe' has no attribute {name!r}")
