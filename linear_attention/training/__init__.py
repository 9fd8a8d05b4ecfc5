"""Config-driven training: validated configs, optax chain, orbax checkpoints, device mesh,
metrics, the loop (`train`), reloading a run (`load_run`, `evaluate_run`) and the command lines
(`la-train` / `experiments/train.py`, `la-eval`, `la-generate`, `la-tokenizer`). The sweep
engine is the subpackage `linear_attention.training.sweep` (imported on its own: it draws
figures)."""

from linear_attention.training import data_kinds
from linear_attention.training.config import (
    ExperimentConfig,
    MeshConfig,
    OptimizerConfig,
    TrainConfig,
    experiment_config,
)
from linear_attention.training.data_kinds import DATA_KINDS, DataKind
from linear_attention.training.load import evaluate_run, load_run
from linear_attention.training.optim import make_optimizer, make_schedule
from linear_attention.training.trainer import NonFiniteLossError, build_data, build_model, train

# Every data kind's config class (`MQARDataConfig`, ...), named from the registry.
globals().update({cls.__name__: cls for cls in data_kinds.DATA_CONFIGS})

__all__ = [
    *(cls.__name__ for cls in data_kinds.DATA_CONFIGS),
    "DATA_KINDS",
    "DataKind",
    "ExperimentConfig",
    "MeshConfig",
    "NonFiniteLossError",
    "OptimizerConfig",
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
