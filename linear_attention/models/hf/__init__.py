"""Hugging Face checkpoints in and out: `from_pretrained(path) -> (model, config)` reads a local
transformers folder (`config.json` + safetensors, sharded or not) and `save_pretrained(model,
out)` writes one that `transformers.AutoModelForCausalLM.from_pretrained(out)` loads with the
same logits. Nothing is downloaded. Architectures: `ARCHITECTURES` (docs/hf.md).

Everything is checked before any weight is read: the `model_type`, every config field (a field
the mapping does not know raises, naming it), and the name and shape of every tensor (a missing,
unexpected or mis-shaped one raises, naming it). Weights are converted to float32.
"""

from __future__ import annotations

import dataclasses
import json
import os
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from linear_attention.models.config import ModelConfig
from linear_attention.models.hf import (
    bamba,
    files,
    kimi_linear,
    mamba,
    mamba2,
    olmo_hybrid,
    qwen3_5,
    qwen3_5_moe,
    qwen3_next,
)
from linear_attention.models.hf.multimodal import VISION_PREFIX, Multimodal
from linear_attention.models.model import LanguageModel

# A mapping: a module (or a `Multimodal`, a `MambaMapping`) with MODEL_TYPE, MIXERS,
# model_options, hf_config, tensor_shapes, to_params, from_params, and optionally STORED_FORMS,
# EXPORT_REFUSED, MLP (False: blocks without an MLP), HEADS (False: its layers read no
# num_heads) and not_imported_fields (hf -> lines for `not_imported`).
Mapping = ModuleType | Multimodal | mamba.MambaMapping
# (Export tries them in this order: a dense hybrid is written as qwen3_5_text, one with
# experts as qwen3_next unless another type is asked for.)
ARCHITECTURES: dict[str, Mapping] = {
    qwen3_5.MODEL_TYPE: qwen3_5,
    qwen3_next.MODEL_TYPE: qwen3_next,
    qwen3_5_moe.MODEL_TYPE: qwen3_5_moe,
    "qwen3_5": Multimodal("qwen3_5", "Qwen3_5ForConditionalGeneration", qwen3_5),
    "qwen3_5_moe": Multimodal("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", qwen3_5_moe),
    mamba2.MODEL_TYPE: mamba2,
    kimi_linear.MODEL_TYPE: kimi_linear,
    olmo_hybrid.MODEL_TYPE: olmo_hybrid,
    bamba.MODEL_TYPE: bamba,
    mamba.MAMBA_MAPPING.MODEL_TYPE: mamba.MAMBA_MAPPING,
    mamba.FALCON_MAMBA.MODEL_TYPE: mamba.FALCON_MAMBA,
}
CONFIG_NAME = "config.json"
WEIGHTS_NAME, INDEX_NAME = files.WEIGHTS_NAME, files.INDEX_NAME
# Tensors a causal-LM checkpoint may carry that the causal LM does not use (transformers skips
# them too): Qwen3.5's multi-token-prediction head.
UNUSED_PREFIXES = ("mtp.",)
# What the parts a checkpoint holds but the import leaves out are (`not_imported`).
NOT_IMPORTED = {
    "mtp.": "the multi-token-prediction head (not part of the causal LM)",
    VISION_PREFIX: "the vision tower (this library's model reads tokens only)",
}
# Mixer options that change how a layer computes, not what (kernel algorithm, packed rows).
NUMERICS_FREE = ("method", "chunk_size", "reset_positions")


def read_config(path: str) -> tuple[dict, Mapping]:
    """`(config.json as a dict, its architecture's mapping module)`; ValueError when `path` is
    not a checkpoint folder, its config.json is damaged or holds a field of the wrong kind
    (`files.check_fields`), or its `model_type` is not supported."""
    if not os.path.isdir(path):
        raise ValueError(f"path {path!r} is not a folder (a local transformers checkpoint)")
    file = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(file):
        raise ValueError(f"{path!r} holds no {CONFIG_NAME}: not a transformers checkpoint")
    hf = files.read_json(file, "a JSON object of the model's config")
    if not isinstance(hf, dict):
        raise ValueError(
            f"{file} is a JSON {type(hf).__name__}, expected an object of the model's config"
        )
    model_type = hf.get("model_type")
    if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
        raise ValueError(
            f"unsupported model_type {model_type!r} in {file}; supported: "
            f"{', '.join(ARCHITECTURES)}"
        )
    files.check_fields(hf, file)
    return hf, ARCHITECTURES[model_type]


def model_config(hf: dict, mapping: Mapping) -> ModelConfig:
    """The `ModelConfig` of transformers config `hf`; ValueError naming what does not map."""
    try:
        return ModelConfig(**_checked(mapping.model_options, hf))
    except ValueError as e:
        raise ValueError(f"{hf.get('model_type')}: {e}") from None


