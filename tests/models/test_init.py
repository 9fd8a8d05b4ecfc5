"""transformers' initialisation (`ModelConfig.initializer_range`, `models.init`): the
distributions and ranges of every parameter of a Qwen3-Next-shaped model (Gated DeltaNet and
gated attention layers, experts), a Mamba-2 one, and Kimi Linear (KDA, MLA, experts), OLMo
Hybrid (Gated DeltaNet, attention) and Bamba (Mamba-2, attention) ones, against `_init_weights`'
rules, with fixed seeds (torch's draws cannot be compared bit for bit); the importer reads the
checkpoint's `initializer_range` and export writes it back; bad values are refused."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from linear_attention.models import LanguageModel, ModelConfig, hf
from linear_attention.models.init import (
    A_MAX,
    A_MIN,
    DT_MAX,
    DT_MIN,
    KIMI_A_MAX,
    KIMI_A_MIN,
    OLMO_A_MAX,
    OLMO_A_MIN,
)

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")
R = 0.05


def params_of(config) -> dict[str, np.ndarray]:
    model = LanguageModel(config, rngs=nnx.Rngs(0))
    leaves = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    return {jax.tree_util.keystr(p, simple=True, separator="."): np.asarray(v) for p, v in leaves}


def fixture_config(name: str, **fields) -> ModelConfig:
    with open(os.path.join(FIXTURES, name, "config.json")) as f:
        given = json.load(f)
    return hf.model_config(dict(given, **fields), hf.ARCHITECTURES[given["model_type"]])


def check_normal(name, x, std):
    """Mean and std of the draws of N(0, std²) within 4.5 standard errors."""
    n = x.size
    assert abs(x.mean()) <= 4.5 * std / np.sqrt(n), name
    assert abs(x.std() / std - 1) <= 4.5 / np.sqrt(2 * n), (name, x.std())


def test_a_qwen3_next_shaped_model_initialises_as_transformers():
    config = fixture_config(
        "qwen3_next", hidden_size=64, initializer_range=R, moe_intermediate_size=32
    )
    assert config.initializer_range == R
    params = params_of(config)
    normal = [
        n for n in params if n.endswith(("kernel", "embedding")) or n.endswith(("w_gate", "w_up"))
    ]
    normal.append("blocks.0.mlp.w_down")
    assert "blocks.0.mixer.inputs.conv.kernel" in normal  # (an nn.Conv1d: N(0, r²) too)
    for name in normal:
        check_normal(name, params[name], R)
    for name, x in params.items():
        if name.endswith("scale"):  # zero-centred norms hold w = 0, i.e. scale 1
            np.testing.assert_array_equal(x, 1.0, err_msg=name)
    for i in (0, 1, 2):  # the Gated DeltaNet layers
        a = np.exp(params[f"blocks.{i}.mixer.decay.a_log"])
        assert a.min() >= A_MIN * (1 - 1e-6) and a.max() <= A_MAX * (1 + 1e-6)
        np.testing.assert_array_equal(params[f"blocks.{i}.mixer.decay.dt_bias"], 1.0)


def test_a_mamba2_model_initialises_as_transformers():
    config = fixture_config("mamba2")  # (its initializer_range: 0.1, transformers' default)
    assert config.initializer_range == 0.1
    params = params_of(config)
    for name in ("embed.embedding", "blocks.0.mixer.inputs.qkv_proj.kernel"):
        check_normal(name, params[name], 0.1)
    for i in (0, 1):
        p = {n[len(f"blocks.{i}.mixer.") :]: x for n, x in params.items() if f"{i}.mixer." in n}
        heads = p["decay.a_log"].shape[0]
        np.testing.assert_allclose(np.exp(p["decay.a_log"]), np.arange(1, heads + 1), rtol=1e-6)
        dt = np.log1p(np.exp(p["decay.dt_bias"].astype(np.float64)))  # softplus
        assert dt.min() >= DT_MIN * (1 - 1e-5) and dt.max() <= DT_MAX * (1 + 1e-5)
        np.testing.assert_array_equal(p["skip"], 1.0)
        np.testing.assert_array_equal(p["inputs.conv.bias"], 0.0)
        kernel = p["inputs.conv.kernel"]  # kaiming_uniform(a=√5): U(±1/√K)
        bound = 1 / np.sqrt(kernel.shape[0])
        assert np.abs(kernel).max() <= bound
        check_normal("conv", kernel - 0.0, bound / np.sqrt(3))  # (the uniform's std)
        out = p["output.out_proj.kernel"]
        assert np.abs(out).max() <= 1 / np.sqrt(out.shape[0])
        np.testing.assert_array_equal(p["output.norm.scale"], 1.0)


def test_a_mamba_model_initialises_as_transformers():
    """Mamba-1 (`MambaPreTrainedModel._init_weights`): in_proj, x_proj and the embedding
    N(0, r²); A_log = log n on every channel, D = 1, the dt_proj kernel U(±1/√R), its bias
    softplus⁻¹ of dt in the range; the conv (bias 0) and out_proj U(±1/√fan_in)."""
    config = ModelConfig(
        vocab_size=64, d_model=32, num_layers=1, mixer="mamba", mlp=False,
        initializer_range=R, options=dict(state_dim=8),
    )  # fmt: skip
    p = {n.removeprefix("blocks.0.mixer."): x for n, x in params_of(config).items()}
    for name in ("embed.embedding", "inputs.in_proj.kernel", "x_proj.kernel"):
        check_normal(name, p[name], R)
    np.testing.assert_allclose(np.exp(p["A_log"]), np.tile(np.arange(1, 9), (64, 1)), rtol=1e-6)
    np.testing.assert_array_equal(p["D"], 1.0)
    check_dt_bias("dt_proj.bias", p["dt_proj.bias"])
    np.testing.assert_array_equal(p["inputs.conv1d.bias"], 0.0)
    for name in ("dt_proj.kernel", "inputs.conv1d.kernel", "out_proj.kernel"):
        bound = 1 / np.sqrt(p[name].shape[0])  # R = ⌈32 / 16⌉ = 2, K = 4, E = 64
        assert np.abs(p[name]).max() <= bound, name
        check_normal(name, p[name], bound / np.sqrt(3))  # (the uniform's std)


def softplus(x):
    return np.log1p(np.exp(np.asarray(x, np.float64)))


def check_log_uniform_a(name, a_log, low, high):
    a = np.exp(a_log.astype(np.float64))
    assert a.min() >= low * (1 - 1e-6) and a.max() <= high * (1 + 1e-6), (name, a)


def check_dt_bias(name, dt_bias):
    dt = softplus(dt_bias)  # (dt's floor, 1e-4, lies below the range)
    assert dt.min() >= DT_MIN * (1 - 1e-5) and dt.max() <= DT_MAX * (1 + 1e-5), (name, dt)
    assert np.ptp(dt) > 0, name


# Each architecture's own parameters: (name ending, check of the array).
LAYER_RULES = {
    "kimi_linear": {  # KDA: A per head, dt per channel
        "decay.a_log": lambda n, x: check_log_uniform_a(n, x, KIMI_A_MIN, KIMI_A_MAX),
        "decay.dt_bias": check_dt_bias,
    },
    "olmo_hybrid": {
        "decay.a_log": lambda n, x: check_log_uniform_a(n, x, OLMO_A_MIN, OLMO_A_MAX),
        "decay.dt_bias": check_dt_bias,
    },
    "bamba": {
        "decay.a_log": lambda n, x: np.testing.assert_allclose(
            np.exp(x), np.arange(1, x.size + 1), rtol=1e-6, err_msg=n
        ),
        "decay.dt_bias": lambda n, x: np.testing.assert_array_equal(x, 1.0, err_msg=n),
        "mixer.skip": lambda n, x: np.testing.assert_array_equal(x, 1.0, err_msg=n),
    },
}


@pytest.mark.parametrize("name", sorted(LAYER_RULES))
def test_a_kimi_olmo_hybrid_or_bamba_model_initialises_as_transformers(name):
    """Every parameter: kernels, embeddings, experts and the conv (an nn.Conv1d here, also in
    Bamba) N(0, r²), biases and the score bias 0, norm scales 1, the layer's own rules."""
    config = fixture_config(name, initializer_range=R)
    assert (config.initializer_range, config.initializer) == (R, name)
    rules = LAYER_RULES[name]
    seen = set()
    for key, x in params_of(config).items():
        own = [end for end in rules if key.endswith(end)]
        if own:
            rules[own[0]](key, x)
            seen.add(own[0])
        elif key.endswith(("kernel", "embedding", "w_gate", "w_up", "w_down")):
            check_normal(key, x, R)
        elif key.endswith(("bias", "score_bias")):
            np.testing.assert_array_equal(x, 0.0, err_msg=key)
        elif key.endswith("scale"):
            np.testing.assert_array_equal(x, 1.0, err_msg=key)
        else:
            raise AssertionError(f"{key}: no rule")
    assert seen == set(rules)


