"""Bamba (transformers' `bamba`, `BambaForCausalLM`): its config and tensors as this library's
`ModelConfig` and parameters, both ways.

Every layer is pre-norm, `x + mixer(RMSNorm(x))` then `x + mlp(RMSNorm(x))` with a SwiGLU MLP;
the mixer is Mamba-2's (`linear_attention` → `gated` with the options of `mamba2.py`, its
tensors mapped as there) or softmax attention (`full_attention` → `softmax`: the layers of
`attn_layer_indices`) with grouped KV heads and rotary on the first half of each head's channels
(transformers fixes `partial_rotary_factor` at 0.5), no q/k norm, no output gate.

| transformers (`model.layers.{i}.`)           | here (`blocks[i].`)                            |
| -------------------------------------------- | ---------------------------------------------- |
| `mamba.*` (in_proj, conv1d, A_log, dt_bias, ...) | `mixer.*`, as `mamba2.py` maps `mixer.*`   |
| `self_attn.q_proj`, `k_proj`, `v_proj`       | `mixer.inputs.qkv_proj` (q, k, v)              |
| `self_attn.o_proj`                           | `mixer.output.out_proj`                        |
| `input_layernorm`, `pre_ff_layernorm`        | `mixer_norm`, `mlp_norm` (w, as is)            |
| `feed_forward.gate_proj`, `up_proj`, `down_proj` | `mlp.w_gate`, `w_up`, `w_down`             |
| `model.embed_tokens`, `model.final_layernorm`, `lm_head` | `embed`, `final_norm`, `head`      |
"""

from __future__ import annotations

import numpy as np

from linear_attention.layers.linear import GatedMixer
from linear_attention.layers.options import conv_kernel_size
from linear_attention.layers.softmax import SoftmaxMixer
from linear_attention.models.hf import mamba2
from linear_attention.models.hf.common import (
    INERT,
    Unsupported,
    initializer_field,
    initializer_options,
)
from linear_attention.models.hf.qwen3_5 import (
    dense_mlp_params,
    dense_mlp_shapes,
    dense_mlp_tensors,
)

MODEL_TYPE = "bamba"
ARCHITECTURE = "BambaForCausalLM"
GATED, ATTENTION = GatedMixer.NAME, SoftmaxMixer.NAME
MIXERS = {"linear_attention": GATED, "full_attention": ATTENTION}
# transformers' Bamba rotates this share of each attention head's channels, whatever the config.
PARTIAL_ROTARY = 0.5
# Fields that only set the initialisation or the training loss, or how the torch path computes
# the same numbers (its chunk length; the logits it keeps in generation).
INIT_ONLY = ("mamba_chunk_size", "z_loss_coefficient", "num_logits_to_keep")
MAPPED = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "rope_parameters",
    "attention_bias",
    "attention_dropout",
    "mlp_bias",
    "attn_layer_indices",
    "mamba_n_heads",
    "mamba_d_head",
    "mamba_n_groups",
    "mamba_d_state",
    "mamba_d_conv",
    "mamba_expand",
    "mamba_conv_bias",
    "mamba_proj_bias",
    "time_step_limit",
)
ROPE_FIELDS = ("rope_type", "rope_theta", "partial_rotary_factor")


def _require(hf: dict, name: str, wanted) -> None:
    if hf[name] != wanted:
        raise Unsupported(f"{name}={hf[name]!r} is not supported (only {wanted!r})")


def layer_types(hf: dict) -> list[str]:
    """Each layer's type, as transformers' `layers_block_type` gives it."""
    attention = set(hf["attn_layer_indices"] or ())
    return [
        "full_attention" if i in attention else "linear_attention"
        for i in range(hf["num_hidden_layers"])
    ]


def mamba_fields(hf: dict) -> dict:
    """The Mamba-2 mixer's sizes under mamba2's field names (for `mamba2`'s mixer mapping)."""
    return dict(
        hidden_size=hf["hidden_size"],
        num_heads=hf["mamba_n_heads"],
        head_dim=hf["mamba_d_head"],
        state_size=hf["mamba_d_state"],
        n_groups=hf["mamba_n_groups"],
        conv_kernel=hf["mamba_d_conv"],
        use_conv_bias=hf["mamba_conv_bias"],
    )


def head_dim(hf: dict) -> int:
    return hf["hidden_size"] // hf["num_attention_heads"]


