"""xmoe: train expert-specialized Mixture-of-Experts models, padding-free, from one CPU to many GPUs."""

from xmoe._version import __version__
from xmoe.config import ModelConfig, MoEConfig, ParallelConfig, RunConfig, TrainConfig

__all__ = ["MoEConfig", "ModelConfig", "ParallelConfig", "RunConfig", "TrainConfig", "__version__"]