def test_a_model_built_inside_a_trace_draws_to_the_same_rules():
    """Inside a trace (a jit, `nnx.eval_shape`) the draws come from JAX's sampler, not
    NumPy's: the same distributions, ranges and constants."""
    config = ModelConfig(vocab_size=64, d_model=32, num_layers=1, num_heads=2, mixer="kda",
                         mlp=False, tie_embeddings=False, initializer_range=R)  # fmt: skip
    model = nnx.jit(lambda: LanguageModel(config, rngs=nnx.Rngs(0)))()
    leaves = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    params = {jax.tree_util.keystr(p, simple=True, separator="."): np.asarray(v) for p, v in leaves}
    rules = LAYER_RULES["kimi_linear"]
    for key, x in params.items():
        own = [end for end in rules if key.endswith(end)]
        if own:
            rules[own[0]](key, x)
        elif key.endswith(("kernel", "embedding")):
            check_normal(key, x, R)
        else:
            np.testing.assert_array_equal(x, 1.0 if key.endswith("scale") else 0.0, err_msg=key)


def test_initializer_range_maps_both_ways_and_bad_values_are_refused():
    config = fixture_config("qwen3_next")
    assert config.initializer_range == 0.02
    mapping = hf.ARCHITECTURES["qwen3_next"]
    assert mapping.hf_config(config)["initializer_range"] == 0.02
    unset = dataclasses.replace(config, initializer_range=None)
    assert "initializer_range" not in mapping.hf_config(unset)
    with pytest.raises(ValueError, match="initializer_range must be"):
        ModelConfig(vocab_size=30, mixer="softmax", initializer_range=0.0)
    with pytest.raises(ValueError, match="initializer_range=0.02 sets transformers'.*not linear"):
        ModelConfig(vocab_size=30, mixer="linear", initializer_range=0.02)
    unknown = r"unknown initializer .mamba3. \(did you mean .mamba.\?\); allowed: qwen3_5, mamba2"
    with pytest.raises(ValueError, match=unknown):
        ModelConfig(vocab_size=30, mixer="gated", initializer_range=0.02, initializer="mamba3")
    with pytest.raises(ValueError, match="initializer='bamba' needs initializer_range"):
        ModelConfig(vocab_size=30, mixer="gated", initializer="bamba")
    with pytest.raises(
        ValueError, match="initializer='bamba' initialises gated, softmax .*not kda"
    ):
        ModelConfig(vocab_size=30, mixer="kda", initializer_range=0.02, initializer="bamba")


