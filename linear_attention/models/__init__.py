"""Language models over the mixer registry: `ModelConfig`, `LanguageModel`, decoding, and
Hugging Face checkpoints in and out (`from_pretrained`, `save_pretrained`: `models.hf`)."""

from linear_attention.models.config import ModelConfig
from linear_attention.models.decoding import generate, generate_stream, state_size_bytes, step_fn
from linear_attention.models.hf import from_pretrained, save_pretrained
from linear_attention.models.model import Hidden, LanguageModel, ModelState, redraw_features

__all__ = [
    "ModelConfig",
    "Hidden",
    "LanguageModel",
    "ModelState",
    "from_pretrained",
    "generate",
    "generate_stream",
    "redraw_features",
    "save_pretrained",
    "state_size_bytes",
    "step_fn",
]
