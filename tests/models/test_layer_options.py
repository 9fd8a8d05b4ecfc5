"""`ModelConfig.layer_options` (per-layer-type heads, dims and options) and `mlp_dim`."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_attention.models import LanguageModel, ModelConfig, step_fn

HYBRID = dict(
    vocab_size=40,
    d_model=32,
    num_layers=2,
    num_heads=2,
    mixer=("gated_deltanet", "softmax"),
    mlp_dim=24,
    layer_options={
        "softmax": {"num_heads": 4, "head_dim": 4, "num_kv_heads": 1, "rope": True},
        "gated_deltanet": {"num_value_heads": 4, "conv_bias": False},
    },
)


def test_each_layer_type_takes_its_own_heads_dims_and_rotary():
    config = ModelConfig(**HYBRID)
    assert config.layer_num_heads("softmax") == 4 and config.layer_num_heads("gated_deltanet") == 2
    model = LanguageModel(config, rngs=nnx.Rngs(0))
    gdn, attention = model.blocks[0].mixer, model.blocks[1].mixer
    # gated_deltanet: 2 q/k heads of 16 and 4 value heads of 16; no rotary, no conv bias
    assert gdn.inputs.qkv_proj.kernel.shape == (32, (2 + 2) * 16 + 4 * 16)
    assert not gdn.inputs.rope and gdn.inputs.conv.bias is None
    # softmax: 4 query heads of 4, 1 KV head, rotary on
    assert attention.inputs.qkv_proj.kernel.shape == (32, (4 + 1 + 1) * 4)
    assert attention.inputs.rope and attention.output.out_proj.kernel.shape == (16, 32)
    assert model.blocks[0].mlp.w_up.kernel.shape == (32, 24)
    tokens = jax.random.randint(jax.random.key(1), (2, 7), 0, 40)
    full = nnx.jit(lambda m, t: m(t))(model, tokens)
    state = model.init_state(2, 8)
    logits, state = nnx.jit(lambda m, t, s: m.prefill(t, s))(model, tokens[:, :3], state)
    steps, step_once = [logits], step_fn(model)
    for t in range(3, 7):
        step, state = step_once(tokens[:, t], state)
        steps.append(step[:, None])
    np.testing.assert_allclose(jnp.concatenate(steps, 1), full, rtol=1e-5, atol=1e-5)


def test_layer_options_round_trip_through_json():
    config = ModelConfig(**HYBRID)
    again = ModelConfig(**json.loads(json.dumps(dataclasses.asdict(config))))
    assert again == config and hash(again) == hash(config)
    assert config.layer_options["softmax"] == {
        "head_dim": 4,
        "num_heads": 4,
        "num_kv_heads": 1,
        "rope": True,
    }
    # config.json holds it as an object, which a run's ConfigDict reads back (and overrides)
    from linear_attention.training.cli_args import config_from_json

    written = json.loads(json.dumps(dataclasses.asdict(config)))
    assert written["layer_options"]["softmax"]["num_heads"] == 4
    section = config_from_json({"model": written})["model"].to_dict()
    assert section["layer_options"] == written["layer_options"]
    assert ModelConfig(**{**section, "mixer": config.mixer}) == config  # (mixer: "a,b" there)
    with pytest.raises(TypeError, match="cannot change"):
        config.layer_options["softmax"] = {}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(layer_options={"kda": {"num_heads": 2}}), "names mixer 'kda', which no layer uses"),
        (dict(layer_options={"softmax": {"window": 4}}), "sets window=4, which mixer 'softmax'"),
        (dict(layer_options={"softmax": {"num_heads": 0}}), "num_heads'\\] must be an integer"),
        (dict(layer_options={"softmax": {"head_dim": [4]}}), "must be a bool, number, string"),
        (dict(layer_options={"softmax": {"num_kv_heads": 3}}), "num_kv_heads=3 must divide"),
        (dict(layer_options="softmax"), "layer_options must be a mapping"),
        (dict(mlp=False), "mlp_dim=24 needs mlp=True"),
        (
            dict(layer_options={"softmax": {"norm_position": "mid"}}),
            r"unknown layer_options\['softmax'\]\['norm_position'\] 'mid'; allowed: pre, post",
        ),
        (dict(norm_position="mid"), "norm_position"),
    ],
)
def test_bad_layer_options_are_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**HYBRID, **change})


def test_norm_position_per_layer_type():
    config = ModelConfig(**{**HYBRID, "layer_options": {"softmax": {"norm_position": "post"}}})
    assert config.layer_norm_position("softmax") == "post"
    assert config.layer_norm_position("gated_deltanet") == "pre"
    model = LanguageModel(config, rngs=nnx.Rngs(0))
    assert [block.post_norm for block in model.blocks] == [False, True]


def test_defaults_unchanged_without_layer_options():
    config = ModelConfig(vocab_size=40, d_model=32, num_layers=1, num_heads=2, mixer="softmax")
    model = LanguageModel(config, rngs=nnx.Rngs(0))
    assert config.layer_options == {} and config.mlp_dim is None
    assert model.blocks[0].mlp.w_up.kernel.shape == (32, 128)
    assert model.blocks[0].mixer.inputs.q_norm is None