@pytest.mark.parametrize("name", sorted(LAYER_RULES))
def test_the_architecture_is_mapped_both_ways_and_another_refused_on_export(name):
    config = fixture_config(name)
    assert (config.initializer_range, config.initializer) == (0.02, name)
    mapping = hf.ARCHITECTURES[name]
    assert mapping.hf_config(config)["initializer_range"] == 0.02
    unset = dataclasses.replace(config, initializer=None)  # (the mixers' default: the same)
    assert mapping.hf_config(unset)["initializer_range"] == 0.02
    # (another architecture with these layers' mixers: only OLMo Hybrid's are Qwen3.5's too)
    other = {"olmo_hybrid": "qwen3_5"}.get(name)
    if other is not None:
        with pytest.raises(ValueError, match=f"initializer='{other}': a {name} checkpoint"):
            mapping.hf_config(dataclasses.replace(config, initializer=other))


def test_olmo_hybrid_initialisation_ranges_other_than_the_drawn_ones_are_refused():
    with pytest.raises(ValueError, match="linear_dt_min=0.01 is not supported"):
        fixture_config("olmo_hybrid", linear_dt_min=0.01)


@pytest.mark.hf
@pytest.mark.parametrize(
    "name",
    ["qwen3_next", "mamba2", "kimi_linear", "olmo_hybrid", "bamba", "mamba", "falcon_mamba"],
)
def test_every_parameter_draws_as_transformers_draws_it(name, tmp_path):
    """transformers' own initialisation of the fixture's architecture (`from_config`, saved and
    read back by `hf.from_pretrained`), against this library's: each constant parameter equal,
    each drawn one (64 values or more) with the same spread and centre (within 4.5 standard
    errors)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    folder = os.path.join(FIXTURES, name)
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(folder)
    )
    reference.save_pretrained(tmp_path)
    loaded, config = hf.from_pretrained(str(tmp_path))
    theirs = nnx.to_pure_dict(nnx.state(loaded, nnx.Param))
    ours = params_of(config)
    leaves = jax.tree_util.tree_leaves_with_path(theirs)
    assert len(leaves) == len(ours)
    for path, want in leaves:
        key = jax.tree_util.keystr(path, simple=True, separator=".")
        got, want = ours[key], np.asarray(want, np.float64)
        if np.ptp(want) == 0:
            np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=key)
        elif want.size >= 64:  # (two samples of n: 4.5 standard errors of their difference)
            spread = 4.5 * np.sqrt(1 / want.size)
            assert abs(np.log(got.std() / want.std())) <= spread, (key, got.std(), want.std())
            assert abs(got.mean() - want.mean()) <= spread * np.sqrt(2) * want.std(), key
