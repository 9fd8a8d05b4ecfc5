"""OLMo Hybrid (transformers' `olmo_hybrid`, `OlmoHybridForCausalLM`): its config and tensors
as this library's `ModelConfig` and parameters, both ways.

A layer is Gated DeltaNet (`linear_attention`) or softmax attention (`full_attention`), each
followed by a SwiGLU MLP. Where it differs from Qwen3.5 (`qwen3_5.py`):

- the attention layers are post-norm, `x + norm(attn(x))` then `x + norm(mlp(x))`
  (`layer_options.softmax.norm_position="post"`), the Gated DeltaNet layers pre-norm;
- attention: q and k each RMS-normalised over the whole projection, one scale per channel
  (`qk_norm_all_heads`), no output gate, rotary on every channel of the head, or none at all
  when `rope_parameters.rope_theta` is null (the released checkpoints: NoPE); the head width is
  `head_dim` when config.json has one, else `hidden_size // num_attention_heads`;
- Gated DeltaNet: separate q, k, v, a, b and gate projections; keys of `linear_key_head_dim`
  (`state_dim`) and values of `linear_value_head_dim` (`head_dim`, twice as wide by default);
  β = 2·sigmoid with `linear_allow_neg_eigval`; the gated output RMSNorm has eps 1e-5
  (`out_norm_eps`), whatever `rms_norm_eps`;
- every RMSNorm applies its weight w (not 1 + w): the scale here is w, as is.

The tensors as the released checkpoints store them (transformers' loader renames
`attention_layer_norm` and `feedforward_layer_norm` to its modules' `input_layernorm` and
`post_attention_layernorm`, and concatenates the three convs into its `conv1d`):

| stored (`model.layers.{i}.`)                      | here (`blocks[i].`)                      |
| ------------------------------------------------- | ---------------------------------------- |
| `linear_attn.q_proj`, `k_proj`, `v_proj`          | `mixer.inputs.qkv_proj` (q, k, v)        |
| `linear_attn.{q,k,v}_conv1d` [C, 1, K], no bias   | `mixer.inputs.conv.kernel` [K, ΣC]       |
| `linear_attn.b_proj`, `a_proj` [Hv, D]            | `mixer.beta_proj`, `mixer.decay.proj`    |
| `linear_attn.A_log`, `dt_bias` [Hv]               | `mixer.decay.a_log`, `dt_bias`           |
| `linear_attn.o_norm` [dv], shared by the heads    | `mixer.output.norm.scale`                |
| `linear_attn.g_proj`, `o_proj`                    | `mixer.output.gate_proj`, `out_proj`     |
| `attention_layer_norm`, `feedforward_layer_norm`  | `mixer_norm`, `mlp_norm` (pre-norm)      |
| `self_attn.q_proj`, `k_proj`, `v_proj`            | `mixer.inputs.qkv_proj` (q, k, v)        |
| `self_attn.q_norm` [H·hd], `k_norm` [Hkv·hd]      | `mixer.inputs.q_norm`, `k_norm` scale    |
| `self_attn.o_proj`                                | `mixer.output.out_proj`                  |
| `feedforward_layer_norm`, `post_feedforward_layernorm` | `mixer_norm`, `mlp_norm` (post-norm) |
| `mlp.gate_proj`, `up_proj`, `down_proj`           | `mlp.w_gate`, `w_up`, `w_down`           |
| `model.embed_tokens`, `model.norm`, `lm_head`     | `embed`, `final_norm`, `head`            |

Also read (`STORED_FORMS`): the modules' own names (`input_layernorm`,
`post_attention_layernorm`, a fused `linear_attn.conv1d`), and the three convs split at other
channels than q | k | v, as transformers' `save_pretrained` writes them (three equal parts of
the fused conv): like transformers' loader, only their concatenation counts.

A `nn.Linear` weight `[out, in]` is the transpose of an `nnx.Linear` kernel.
"""

from __future__ import annotations

import re

import numpy as np

