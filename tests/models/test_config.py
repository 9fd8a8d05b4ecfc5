"""ModelConfig: conversion of ConfigDict-style input and a ValueError naming every bad field."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_collections
import pytest

from linear_attention.models import ModelConfig

BASE = dict(vocab_size=32, d_model=16, num_layers=2, num_heads=2, max_length=16)


def test_from_config_dict_with_list_and_dtype_object():
    cd = ml_collections.ConfigDict(dict(BASE, mixer=["gated", "softmax"], dtype="bfloat16"))
    config = ModelConfig(**dict(cd))
    assert config.mixer == ("gated", "softmax") and config.layer_mixers == ("gated", "softmax")
    assert config.dtype == "bfloat16" and config.compute_dtype == jnp.bfloat16
    assert ModelConfig(**BASE, param_dtype=jnp.float32).param_dtype == "float32"
    hash(config)  # frozen and hashable: usable as static data under jit
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.d_model = 32


def test_mixer_pattern_repeats_to_num_layers():
    config = ModelConfig(**dict(BASE, num_layers=4), mixer=("gated", "softmax"))
    assert config.layer_mixers == ("gated", "softmax", "gated", "softmax")
    assert ModelConfig(**BASE, mixer="retnet").layer_mixers == ("retnet", "retnet")


def test_mixer_options_only_pass_what_a_mixer_uses():
    config = ModelConfig(
        **BASE, mixer=("favor", "softmax"), options=dict(feature_dim=8, method="scan")
    )
    assert config.mixer_options("favor")["feature_dim"] == 8
    assert config.mixer_options("favor")["method"] == "scan"
    assert "feature_dim" not in config.mixer_options("softmax")
    assert "method" not in config.mixer_options("softmax")
    delta = ModelConfig(
        **BASE, mixer=("gated_deltanet", "gated"), options=dict(allow_neg_eigval=True)
    )
    assert delta.mixer_options("gated_deltanet")["allow_neg_eigval"] is True
    assert "allow_neg_eigval" not in delta.mixer_options("gated")
    assert delta.conv is None  # each mixer's default: on for the delta rule, off for gated
    scaled = ModelConfig(**BASE, mixer=("linear", "softmax"), options=dict(feature_scale=8))
    assert scaled.options.get("feature_scale") == 8.0 and isinstance(
        scaled.options.get("feature_scale"), float
    )
    assert scaled.mixer_options("linear")["feature_scale"] == 8.0
    assert "feature_scale" not in scaled.mixer_options("softmax")
    # a common option a mixer refuses (rwkv7: conv, rope) goes to the hybrid's other layers
    shifted = ModelConfig(**BASE, mixer=("rwkv7", "softmax"), conv=4, position="rope")
    assert shifted.mixer_options("softmax")["conv"] == 4
    assert shifted.mixer_options("softmax")["rope"] is True
    assert "conv" not in shifted.mixer_options("rwkv7")
    assert "rope" not in shifted.mixer_options("rwkv7")


BAD = [
    (dict(vocab_size=0), "vocab_size"),
    (dict(d_model=15), "d_model=15 is not divisible by num_heads=2"),
    (dict(num_layers=0), "num_layers"),
    (dict(max_length=1.5), "max_length"),
    (dict(head_dim=0), "head_dim"),
    (dict(mixer="hyena"), "unknown mixer 'hyena'"),
    (dict(mixer=("gated", "softmax", "linear")), "mixer has 3 names"),
    (dict(mixer=()), "mixer has 0 names"),
    (dict(mixer=3), "mixer must be"),
    (dict(position="alibi"), "unknown position 'alibi'"),
    (dict(dtype="int8"), "dtype"),
    (dict(param_dtype="float64"), "param_dtype"),
    (
        dict(mixer="softmax", options=dict(feature_map="relu")),
        "options.feature_map='relu': no mixer of this model takes it",
    ),
    (
        dict(mixer="linear", options=dict(feature_dim=8)),
        "options.feature_dim=8: no mixer of this model takes it",
    ),
    (
        dict(mixer="taylor", options=dict(feature_scale=8.0)),
        "options.feature_scale=8.0: no mixer of this model takes it",
    ),
    (
        dict(mixer="linear", options=dict(feature_scale=-1.0)),
        "feature_scale must be a finite number > 0",
    ),
    (
        dict(mixer="linear", options=dict(feature_map="favor_plus")),
        "unknown feature_map 'favor_plus'",
    ),
    (
        dict(mixer=("favor", "linear"), options=dict(feature_map="relu", feature_dim=0)),
        "feature_dim",
    ),
    (dict(mixer="linear", redraw_interval=10), "redraw_interval=10 needs a favor layer"),
    (dict(redraw_interval=-1), "redraw_interval"),
    (dict(options=dict(method="fft")), "unknown method 'fft'"),
    (dict(options=dict(chunk_size=0)), "chunk_size"),
    (dict(conv=1), "conv must be"),
    (dict(mlp_ratio=0), "mlp_ratio"),
    (dict(options=dict(eps=0.0)), "eps"),
    (dict(position="rope", head_dim=7), "even q/k head dimension"),
    (dict(out_gate="no"), "out_gate"),
    (
        dict(mixer="linear", options=dict(allow_neg_eigval=True)),
        "options.allow_neg_eigval=True: no mixer of this model takes it",
    ),
    (
        dict(mixer="deltanet", options=dict(allow_neg_eigval="yes")),
        "allow_neg_eigval must be a bool",
    ),
    (
        dict(mixer="deltanet", options=dict(method="associative_scan")),
        "unknown method 'associative_scan'",
    ),
    (dict(reset_positions="yes"), "reset_positions must be a bool"),
    (dict(reset_positions=False), "reset_positions=False needs position 'learned' or 'rope'"),
    (
        dict(mixer="gla", options=dict(feature_map="relu")),
        "options.feature_map='relu': no mixer of this model takes it",
    ),
    (
        dict(mixer="softmax", options=dict(method="chunked")),
        r"options.method='chunked': no mixer of this model takes it \(mixers: softmax",
    ),
    (
        dict(mixer=("swa", "softmax"), options=dict(eps=1e-3)),
        r"options.eps=0.001: no mixer of this model takes it",
    ),
    (dict(mixer="rwkv7", conv=4), r"conv=4 is not used by any layer: rwkv7 takes no conv"),
    (dict(mixer="rwkv7", position="rope"), r"position='rope' is not used by any layer: rwkv7"),
]


@pytest.mark.parametrize("fields,match", BAD, ids=[m for _, m in BAD])
def test_bad_fields_raise(fields, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{**BASE, **fields})
