"""Config-driven training: validated configs, optax chain, orbax checkpoints, device mesh,
metrics, the loop (`train`) and the command line (`la-train`, `experiments/train.py`)."""

from linear_attention.training.config import (
    ExperimentConfig,
    MeshConfig,
    MQARDataConfig,
    OptimizerConfig,
    TextDataConfig,
    TrainConfig,
    experiment_config,
)
from linear_attention.training.optim import make_optimizer, make_schedule
from linear_attention.training.trainer import NonFiniteLossError, build_data, build_model, train

__all__ = [
    "ExperimentConfig",
    "MQARDataConfig",
    "MeshConfig",
    "NonFiniteLossError",
    "OptimizerConfig",
    "TextDataConfig",
    "TrainConfig",
    "build_data",
    "build_model",
    "experiment_config",
    "make_optimizer",
    "make_schedule",
    "train",
]