def _check(hf: dict) -> float:
    """Every field of `hf` checked; the rotary base. `Unsupported` naming the first field it
    cannot represent."""
    unknown = sorted(set(hf) - set(MAPPED) - set(INERT) - set(INIT_ONLY))
    if unknown:
        raise Unsupported(
            f"config field {unknown[0]!r} is not understood by the {MODEL_TYPE} importer"
        )
    missing = [f for f in MAPPED if f not in hf]
    if missing:
        raise Unsupported(f"config field {missing[0]!r} is missing")
    for name, wanted in (
        ("hidden_act", "silu"),
        ("attention_bias", False),
        ("attention_dropout", 0.0),
        ("mlp_bias", False),
        ("mamba_proj_bias", False),
    ):
        _require(hf, name, wanted)
    if [mamba2.number(v) for v in hf["time_step_limit"]] != [0.0, float("inf")]:
        raise Unsupported(
            f"time_step_limit={hf['time_step_limit']!r} is not supported (only [0.0, inf]: dt "
            "unclamped)"
        )
    h, p, g, d = hf["mamba_n_heads"], hf["mamba_d_head"], hf["mamba_n_groups"], hf["hidden_size"]
    if hf["mamba_expand"] * d != h * p:
        raise Unsupported(
            f"mamba_expand={hf['mamba_expand']} · hidden_size={d} differs from mamba_n_heads={h} "
            f"· mamba_d_head={p}"
        )
    if h % g:
        raise Unsupported(f"mamba_n_groups={g} must divide mamba_n_heads={h}")
    rope = hf["rope_parameters"]
    if not isinstance(rope, dict):
        raise Unsupported(f"rope_parameters={rope!r} is not supported (a dict)")
    for name in sorted(set(rope) - set(ROPE_FIELDS)):
        raise Unsupported(f"config field 'rope_parameters.{name}' is not understood")
    _require(rope, "rope_type", "default")
    if rope.get("partial_rotary_factor", PARTIAL_ROTARY) != PARTIAL_ROTARY:
        raise Unsupported(
            f"rope_parameters.partial_rotary_factor={rope['partial_rotary_factor']!r} is not "
            f"supported (transformers' bamba rotates {PARTIAL_ROTARY} of each head whatever it "
            "says)"
        )
    for i in hf["attn_layer_indices"] or ():
        if not 0 <= i < hf["num_hidden_layers"]:
            raise Unsupported(f"attn_layer_indices has {i}, not a layer")
    return float(rope["rope_theta"])


def model_options(hf: dict) -> dict:
    """`ModelConfig` keyword arguments for the transformers config `hf` (a dict, as in
    config.json); `Unsupported` naming the first field it cannot represent."""
    theta = _check(hf)
    kinds = layer_types(hf)
    eps = float(hf["rms_norm_eps"])
    layer_options = {}
    if "linear_attention" in kinds:
        layer_options[GATED] = mamba2.gated_options(mamba_fields(hf), eps)
    if "full_attention" in kinds:
        hd = head_dim(hf)
        layer_options[ATTENTION] = dict(
            num_heads=hf["num_attention_heads"],
            head_dim=hd,
            num_kv_heads=hf["num_key_value_heads"],
            rope=True,
            rope_base=theta,
            rotary_dim=int(hd * PARTIAL_ROTARY),
        )
    return dict(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["mamba_n_groups"],
        mixer=tuple(MIXERS[kind] for kind in kinds),
        mlp=True,
        mlp_dim=hf["intermediate_size"],
        norm_eps=eps,
        max_length=hf["max_position_embeddings"],
        tie_embeddings=bool(hf["tie_word_embeddings"]),
        position="none",
        layer_options=layer_options,
        **initializer_options(hf, MODEL_TYPE),
    )


def hf_config(config) -> dict:
    """The transformers config (config.json's dict) of a `ModelConfig` in bamba's shape, the
    inverse of `model_options` (the caller checks that it is one)."""
    mixers = config.layer_mixers
    out = dict(
        architectures=[ARCHITECTURE],
        model_type=MODEL_TYPE,
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=config.mlp_dim or int(config.mlp_ratio * config.d_model),
        num_hidden_layers=config.num_layers,
        hidden_act="silu",
        max_position_embeddings=config.max_length,
        rms_norm_eps=config.norm_eps,
        tie_word_embeddings=config.tie_embeddings,
        attention_bias=False,
        attention_dropout=0.0,
        mlp_bias=False,
        attn_layer_indices=[i for i, m in enumerate(mixers) if m == ATTENTION],
        mamba_proj_bias=False,
        time_step_limit=[0.0, {"__float__": "Infinity"}],
        # Token ids are not part of the model here (a converted run's generation_config.json
        # carries them); transformers' defaults could lie outside a small vocabulary.
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
        dtype="float32",
    )
    heads = config.layer_num_heads(ATTENTION) if ATTENTION in mixers else config.num_heads
    rope_base = 10000.0
    if ATTENTION in mixers:
        attn = config.mixer_config(ATTENTION)
        rope_base = attn.rope_base
        out.update(num_key_value_heads=attn.num_kv_heads or heads)
    out.update(
        num_attention_heads=heads,
        num_key_value_heads=out.get("num_key_value_heads", heads),
        rope_parameters=dict(
            rope_type="default", rope_theta=rope_base, partial_rotary_factor=PARTIAL_ROTARY
        ),
    )
    out.update(_mamba_sizes(config))
    out.update(initializer_field(config, MODEL_TYPE))
    return out


