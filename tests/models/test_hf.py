"""Hugging Face checkpoints in and out (`models.hf`, `la-convert`), against the committed
fixtures of `tests/fixtures/make_hf_fixtures.py`: transformers' own logits and greedy tokens.

The default run needs only safetensors (no torch, no transformers). `-m hf` regenerates the
fixtures with transformers and compares live, both ways. The import and export checks of
Qwen3.5 (dense and multimodal), Mamba-2 and Bamba are here, the other fixtures' in
tests/models/test_hf_checkpoints.py (the checks themselves in tests/models/_hf_cases.py)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from linear_attention.models import LanguageModel, hf
from linear_attention.training import convert
from linear_attention.training.cli_args import load_config_file
from linear_attention.training.config import experiment_config
from linear_attention.training.load import load_run
from linear_attention.training.trainer import initialize_from, train
from linear_attention.training.workdir import RunError
from tests.models import _hf_cases
from tests.models._hf_cases import (
    ARCHITECTURES,
    FIXTURES,
    IN_TEST_HF,
    TEXT_TYPES,
    check_against_reference,
    full_pass,
    fused_convs,
    relative_error,
    tensors,
)


@pytest.fixture(scope="module", params=IN_TEST_HF)
def imported(request):
    return _hf_cases.imported(request.param)


def test_import_matches_transformers(imported):
    _hf_cases.check_import(imported)


def test_export_gives_back_the_checkpoint(imported, tmp_path):
    _hf_cases.check_export(imported, tmp_path)


def test_export_refuses_a_model_without_an_equivalent(imported, tmp_path):
    _hf_cases.check_export_refusal(imported, tmp_path)


@pytest.mark.parametrize(("name", "model_type"), [("qwen3_next", None), ("qwen3_5_moe", "text")])
def test_router_aux_loss_maps_both_ways(name, model_type):
    """`router_aux_loss_coef` is the training loss's weight when `output_router_logits` is true
    (transformers adds the loss then only), else 0; export writes it back."""
    with open(os.path.join(FIXTURES, name, "config.json")) as f:
        fixture = json.load(f)
    if model_type:  # (the multimodal fixture's text model)
        fixture = fixture["text_config"]
    mapping = hf.ARCHITECTURES[fixture["model_type"]]
    for output, coef, want in ((False, 0.02, 0.0), (True, 0.02, 0.02), (True, 0.0, 0.0)):
        given = dict(fixture, output_router_logits=output, router_aux_loss_coef=coef)
        config = hf.model_config(given, mapping)
        assert config.moe_aux_loss_coef == want
        written = mapping.hf_config(config)
        assert written["output_router_logits"] == (want > 0)
        assert hf.model_config(written, mapping) == config
        if want:
            assert written["router_aux_loss_coef"] == coef
    with pytest.raises(ValueError, match="moe_aux_loss_coef must be"):
        hf.model_config(
            dict(fixture, output_router_logits=True, router_aux_loss_coef=-1.0), mapping
        )


@pytest.mark.parametrize("name", ["qwen3_5_vl", "qwen3_5_moe"])
def test_multimodal_leaves_out_the_vision_tower_by_rule(name, tmp_path):
    """A multimodal folder imports as its text model: the vision tower's tensors are named by
    `not_imported`, and export as the multimodal type is refused with the reason."""
    folder = os.path.join(FIXTURES, name)
    visual = sum(n.startswith("model.visual.") for n in tensors(folder))
    assert visual > 0
    assert hf.not_imported(folder) == [
        f"model.visual.* ({visual} tensors): the vision tower (this library's model reads "
        "tokens only)"
    ]
    assert hf.not_imported(os.path.join(FIXTURES, "qwen3_5")) == []
    model_type = json.load(open(os.path.join(folder, "config.json")))["model_type"]
    config = hf.model_config(*hf.read_config(folder))
    model = nnx.eval_shape(lambda: LanguageModel(config, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=f"{model_type}: {model_type} is the multimodal .*vision"):
        hf.save_pretrained(model, str(tmp_path / "out"), model_type=model_type)


def _fuse_experts(values: dict) -> None:
    """The released Qwen3.5-MoE layout: each layer's experts as `experts.gate_up_proj`
    [E, 2·I, D] (gate rows, then up rows) and `experts.down_proj` [E, D, I]."""
    for name in [n for n in values if n.endswith("mlp.experts.0.gate_proj.weight")]:
        prefix = name[: -len("0.gate_proj.weight")]
        count = sum(n.startswith(prefix) and n.endswith(".down_proj.weight") for n in values)
        parts = {
            part: np.stack([values.pop(f"{prefix}{e}.{part}.weight") for e in range(count)])
            for part in ("gate_proj", "up_proj", "down_proj")
        }
        values[prefix + "gate_up_proj"] = np.concatenate(
            [parts["gate_proj"], parts["up_proj"]], axis=1
        )
        values[prefix + "down_proj"] = parts["down_proj"]


def test_fused_experts_import_as_the_per_expert_ones(tmp_path):
    folder = _copy(tmp_path, "qwen3_5_moe")
    _edit_tensors(folder, _fuse_experts)
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in tensors(folder)
    fused, _ = hf.from_pretrained(folder)
    unfused, _ = hf.from_pretrained(os.path.join(FIXTURES, "qwen3_5_moe"))
    ours = nnx.to_pure_dict(nnx.state(fused, nnx.Param))
    theirs = nnx.to_pure_dict(nnx.state(unfused, nnx.Param))
    for (path, a), (_, b) in zip(
        jax.tree_util.tree_leaves_with_path(ours),
        jax.tree_util.tree_leaves_with_path(theirs),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
    _edit_tensors(
        folder,
        lambda t: t.update(
            {"model.language_model.layers.0.mlp.experts.gate_up_proj": np.zeros((4, 31, 32))}
        ),
    )
    with pytest.raises(ValueError, match=r"experts.gate_up_proj' has shape \(4, 31, 32\)"):
        hf.from_pretrained(folder)


def _copy(tmp_path, name="qwen3_5"):
    folder = str(tmp_path / name)
    shutil.copytree(os.path.join(FIXTURES, name), folder)
    return folder


def _edit_config(folder, change):
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        values = json.load(f)
    change(values)
    with open(path, "w") as f:
        json.dump(values, f)


def _edit_tensors(folder, change):
    values = tensors(folder)
    change(values)
    save_file(values, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("config_change", "tensor_change", "message"),
    [
        (lambda c: c.update(model_type="llama"), None, "unsupported model_type 'llama'"),
        (lambda c: c.update(sliding_window=8), None, "config field 'sliding_window' is not under"),
        (lambda c: c.update(hidden_act="gelu"), None, "hidden_act='gelu' is not supported"),
        (lambda c: c.pop("linear_num_value_heads"), None, "'linear_num_value_heads' is missing"),
        (
            lambda c: c["rope_parameters"].update(rope_type="yarn"),
            None,
            "rope_type='yarn' is not supported",
        ),
        (
            lambda c: c.update(layer_types=["linear_attention"] * 3 + ["sliding_attention"]),
            None,
            "layer type 'sliding_attention' is not supported",
        ),
        (None, lambda t: t.pop("model.layers.1.linear_attn.A_log"), "'model.layers.1.linear_attn"),
        (
            None,
            lambda t: t.update({"model.norm.weight": np.zeros(31, np.float32)}),
            r"'model.norm.weight' has shape \(31,\), expected \(32,\)",
        ),
        (
            None,
            lambda t: t.update({"model.extra.weight": np.zeros(3, np.float32)}),
            "'model.extra.weight' is not part of the architecture",
        ),
    ],
)
def test_bad_checkpoints_refused_before_any_weight_is_read(
    tmp_path, monkeypatch, config_change, tensor_change, message
):
    folder = _copy(tmp_path)
    _refused_before_reading(folder, monkeypatch, config_change, tensor_change, message)


@pytest.mark.parametrize(
    ("config_change", "tensor_change", "message"),
    [
        (lambda c: c.update(use_bias=True), None, "use_bias=True is not supported"),
        (
            lambda c: c.update(time_step_limit=[0.0, 10.0]),
            None,
            r"time_step_limit=\[0.0, 10.0\] is not supported",
        ),
        (lambda c: c.update(n_groups=3), None, "n_groups=3 must divide num_heads=8"),
        (lambda c: c.update(expand=3), None, "expand=3 · hidden_size=32 differs from"),
        (lambda c: c.update(norm_before_gate=True), None, "field 'norm_before_gate' is not"),
        (
            None,
            lambda t: t.pop("backbone.layers.1.mixer.D"),
            "'backbone.layers.1.mixer.D' is missing",
        ),
    ],
)
def test_bad_mamba2_checkpoints_refused(
    tmp_path, monkeypatch, config_change, tensor_change, message
):
    folder = _copy(tmp_path, "mamba2")
    _refused_before_reading(folder, monkeypatch, config_change, tensor_change, message)


@pytest.mark.parametrize(
    ("config_change", "tensor_change", "message"),
    [
        (
            lambda c: c["text_config"].update(sliding_window=8),
            None,
            "text_config: config field 'sliding_window' is not under",
        ),
        (lambda c: c.update(audio_config={}), None, "config field 'audio_config' is not under"),
        (
            lambda c: c["text_config"].update(model_type="qwen3_5_text"),
            None,
            "text_config.model_type='qwen3_5_text' is not supported",
        ),
        (
            lambda c: c.update(tie_word_embeddings=False),
            None,
            "tie_word_embeddings=False differs from text_config.tie_word_embeddings=True",
        ),
        (
            None,
            lambda t: t.update({"model.norm.weight": np.zeros(32, np.float32)}),
            "'model.norm.weight' is not part of the architecture",
        ),
        (
            None,
            lambda t: t.pop("model.language_model.layers.0.mlp.experts.3.up_proj.weight"),
            r"'model.language_model.layers.0.mlp.experts.3.up_proj.weight' is missing",
        ),
    ],
)
def test_bad_multimodal_checkpoints_refused(
    tmp_path, monkeypatch, config_change, tensor_change, message
):
    folder = _copy(tmp_path, "qwen3_5_moe")
    _refused_before_reading(folder, monkeypatch, config_change, tensor_change, message)


@pytest.mark.parametrize(
    ("config_change", "tensor_change", "message"),
    [
        (lambda c: c.update(sliding_window=8), None, "config field 'sliding_window' is not un"),
        (lambda c: c.update(num_key_value_heads=1), None, "num_key_value_heads=1 differs from"),
        (lambda c: c.update(attention_bias=True), None, "attention_bias=True is not supported"),
        (
            lambda c: c.update(mlp_layer_types=["sparse", "dense", "sparse", "sparse"]),
            None,
            "only dense layers first, then sparse",
        ),
        (lambda c: c.update(num_expert_group=4), None, "moe_groups=4 must divide num_experts=6"),
        (lambda c: c.update(n_group=1), None, "n_group=1 differs from num_expert_group=2"),
        (lambda c: c.update(qk_head_dim=16), None, "qk_head_dim=16 differs from the 12"),
        (lambda c: c.pop("kv_lora_rank"), None, "'kv_lora_rank' is missing"),
        (
            None,
            lambda t: t.pop("model.layers.1.block_sparse_moe.gate.e_score_correction_bias"),
            "'model.layers.1.block_sparse_moe.gate.e_score_correction_bias' is missing",
        ),
        (
            None,
            lambda t: t.update({"model.layers.1.self_attn.kv_b_proj.weight": np.zeros((32, 15))}),
            r"kv_b_proj.weight' has shape \(32, 15\), expected \(32, 16\)",
        ),
    ],
)
def test_bad_kimi_linear_checkpoints_refused(
    tmp_path, monkeypatch, config_change, tensor_change, message
):
    folder = _copy(tmp_path, "kimi_linear")
    _refused_before_reading(folder, monkeypatch, config_change, tensor_change, message)


def _released_form(config: dict) -> None:
    """A saved Kimi Linear config.json rewritten in the released (remote-code) form: the KDA
    sizes and the layer lists (1-based) under `linear_attn_config`, `first_k_dense_replace`,
    the remote code's `head_dim` (hidden / heads) and the fields transformers does not read."""
    kinds = config.pop("layer_types")
    config["linear_attn_config"] = {
        "head_dim": config.pop("linear_head_dim"),
        "num_heads": config.pop("linear_num_heads"),
        "short_conv_kernel_size": config.pop("linear_conv_kernel_dim"),
        "full_attn_layers": [i + 1 for i, k in enumerate(kinds) if k == "full_attention"],
        "kda_layers": [i + 1 for i, k in enumerate(kinds) if k == "linear_attention"],
    }
    config["first_k_dense_replace"] = config.pop("mlp_layer_types").count("dense")
    del config["qk_head_dim"]
    config.update(
        head_dim=config["hidden_size"] // config["num_attention_heads"],
        mla_use_nope=True,
        moe_router_activation_func="sigmoid",
        moe_layer_freq=1,
        use_grouped_topk=True,
        num_nextn_predict_layers=0,
        rope_theta=10000.0,
        rope_scaling=None,
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (None, None),
        (lambda c: c.update(mla_use_nope=False), "mla_use_nope=False is not supported"),
        (lambda c: c.update(moe_router_activation_func="softmax"), "func='softmax' is not sup"),
        (lambda c: c["linear_attn_config"].update(chunk=4), "'linear_attn_config.chunk' is not"),
        (lambda c: c["linear_attn_config"].update(kda_layers=[1]), "gives layer 3 no type"),
    ],
)
def test_released_kimi_linear_config_reads_as_transformers_reads_it(tmp_path, change, message):
    folder = _copy(tmp_path, "kimi_linear")
    _edit_config(folder, _released_form)
    if change is None:
        saved = hf.model_config(*hf.read_config(os.path.join(FIXTURES, "kimi_linear")))
        assert hf.model_config(*hf.read_config(folder)) == saved
        return
    _edit_config(folder, change)
    with pytest.raises(ValueError, match=message):
        hf.model_config(*hf.read_config(folder))


