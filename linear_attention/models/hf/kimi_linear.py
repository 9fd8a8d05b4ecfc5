"""Kimi Linear (transformers' `kimi_linear`, `KimiLinearForCausalLM`): its config and tensors as
this library's `ModelConfig` and parameters, both ways.

A layer is KDA (`linear_attention`: the `kda` mixer) or multi-head latent attention without
rotary positions (`full_attention`: the `mla` mixer, rope off), then a dense SwiGLU (`dense`)
or a mixture of experts (`sparse`: `layers.moe.MoE` with DeepSeek-V3's routing). The tensors
are read in the layout transformers' `save_pretrained` writes, the released checkpoints' (its
weight conversion fuses the convs and the experts at load time):

| transformers (`model.layers.{i}.`)                  | here (`blocks[i].`)                        |
| --------------------------------------------------- | ------------------------------------------ |
| `self_attn.q_proj`, `k_proj`, `v_proj` [H·K, D]     | `mixer.inputs.qkv_proj` (q | k | v)        |
| `self_attn.{q,k,v}_conv1d` [H·K, 1, 4], no bias     | `mixer.inputs.conv.kernel` (conv_bias off) |
| `self_attn.f_a_proj`, `f_b_proj`, `dt_bias` [H·K]   | `mixer.decay.down`, `up`, `dt_bias`        |
| `self_attn.A_log` [1, 1, H, 1]                      | `mixer.decay.a_log` [H]                    |
| `self_attn.b_proj`                                  | `mixer.beta_proj`                          |
| `self_attn.g_a_proj`, `g_b_proj` (no bias)          | `mixer.output.gate_proj`, `gate_up`        |
| `self_attn.o_norm` [K] (eps rms_norm_eps), `o_proj` | `mixer.output.norm` (shared), `out_proj`   |
| `self_attn.q_proj` [H·(Dn+Dr), D]                   | `mixer.inputs.q_proj` (MLA)                |
| `self_attn.q_a_proj`, `q_a_layernorm`, `q_b_proj`   | `mixer.inputs.q_down`, `q_norm`, `q_proj`  |
| `self_attn.kv_a_proj_with_mqa` [R + Dr, D]          | `mixer.inputs.kv_down`                     |
| `self_attn.kv_a_layernorm` [R], `kv_b_proj`         | `mixer.inputs.kv_norm`, `kv_up`            |
| `self_attn.o_proj` [D, H·Dv]                        | `mixer.output.out_proj`                    |
| `block_sparse_moe.gate_proj`, `up_proj`, `down_proj`| `mlp.w_gate`, `w_up`, `w_down` (dense)     |
| `block_sparse_moe.gate.weight` [E, D]               | `mlp.router`                               |
| `block_sparse_moe.gate.e_score_correction_bias`     | `mlp.score_bias`                           |
| `block_sparse_moe.experts.{e}.w1`, `w3`, `w2`       | `mlp.w_gate[e]`, `w_up[e]`, `w_down[e]`    |
| `block_sparse_moe.shared_experts.*`                 | `mlp.shared` (no gate)                     |
| `input_layernorm`, `post_attention_layernorm`       | `mixer_norm`, `mlp_norm`                   |
| `model.embed_tokens`, `model.norm`, `lm_head`       | `embed`, `final_norm`, `head`              |

Every norm applies w (not 1 + w). The MLP layers must be `first_k_dense_replace` dense ones
then experts (`moe_dense_layers`); the router is sigmoid with the score bias, grouped top-k
(`n_group`, `topk_group`), renormalised (`norm_topk_prob`) and scaled
(`routed_scaling_factor`); the `n_shared_experts` shared experts are one ungated SwiGLU of
`n_shared_experts · moe_intermediate_size`. The config fields transformers aliases are read
under either name (`num_experts` / `num_local_experts`, ...). The released config.json (remote
code) is read as transformers reads it (`_released`): `linear_attn_config` gives the KDA sizes
and, by its 1-based layer lists, `layer_types`; `first_k_dense_replace` gives
`mlp_layer_types`; the fields transformers does not read must hold the value that computes what
it computes (`mla_use_nope` true, a sigmoid router, `moe_layer_freq` 1, no multi-token
prediction layers; `rope_theta` / `rope_scaling` are left alone: its MLA has no rotary).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from linear_attention.layers.kda import KDAMixer
from linear_attention.layers.mla import MLAMixer, latent_sizes
from linear_attention.layers.options import conv_kernel_size
from linear_attention.models.hf import qwen3_5
from linear_attention.models.hf.common import (
    INERT,
    Unsupported,
    initializer_field,
    initializer_options,
)

MODEL_TYPE = "kimi_linear"
ARCHITECTURE = "KimiLinearForCausalLM"
KDA, MLA = KDAMixer.NAME, MLAMixer.NAME
MIXERS = {"linear_attention": KDA, "full_attention": MLA}
MLA_DEFAULTS = dataclasses.asdict(MLAMixer.Config())
# transformers' attribute_map: config.json holds the right-hand names.
ALIASES = {
    "max_position_embeddings": "model_max_length",
    "norm_topk_prob": "moe_renormalize",
    "n_group": "num_expert_group",
    "num_local_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
}
MAPPED = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "num_shared_experts",
    "routed_scaling_factor",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_rope_head_dim",
    "v_head_dim",
    "qk_nope_head_dim",
    "num_expert_group",
    "topk_group",
    "num_experts_per_token",
    "moe_renormalize",
    "hidden_act",
    "model_max_length",
    "rms_norm_eps",
    "tie_word_embeddings",
    "attention_bias",
    "attention_dropout",
    "num_experts",
    "mlp_layer_types",
    "layer_types",
    "linear_head_dim",
    "linear_num_heads",
    "linear_conv_kernel_dim",
)
# Derived by transformers from the fields above (checked against them), or training-only.
DERIVED = ("head_dim", "qk_head_dim")
TRAINING_ONLY = ("output_router_logits", "pretraining_tp")
# Fields with transformers' defaults (a config.json may leave them out).
DEFAULTS = dict(
    q_lora_rank=None,
    attention_bias=False,
    attention_dropout=0.0,
    num_shared_experts=1,
    num_expert_group=1,
    topk_group=1,
    moe_renormalize=True,
)


# The released config.json (remote code): the fields transformers folds into its own, the
# linear_attn_config entries (layer numbers 1-based), and those it does not read, with the one
# value that computes what transformers computes (None: any value; rope_theta / rope_scaling:
# transformers' MLA has no rotary).
LINEAR_ATTN_CONFIG = {
    "head_dim": "linear_head_dim",
    "num_heads": "linear_num_heads",
    "short_conv_kernel_size": "linear_conv_kernel_dim",
}
RELEASED_FIXED = dict(
    mla_use_nope=True,
    moe_router_activation_func="sigmoid",
    moe_layer_freq=1,
    num_nextn_predict_layers=0,
    rope_theta=None,
    rope_scaling=None,
    auto_map=None,
)


def _released(hf: dict) -> dict:
    """`hf` with the released config.json's remote-code fields as transformers reads them:
    `linear_attn_config` (it takes precedence over the top-level linear fields; its layer
    lists give `layer_types` unless the config has them), `first_k_dense_replace` (gives
    `mlp_layer_types` unless the config has them), `use_grouped_topk`; the others of
    `RELEASED_FIXED` must hold their value. `head_dim` is then transformers' own."""
    hf = dict(hf)
    linear = hf.pop("linear_attn_config", None)
    if linear is None and "first_k_dense_replace" not in hf:
        return hf
    for name, wanted in RELEASED_FIXED.items():
        value = hf.pop(name, wanted)
        if wanted is not None and value != wanted:
            raise Unsupported(f"{name}={value!r} is not supported (only {wanted!r})")
    if not hf.pop("use_grouped_topk", True) and hf.get("num_expert_group", 1) != 1:
        raise Unsupported("use_grouped_topk=False with num_expert_group > 1 is not supported")
    hf.pop("head_dim", None)  # (the remote code's hidden_size / heads; transformers resets it)
    n = hf.get("num_hidden_layers", 0)
    if linear is not None:
        lists = ("full_attn_layers", "kda_layers")
        for key in sorted(set(linear) - set(LINEAR_ATTN_CONFIG) - set(lists)):
            raise Unsupported(f"config field 'linear_attn_config.{key}' is not understood")
        hf.update(
            {
                ours: linear[theirs]
                for theirs, ours in LINEAR_ATTN_CONFIG.items()
                if theirs in linear
            }
        )
        if "layer_types" not in hf and all(k in linear for k in lists):
            types = [None] * n
            for key, kind in zip(lists, ("full_attention", "linear_attention"), strict=True):
                for layer in linear[key]:
                    if not 1 <= layer <= n:
                        raise Unsupported(f"linear_attn_config.{key} names layer {layer} of {n}")
                    types[layer - 1] = kind
            if None in types:
                raise Unsupported(f"linear_attn_config gives layer {types.index(None) + 1} no type")
            hf["layer_types"] = types
    first_dense = hf.pop("first_k_dense_replace", None)
    if first_dense is not None and "mlp_layer_types" not in hf:
        hf["mlp_layer_types"] = ["dense" if i < first_dense else "sparse" for i in range(n)]
    return hf