def _mamba_sizes(config) -> dict:
    """The `mamba_*` sizes of `config`'s `gated` layers, for `hf_config`."""
    if GATED not in config.layer_mixers:  # transformers still checks them; nothing reads them
        return dict(
            mamba_n_heads=1,
            mamba_d_head=2 * config.d_model,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_conv_bias=True,
        )
    gated, g = config.mixer_config(GATED), config.layer_num_heads(GATED)
    h, p = gated.num_value_heads or g, gated.head_dim or config.d_model // g
    width = h * p  # (not a multiple of d_model: an expand that model_options refuses)
    return dict(
        mamba_n_heads=h,
        mamba_d_head=p,
        mamba_n_groups=g,
        mamba_d_state=gated.state_dim or p,
        mamba_d_conv=conv_kernel_size(gated.conv) or 4,
        mamba_expand=width // config.d_model
        if width % config.d_model == 0
        else width / config.d_model,
        mamba_conv_bias=gated.conv_bias,
    )


def tensor_shapes(hf: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor a `BambaForCausalLM` of config `hf` holds, with its shape."""
    d, v = hf["hidden_size"], hf["vocab_size"]
    h, hkv, hd = hf["num_attention_heads"], hf["num_key_value_heads"], head_dim(hf)
    shapes = {"model.embed_tokens.weight": (v, d), "model.final_layernorm.weight": (d,)}
    if not hf["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, d)
    view = mamba_fields(hf)
    for i, kind in enumerate(layer_types(hf)):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "pre_ff_layernorm.weight": (d,)})
        shapes.update(dense_mlp_shapes(hf, p + "feed_forward."))
        if kind == "linear_attention":
            shapes.update(mamba2.mixer_shapes(view, p + "mamba."))
        else:
            a = p + "self_attn."
            shapes.update(
                {
                    a + "q_proj.weight": (h * hd, d),
                    a + "k_proj.weight": (hkv * hd, d),
                    a + "v_proj.weight": (hkv * hd, d),
                    a + "o_proj.weight": (d, h * hd),
                }
            )
    return shapes


def to_params(hf: dict, get) -> dict:
    """This library's parameters (a nested dict as `nnx.to_pure_dict` gives, float32 arrays)
    from the tensors `get(name) -> np.ndarray float32` of a checkpoint of config `hf`."""
    view, blocks = mamba_fields(hf), {}
    for i, kind in enumerate(layer_types(hf)):
        p = f"model.layers.{i}."
        if kind == "linear_attention":
            mixer = mamba2.mixer_params(view, get, p + "mamba.")
        else:
            a = p + "self_attn."
            qkv = np.concatenate([get(a + f"{x}_proj.weight") for x in "qkv"])
            mixer = {
                "inputs": {"qkv_proj": {"kernel": qkv.T}},
                "output": {"out_proj": {"kernel": get(a + "o_proj.weight").T}},
            }
        blocks[i] = {
            "mixer_norm": {"scale": get(p + "input_layernorm.weight")},
            "mlp_norm": {"scale": get(p + "pre_ff_layernorm.weight")},
            "mlp": dense_mlp_params(get, p + "feed_forward."),
            "mixer": mixer,
        }
    params = {
        "embed": {"embedding": get("model.embed_tokens.weight")},
        "final_norm": {"scale": get("model.final_layernorm.weight")},
        "blocks": blocks,
    }
    if not hf["tie_word_embeddings"]:
        params["head"] = {"kernel": get("lm_head.weight").T}
    return params


def from_params(hf: dict, params: dict) -> dict[str, np.ndarray]:
    """The checkpoint tensors (float32) of `params`, the inverse of `to_params`."""
    out = {
        "model.embed_tokens.weight": params["embed"]["embedding"],
        "model.final_layernorm.weight": params["final_norm"]["scale"],
    }
    if not hf["tie_word_embeddings"]:
        out["lm_head.weight"] = params["head"]["kernel"].T
    h, hkv, hd = hf["num_attention_heads"], hf["num_key_value_heads"], head_dim(hf)
    view = mamba_fields(hf)
    for i, kind in enumerate(layer_types(hf)):
        p, block = f"model.layers.{i}.", params["blocks"][i]
        out[p + "input_layernorm.weight"] = block["mixer_norm"]["scale"]
        out[p + "pre_ff_layernorm.weight"] = block["mlp_norm"]["scale"]
        out.update(dense_mlp_tensors(block["mlp"], p + "feed_forward."))
        mixer = block["mixer"]
        if kind == "linear_attention":
            out.update(mamba2.mixer_tensors(view, mixer, p + "mamba."))
        else:
            a = p + "self_attn."
            qkv = mixer["inputs"]["qkv_proj"]["kernel"].T
            q, k, v = np.split(qkv, [h * hd, (h + hkv) * hd])
            out[a + "q_proj.weight"], out[a + "k_proj.weight"], out[a + "v_proj.weight"] = q, k, v
            out[a + "o_proj.weight"] = mixer["output"]["out_proj"]["kernel"].T
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}
