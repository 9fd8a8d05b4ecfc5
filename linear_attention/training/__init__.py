"""Config-driven training: validated configs, optax chain, orbax checkpoints, device mesh,
metrics, the loop (`train`), reloading a run (`load_run`, `evaluate_run`) and the command lines
(`la-train` / `experiments/train.py`, `la-eval`, `la-generate`, `la-tokenizer`). The sweep
engine is the subpackage `linear_attention.training.sweep` (imported on its own: it draws
figures)."""

import importlib

# The names this package gives, each from its module, imported on first use: a command line
# (``la-train``: `cli`) can then act before JAX is loaded (`signals.honour_interrupts`).
_NAMES = {
    "DATA_KINDS": "data_kinds",
    "DataKind": "data_kinds",
    "ExperimentConfig": "config",
    "MeshConfig": "config",
    "OptimizerConfig": "config",
    "TrainConfig": "config",
    "experiment_config": "config",
    "evaluate_run": "load",
    "load_run": "load",
    "make_optimizer": "optim",
    "make_schedule": "optim",
    "NonFiniteLossError": "trainer",
    "build_data": "trainer",
    "build_model": "trainer",
    "chunked_cross_entropy": "chunked_loss",
    "train": "trainer",
}


def _data_configs() -> dict:
    """Every data kind's config class (`MQARDataConfig`, ...), named from the registry."""
    registry = importlib.import_module(f"{__name__}.data_kinds")
    return {cls.__name__: cls for cls in registry.DATA_CONFIGS}


def __getattr__(name: str):
    if name in _NAMES:
        value = getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    elif name == "__all__":
        value = [*_data_configs(), *_NAMES]
    elif name.endswith("DataConfig") and name in _data_configs():
        value = _data_configs()[name]
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__getattr__("__all__")})