@pytest.mark.parametrize(
    ("config_change", "tensor_change", "message"),
    [
        (lambda c: c.update(rope_parameters=None), None, "rope_parameters=None is not supported"),
        (
            lambda c: c["rope_parameters"].update(partial_rotary_factor=0.5),
            None,
            "field 'rope_parameters.partial_rotary_factor' is not understood",
        ),
        (lambda c: c.update(attention_bias=True), None, "attention_bias=True is not supported"),
        (lambda c: c.update(rms_norm_eps=1e-5), None, "rms_norm_eps=1e-05 is not supported"),
        (lambda c: c.update(sliding_window=8), None, "field 'sliding_window' is not understood"),
        (
            lambda c: c.update(layer_types=["linear_attention"] * 3),
            None,
            "layer_types has no 'full_attention' layer",
        ),
        (
            None,
            lambda t: t.update({"model.layers.0.input_layernorm.weight": np.ones(32, np.float32)}),
            "'model.layers.0.input_layernorm.weight' and 'model.layers.0.attention_layer_norm",
        ),
        (
            None,
            lambda t: t.update(
                {"model.layers.2.linear_attn.v_conv1d.weight": np.ones((31, 1, 4), np.float32)}
            ),
            r"convs of model.layers.2.linear_attn.\* hold 95 channels; .* 16 \+ 16 \+ 64 = 96",
        ),
        (
            None,
            lambda t: t.pop("model.layers.1.post_feedforward_layernorm.weight"),
            "'model.layers.1.post_feedforward_layernorm.weight' is missing",
        ),
    ],
)
def test_bad_olmo_hybrid_checkpoints_refused(
    tmp_path, monkeypatch, config_change, tensor_change, message
):
    folder = _copy(tmp_path, "olmo_hybrid")
    _refused_before_reading(folder, monkeypatch, config_change, tensor_change, message)


