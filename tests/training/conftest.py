from pathlib import Path

import pytest

from tests.scripts import load_module

ROOT = Path(__file__).resolve().parents[2]


def load_config(name: str, arg: str | None = None):
    """``get_config(arg)`` of ``configs/<name>.py``."""
    return load_module(f"configs/{name}.py", f"configs_{name}").get_config(arg)


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