def _fields(hf: dict) -> dict:
    """`hf` with transformers' aliases under config.json's names and the defaults filled in;
    `Unsupported` naming a field it does not know or a missing one."""
    hf = _released(hf)
    for alias, name in ALIASES.items():
        if alias in hf:
            if name in hf and hf[name] != hf[alias]:
                raise Unsupported(f"{alias}={hf[alias]!r} differs from {name}={hf[name]!r}")
            hf[name] = hf.pop(alias)
    known = set(MAPPED) | set(DERIVED) | set(TRAINING_ONLY) | set(INERT)
    unknown = sorted(set(hf) - known)
    if unknown:
        raise Unsupported(
            f"config field {unknown[0]!r} is not understood by the kimi_linear importer"
        )
    hf = {**DEFAULTS, **hf}
    missing = [f for f in MAPPED if f not in hf]
    if missing:
        raise Unsupported(f"config field {missing[0]!r} is missing")
    return hf


def _require(hf: dict, name: str, wanted) -> None:
    if hf[name] != wanted:
        raise Unsupported(f"{name}={hf[name]!r} is not supported (only {wanted!r})")


def _checked(hf: dict) -> dict:
    """The fields of `hf` after every check; `Unsupported` naming the first it cannot hold."""
    hf = _fields(hf)
    _require(hf, "hidden_act", "silu")
    _require(hf, "attention_bias", False)
    _require(hf, "attention_dropout", 0.0)
    if hf["num_key_value_heads"] != hf["num_attention_heads"]:
        raise Unsupported(
            f"num_key_value_heads={hf['num_key_value_heads']} differs from num_attention_heads="
            f"{hf['num_attention_heads']} (Kimi Linear's MLA expands the latent to every head)"
        )
    derived = dict(
        head_dim=hf["qk_rope_head_dim"], qk_head_dim=hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]
    )
    for name, value in derived.items():
        if name in hf and hf[name] != value:
            raise Unsupported(f"{name}={hf[name]!r} differs from the {value} the other fields give")
    n = hf["num_hidden_layers"]
    for name in ("layer_types", "mlp_layer_types"):
        if not isinstance(hf[name], list) or len(hf[name]) != n:
            raise Unsupported(f"{name} must list num_hidden_layers={n} entries, got {hf[name]!r}")
    for kind in hf["layer_types"]:
        if kind not in MIXERS:
            raise Unsupported(f"layer type {kind!r} is not supported (known: {', '.join(MIXERS)})")
    dense = _dense_layers(hf)
    if hf["mlp_layer_types"] != ["dense"] * dense + ["sparse"] * (n - dense):
        raise Unsupported(
            f"mlp_layer_types={hf['mlp_layer_types']!r}: only dense layers first, then sparse "
            "ones, is supported"
        )
    if dense < n and hf["num_shared_experts"] < 1:
        raise Unsupported("num_shared_experts=0 (no shared expert) is not supported")
    return hf