def _checked(read, hf: dict):
    """`read(hf)`, a field of an unexpected kind (a list for a number, ...) a ValueError."""
    try:
        return read(hf)
    except (TypeError, KeyError, AttributeError, IndexError, ZeroDivisionError) as e:
        raise ValueError(
            f"a config field has a value of the wrong kind ({type(e).__name__}: {e}); compare "
            "config.json with the one transformers writes for this model_type"
        ) from None


def check_tensors(expected: dict, found: dict) -> None:
    """Every expected tensor present with its shape, nothing else (but `UNUSED_PREFIXES`)."""
    for name, shape in expected.items():
        if name not in found:
            raise ValueError(f"tensor {name!r} is missing from the checkpoint (expected {shape})")
        if tuple(found[name]) != tuple(shape):
            raise ValueError(
                f"tensor {name!r} has shape {tuple(found[name])}, expected {tuple(shape)}"
            )
    for name in sorted(found):
        if name not in expected and not name.startswith(UNUSED_PREFIXES):
            raise ValueError(f"tensor {name!r} is not part of the architecture; not loaded")


def _reader(entries: dict[str, files.TensorEntry], allow_nonfinite: bool):
    def get(name: str) -> np.ndarray:
        return files.read_tensor(name, entries[name], allow_nonfinite=allow_nonfinite)

    return get


def from_pretrained(
    path: str, *, allow_nonfinite: bool = False
) -> tuple[LanguageModel, ModelConfig]:
    """`(model, config)` from the local transformers checkpoint folder `path` (float32).
    Every tensor the model uses must be a float; one holding NaN or Inf is refused unless
    `allow_nonfinite`."""
    hf, mapping = read_config(path)
    config = model_config(hf, mapping)
    entries = files.tensor_entries(path)
    for name, entry in entries.items():  # (before any is read)
        if not name.startswith(tuple(NOT_IMPORTED)):
            files.check_float(name, entry)
    shapes, wraps = {name: entry.shape for name, entry in entries.items()}, []
    for form in getattr(mapping, "STORED_FORMS", ()):
        shapes, wrap = form(shapes)
        wraps.append(wrap)
    check_tensors(_checked(mapping.tensor_shapes, hf), shapes)
    get = _reader(entries, allow_nonfinite)
    for wrap in wraps:  # (the first form's names are read first: it wraps the reader)
        get = wrap(get)
    params = _checked(lambda hf: mapping.to_params(hf, get), hf)
    abstract = nnx.eval_shape(lambda: LanguageModel(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    want = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    got_paths = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)}
    for p, _ in jax.tree_util.tree_leaves_with_path(want):
        key = jax.tree_util.keystr(p)
        if key not in got_paths:
            raise ValueError(f"the {mapping.MODEL_TYPE} mapping gives no parameter {key}")
    for p, leaf in jax.tree_util.tree_leaves_with_path(params):
        key = jax.tree_util.keystr(p)
        target = _at(want, p)
        if target is None or tuple(target.shape) != leaf.shape:
            raise ValueError(f"parameter {key} has shape {leaf.shape}, the model's is {target}")
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))
    return nnx.merge(graphdef, state), config


def _at(tree, path):
    for entry in path:
        key = getattr(entry, "key", getattr(entry, "idx", None))
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def not_imported(path: str) -> list[str]:
    """What the checkpoint folder `path` holds that `from_pretrained` leaves out, one line per
    part (`NOT_IMPORTED`: the vision tower of a multimodal checkpoint, a multi-token-prediction
    head), with its tensor count, then each config field read and left alone whose value is
    not transformers' default (the mapping's `not_imported_fields`, e.g. mamba's
    initialisation-only fields); empty when everything is imported."""
    hf, mapping = read_config(path)
    names = files.tensor_entries(path)
    lines = []
    for prefix, what in NOT_IMPORTED.items():
        count = sum(name.startswith(prefix) for name in names)
        if count:
            lines.append(f"{prefix}* ({count} tensors): {what}")
    return lines + _checked(getattr(mapping, "not_imported_fields", lambda hf: []), hf)