@pytest.mark.parametrize(
    ("config_change", "tensor_change", "message"),
    [
        (lambda c: c.update(mamba_proj_bias=True), None, "mamba_proj_bias=True is not supported"),
        (lambda c: c.update(mlp_bias=True), None, "mlp_bias=True is not supported"),
        (
            lambda c: c["rope_parameters"].update(partial_rotary_factor=0.25),
            None,
            "partial_rotary_factor=0.25 is not supported",
        ),
        (
            lambda c: c.update(time_step_limit=[0.0, 10.0]),
            None,
            r"time_step_limit=\[0.0, 10.0\] is not supported",
        ),
        (lambda c: c.update(mamba_n_groups=3), None, "mamba_n_groups=3 must divide mamba_n_heads"),
        (lambda c: c.update(attn_layer_indices=[5]), None, "attn_layer_indices has 5, not a"),
        (lambda c: c.update(sliding_window=8), None, "field 'sliding_window' is not understood"),
        (
            None,
            lambda t: t.pop("model.layers.2.mamba.D"),
            "'model.layers.2.mamba.D' is missing",
        ),
        (
            None,
            lambda t: t.update({"model.layers.1.mamba.D": np.ones(8, np.float32)}),
            "'model.layers.1.mamba.D' is not part of the architecture",
        ),
    ],
)
def test_bad_bamba_checkpoints_refused(
    tmp_path, monkeypatch, config_change, tensor_change, message
):
    folder = _copy(tmp_path, "bamba")
    _refused_before_reading(folder, monkeypatch, config_change, tensor_change, message)