def _dense_layers(hf: dict) -> int:
    kinds = list(hf["mlp_layer_types"])
    return kinds.index("sparse") if "sparse" in kinds else len(kinds)


def model_options(hf: dict) -> dict:
    """`ModelConfig` keyword arguments for the transformers config `hf` (a dict, as in
    config.json); `Unsupported` naming the first field it cannot represent."""
    hf = _checked(hf)
    layer_types, n = hf["layer_types"], hf["num_hidden_layers"]
    layer_options = {}
    if "linear_attention" in layer_types:
        layer_options[KDA] = dict(
            num_heads=hf["linear_num_heads"],
            head_dim=hf["linear_head_dim"],
            conv=hf["linear_conv_kernel_dim"],
            conv_bias=False,
            out_norm_shared=True,
            out_norm_eps=float(hf["rms_norm_eps"]),
            gate_bias=False,
        )
    if "full_attention" in layer_types:
        layer_options[MLA] = dict(
            num_heads=hf["num_attention_heads"],
            head_dim=hf["v_head_dim"],
            nope_dim=hf["qk_nope_head_dim"],
            rope_dim=hf["qk_rope_head_dim"],
            kv_rank=hf["kv_lora_rank"],
            q_rank=hf["q_lora_rank"],
        )
    options = dict(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        num_layers=n,
        num_heads=hf["linear_num_heads"],
        mixer=tuple(MIXERS[kind] for kind in layer_types),
        mlp=True,
        mlp_dim=hf["intermediate_size"],
        norm_eps=float(hf["rms_norm_eps"]),
        max_length=hf["model_max_length"],
        tie_embeddings=bool(hf["tie_word_embeddings"]),
        position="none",
        layer_options=layer_options,
        **initializer_options(hf, MODEL_TYPE),
    )
    dense = _dense_layers(hf)
    if dense == n:  # (no layer has experts: their fields are read and unused)
        return options
    return dict(
        options,
        num_experts=hf["num_experts"],
        experts_per_token=hf["num_experts_per_token"],
        moe_dim=hf["moe_intermediate_size"],
        shared_expert_dim=hf["num_shared_experts"] * hf["moe_intermediate_size"],
        moe_norm_topk=bool(hf["moe_renormalize"]),
        moe_router="sigmoid",
        moe_score_bias=True,
        moe_groups=hf["num_expert_group"],
        moe_topk_groups=hf["topk_group"],
        moe_routed_scale=float(hf["routed_scaling_factor"]),
        moe_shared_gate=False,
        moe_dense_layers=dense,
    )


