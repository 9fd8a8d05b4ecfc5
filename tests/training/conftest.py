import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_config(name: str, arg: str | None = None):
    """``get_config(arg)`` of ``configs/<name>.py``."""
    path = ROOT / "configs" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"configs_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def tiny_mqar():
    """The smoke preset with a favor + softmax hybrid whose features are redrawn every 2 steps,
    so the loop's redraw and both kinds of mixer are exercised."""
    config = load_config("mqar", "smoke")
    config.model.mixer = "favor,softmax"
    config.model.feature_dim = 8
    config.model.redraw_interval = 2
    return config


@pytest.fixture
def tiny_config():
    return tiny_mqar()