def _module_names(values: dict) -> None:
    """OLMo Hybrid's tensors under transformers' module names: `input_layernorm`,
    `post_attention_layernorm` and one fused `linear_attn.conv1d` per layer."""
    for name in list(values):
        for stored, module in (
            ("attention_layer_norm", "input_layernorm"),
            ("feedforward_layer_norm", "post_attention_layernorm"),
        ):
            if name.endswith(f".{stored}.weight"):
                values[name.replace(stored, module)] = values.pop(name)
    values.update(fused_convs({n: values.pop(n) for n in list(values) if "conv1d" in n}))
    for name in [n for n in values if n.endswith("linear_attn.conv1d")]:
        values[name + ".weight"] = values.pop(name)


@pytest.mark.parametrize(
    ("config_change", "tensor_change", "message"),
    [
        (lambda c: c.update(use_bias=True), None, "use_bias=True is not supported"),
        (lambda c: c.update(hidden_act="gelu"), None, "hidden_act='gelu' is not supported"),
        (lambda c: c.update(intermediate_size=48), None, "intermediate_size=48 differs from"),
        (lambda c: c.update(time_step_rank=0.5), None, "time_step_rank=0.5 is not a positive"),
        (lambda c: c.update(mixer_rms_eps=1e-6), None, "'mixer_rms_eps' is not understood by"),
        (lambda c: c.pop("state_size"), None, "'state_size' is missing"),
        (
            None,
            lambda t: t.pop("backbone.layers.1.mixer.x_proj.weight"),
            "'backbone.layers.1.mixer.x_proj.weight' is missing",
        ),
        (
            lambda c: c.update(use_conv_bias=False),
            None,
            "'backbone.layers.0.mixer.conv1d.bias' is not part of the architecture",
        ),
    ],
)
def test_bad_mamba_checkpoints_refused(
    tmp_path, monkeypatch, config_change, tensor_change, message
):
    folder = _copy(tmp_path, "mamba")
    _refused_before_reading(folder, monkeypatch, config_change, tensor_change, message)


