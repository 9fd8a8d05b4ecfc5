"""Language models over the mixer registry: `ModelConfig`, `LanguageModel`, decoding."""

from linear_attention.models.config import ModelConfig
from linear_attention.models.decoding import generate, generate_stream, state_size_bytes, step_fn
from linear_attention.models.model import Hidden, LanguageModel, ModelState, redraw_features

__all__ = [
    "ModelConfig",
    "Hidden",
    "LanguageModel",
    "ModelState",
    "generate",
    "generate_stream",
    "redraw_features",
    "state_size_bytes",
    "step_fn",
]
