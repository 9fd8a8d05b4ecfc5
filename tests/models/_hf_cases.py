"""The Hugging Face fixtures' architectures and the checks each one's import and export go
through, shared by tests/models/test_hf.py and tests/models/test_hf_checkpoints.py (the
architectures split between the two files so that the suite's two workers, which take a file
each, import them in parallel)."""

from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open

from linear_attention.models import LanguageModel, ModelConfig, hf, step_fn

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")
ARCHITECTURES = ("qwen3_5", "qwen3_next", "qwen3_5_vl", "qwen3_5_moe", "mamba2", "kimi_linear")
ARCHITECTURES += ("olmo_hybrid", "olmo_hybrid_nope", "bamba", "mamba", "falcon_mamba")
# test_hf.py's share (qwen3_5_vl reuses qwen3_5's compiled passes, so they stay together);
# test_hf_checkpoints.py takes the rest.
IN_TEST_HF = ("qwen3_5", "qwen3_5_vl", "mamba2", "bamba")
IN_TEST_HF_CHECKPOINTS = tuple(a for a in ARCHITECTURES if a not in IN_TEST_HF)
# Each fixture's layers.
HYBRID = ("gated_deltanet",) * 3 + ("softmax",)
LAYERS = dict.fromkeys(ARCHITECTURES[:4], HYBRID) | {"mamba2": ("gated", "gated")}
LAYERS["kimi_linear"] = ("kda", "mla") * 2
LAYERS["olmo_hybrid"] = ("gated_deltanet", "softmax", "gated_deltanet")
LAYERS["olmo_hybrid_nope"] = ("softmax", "gated_deltanet")
LAYERS["bamba"] = ("gated", "softmax", "gated")
LAYERS["mamba"] = LAYERS["falcon_mamba"] = ("mamba", "mamba")
# An option each family's checkpoints fix, and a value they cannot hold.
OFF_SHAPE = {
    "gated_deltanet": ("conv_bias", True),
    "gated": ("d_skip", False),
    "kda": ("gate_bias", True),
    "softmax": ("qk_norm_all_heads", False),
    "mamba": ("norm_position", "post"),
}
# Its problem, where not "{mixer} layers: {option}={value} ({model_type} has {not value})":
# every setting of Mamba's own options has a checkpoint; its blocks are pre-norm.
OFF_SHAPE_PROBLEM = {"mamba": "mamba layers: norm_position='post' ({model_type} has 'pre')"}
OLMO_CONVS = tuple(f"linear_attn.{x}_conv1d.weight" for x in "qkv")
# The multimodal fixtures export as their text model's type (their own export is refused).
TEXT_TYPES = {"qwen3_5_vl": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def relative_error(got, want) -> float:
    return float(np.max(np.abs(np.asarray(got) - want)) / np.max(np.abs(want)))


def tensors(folder: str) -> dict[str, np.ndarray]:
    with safe_open(os.path.join(folder, "model.safetensors"), "np") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def text_tensors(folder: str) -> dict[str, np.ndarray]:
    """The causal LM's tensors of a fixture: a multimodal one's text model, renamed as
    `AutoModelForCausalLM` names it (`model.language_model.` → `model.`, no vision tower)."""
    out = {}
    for name, value in tensors(folder).items():
        if name.startswith("model.language_model."):
            out["model." + name[len("model.language_model.") :]] = value
        elif not name.startswith("model.visual."):
            out[name] = value
    return out


def fused_convs(values: dict) -> dict:
    """`values` with each OLMo Hybrid layer's q, k, v convs as their concatenation (what
    transformers' loader reads: its `save_pretrained` splits them into three equal parts, the
    export here at the q | k | v widths)."""
    out = dict(values)
    for name in [n for n in values if n.endswith(OLMO_CONVS[0])]:
        prefix = name[: -len(OLMO_CONVS[0])]
        out[prefix + "linear_attn.conv1d"] = np.concatenate(
            [out.pop(prefix + c) for c in OLMO_CONVS]
        )
    return out


# compiled once per model shape (reused by every test of a module)
full_pass = nnx.jit(lambda model, tokens: model(tokens))
prefill = nnx.jit(lambda model, tokens, state: model.prefill(tokens, state))


def check_against_reference(model, reference, split: int = 5) -> None:
    """Logits (relative ≤ 1e-4); prefill of `split` tokens then one step per token equal to
    the full pass (relative ≤ 1e-4, the float32 bound of the chunk vs step kernels; measured
    ~1e-5); and greedy decoding from there (argmax, step) giving transformers' tokens."""
    tokens, want = reference["tokens"], reference["logits"]
    num_new = reference["greedy"].shape[1]
    logits = full_pass(model, jnp.asarray(tokens))
    assert relative_error(logits, want) <= 1e-4
    state = model.init_state(tokens.shape[0], tokens.shape[1] + num_new)
    decoded, state = prefill(model, jnp.asarray(tokens[:, :split]), state)
    steps, step = [decoded], step_fn(model)
    for t in range(split, tokens.shape[1]):
        last, state = step(jnp.asarray(tokens[:, t]), state)
        steps.append(last[:, None])
    assert relative_error(jnp.concatenate(steps, axis=1), np.asarray(logits)) <= 1e-4
    greedy = []
    for _ in range(num_new):
        greedy.append(jnp.argmax(last, axis=-1).astype(jnp.int32))
        last, state = step(greedy[-1], state)
    np.testing.assert_array_equal(jnp.stack(greedy, axis=1), reference["greedy"])


def imported(name: str):
    """The fixture `name` imported: (folder, model, config, transformers' reference)."""
    folder = os.path.join(FIXTURES, name)
    model, config = hf.from_pretrained(folder)
    return folder, model, config, dict(np.load(os.path.join(folder, "reference.npz")))


def check_import(imported) -> None:
    """The layers and experts the fixture has, and transformers' logits, prefill + steps and
    greedy tokens (`check_against_reference`)."""
    folder, model, config, reference = imported
    folder, model, config, reference = imported
    assert isinstance(model, LanguageModel) and isinstance(config, ModelConfig)
    assert config.layer_mixers == LAYERS[os.path.basename(folder)]
    has_experts = os.path.basename(folder) in ("qwen3_next", "qwen3_5_moe", "kimi_linear")
    assert (config.num_experts > 0) == has_experts
    check_against_reference(model, reference)


def check_export(imported, tmp_path) -> None:
    """`save_pretrained` writes the fixture's own tensors (norms through 1 + w, to rounding)
    and a config.json that imports as the same model; a multimodal fixture's text model, as
    its text model's type."""
    folder, model, config, _ = imported
    with open(os.path.join(folder, "config.json")) as f:
        original = json.load(f)
    model_type = TEXT_TYPES.get(os.path.basename(folder))
    out = hf.save_pretrained(model, str(tmp_path / "out"), model_type=model_type)
    theirs, ours = fused_convs(text_tensors(folder)), fused_convs(tensors(out))
    assert sorted(theirs) == sorted(ours)
    for name, want in theirs.items():
        np.testing.assert_allclose(ours[name], want, rtol=0, atol=1e-7, err_msg=name)
    with open(os.path.join(out, "config.json")) as f:
        written = json.load(f)
    if model_type is None:
        assert written["model_type"] == original["model_type"]
        assert written["architectures"] == original["architectures"]
    else:
        assert written["model_type"] == original["text_config"]["model_type"] == model_type
    assert hf.model_config(written, hf.ARCHITECTURES[written["model_type"]]) == config


def check_export_refusal(imported, tmp_path) -> None:
    """A model with no equivalent (a linear mixer) is refused, and so is the fixture's config
    with one option off the checkpoint's shape, naming the option."""
    _, _, config, _ = imported
    linear = LanguageModel(
        ModelConfig(vocab_size=32, d_model=16, num_layers=1, num_heads=2, mixer="linear"),
        rngs=nnx.Rngs(0),
    )
    with pytest.raises(ValueError, match="qwen3_5_text: mixer 'linear' has no qwen3_5_text layer"):
        hf.save_pretrained(linear, str(tmp_path / "a"))
    # one option off the checkpoint's shape: the conv bias back on (Qwen), no D skip (Mamba-2)
    mixer = config.layer_mixers[0]
    option, value = OFF_SHAPE[mixer]
    options = dict(config.layer_options)
    options[mixer] = {**dict(options[mixer]), option: value}
    other = dataclasses.replace(config, layer_options=options)
    model_type = hf.export_type(config)
    problems = hf.export_problems(other, hf.ARCHITECTURES[model_type])
    problem = f"{mixer} layers: {option}={value} ({model_type} has {not value})"
    assert problems == [OFF_SHAPE_PROBLEM.get(mixer, problem).format(model_type=model_type)]
    if not config.mlp:
        with_mlp = dataclasses.replace(config, mlp=True)
        assert hf.export_problems(with_mlp, hf.ARCHITECTURES[model_type]) == [
            f"mlp=True: every {model_type} layer has no MLP"
        ]