def test_falcon_mamba_maps_its_norms_both_ways(tmp_path, monkeypatch):
    """Falcon-Mamba's `mixer_rms_eps` is the mixer's `bcdt_norm_eps`: a Mamba-1 model with the
    norms exports as falcon_mamba (as mamba it is refused, naming the option), one without
    them as mamba (as falcon_mamba it is refused); a falcon_mamba config without a positive
    `mixer_rms_eps` is refused."""
    falcon = hf.model_config(*hf.read_config(os.path.join(FIXTURES, "falcon_mamba")))
    mamba = hf.model_config(*hf.read_config(os.path.join(FIXTURES, "mamba")))
    assert falcon.mixer_config("mamba").bcdt_norm_eps == 1e-3
    assert (hf.export_type(falcon), hf.export_type(mamba)) == ("falcon_mamba", "mamba")
    assert hf.export_problems(falcon, hf.ARCHITECTURES["mamba"]) == [
        "mamba layers: bcdt_norm_eps=0.001 (mamba has None)"
    ]
    assert hf.export_problems(mamba, hf.ARCHITECTURES["falcon_mamba"]) == [
        "mixer_rms_eps=None is not a positive number (the mamba mixer's bcdt_norm_eps)"
    ]
    folder = _copy(tmp_path, "falcon_mamba")
    message = "mixer_rms_eps=0 is not a positive number"
    _refused_before_reading(folder, monkeypatch, lambda c: c.update(mixer_rms_eps=0), None, message)


def test_mamba_export_ignores_num_heads_which_its_layers_do_not_read():
    """A Mamba-1 model's `num_heads` (not read by the mamba mixer) does not stop its export;
    the same model with the norms of δ, B and C is refused as mamba, naming the option."""
    config = hf.model_config(*hf.read_config(os.path.join(FIXTURES, "mamba")))
    four = dataclasses.replace(config, num_heads=4)
    assert hf.export_problems(four, hf.ARCHITECTURES["mamba"]) == []
    options = {"mamba": {**config.layer_options["mamba"], "bcdt_norm_eps": 1e-5}}
    normed = dataclasses.replace(four, layer_options=options)
    assert hf.export_problems(normed, hf.ARCHITECTURES["mamba"]) == [
        "mamba layers: bcdt_norm_eps=1e-05 (mamba has None)"
    ]


