"""Qwen3.5 (transformers' `qwen3_5_text`, `Qwen3_5ForCausalLM`, the text model of Qwen3.5):
its config and tensors as this library's `ModelConfig` and parameters, both ways.

The released Qwen3.5 checkpoints are multimodal (`qwen3_5`, `Qwen3_5ForConditionalGeneration`,
a vision tower beside the text model); this maps the text-only causal LM, which is what
transformers saves for `Qwen3_5ForCausalLM`. A layer is Gated DeltaNet (`linear_attention`) or
gated softmax attention (`full_attention`), each followed by a SwiGLU MLP:

| transformers                                   | here                                        |
| ---------------------------------------------- | ------------------------------------------- |
| `linear_attn.in_proj_qkv` [2·Hk·dk + Hv·dv, D] | `mixer.inputs.qkv_proj` (q | k | v, as is)  |
| `linear_attn.conv1d` [C, 1, K], no bias        | `mixer.inputs.conv.kernel` = w[:, 0, :]ᵀ    |
| `linear_attn.in_proj_b` / `in_proj_a`          | `mixer.beta_proj` / `mixer.decay.proj`      |
| `linear_attn.A_log`, `dt_bias`                 | `mixer.decay.a_log`, `dt_bias`              |
| `linear_attn.norm` [dv], shared by the heads   | `mixer.output.norm.scale` (out_norm_shared) |
| `linear_attn.in_proj_z`, `out_proj`            | `mixer.output.gate_proj`, `out_proj`        |
| `self_attn.q_proj` [H·2·hd, D], per head q|gate | q → `qkv_proj`, gate → `output.gate_proj`  |
| `self_attn.k_proj`, `v_proj` [Hkv·hd, D]       | `mixer.inputs.qkv_proj` (num_kv_heads)      |
| `self_attn.q_norm`, `k_norm` (1 + w)           | `mixer.inputs.q_norm`, `k_norm` scale       |
| `self_attn.o_proj`                             | `mixer.output.out_proj` (sigmoid gate)      |
| `input_layernorm`, `post_attention_layernorm`  | `mixer_norm`, `mlp_norm` (scale = 1 + w)    |
| `mlp.gate_proj`, `up_proj`, `down_proj`        | `mlp.w_gate`, `w_up`, `w_down`              |
| `model.embed_tokens`, `model.norm`, `lm_head`  | `embed`, `final_norm` (1 + w), `head`       |

A `nn.Linear` weight `[out, in]` is the transpose of an `nnx.Linear` kernel. transformers'
zero-centred norms apply `1 + w`; the scale stored here is that `1 + w` (the same float32
product). Rotary: the attention layers only (`layer_options`), on the first
`head_dim · partial_rotary_factor` channels, the half-split layout (Qwen3.5's multimodal rotary
sections coincide for text, where the three position streams are equal).
"""

from __future__ import annotations

import numpy as np

from linear_attention.layers.delta import GatedDeltaNetMixer
from linear_attention.layers.softmax import SoftmaxMixer
from linear_attention.models.hf.common import (  # (also imported from here by the others)
    INERT,
    Unsupported,
    initializer_field,
    initializer_range,
)

MODEL_TYPE = "qwen3_5_text"
ARCHITECTURE = "Qwen3_5ForCausalLM"
GDN, ATTENTION = GatedDeltaNetMixer.NAME, SoftmaxMixer.NAME
MIXERS = {"linear_attention": GDN, "full_attention": ATTENTION}
# The eps of the norms inside the mixers here (the output and q/k norms), which transformers
# takes from rms_norm_eps.
INNER_NORM_EPS = 1e-6

MAPPED = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "rope_parameters",
    "attention_bias",
    "attention_dropout",
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "layer_types",
)
ROPE_FIELDS = (
    "rope_type",
    "rope_theta",
    "partial_rotary_factor",
    "mrope_section",
    "mrope_interleaved",
)


def _require(hf: dict, name: str, wanted) -> None:
    if hf.get(name, wanted) != wanted:
        raise Unsupported(f"{name}={hf[name]!r} is not supported (only {wanted!r})")


