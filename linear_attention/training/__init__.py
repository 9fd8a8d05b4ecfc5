"""Config-driven training: validated configs, optax chain, orbax checkpoints, device mesh,
metrics, the loop (`train`), reloading a run (`load_run`, `evaluate_run`) and the command lines
(`la-train` / `experiments/train.py`, `la-eval`, `la-generate`, `la-tokenizer`). The sweep
engine is the subpackage `linear_attention.training.sweep` (imported on its own: it draws
figures)."""

from linear_attention.training.config import (
    ExperimentConfig,
    MeshConfig,
    MQARDataConfig,
    OptimizerConfig,
    TextDataConfig,
    TokenDataConfig,
    TrainConfig,
    experiment_config,
)
from linear_attention.training.load import evaluate_run, load_run
from linear_attention.training.optim import make_optimizer, make_schedule
from linear_attention.training.trainer import NonFiniteLossError, build_data, build_model, train

__all__ = [
    "ExperimentConfig",
    "MQARDataConfig",
    "MeshConfig",
    "NonFiniteLossError",
    "OptimizerConfig",
    "TextDataConfig",
    "TokenDataConfig",
    "TrainConfig",
    "build_data",
    "build_model",
    "evaluate_run",
    "experiment_config",
    "load_run",
    "make_optimizer",
    "make_schedule",
    "train",
]