def test_mamba_lists_its_initialisation_fields_when_not_the_defaults(tmp_path):
    """Mamba's `time_step_*` fields set only the initialisation: read and left alone, each
    value other than transformers' default listed by `not_imported` (the fixture has none);
    `time_step_rank` "auto" is transformers' ⌈hidden_size / 16⌉."""
    assert hf.not_imported(os.path.join(FIXTURES, "mamba")) == []
    folder = _copy(tmp_path, "mamba")
    _edit_config(folder, lambda c: c.update(time_step_max=0.2, time_step_init_scheme="constant"))
    assert hf.not_imported(folder) == [
        "config field time_step_max=0.2: initialisation only (this library initialises with "
        "transformers' default 0.1)",
        "config field time_step_init_scheme='constant': initialisation only (this library "
        "initialises with transformers' default 'random')",
    ]
    _edit_config(folder, lambda c: c.update(hidden_size=48, intermediate_size=96))
    hf_config, mapping = hf.read_config(folder)
    auto = hf.model_config({**hf_config, "time_step_rank": "auto"}, mapping)
    assert auto.mixer_config("mamba").dt_rank is None  # (⌈48 / 16⌉ = 3, the default)
    assert hf.model_config({**hf_config, "time_step_rank": 3}, mapping) == auto


def test_olmo_hybrid_module_names_import_as_the_stored_ones(tmp_path):
    """The modules' own names (and a fused conv) give the same parameters as the stored names
    (and the three convs, split by transformers' save_pretrained at other channels)."""
    folder = _copy(tmp_path, "olmo_hybrid")
    _edit_tensors(folder, _module_names)
    assert "model.layers.1.post_attention_layernorm.weight" in tensors(folder)
    renamed, _ = hf.from_pretrained(folder)
    stored, _ = hf.from_pretrained(os.path.join(FIXTURES, "olmo_hybrid"))
    ours = nnx.to_pure_dict(nnx.state(renamed, nnx.Param))
    theirs = nnx.to_pure_dict(nnx.state(stored, nnx.Param))
    for (path, a), (_, b) in zip(
        jax.tree_util.tree_leaves_with_path(ours),
        jax.tree_util.tree_leaves_with_path(theirs),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def _refused_before_reading(folder, monkeypatch, config_change, tensor_change, message):
    if config_change is not None:
        _edit_config(folder, config_change)
    if tensor_change is not None:
        _edit_tensors(folder, tensor_change)
    monkeypatch.setattr(hf, "_reader", lambda *args: pytest.fail("a weight was read"))
    with pytest.raises(ValueError, match=message):
        hf.from_pretrained(folder)


def test_not_a_checkpoint_folder(tmp_path):
    with pytest.raises(ValueError, match="is not a folder"):
        hf.from_pretrained(str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match="holds no config.json"):
        hf.from_pretrained(str(tmp_path))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """`la-convert --from-hf` of the qwen3_5 fixture, run in a subprocess where torch and
    transformers cannot be imported (as in CI): the workdir."""
    folder = os.path.join(FIXTURES, "qwen3_5")
    workdir = str(tmp_path_factory.mktemp("converted") / "run")
    script = (
        "import sys; sys.modules.update(torch=None, transformers=None); "
        "from linear_attention.training import convert; "
        f"sys.exit(convert.main(['--from-hf', {folder!r}, '--workdir', {workdir!r}]))"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    return workdir


def test_convert_workdir_round_trip(converted, tmp_path, capsys):
    """The converted run's checkpoint gives transformers' logits; `--to-hf` gives the
    checkpoint's tensors and tokenizer back; `--model-type qwen3_5` (multimodal) is refused
    with the reason."""
    folder, out = os.path.join(FIXTURES, "qwen3_5"), str(tmp_path / "out")
    assert sorted(os.listdir(converted)) == [
        "checkpoints",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
    ]
    model, config = load_run(converted)
    assert config.data.tokenizer == os.path.join(converted, "tokenizer.json")
    reference = np.load(os.path.join(folder, "reference.npz"))
    logits = full_pass(model, jnp.asarray(reference["tokens"]))
    assert relative_error(logits, reference["logits"]) <= 1e-4
    assert convert.main(["--to-hf", converted, out]) == 0
    theirs, ours = tensors(folder), tensors(out)
    for name, want in theirs.items():
        np.testing.assert_allclose(ours[name], want, rtol=0, atol=1e-7, err_msg=name)
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))
    refused = ["--to-hf", converted, str(tmp_path / "vl"), "--model-type", "qwen3_5"]
    assert convert.main(refused) == 2
    assert "qwen3_5 is the multimodal checkpoint" in capsys.readouterr().err


