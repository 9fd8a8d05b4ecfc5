"""Load a script or config file of the checkout (experiments/, configs/) as a module, for tests."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_module(relative_path: str, name: str):
    """Execute `ROOT/relative_path` as module `name` (registered, so dataclasses resolve)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relative_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