def hf_config(config) -> dict:
    """The transformers config (config.json's dict) of a `ModelConfig` in kimi_linear's shape,
    the inverse of `model_options` (the caller checks that it is one)."""
    kinds = {v: k for k, v in MIXERS.items()}
    used = set(config.layer_mixers)
    kda = config.mixer_config(KDA) if KDA in used else None
    mla = config.mixer_config(MLA) if MLA in used else None
    kda_heads, mla_heads = (config.layer_num_heads(n) for n in (KDA, MLA))
    v_dim = (mla and mla.head_dim) or config.d_model // mla_heads
    rank, nope, rope = latent_sizes(v_dim, dataclasses.asdict(mla) if mla else MLA_DEFAULTS)
    moe = config.moe_options
    n, dense = config.num_layers, config.moe_dense_layers if moe else config.num_layers
    width = moe["hidden_dim"] if moe else 1
    # (a model without a KDA, an MLA or an MoE layer still names the other's sizes)
    return dict(
        architectures=[ARCHITECTURE],
        model_type=MODEL_TYPE,
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=config.mlp_dim or int(config.mlp_ratio * config.d_model),
        moe_intermediate_size=width,
        num_hidden_layers=n,
        num_attention_heads=mla_heads,
        num_key_value_heads=mla_heads,
        num_shared_experts=moe["shared_dim"] // width if moe else 1,
        routed_scaling_factor=moe["routed_scale"] if moe else 1.0,
        kv_lora_rank=rank,
        q_lora_rank=mla.q_rank if mla else None,
        qk_rope_head_dim=rope,
        v_head_dim=v_dim,
        qk_nope_head_dim=nope,
        num_expert_group=moe["num_groups"] if moe else 1,
        topk_group=moe["topk_groups"] if moe else 1,
        num_experts_per_token=moe["top_k"] if moe else 1,
        moe_renormalize=moe["norm_topk"] if moe else True,
        hidden_act="silu",
        model_max_length=config.max_length,
        rms_norm_eps=config.norm_eps,
        tie_word_embeddings=config.tie_embeddings,
        attention_bias=False,
        attention_dropout=0.0,
        num_experts=moe["num_experts"] if moe else 1,
        mlp_layer_types=["dense"] * dense + ["sparse"] * (n - dense),
        layer_types=[kinds[m] for m in config.layer_mixers],
        linear_head_dim=(kda and kda.head_dim) or config.d_model // kda_heads,
        linear_num_heads=kda_heads,
        linear_conv_kernel_dim=conv_kernel_size(kda.conv) if kda else 4,
        output_router_logits=False,
        # (transformers' defaults are the released vocabulary's ids, out of a smaller one)
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
        dtype="float32",
        **initializer_field(config, MODEL_TYPE),
    )