from linear_attention.layers.delta import GatedDeltaNetMixer
from linear_attention.layers.options import conv_kernel_size
from linear_attention.layers.softmax import SoftmaxMixer
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
from linear_attention.models.init import DT_FLOOR, DT_MAX, DT_MIN, OLMO_A_MAX, OLMO_A_MIN

MODEL_TYPE = "olmo_hybrid"
ARCHITECTURE = "OlmoHybridForCausalLM"
GDN, ATTENTION = GatedDeltaNetMixer.NAME, SoftmaxMixer.NAME
MIXERS = {"linear_attention": GDN, "full_attention": ATTENTION}
# The eps of the q/k norms here, which transformers takes from rms_norm_eps.
QK_NORM_EPS = 1e-6
# The eps of the Gated DeltaNet's gated output norm (fixed in transformers, as FLA's default).
GATED_NORM_EPS = 1e-5
# Fields that only set the initialisation of A_log and dt_bias, with the values (transformers'
# defaults) that `models.init` draws with.
INIT_ONLY = {
    "linear_a_log_min": OLMO_A_MIN,
    "linear_a_log_max": OLMO_A_MAX,
    "linear_dt_min": DT_MIN,
    "linear_dt_max": DT_MAX,
    "linear_dt_init_floor": DT_FLOOR,
}
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
    "layer_types",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
    "linear_allow_neg_eigval",
)
# Read when present: the attention head width (else hidden_size // num_attention_heads).
OPTIONAL = ("head_dim",)
ROPE_FIELDS = ("rope_type", "rope_theta")


def _require(hf: dict, name: str, wanted) -> None:
    if hf[name] != wanted:
        raise Unsupported(f"{name}={hf[name]!r} is not supported (only {wanted!r})")


def head_dim(hf: dict) -> int:
    """The attention layers' head width, as transformers takes it."""
    return hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]


def _rope_theta(hf: dict) -> float | None:
    """The attention layers' rotary base, or None: no rotary (NoPE)."""
    rope = hf["rope_parameters"]
    if rope is None:  # transformers would fill in its default rotary: say which is meant
        raise Unsupported(
            "rope_parameters=None is not supported: transformers fills in a default rotary; "
            "give rope_parameters.rope_theta (a number, or null for no rotary)"
        )
    for name in sorted(set(rope) - set(ROPE_FIELDS)):
        raise Unsupported(f"config field 'rope_parameters.{name}' is not understood")
    if rope.get("rope_type") != "default":
        raise Unsupported(f"rope_type={rope.get('rope_type')!r} is not supported (only 'default')")
    if "rope_theta" not in rope:
        raise Unsupported("config field 'rope_parameters.rope_theta' is missing")
    theta = rope["rope_theta"]
    return None if theta is None else float(theta)


def _checked_layer_types(hf: dict) -> list[str]:
    """The layer types of `hf`, after checking every field it holds; `Unsupported` naming the
    first field it cannot represent."""
    unknown = sorted(set(hf) - set(MAPPED) - set(OPTIONAL) - set(INERT) - set(INIT_ONLY))
    if unknown:
        raise Unsupported(
            f"config field {unknown[0]!r} is not understood by the {MODEL_TYPE} importer"
        )
    missing = [f for f in MAPPED if f not in hf]
    if missing:
        raise Unsupported(f"config field {missing[0]!r} is missing")
    _require(hf, "hidden_act", "silu")
    _require(hf, "attention_bias", False)
    _require(hf, "attention_dropout", 0.0)
    _require(hf, "rms_norm_eps", QK_NORM_EPS)
    for name, wanted in INIT_ONLY.items():
        if name in hf and hf[name] != wanted:  # (initializer_range's draws use these)
            raise Unsupported(f"{name}={hf[name]!r} is not supported (only {wanted!r})")
    _rope_theta(hf)
    layer_types = list(hf["layer_types"])
    if len(layer_types) != hf["num_hidden_layers"]:
        raise Unsupported(
            f"layer_types has {len(layer_types)} entries for num_hidden_layers="
            f"{hf['num_hidden_layers']}"
        )
    for kind in layer_types:
        if kind not in MIXERS:
            raise Unsupported(f"layer type {kind!r} is not supported (known: {', '.join(MIXERS)})")
    for kind in MIXERS:  # (transformers' own rule)
        if kind not in layer_types:
            raise Unsupported(f"layer_types has no {kind!r} layer; {MODEL_TYPE} needs one")
    return layer_types