def test_init_from_takes_the_converted_parameters(converted):
    """`config.train.init_from`: a model of the same config starts from the run's parameters;
    one of another shape is refused, naming the parameter."""
    _, config = load_run(converted)
    fresh = LanguageModel(config.model, rngs=nnx.Rngs(7))
    initialize_from(fresh, converted)
    reference = np.load(os.path.join(FIXTURES, "qwen3_5", "reference.npz"))
    logits = full_pass(fresh, jnp.asarray(reference["tokens"]))
    assert relative_error(logits, reference["logits"]) <= 1e-4
    narrower = dataclasses.replace(config.model, mlp_dim=40)
    message = r"parameter .*mlp.* is of shape .*48.*this model's is .*40"
    with pytest.raises(RunError, match=message):
        initialize_from(LanguageModel(narrower, rngs=nnx.Rngs(0)), converted)


def test_a_converted_config_json_trains_from_its_checkpoint(converted):
    """`la-train --config W/config.json --config.train.init_from=W` reads the run's config as
    a config file; init_from must name a run."""
    config = load_config_file(os.path.join(converted, "config.json"))
    config.train.init_from = converted
    assert experiment_config(config).model == load_run(converted)[1].model
    config.train.init_from = os.path.dirname(converted)
    with pytest.raises(ValueError, match="train.init_from.* is not a run workdir"):
        experiment_config(config)


@pytest.mark.slow
def test_fine_tune_a_converted_run(converted, tmp_path):
    """`la-train` with `config.train.init_from`: two steps of fine-tuning from the converted
    checkpoint on the built-in corpus, then `la-convert --to-hf` of the result."""
    values = json.loads(open(os.path.join(converted, "config.json")).read())
    values["train"].update(init_from=converted, num_steps=2, batch_size=2, eval_every=2)
    values["train"].update(checkpoint_every=2, log_every=1, eval_batch_size=2)
    values["data"].update(seq_len=16, max_bytes=20000, num_val_windows=2)
    summary = train(values, str(tmp_path / "tuned"))
    assert np.isfinite(summary["eval/loss"])
    assert convert.main(["--to-hf", str(tmp_path / "tuned"), str(tmp_path / "out")]) == 0
    assert sorted(os.listdir(tmp_path / "out")) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
    ]