def export_problems(config: ModelConfig, mapping: Mapping) -> list[str]:
    """Why `config` has no exact `mapping` checkpoint (empty when it has one): the config that
    the exported checkpoint would import as, compared with `config`, field by field."""
    if getattr(mapping, "EXPORT_REFUSED", None):
        return [mapping.EXPORT_REFUSED]
    known = set(mapping.MIXERS.values())
    others = [m for m in dict.fromkeys(config.layer_mixers) if m not in known]
    if others:
        return [
            f"mixer {m!r} has no {mapping.MODEL_TYPE} layer (it has {sorted(known)})"
            for m in others
        ]
    has_mlp = getattr(mapping, "MLP", True)
    if config.mlp != has_mlp:
        has = "has an MLP" if has_mlp else "has no MLP"
        return [f"mlp={config.mlp}: every {mapping.MODEL_TYPE} layer {has}"]
    try:
        rebuilt = ModelConfig(**mapping.model_options(mapping.hf_config(config)))
    except ValueError as e:
        return [str(e)]
    problems = []
    for field in (
        "vocab_size",
        "d_model",
        "num_layers",
        "mixer",
        "norm_eps",
        "moe_dense_layers",
        "moe_aux_loss_coef",
    ):
        if getattr(config, field) != getattr(rebuilt, field):
            problems.append(
                f"{field}={getattr(config, field)!r} ({mapping.MODEL_TYPE} gives "
                f"{getattr(rebuilt, field)!r})"
            )
    for field, wanted in (("position", "none"), ("tie_embeddings", rebuilt.tie_embeddings)):
        if getattr(config, field) != wanted:
            problems.append(f"{field}={getattr(config, field)!r} (only {wanted!r})")
    if config.moe_options != rebuilt.moe_options:
        problems.append(
            f"the experts {config.moe_options} ({mapping.MODEL_TYPE} gives {rebuilt.moe_options})"
        )
    if config.layer_mixers != rebuilt.layer_mixers:
        return problems
    for name in dict.fromkeys(config.layer_mixers):
        heads = getattr(mapping, "HEADS", True)
        problems += _layer_problems(config, rebuilt, name, mapping.MODEL_TYPE, heads)
    return problems


def _layer_problems(
    config: ModelConfig, rebuilt: ModelConfig, name: str, model_type: str, heads: bool = True
):
    """How the layers of mixer `name` differ between `config` and `rebuilt`, the config its
    `model_type` checkpoint imports as: heads (unless `heads` is False: its layers read none),
    norm position, each option that changes the numbers."""
    problems = []
    if heads and config.layer_num_heads(name) != rebuilt.layer_num_heads(name):
        problems.append(f"{name} layers: num_heads={config.layer_num_heads(name)}")
    position = config.layer_norm_position(name)
    if position != rebuilt.layer_norm_position(name):
        has = f"{model_type} has {rebuilt.layer_norm_position(name)!r}"
        problems.append(f"{name} layers: norm_position={position!r} ({has})")
    ours = dataclasses.asdict(config.mixer_config(name))
    theirs = dataclasses.asdict(rebuilt.mixer_config(name))
    for option, value in ours.items():
        if option not in NUMERICS_FREE and value != theirs[option]:
            problems.append(
                f"{name} layers: {option}={value!r} ({model_type} has {theirs[option]!r})"
            )
    return problems


def export_type(config: ModelConfig, model_type: str | None = None) -> str:
    """The architecture `config` exports as: `model_type`, or (None) the first of
    `ARCHITECTURES` that holds it exactly (a dense hybrid: qwen3_5_text; with experts:
    qwen3_next; never a multimodal type, whose export is refused); ValueError with every
    architecture's reasons when none does."""
    if model_type is not None and model_type not in ARCHITECTURES:
        raise ValueError(
            f"unknown model_type {model_type!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    reasons = []
    candidates = [n for n, m in ARCHITECTURES.items() if not getattr(m, "EXPORT_REFUSED", None)]
    for name in [model_type] if model_type else candidates:
        problems = export_problems(config, ARCHITECTURES[name])
        if not problems:
            return name
        reasons.append(f"{name}: " + "; ".join(problems))
    raise ValueError("this model has no transformers equivalent (" + " | ".join(reasons) + ")")


def save_pretrained(
    model: LanguageModel, out: str, *, model_type: str | None = None, allow_nonfinite=False
) -> str:
    """Write `model` as a transformers checkpoint into the folder `out` (`config.json`,
    `model.safetensors`, float32), of `model_type` (None: `export_type`'s choice); ValueError
    with the reasons when the model's config has no exact equivalent, or naming the first
    tensor that holds NaN or Inf (unless `allow_nonfinite`). Returns `out`."""
    from safetensors.numpy import save_file

    mapping = ARCHITECTURES[export_type(model.config, model_type)]
    hf = mapping.hf_config(model.config)
    params = jax.tree.map(
        lambda x: np.asarray(x, np.float32), nnx.to_pure_dict(nnx.state(model, nnx.Param))
    )
    tensors = mapping.from_params(hf, params)
    check_tensors(mapping.tensor_shapes(hf), {k: v.shape for k, v in tensors.items()})
    for name, values in tensors.items():
        files.check_finite(f"tensor {name!r}", values, allow_nonfinite)
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, WEIGHTS_NAME), metadata={"format": "pt"})
    with open(os.path.join(out, CONFIG_NAME), "w") as f:
        json.dump(hf, f, indent=2)
    return out


__all__ = [
    "ARCHITECTURES",
    "export_problems",
    "export_type",
    "from_pretrained",
    "not_imported",
    "read_config",
    "save_pretrained",
]