def model_options(hf: dict) -> dict:
    """`ModelConfig` keyword arguments for the transformers config `hf` (a dict, as in
    config.json); `Unsupported` naming the first field it cannot represent."""
    layer_types = _checked_layer_types(hf)
    theta = _rope_theta(hf)
    attention = dict(
        num_heads=hf["num_attention_heads"],
        head_dim=head_dim(hf),
        num_kv_heads=hf["num_key_value_heads"],
        qk_norm=True,
        qk_norm_all_heads=True,
        rope=theta is not None,
        norm_position="post",
    )
    if theta is not None:
        attention["rope_base"] = theta
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
        **initializer_options(hf, MODEL_TYPE),
        layer_options={
            GDN: dict(
                num_heads=hf["linear_num_key_heads"],
                head_dim=hf["linear_value_head_dim"],
                state_dim=hf["linear_key_head_dim"],
                num_value_heads=hf["linear_num_value_heads"],
                conv=hf["linear_conv_kernel_dim"],
                conv_bias=False,
                out_norm_shared=True,
                out_norm_eps=GATED_NORM_EPS,
                allow_neg_eigval=bool(hf["linear_allow_neg_eigval"]),
            ),
            ATTENTION: attention,
        },
    )


def hf_config(config) -> dict:
    """The transformers config (config.json's dict) of a `ModelConfig` in olmo_hybrid's shape,
    the inverse of `model_options` (the caller checks that it is one); `Unsupported` without a
    layer of each type."""
    kinds = {v: k for k, v in MIXERS.items()}
    for name in (GDN, ATTENTION):
        if name not in config.layer_mixers:
            raise Unsupported(f"{MODEL_TYPE} needs a {name} layer and a layer of each type")
    gdn, attn = config.mixer_config(GDN), config.mixer_config(ATTENTION)
    gdn_heads, heads = config.layer_num_heads(GDN), config.layer_num_heads(ATTENTION)
    value_dim = gdn.head_dim or config.d_model // gdn_heads
    return dict(
        architectures=[ARCHITECTURE],
        model_type=MODEL_TYPE,
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        intermediate_size=config.mlp_dim or int(config.mlp_ratio * config.d_model),
        num_hidden_layers=config.num_layers,
        num_attention_heads=heads,
        num_key_value_heads=attn.num_kv_heads or heads,
        head_dim=attn.head_dim or config.d_model // heads,
        hidden_act="silu",
        max_position_embeddings=config.max_length,
        rms_norm_eps=config.norm_eps,
        tie_word_embeddings=config.tie_embeddings,
        rope_parameters=dict(rope_type="default", rope_theta=attn.rope_base if attn.rope else None),
        attention_bias=False,
        attention_dropout=0.0,
        layer_types=[kinds.get(m, m) for m in config.layer_mixers],
        linear_num_key_heads=gdn_heads,
        linear_num_value_heads=gdn.num_value_heads or gdn_heads,
        linear_key_head_dim=gdn.state_dim or value_dim,
        linear_value_head_dim=value_dim,
        linear_conv_kernel_dim=conv_kernel_size(gdn.conv),
        linear_allow_neg_eigval=gdn.allow_neg_eigval,
        # Token ids are not part of the model here (a converted run's generation_config.json
        # carries them); transformers' defaults, 100277 and 100257, would lie outside a
        # smaller vocabulary.
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
        dtype="float32",
        **initializer_field(config, MODEL_TYPE),
    )