def _checked_layer_types(hf: dict) -> list[str]:
    """The layer types of the transformers config `hf`, after checking every field it holds;
    `Unsupported` naming the first field it cannot represent."""
    unknown = sorted(set(hf) - set(MAPPED) - set(INERT))
    if unknown:
        raise Unsupported(f"config field {unknown[0]!r} is not understood by the qwen3_5 importer")
    missing = [
        f for f in MAPPED if f not in hf and f not in ("attention_bias", "attention_dropout")
    ]
    if missing:
        raise Unsupported(f"config field {missing[0]!r} is missing")
    _require(hf, "hidden_act", "silu")
    _require(hf, "attention_bias", False)
    _require(hf, "attention_dropout", 0.0)
    _require(hf, "rms_norm_eps", INNER_NORM_EPS)
    if hf["linear_key_head_dim"] != hf["linear_value_head_dim"]:
        raise Unsupported(
            f"linear_key_head_dim={hf['linear_key_head_dim']} differs from linear_value_head_dim="
            f"{hf['linear_value_head_dim']}: the gated_deltanet mixer has one head_dim"
        )
    rope = dict(hf["rope_parameters"] or {})
    for name in sorted(set(rope) - set(ROPE_FIELDS)):
        raise Unsupported(f"config field 'rope_parameters.{name}' is not understood")
    _require(rope, "rope_type", "default")
    layer_types = list(hf["layer_types"])
    if len(layer_types) != hf["num_hidden_layers"]:
        raise Unsupported(
            f"layer_types has {len(layer_types)} entries for num_hidden_layers="
            f"{hf['num_hidden_layers']}"
        )
    for kind in layer_types:
        if kind not in MIXERS:
            raise Unsupported(f"layer type {kind!r} is not supported (known: {', '.join(MIXERS)})")
    return layer_types


def _layer_options(hf: dict, layer_types: list[str]) -> dict:
    """`ModelConfig.layer_options` of each mixer the layers of `hf` use."""
    rope = dict(hf["rope_parameters"] or {})
    head_dim = hf["head_dim"]
    rotary_dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    layer_options = {}
    if "linear_attention" in layer_types:
        layer_options[GDN] = dict(
            num_heads=hf["linear_num_key_heads"],
            head_dim=hf["linear_value_head_dim"],
            num_value_heads=hf["linear_num_value_heads"],
            conv=hf["linear_conv_kernel_dim"],
            conv_bias=False,
            out_norm_shared=True,
        )
    if "full_attention" in layer_types:
        layer_options[ATTENTION] = dict(
            num_heads=hf["num_attention_heads"],
            head_dim=head_dim,
            num_kv_heads=hf["num_key_value_heads"],
            qk_norm=True,
            rope=True,
            rope_base=float(rope.get("rope_theta", 10000.0)),
            rotary_dim=None if rotary_dim == head_dim else rotary_dim,
            out_gate=True,
            gate_activation="sigmoid",
        )
    return layer_options


def model_options(hf: dict) -> dict:
    """`ModelConfig` keyword arguments for the transformers config `hf` (a dict, as in
    config.json); `Unsupported` naming the first field it cannot represent."""
    layer_types = _checked_layer_types(hf)
    layer_options = _layer_options(hf, layer_types)
    return dict(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["linear_num_key_heads"],
        mixer=tuple(MIXERS[kind] for kind in layer_types),
        mlp=True,
        mlp_dim=hf["intermediate_size"],
        norm_eps=float(hf["rms_norm_eps"]),
        max_length=hf["max_position_embeddings"],
        tie_embeddings=bool(hf["tie_word_embeddings"]),
        position="none",
        layer_options=layer_options,
        initializer_range=initializer_range(hf),
    )