def tensor_shapes(hf: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor a `KimiLinearForCausalLM` of config `hf` holds (the saved layout), with its
    shape."""
    hf = _checked(hf)
    d, v = hf["hidden_size"], hf["vocab_size"]
    h, k, c = hf["linear_num_heads"], hf["linear_head_dim"], hf["linear_conv_kernel_dim"]
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not hf["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, d)
    dense = _dense_layers(hf)
    for i, kind in enumerate(hf["layer_types"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        m = p + "block_sparse_moe."
        if i < dense:
            shapes.update(qwen3_5.dense_mlp_shapes(hf, m))
        else:
            shapes.update(_moe_shapes(hf, m))
        a = p + "self_attn."
        if kind == "linear_attention":
            for x in ("q", "k", "v"):
                shapes[a + f"{x}_proj.weight"] = (h * k, d)
                shapes[a + f"{x}_conv1d.weight"] = (h * k, 1, c)
            shapes.update(
                {
                    a + "f_a_proj.weight": (k, d),
                    a + "f_b_proj.weight": (h * k, k),
                    a + "dt_bias": (h * k,),
                    a + "A_log": (1, 1, h, 1),
                    a + "b_proj.weight": (h, d),
                    a + "g_a_proj.weight": (k, d),
                    a + "g_b_proj.weight": (h * k, k),
                    a + "o_norm.weight": (k,),
                    a + "o_proj.weight": (d, h * k),
                }
            )
        else:
            ha, r, q_rank = hf["num_attention_heads"], hf["kv_lora_rank"], hf["q_lora_rank"]
            dn, dr, dv = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"]
            if q_rank:
                shapes[a + "q_a_proj.weight"] = (q_rank, d)
                shapes[a + "q_a_layernorm.weight"] = (q_rank,)
                shapes[a + "q_b_proj.weight"] = (ha * (dn + dr), q_rank)
            else:
                shapes[a + "q_proj.weight"] = (ha * (dn + dr), d)
            shapes.update(
                {
                    a + "kv_a_proj_with_mqa.weight": (r + dr, d),
                    a + "kv_a_layernorm.weight": (r,),
                    a + "kv_b_proj.weight": (ha * (dn + dv), r),
                    a + "o_proj.weight": (d, ha * dv),
                }
            )
    return shapes


def _moe_shapes(hf: dict, m: str) -> dict[str, tuple[int, ...]]:
    d, e, i = hf["hidden_size"], hf["num_experts"], hf["moe_intermediate_size"]
    shapes = {m + "gate.weight": (e, d), m + "gate.e_score_correction_bias": (e,)}
    for j in range(e):
        x = f"{m}experts.{j}."
        shapes.update({x + "w1.weight": (i, d), x + "w3.weight": (i, d), x + "w2.weight": (d, i)})
    shared = dict(hf, intermediate_size=hf["num_shared_experts"] * i)
    shapes.update(qwen3_5.dense_mlp_shapes(shared, m + "shared_experts."))
    return shapes


def _linear(get, name: str) -> dict:
    return {"kernel": get(name).T}


def _kda_params(get, a: str) -> dict:
    qkv = np.concatenate([get(a + f"{x}_proj.weight") for x in ("q", "k", "v")])
    conv = np.concatenate([get(a + f"{x}_conv1d.weight") for x in ("q", "k", "v")])
    return {
        "inputs": {"qkv_proj": {"kernel": qkv.T}, "conv": {"kernel": conv[:, 0, :].T}},
        "beta_proj": _linear(get, a + "b_proj.weight"),
        "decay": {
            "down": _linear(get, a + "f_a_proj.weight"),
            "up": _linear(get, a + "f_b_proj.weight"),
            "a_log": get(a + "A_log").reshape(-1),
            "dt_bias": get(a + "dt_bias"),
        },
        "output": {
            "norm": {"scale": get(a + "o_norm.weight")},
            "gate_proj": _linear(get, a + "g_a_proj.weight"),
            "gate_up": _linear(get, a + "g_b_proj.weight"),
            "out_proj": _linear(get, a + "o_proj.weight"),
        },
    }


def _mla_params(hf: dict, get, a: str) -> dict:
    inputs = {
        "kv_down": _linear(get, a + "kv_a_proj_with_mqa.weight"),
        "kv_norm": {"scale": get(a + "kv_a_layernorm.weight")},
        "kv_up": _linear(get, a + "kv_b_proj.weight"),
    }
    if hf["q_lora_rank"]:
        inputs["q_down"] = _linear(get, a + "q_a_proj.weight")
        inputs["q_norm"] = {"scale": get(a + "q_a_layernorm.weight")}
        inputs["q_proj"] = _linear(get, a + "q_b_proj.weight")
    else:
        inputs["q_proj"] = _linear(get, a + "q_proj.weight")
    return {"inputs": inputs, "output": {"out_proj": _linear(get, a + "o_proj.weight")}}


def _moe_params(hf: dict, get, m: str) -> dict:
    experts = range(hf["num_experts"])

    def stack(name):
        return np.stack([get(f"{m}experts.{e}.{name}.weight").T for e in experts])

    return {
        "router": _linear(get, m + "gate.weight"),
        "score_bias": get(m + "gate.e_score_correction_bias"),
        "w_gate": stack("w1"),
        "w_up": stack("w3"),
        "w_down": stack("w2"),
        "shared": qwen3_5.dense_mlp_params(get, m + "shared_experts."),
    }


def to_params(hf: dict, get) -> dict:
    """This library's parameters (a nested dict as `nnx.to_pure_dict` gives, float32 arrays)
    from the tensors `get(name) -> np.ndarray float32` of a checkpoint of config `hf`."""
    hf = _checked(hf)
    dense, blocks = _dense_layers(hf), {}
    for i, kind in enumerate(hf["layer_types"]):
        p = f"model.layers.{i}."
        m, a = p + "block_sparse_moe.", p + "self_attn."
        blocks[i] = {
            "mixer_norm": {"scale": get(p + "input_layernorm.weight")},
            "mlp_norm": {"scale": get(p + "post_attention_layernorm.weight")},
            "mlp": (qwen3_5.dense_mlp_params(get, m) if i < dense else _moe_params(hf, get, m)),
            "mixer": _kda_params(get, a) if kind == "linear_attention" else _mla_params(hf, get, a),
        }
    params = {
        "embed": {"embedding": get("model.embed_tokens.weight")},
        "final_norm": {"scale": get("model.norm.weight")},
        "blocks": blocks,
    }
    if not hf["tie_word_embeddings"]:
        params["head"] = _linear(get, "lm_head.weight")
    return params


def from_params(hf: dict, params: dict) -> dict[str, np.ndarray]:
    """The checkpoint tensors (float32) of `params` (as `to_params` makes them), the inverse of
    `to_params`."""
    hf = _checked(hf)
    out = {}

    def linear(name, p):
        out[name] = p["kernel"].T

    out["model.embed_tokens.weight"] = params["embed"]["embedding"]
    out["model.norm.weight"] = params["final_norm"]["scale"]
    if not hf["tie_word_embeddings"]:
        linear("lm_head.weight", params["head"])
    dense, h = _dense_layers(hf), hf["linear_num_heads"]
    for i, kind in enumerate(hf["layer_types"]):
        p, block = f"model.layers.{i}.", params["blocks"][i]
        m, a, mixer = p + "block_sparse_moe.", p + "self_attn.", block["mixer"]
        out[p + "input_layernorm.weight"] = block["mixer_norm"]["scale"]
        out[p + "post_attention_layernorm.weight"] = block["mlp_norm"]["scale"]
        mlp = block["mlp"]
        if i < dense:
            out.update(qwen3_5.dense_mlp_tensors(mlp, m))
        else:
            linear(m + "gate.weight", mlp["router"])
            out[m + "gate.e_score_correction_bias"] = mlp["score_bias"]
            out.update(qwen3_5.dense_mlp_tensors(mlp["shared"], m + "shared_experts."))
            for e in range(mlp["w_gate"].shape[0]):
                for ours, theirs in (("w_gate", "w1"), ("w_up", "w3"), ("w_down", "w2")):
                    out[f"{m}experts.{e}.{theirs}.weight"] = mlp[ours][e].T
        if kind == "linear_attention":
            qkv = mixer["inputs"]["qkv_proj"]["kernel"].T
            conv = mixer["inputs"]["conv"]["kernel"].T[:, None, :]
            for x, w, c in zip("qkv", np.split(qkv, 3), np.split(conv, 3), strict=True):
                out[a + f"{x}_proj.weight"], out[a + f"{x}_conv1d.weight"] = w, c
            decay, output = mixer["decay"], mixer["output"]
            linear(a + "b_proj.weight", mixer["beta_proj"])
            linear(a + "f_a_proj.weight", decay["down"])
            linear(a + "f_b_proj.weight", decay["up"])
            out[a + "A_log"] = decay["a_log"].reshape(1, 1, h, 1)
            out[a + "dt_bias"] = decay["dt_bias"]
            out[a + "o_norm.weight"] = output["norm"]["scale"]
            linear(a + "g_a_proj.weight", output["gate_proj"])
            linear(a + "g_b_proj.weight", output["gate_up"])
            linear(a + "o_proj.weight", output["out_proj"])
        else:
            inputs = mixer["inputs"]
            if hf["q_lora_rank"]:
                linear(a + "q_a_proj.weight", inputs["q_down"])
                out[a + "q_a_layernorm.weight"] = inputs["q_norm"]["scale"]
                linear(a + "q_b_proj.weight", inputs["q_proj"])
            else:
                linear(a + "q_proj.weight", inputs["q_proj"])
            linear(a + "kv_a_proj_with_mqa.weight", inputs["kv_down"])
            out[a + "kv_a_layernorm.weight"] = inputs["kv_norm"]["scale"]
            linear(a + "kv_b_proj.weight", inputs["kv_up"])
            linear(a + "o_proj.weight", mixer["output"]["out_proj"])
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}
