"""xmoe: train expert-specialized Mixture-of-Experts models, padding-free, from one CPU to many GPUs."""

from xmoe.config import ModelConfig, MoEConfig, ParallelConfig, RunConfig, TrainConfig

__version__ = "0.1.0"
__all__ = ["MoEConfig", "ModelConfig", "ParallelConfig", "RunConfig", "TrainConfig", "__version__"]