def hf_config(config) -> dict:
    """The transformers config (config.json's dict) of a `ModelConfig` in qwen3_5's shape, the
    inverse of `model_options` (the caller checks that it is one)."""
    kinds = {v: k for k, v in MIXERS.items()}
    layers = dict(config.layer_options)
    gdn = dict(layers.get(GDN, ()))
    attn = dict(layers.get(ATTENTION, ()))
    head_dim = attn.get("head_dim", 2 * gdn.get("head_dim", 64))
    rotary_dim = attn.get("rotary_dim") or head_dim
    # (a model without an attention or a linear layer still names the other's sizes)
    return dict(
        architectures=[ARCHITECTURE],
        model_type=MODEL_TYPE,
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=config.mlp_dim or int(config.mlp_ratio * config.d_model),
        num_hidden_layers=config.num_layers,
        num_attention_heads=attn.get("num_heads", config.num_heads),
        num_key_value_heads=attn.get("num_kv_heads") or attn.get("num_heads", config.num_heads),
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=config.max_length,
        rms_norm_eps=config.norm_eps,
        tie_word_embeddings=config.tie_embeddings,
        rope_parameters=dict(
            rope_type="default",
            rope_theta=attn.get("rope_base", 10000.0),
            partial_rotary_factor=rotary_dim / head_dim,
        ),
        attention_bias=False,
        attention_dropout=0.0,
        linear_conv_kernel_dim=gdn.get("conv", 4),
        linear_key_head_dim=gdn.get("head_dim", config.d_model // config.num_heads),
        linear_value_head_dim=gdn.get("head_dim", config.d_model // config.num_heads),
        linear_num_key_heads=gdn.get("num_heads", config.num_heads),
        linear_num_value_heads=gdn.get("num_value_heads") or gdn.get("num_heads", config.num_heads),
        layer_types=[kinds[m] for m in config.layer_mixers],
        dtype="float32",
        **initializer_field(config, "qwen3_5"),
    )


def dense_mlp_shapes(hf: dict, prefix: str) -> dict[str, tuple[int, ...]]:
    """The SwiGLU MLP's tensors under `prefix` (`model.layers.{i}.mlp.`)."""
    d, inter = hf["hidden_size"], hf["intermediate_size"]
    return {
        prefix + "gate_proj.weight": (inter, d),
        prefix + "up_proj.weight": (inter, d),
        prefix + "down_proj.weight": (d, inter),
    }


def dense_mlp_params(get, prefix: str) -> dict:
    return {
        "w_gate": {"kernel": get(prefix + "gate_proj.weight").T},
        "w_up": {"kernel": get(prefix + "up_proj.weight").T},
        "w_down": {"kernel": get(prefix + "down_proj.weight").T},
    }


def dense_mlp_tensors(mlp: dict, prefix: str) -> dict[str, np.ndarray]:
    return {
        prefix + f"{theirs}.weight": mlp[ours]["kernel"].T
        for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj"))
    }


# transformers' default router_aux_loss_coef, written on export when the loss is off.
HF_AUX_LOSS_COEF = 0.001


def moe_aux_loss_coef(hf: dict) -> float:
    """`ModelConfig.moe_aux_loss_coef` of a MoE config `hf`: its `router_aux_loss_coef` when
    `output_router_logits` is true (transformers adds the load-balancing loss then only), else
    0."""
    if not hf.get("output_router_logits", False):
        return 0.0
    return float(hf.get("router_aux_loss_coef", HF_AUX_LOSS_COEF))


def aux_loss_fields(config) -> dict:
    """The inverse of `moe_aux_loss_coef`: `output_router_logits` and `router_aux_loss_coef`."""
    coef = config.moe_aux_loss_coef
    return dict(output_router_logits=coef > 0, router_aux_loss_coef=coef or HF_AUX_LOSS_COEF)


def moe_mlp_shapes(hf: dict, prefix: str) -> dict[str, tuple[int, ...]]:
    """The mixture-of-experts MLP's tensors under `prefix` (Qwen3-Next's and Qwen3.5-MoE's):
    the router `gate`, each expert's SwiGLU, the shared expert and its sigmoid gate."""
    d, i = hf["hidden_size"], hf["moe_intermediate_size"]
    shapes = {
        prefix + "gate.weight": (hf["num_experts"], d),
        prefix + "shared_expert_gate.weight": (1, d),
    }
    for e in range(hf["num_experts"]):
        shapes.update(dense_mlp_shapes(dict(hf, intermediate_size=i), f"{prefix}experts.{e}."))
    s = hf["shared_expert_intermediate_size"]
    shapes.update(dense_mlp_shapes(dict(hf, intermediate_size=s), prefix + "shared_expert."))
    return shapes


def moe_mlp_params(hf: dict):
    """`mlp_params` for the mixture-of-experts MLP (`layers.moe.MoE`): experts stacked
    `[E, D, I]` / `[E, I, D]`."""

    def params(get, prefix: str) -> dict:
        experts = range(hf["num_experts"])

        def stack(name):
            return np.stack([get(f"{prefix}experts.{e}.{name}.weight").T for e in experts])

        return {
            "router": {"kernel": get(prefix + "gate.weight").T},
            "w_gate": stack("gate_proj"),
            "w_up": stack("up_proj"),
            "w_down": stack("down_proj"),
            "shared": dense_mlp_params(get, prefix + "shared_expert."),
            "shared_gate": {"kernel": get(prefix + "shared_expert_gate.weight").T},
        }

    return params


def moe_mlp_tensors(mlp: dict, prefix: str) -> dict[str, np.ndarray]:
    """The inverse of `moe_mlp_params`: one tensor per expert and projection."""
    out = {
        prefix + "gate.weight": mlp["router"]["kernel"].T,
        prefix + "shared_expert_gate.weight": mlp["shared_gate"]["kernel"].T,
    }
    out.update(dense_mlp_tensors(mlp["shared"], prefix + "shared_expert."))
    for e in range(mlp["w_gate"].shape[0]):
        for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
            out[f"{prefix}experts.{e}.{theirs}.weight"] = mlp[ours][e].T
    return out


def tensor_shapes(hf: dict, mlp_shapes=dense_mlp_shapes) -> dict[str, tuple[int, ...]]:
    """Every tensor a `Qwen3_5ForCausalLM` of config `hf` holds, with its shape (each layer's
    MLP from `mlp_shapes(hf, prefix)`)."""
    d, v = hf["hidden_size"], hf["vocab_size"]
    hk, hv = hf["linear_num_key_heads"], hf["linear_num_value_heads"]
    dk, dv, k = hf["linear_key_head_dim"], hf["linear_value_head_dim"], hf["linear_conv_kernel_dim"]
    h, hkv, hd = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not hf["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, d)
    for i, kind in enumerate(hf["layer_types"]):
        p = f"model.layers.{i}."
        shapes.update(
            {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)}
        )
        shapes.update(mlp_shapes(hf, p + "mlp."))
        if kind == "linear_attention":
            c = 2 * hk * dk + hv * dv
            a = p + "linear_attn."
            shapes.update(
                {
                    a + "in_proj_qkv.weight": (c, d),
                    a + "conv1d.weight": (c, 1, k),
                    a + "in_proj_z.weight": (hv * dv, d),
                    a + "in_proj_b.weight": (hv, d),
                    a + "in_proj_a.weight": (hv, d),
                    a + "A_log": (hv,),
                    a + "dt_bias": (hv,),
                    a + "norm.weight": (dv,),
                    a + "out_proj.weight": (d, hv * dv),
                }
            )
        else:
            a = p + "self_attn."
            shapes.update(
                {
                    a + "q_proj.weight": (h * 2 * hd, d),
                    a + "k_proj.weight": (hkv * hd, d),
                    a + "v_proj.weight": (hkv * hd, d),
                    a + "q_norm.weight": (hd,),
                    a + "k_norm.weight": (hd,),
                    a + "o_proj.weight": (d, h * hd),
                }
            )
    return shapes


def _linear(get, name: str) -> dict:
    return {"kernel": get(name).T}


def _norm(get, name: str) -> dict:  # zero-centred: transformers applies 1 + w
    return {"scale": 1.0 + get(name)}


def _gdn_params(get, a: str) -> dict:
    """A Gated DeltaNet layer's mixer from its tensors under `a` (`...linear_attn.`)."""
    return {
        "inputs": {
            "qkv_proj": _linear(get, a + "in_proj_qkv.weight"),
            "conv": {"kernel": get(a + "conv1d.weight")[:, 0, :].T},
        },
        "beta_proj": _linear(get, a + "in_proj_b.weight"),
        "decay": {
            "proj": _linear(get, a + "in_proj_a.weight"),
            "a_log": get(a + "A_log"),
            "dt_bias": get(a + "dt_bias"),
        },
        "output": {
            "norm": {"scale": get(a + "norm.weight")},
            "gate_proj": _linear(get, a + "in_proj_z.weight"),
            "out_proj": _linear(get, a + "out_proj.weight"),
        },
    }


def _attention_params(hf: dict, get, a: str) -> dict:
    """A gated attention layer's mixer from its tensors under `a` (`...self_attn.`)."""
    h, hd = hf["num_attention_heads"], hf["head_dim"]
    q_gate = get(a + "q_proj.weight").reshape(h, 2, hd, -1)  # per head: q, then gate
    q, gate = q_gate[:, 0].reshape(h * hd, -1), q_gate[:, 1].reshape(h * hd, -1)
    qkv = np.concatenate([q, get(a + "k_proj.weight"), get(a + "v_proj.weight")])
    return {
        "inputs": {
            "qkv_proj": {"kernel": qkv.T},
            "q_norm": _norm(get, a + "q_norm.weight"),
            "k_norm": _norm(get, a + "k_norm.weight"),
        },
        "output": {
            "gate_proj": {"kernel": gate.T},
            "out_proj": _linear(get, a + "o_proj.weight"),
        },
    }


def to_params(hf: dict, get, mlp_params=dense_mlp_params) -> dict:
    """This library's parameters (a nested dict as `nnx.to_pure_dict` gives, float32 arrays)
    from the tensors `get(name) -> np.ndarray float32` of a checkpoint of config `hf` (each
    layer's MLP by `mlp_params(get, prefix)`)."""
    blocks = {}
    for i, kind in enumerate(hf["layer_types"]):
        p = f"model.layers.{i}."
        blocks[i] = {
            "mixer_norm": _norm(get, p + "input_layernorm.weight"),
            "mlp_norm": _norm(get, p + "post_attention_layernorm.weight"),
            "mlp": mlp_params(get, p + "mlp."),
            "mixer": (
                _gdn_params(get, p + "linear_attn.")
                if kind == "linear_attention"
                else _attention_params(hf, get, p + "self_attn.")
            ),
        }
    params = {
        "embed": {"embedding": get("model.embed_tokens.weight")},
        "final_norm": _norm(get, "model.norm.weight"),
        "blocks": blocks,
    }
    if not hf["tie_word_embeddings"]:
        params["head"] = _linear(get, "lm_head.weight")
    return params


def from_params(hf: dict, params: dict, mlp_tensors=dense_mlp_tensors) -> dict[str, np.ndarray]:
    """The checkpoint tensors (float32) of `params` (as `to_params` makes them), the inverse of
    `to_params` (each layer's MLP by `mlp_tensors(mlp, prefix)`)."""
    out = {}

    def linear(name, p):
        out[name] = p["kernel"].T

    def norm(name, p):
        out[name] = p["scale"] - 1.0

    out["model.embed_tokens.weight"] = params["embed"]["embedding"]
    norm("model.norm.weight", params["final_norm"])
    if not hf["tie_word_embeddings"]:
        linear("lm_head.weight", params["head"])
    for i, kind in enumerate(hf["layer_types"]):
        p, block = f"model.layers.{i}.", params["blocks"][i]
        norm(p + "input_layernorm.weight", block["mixer_norm"])
        norm(p + "post_attention_layernorm.weight", block["mlp_norm"])
        out.update(mlp_tensors(block["mlp"], p + "mlp."))
        mixer = block["mixer"]
        if kind == "linear_attention":
            a = p + "linear_attn."
            linear(a + "in_proj_qkv.weight", mixer["inputs"]["qkv_proj"])
            out[a + "conv1d.weight"] = mixer["inputs"]["conv"]["kernel"].T[:, None, :]
            linear(a + "in_proj_b.weight", mixer["beta_proj"])
            linear(a + "in_proj_a.weight", mixer["decay"]["proj"])
            out[a + "A_log"] = mixer["decay"]["a_log"]
            out[a + "dt_bias"] = mixer["decay"]["dt_bias"]
            out[a + "norm.weight"] = mixer["output"]["norm"]["scale"]
            linear(a + "in_proj_z.weight", mixer["output"]["gate_proj"])
            linear(a + "out_proj.weight", mixer["output"]["out_proj"])
        else:
            a = p + "self_attn."
            h, hkv, hd = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
            qkv = mixer["inputs"]["qkv_proj"]["kernel"].T
            q, k, v = np.split(qkv, [h * hd, (h + hkv) * hd])
            gate = mixer["output"]["gate_proj"]["kernel"].T
            q_gate = np.stack([q.reshape(h, hd, -1), gate.reshape(h, hd, -1)], axis=1)
            out[a + "q_proj.weight"] = q_gate.reshape(h * 2 * hd, -1)
            out[a + "k_proj.weight"], out[a + "v_proj.weight"] = k, v
            norm(a + "q_norm.weight", mixer["inputs"]["q_norm"])
            norm(a + "k_norm.weight", mixer["inputs"]["k_norm"])
            linear(a + "o_proj.weight", mixer["output"]["out_proj"])
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}