def tensor_shapes(hf: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor an `OlmoHybridForCausalLM` of config `hf` holds, with its shape."""
    d, v = hf["hidden_size"], hf["vocab_size"]
    hk, hv = hf["linear_num_key_heads"], hf["linear_num_value_heads"]
    dk, dv, k = hf["linear_key_head_dim"], hf["linear_value_head_dim"], hf["linear_conv_kernel_dim"]
    h, hkv, hd = hf["num_attention_heads"], hf["num_key_value_heads"], head_dim(hf)
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not hf["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, d)
    for i, kind in enumerate(hf["layer_types"]):
        p = f"model.layers.{i}."
        shapes.update(dense_mlp_shapes(hf, p + "mlp."))
        if kind == "linear_attention":
            a = p + "linear_attn."
            shapes.update(
                {
                    p + "attention_layer_norm.weight": (d,),
                    p + "feedforward_layer_norm.weight": (d,),
                    a + "q_proj.weight": (hk * dk, d),
                    a + "k_proj.weight": (hk * dk, d),
                    a + "v_proj.weight": (hv * dv, d),
                    a + "q_conv1d.weight": (hk * dk, 1, k),
                    a + "k_conv1d.weight": (hk * dk, 1, k),
                    a + "v_conv1d.weight": (hv * dv, 1, k),
                    a + "a_proj.weight": (hv, d),
                    a + "b_proj.weight": (hv, d),
                    a + "A_log": (hv,),
                    a + "dt_bias": (hv,),
                    a + "g_proj.weight": (hv * dv, d),
                    a + "o_norm.weight": (dv,),
                    a + "o_proj.weight": (d, hv * dv),
                }
            )
        else:
            a = p + "self_attn."
            shapes.update(
                {
                    p + "feedforward_layer_norm.weight": (d,),
                    p + "post_feedforward_layernorm.weight": (d,),
                    a + "q_proj.weight": (h * hd, d),
                    a + "k_proj.weight": (hkv * hd, d),
                    a + "v_proj.weight": (hkv * hd, d),
                    a + "q_norm.weight": (h * hd,),
                    a + "k_norm.weight": (hkv * hd,),
                    a + "o_proj.weight": (d, h * hd),
                }
            )
    return shapes


# Each layer type's block norms as stored: (the mixer's, the MLP's), before them in the linear
# layers and after them in the attention layers.
BLOCK_NORMS = {
    "linear_attention": ("attention_layer_norm", "feedforward_layer_norm"),
    "full_attention": ("feedforward_layer_norm", "post_feedforward_layernorm"),
}


def to_params(hf: dict, get) -> dict:
    """This library's parameters (a nested dict as `nnx.to_pure_dict` gives, float32 arrays)
    from the tensors `get(name) -> np.ndarray float32` of a checkpoint of config `hf`."""

    def linear(name):
        return {"kernel": get(name).T}

    blocks = {}
    for i, kind in enumerate(hf["layer_types"]):
        p = f"model.layers.{i}."
        mixer_norm, mlp_norm = BLOCK_NORMS[kind]
        if kind == "linear_attention":
            a = p + "linear_attn."
            qkv = [get(a + f"{x}_proj.weight") for x in "qkv"]
            conv = [get(a + f"{x}_conv1d.weight")[:, 0, :] for x in "qkv"]
            mixer = {
                "inputs": {
                    "qkv_proj": {"kernel": np.concatenate(qkv).T},
                    "conv": {"kernel": np.concatenate(conv).T},
                },
                "beta_proj": linear(a + "b_proj.weight"),
                "decay": {
                    "proj": linear(a + "a_proj.weight"),
                    "a_log": get(a + "A_log"),
                    "dt_bias": get(a + "dt_bias"),
                },
                "output": {
                    "norm": {"scale": get(a + "o_norm.weight")},
                    "gate_proj": linear(a + "g_proj.weight"),
                    "out_proj": linear(a + "o_proj.weight"),
                },
            }
        else:
            a = p + "self_attn."
            qkv = [get(a + f"{x}_proj.weight") for x in "qkv"]
            mixer = {
                "inputs": {
                    "qkv_proj": {"kernel": np.concatenate(qkv).T},
                    "q_norm": {"scale": get(a + "q_norm.weight")},
                    "k_norm": {"scale": get(a + "k_norm.weight")},
                },
                "output": {"out_proj": linear(a + "o_proj.weight")},
            }
        blocks[i] = {
            "mixer_norm": {"scale": get(p + mixer_norm + ".weight")},
            "mlp_norm": {"scale": get(p + mlp_norm + ".weight")},
            "mlp": dense_mlp_params(get, p + "mlp."),
            "mixer": mixer,
        }
    params = {
        "embed": {"embedding": get("model.embed_tokens.weight")},
        "final_norm": {"scale": get("model.norm.weight")},
        "blocks": blocks,
    }
    if not hf["tie_word_embeddings"]:
        params["head"] = linear("lm_head.weight")
    return params


def from_params(hf: dict, params: dict) -> dict[str, np.ndarray]:
    """The checkpoint tensors (float32) of `params` (as `to_params` makes them), the inverse of
    `to_params`."""
    out = {
        "model.embed_tokens.weight": params["embed"]["embedding"],
        "model.norm.weight": params["final_norm"]["scale"],
    }
    if not hf["tie_word_embeddings"]:
        out["lm_head.weight"] = params["head"]["kernel"].T
    hk, dk = hf["linear_num_key_heads"], hf["linear_key_head_dim"]
    h, hkv, hd = hf["num_attention_heads"], hf["num_key_value_heads"], head_dim(hf)
    for i, kind in enumerate(hf["layer_types"]):
        p, block = f"model.layers.{i}.", params["blocks"][i]
        mixer_norm, mlp_norm = BLOCK_NORMS[kind]
        out[p + mixer_norm + ".weight"] = block["mixer_norm"]["scale"]
        out[p + mlp_norm + ".weight"] = block["mlp_norm"]["scale"]
        out.update(dense_mlp_tensors(block["mlp"], p + "mlp."))
        mixer = block["mixer"]
        qkv = mixer["inputs"]["qkv_proj"]["kernel"].T
        if kind == "linear_attention":
            a = p + "linear_attn."
            q, k, v = np.split(qkv, [hk * dk, 2 * hk * dk])
            conv = np.split(mixer["inputs"]["conv"]["kernel"].T[:, None, :], [hk * dk, 2 * hk * dk])
            for x, part in zip("qkv", conv, strict=True):
                out[a + f"{x}_conv1d.weight"] = part
            out[a + "b_proj.weight"] = mixer["beta_proj"]["kernel"].T
            out[a + "a_proj.weight"] = mixer["decay"]["proj"]["kernel"].T
            out[a + "A_log"] = mixer["decay"]["a_log"]
            out[a + "dt_bias"] = mixer["decay"]["dt_bias"]
            out[a + "o_norm.weight"] = mixer["output"]["norm"]["scale"]
            out[a + "g_proj.weight"] = mixer["output"]["gate_proj"]["kernel"].T
        else:
            a = p + "self_attn."
            q, k, v = np.split(qkv, [h * hd, (h + hkv) * hd])
            out[a + "q_norm.weight"] = mixer["inputs"]["q_norm"]["scale"]
            out[a + "k_norm.weight"] = mixer["inputs"]["k_norm"]["scale"]
        out[a + "q_proj.weight"], out[a + "k_proj.weight"], out[a + "v_proj.weight"] = q, k, v
        out[a + "o_proj.weight"] = mixer["output"]["out_proj"]["kernel"].T
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


# The modules' names of the stored norms (transformers' loader renames the stored ones to them).
MODULE_NORMS = {
    "input_layernorm": "attention_layer_norm",
    "post_attention_layernorm": "feedforward_layer_norm",
}
CONV_PARTS = tuple(f"{x}_conv1d.weight" for x in "qkv")
_LAYER = re.compile(r"^(model\.layers\.\d+\.)(.*)$")


def _conv_sources(a: str, stored: list[str], shapes: dict, out: dict) -> dict:
    """For the Gated DeltaNet layer under `a`: the shapes of its q, k, v conv parts into `out`,
    and `{part name: (stored names, rows of their concatenation)}`."""
    parts = [a + c for c in CONV_PARTS]
    if stored != [a + "conv1d.weight"] and stored != sorted(parts):
        raise ValueError(
            f"the convs of {a}* are {stored}: expected {a}conv1d.weight, or "
            f"{a}q_conv1d.weight, k_conv1d.weight and v_conv1d.weight"
        )
    stored = stored if len(stored) == 1 else parts  # (q, k, v in order)
    projections = [a + f"{x}_proj.weight" for x in "qkv"]
    if any(p not in shapes for p in projections):  # (reported by name by the tensor check)
        out.update({name: tuple(shapes[name]) for name in stored})
        return {}
    kernel = {tuple(shapes[name])[1:] for name in stored}
    if any(len(shapes[name]) != 3 or shapes[name][1] != 1 for name in stored) or len(kernel) > 1:
        got = ", ".join(f"{name} {tuple(shapes[name])}" for name in stored)
        raise ValueError(f"conv tensors {got}: expected [C, 1, K] with one K")
    widths = [shapes[p][0] for p in projections]
    total = sum(shapes[name][0] for name in stored)
    if total != sum(widths):
        raise ValueError(
            f"the convs of {a}* hold {total} channels; q_proj, k_proj and v_proj give "
            f"{' + '.join(map(str, widths))} = {sum(widths)}"
        )
    sources, start = {}, 0
    for part, width in zip(parts, widths, strict=True):
        out[part] = (width, 1, shapes[stored[0]][2])
        sources[part] = (tuple(stored), slice(start, start + width))
        start += width
    return sources


def stored_convs_and_norms(shapes: dict) -> tuple[dict, object]:
    """A stored form (`models.hf.from_pretrained`): `(shapes under the names above, wrap)`.
    Norms under their modules' names are renamed; each Gated DeltaNet layer's conv, stored as
    one fused `conv1d` or as three parts split anywhere, is read as the concatenation of what
    is stored, re-split at the q | k | v widths of its `q_proj`, `k_proj`, `v_proj`.
    `wrap(get)` reads a tensor by the names above. ValueError naming the tensors when a norm
    is stored under both names, or the convs' channels are not the projections' sum."""
    out, renamed, convs = {}, {}, {}
    for name, shape in shapes.items():
        layer = _LAYER.match(name)
        rest = layer.group(2) if layer else ""
        if rest.removesuffix(".weight") in MODULE_NORMS:
            target = layer.group(1) + MODULE_NORMS[rest.removesuffix(".weight")] + ".weight"
            if target in shapes:
                raise ValueError(f"tensors {name!r} and {target!r} are the same norm; keep one")
            renamed[target] = name
            out[target] = tuple(shape)
        elif rest in ("linear_attn.conv1d.weight", *(f"linear_attn.{c}" for c in CONV_PARTS)):
            convs.setdefault(layer.group(1) + "linear_attn.", []).append(name)
        else:
            out[name] = tuple(shape)
    sources = {}
    for a, stored in convs.items():
        sources.update(_conv_sources(a, sorted(stored), shapes, out))

    def wrap(get):
        fused = {}  # each layer's concatenated conv, read once for its three parts

        def read(name):
            if name in renamed:
                return get(renamed[name])
            if name not in sources:
                return get(name)
            parts, rows = sources[name]
            if parts not in fused:
                fused.clear()
                fused[parts] = np.concatenate([get(p) for p in parts])
            return fused[parts][rows]

        return read

    return out, wrap


STORED_FORMS = (stored_convs_and_norms,)
