"""Qwen3.5's multimodal checkpoints (transformers' `qwen3_5`, `Qwen3_5ForConditionalGeneration`,
and `qwen3_5_moe`, `Qwen3_5MoeForConditionalGeneration`: the form the released Qwen3.5 models
take) as their text model's mapping (`qwen3_5`, `qwen3_5_moe`).

Such a folder nests the text model's config under `text_config` (model_type `qwen3_5_text` /
`qwen3_5_moe_text`) beside a `vision_config`, and stores the text model's tensors under
`model.language_model.` (`lm_head.weight` at the top), the vision tower's under `model.visual.`.
The import reads the text model, the causal LM that `AutoModelForCausalLM` makes of the same
folder (`Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM`, which drops the vision tower too): the
vision tower is not imported (this library's model takes tokens, not pixels), by rule, and
`models.hf.not_imported` names it. Errors name tensors as stored (`model.language_model.…`).
The token ids of the image and video placeholders are read
and left alone. Export is refused: this library's model has no vision tower to write; it is
written as the text model's type, which `AutoModelForCausalLM` loads as the same causal LM.
"""

from __future__ import annotations

from types import ModuleType

from linear_attention.models.hf.qwen3_5 import INERT, Unsupported

TEXT_PREFIX, VISION_PREFIX = "model.language_model.", "model.visual."
# The multimodal config's own fields: the sub-configs and the placeholder tokens' ids (which a
# text-only model never sees).
FIELDS = (
    "model_type",
    "text_config",
    "vision_config",
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
    "tie_word_embeddings",
)


class Multimodal:
    """The mapping of the multimodal `model_type` whose text model `text` maps (a module with
    `MODEL_TYPE`, `ARCHITECTURE`, `MIXERS`, `model_options`, `tensor_shapes`, `to_params`), with
    the same interface; its export is refused with `EXPORT_REFUSED`."""

    def __init__(self, model_type: str, architecture: str, text: ModuleType):
        self.MODEL_TYPE, self.ARCHITECTURE, self.text = model_type, architecture, text
        self.MIXERS = text.MIXERS
        self.STORED_FORMS = (*getattr(text, "STORED_FORMS", ()), without_vision)
        self.EXPORT_REFUSED = (
            f"{model_type} is the multimodal checkpoint, whose vision tower this library's model "
            f"does not have; export as {text.MODEL_TYPE} ({text.ARCHITECTURE}), which "
            "AutoModelForCausalLM loads as the same causal LM"
        )

    def text_config(self, hf: dict) -> dict:
        """The text model's config (`text_config`), checked against the top-level fields."""
        unknown = sorted(set(hf) - set(FIELDS) - set(INERT))
        if unknown:
            raise Unsupported(
                f"config field {unknown[0]!r} is not understood by the {self.MODEL_TYPE} importer"
            )
        text = hf.get("text_config")
        if not isinstance(text, dict):
            raise Unsupported("config field 'text_config' is missing")
        if text.get("model_type") != self.text.MODEL_TYPE:
            raise Unsupported(
                f"text_config.model_type={text.get('model_type')!r} is not supported (only "
                f"{self.text.MODEL_TYPE!r})"
            )
        tied = hf.get("tie_word_embeddings", text.get("tie_word_embeddings"))
        if tied != text.get("tie_word_embeddings"):
            raise Unsupported(
                f"tie_word_embeddings={tied!r} differs from text_config.tie_word_embeddings="
                f"{text.get('tie_word_embeddings')!r}"
            )
        return text

    def model_options(self, hf: dict) -> dict:
        """`ModelConfig` keyword arguments of the text model; `Unsupported` naming the field
        (`text_config.<field>` for one of the text model's)."""
        text = self.text_config(hf)
        try:
            return self.text.model_options(text)
        except Unsupported as e:
            raise Unsupported(f"text_config: {e}") from None

    def tensor_shapes(self, hf: dict) -> dict[str, tuple[int, ...]]:
        """The text model's tensors, as stored here (under `model.language_model.`)."""
        shapes = self.text.tensor_shapes(self.text_config(hf))
        return {stored(name): shape for name, shape in shapes.items()}

    def to_params(self, hf: dict, get) -> dict:
        return self.text.to_params(self.text_config(hf), lambda name: get(stored(name)))

    def hf_config(self, config) -> dict:
        raise Unsupported(self.EXPORT_REFUSED)


def stored(name: str) -> str:
    """Where a multimodal checkpoint stores the causal LM's tensor `name`."""
    return TEXT_PREFIX + name[len("model.") :] if name.startswith("model.") else name


def without_vision(shapes: dict) -> tuple[dict, object]:
    """A stored form: the checkpoint's tensors (name -> shape) without the vision tower's
    (`model.visual.*`, never read). Returns `(shapes, wrap)`."""
    kept = {name: shape for name, shape in shapes.items() if not name.startswith(VISION_PREFIX)}
    return kept, lambda get: get