@pytest.mark.slow
def test_fine_tune_a_converted_mamba(tmp_path):
    """Mamba through la-convert and la-train: `--from-hf`, 3 steps from its parameters
    (`config.train.init_from`) that resume from the step-2 checkpoint and evaluate, and
    `--to-hf --model-type mamba` of the result, which imports as the fine-tuned model."""
    run, tuned = str(tmp_path / "run"), str(tmp_path / "tuned")
    assert convert.main(["--from-hf", os.path.join(FIXTURES, "mamba"), "--workdir", run]) == 0
    values = json.loads(open(os.path.join(run, "config.json")).read())
    values["train"].update(init_from=run, num_steps=2, batch_size=2, eval_every=3)
    values["train"].update(checkpoint_every=1, log_every=1, eval_batch_size=2)
    values["data"].update(seq_len=16, max_bytes=20000, num_val_windows=2)
    train(values, tuned)
    values["train"].update(num_steps=3)
    summary = train(values, tuned)  # resumes its own step-2 checkpoint
    assert (summary["step"], summary["resumed_from_step"]) == (3, 2)
    assert np.isfinite(summary["eval/loss"])
    out = str(tmp_path / "out")
    assert convert.main(["--to-hf", tuned, out, "--model-type", "mamba"]) == 0
    model, _ = load_run(tuned)
    exported, _ = hf.from_pretrained(out)
    tokens = jnp.asarray(np.load(os.path.join(FIXTURES, "mamba", "reference.npz"))["tokens"])
    np.testing.assert_array_equal(full_pass(exported, tokens), full_pass(model, tokens))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "give one of --from-hf or --to-hf"),
        (["--from-hf", "x"], "--from-hf needs --workdir W"),
        (["--from-hf", "/nonexistent", "--workdir", "W"], "is not a folder"),
        (["--to-hf", "/nonexistent", "OUT"], "holds no run"),
        (["--from-hf", "x", "--workdir", "W", "--bogus"], "unknown arguments --bogus"),
        (["--to-hf", "W", "OUT", "--model-type", "llama"], "--model-type 'llama': it goes with"),
        (["--from-hf", "x", "--workdir", "W", "--model-type", "qwen3_5_text"], "goes with --to-hf"),
    ],
)
def test_convert_bad_input_exits_2(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert convert.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("la-convert: error: ") and message in err


def test_convert_prints_what_is_not_imported(capsys, tmp_path, monkeypatch):
    """`--from-hf` of a multimodal folder says that the vision tower is left out (the writing
    of the workdir, tested above, is skipped here)."""
    monkeypatch.setattr(convert, "from_hf", lambda path, workdir, **options: None)
    folder = os.path.join(FIXTURES, "qwen3_5_vl")
    assert convert.main(["--from-hf", folder, "--workdir", str(tmp_path / "w")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:] == [f"not imported: {line}" for line in hf.not_imported(folder)]
    assert lines[1].startswith("not imported: model.visual.* (21 tensors): the vision tower")


def test_convert_refuses_an_existing_run(capsys, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    folder = os.path.join(FIXTURES, "qwen3_5")
    assert convert.main(["--from-hf", folder, "--workdir", str(tmp_path)]) == 2
    assert "exists and is not an empty folder" in capsys.readouterr().err


# ------------------------------------------------------------------ live (-m hf)
@pytest.mark.hf
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_live_against_transformers_both_ways(name, tmp_path):
    """Fresh fixtures from transformers, imported here; and this library's export (a
    multimodal fixture's text model as its text type) loaded by
    `AutoModelForCausalLM.from_pretrained` with equal logits."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "fixtures"))
    import make_hf_fixtures

    folder = make_hf_fixtures.build(name, str(tmp_path / "fresh"), seed=3)
    reference = dict(np.load(os.path.join(folder, "reference.npz")))
    model, _ = hf.from_pretrained(folder)
    check_against_reference(model, reference)
    out = hf.save_pretrained(model, str(tmp_path / "export"), model_type=TEXT_TYPES.get(name))
    folders = [out]
    if name == "qwen3_5_moe":  # the released layout: transformers reads it as we do
        _edit_tensors(folder, _fuse_experts)
        folders.append(folder)
    if name == "kimi_linear":  # the released config.json: transformers reads it as we do
        _edit_config(folder, _released_form)
        assert hf.model_config(*hf.read_config(folder)) == hf.model_config(*hf.read_config(out))
        folders.append(folder)
    for checkpoint in folders:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        with torch.no_grad():
            logits = loaded.eval()(torch.tensor(reference["tokens"]).long()).logits.numpy()
        assert relative_error(logits, reference["logits"]) <= 1e-5


@pytest.mark.hf
def test_live_kimi_linear_with_a_low_rank_query(tmp_path, monkeypatch):
    """Kimi Linear's MLA with `q_lora_rank` (q_a_proj, q_a_layernorm, q_b_proj; the released
    model has none, so the fixture neither): imported against transformers, and exported."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "fixtures"))
    import make_hf_fixtures

    def config():
        released = make_hf_fixtures.kimi_linear_config()
        return type(released)(**{**released.to_dict(), "q_lora_rank": 12})

    monkeypatch.setitem(make_hf_fixtures.ARCHITECTURES, "kimi_linear_q", config)
    folder = make_hf_fixtures.build("kimi_linear_q", str(tmp_path / "fresh"), seed=4)
    assert "model.layers.1.self_attn.q_a_layernorm.weight" in tensors(folder)
    reference = dict(np.load(os.path.join(folder, "reference.npz")))
    model, config = hf.from_pretrained(folder)
    assert config.layer_options["mla"]["q_rank"] == 12
    check_against_reference(model, reference)
    out = hf.save_pretrained(model, str(tmp_path / "export"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        logits = loaded.eval()(torch.tensor(reference["tokens"]).long()).logits.numpy()
    assert relative_error(logits, reference["logits"]) <= 1e-5
