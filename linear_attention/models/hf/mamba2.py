"""Mamba-2 (transformers' `mamba2`, `Mamba2ForCausalLM`): its config and tensors as this
library's `ModelConfig` and parameters, both ways.

Every layer is `x + mixer(RMSNorm(x))`, no MLP (`mlp=False`), the mixer Mamba-2's, which is
the `gated` mixer with its Mamba-2 options (`layers.linear.GatedMixer`): G groups of B/C heads
(`num_heads`) shared by H value heads (`num_value_heads`), state size N (`state_dim`), the
input scaled by dt (`dt_input`), the D skip (`d_skip`) and the RMSNorm of y ⊙ silu(z) over G
groups of channels (`gate_before_norm`, `out_norm_groups`). With d_inner = H·P, the tensors of
`backbone.layers.{i}.mixer.` go to `blocks[i].mixer.`:

- `in_proj.weight` rows [z (d_inner), x (d_inner), B (G·N), C (G·N), dt (H)]: z to
  `output.gate_proj`, C, B, x (q, k, v, in that order) to `inputs.qkv_proj`, dt to
  `decay.proj`;
- `conv1d.weight` [d_inner + 2·G·N, 1, K] and `conv1d.bias`: `inputs.conv.kernel` [K, C] and
  `bias`, the channels reordered as C, B, x;
- `A_log`, `dt_bias` [H]: `decay.a_log`, `decay.dt_bias` (`ScalarDecay`); `D` [H]: `skip`;
- `norm.weight` [d_inner]: `output.norm.scale` [G, d_inner / G]; `out_proj`: `output.out_proj`;

and `backbone.layers.{i}.norm.weight` to `blocks[i].mixer_norm.scale` (as is: Mamba-2's norms
apply w, not 1 + w), `backbone.embeddings`, `norm_f`, `lm_head` to `embed`, `final_norm`,
`head`. transformers writes the infinite bound of `time_step_limit` as
`{"__float__": "Infinity"}`; both that and a plain number are read.
"""

from __future__ import annotations

import numpy as np

from linear_attention.layers.linear import GatedMixer
from linear_attention.layers.options import conv_kernel_size
from linear_attention.models.hf.common import (
    INERT,
    Unsupported,
    initializer_field,
    initializer_range,
    number,
)

MODEL_TYPE = "mamba2"
ARCHITECTURE = "Mamba2ForCausalLM"
GATED = GatedMixer.NAME
MIXERS = {"mamba2": GATED}
# Blocks without an MLP.
MLP = False
# Fields that only set the initialisation (time steps, residual rescaling: `models.init` uses
# transformers' defaults, 1e-3 to 1e-1 and no rescaling), or how the torch path computes the
# same numbers (its chunk length; the residual stream kept in float32, which a float32 import
# keeps too).
INIT_ONLY = (
    "time_step_rank",
    "time_step_min",
    "time_step_max",
    "time_step_floor",
    "rescale_prenorm_residual",
    "residual_in_fp32",
    "chunk_size",
)
MAPPED = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_heads",
    "head_dim",
    "state_size",
    "n_groups",
    "expand",
    "conv_kernel",
    "use_conv_bias",
    "use_bias",
    "hidden_act",
    "layer_norm_epsilon",
    "tie_word_embeddings",
    "time_step_limit",
)


def _require(hf: dict, name: str, wanted) -> None:
    if hf[name] != wanted:
        raise Unsupported(f"{name}={hf[name]!r} is not supported (only {wanted!r})")


def model_options(hf: dict) -> dict:
    """`ModelConfig` keyword arguments for the transformers config `hf`; `Unsupported` naming
    the first field it cannot represent."""
    unknown = sorted(set(hf) - set(MAPPED) - set(INERT) - set(INIT_ONLY))
    if unknown:
        raise Unsupported(f"config field {unknown[0]!r} is not understood by the mamba2 importer")
    missing = [f for f in MAPPED if f not in hf]
    if missing:
        raise Unsupported(f"config field {missing[0]!r} is missing")
    _require(hf, "hidden_act", "silu")
    _require(hf, "use_bias", False)
    if [number(v) for v in hf["time_step_limit"]] != [0.0, float("inf")]:
        raise Unsupported(
            f"time_step_limit={hf['time_step_limit']!r} is not supported (only [0.0, inf]: dt "
            "unclamped)"
        )
    h, p, g, d = hf["num_heads"], hf["head_dim"], hf["n_groups"], hf["hidden_size"]
    if hf["expand"] * d != h * p:
        raise Unsupported(
            f"expand={hf['expand']} · hidden_size={d} differs from num_heads={h} · head_dim={p}"
        )
    if h % g:
        raise Unsupported(f"n_groups={g} must divide num_heads={h}")
    eps = float(hf["layer_norm_epsilon"])
    return dict(
        vocab_size=hf["vocab_size"],
        d_model=d,
        num_layers=hf["num_hidden_layers"],
        num_heads=g,
        mixer=GATED,
        mlp=False,
        norm_eps=eps,
        tie_embeddings=bool(hf["tie_word_embeddings"]),
        position="none",
        layer_options={GATED: gated_options(hf, eps)},
        initializer_range=initializer_range(hf),
    )


def gated_options(hf: dict, eps: float) -> dict:
    """`layer_options` of the `gated` layers that make them the Mamba-2 mixer of config `hf`
    (mamba2's field names), its gated norm's eps `eps`."""
    return dict(
        num_heads=hf["n_groups"],
        head_dim=hf["head_dim"],
        num_value_heads=hf["num_heads"],
        state_dim=hf["state_size"],
        conv=hf["conv_kernel"],
        conv_bias=bool(hf["use_conv_bias"]),
        dt_input=True,
        d_skip=True,
        gate_before_norm=True,
        out_norm_groups=hf["n_groups"],
        out_norm_eps=eps,
    )


def hf_config(config) -> dict:
    """The transformers config (config.json's dict) of a `ModelConfig` in mamba2's shape, the
    inverse of `model_options` (the caller checks that it is one)."""
    opts = config.mixer_config(GATED)
    g = config.layer_num_heads(GATED)
    h = opts.num_value_heads or g
    p = opts.head_dim or config.d_model // g
    return dict(
        architectures=[ARCHITECTURE],
        model_type=MODEL_TYPE,
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        num_hidden_layers=config.num_layers,
        num_heads=h,
        head_dim=p,
        state_size=opts.state_dim or p,
        n_groups=g,
        # (a width that is not a multiple of d_model gives an expand that model_options refuses)
        expand=h * p // config.d_model if h * p % config.d_model == 0 else h * p / config.d_model,
        conv_kernel=conv_kernel_size(opts.conv) or 4,
        use_conv_bias=opts.conv_bias,
        use_bias=False,
        hidden_act="silu",
        layer_norm_epsilon=config.norm_eps,
        tie_word_embeddings=config.tie_embeddings,
        time_step_limit=[0.0, {"__float__": "Infinity"}],
        dtype="float32",
        **initializer_field(config, "mamba2"),
    )


def _sizes(hf: dict):
    h, p, n, g = hf["num_heads"], hf["head_dim"], hf["state_size"], hf["n_groups"]
    return h, p, n, g, h * p


def tensor_shapes(hf: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor a `Mamba2ForCausalLM` of config `hf` holds, with its shape."""
    d, v = hf["hidden_size"], hf["vocab_size"]
    shapes = {"backbone.embeddings.weight": (v, d), "backbone.norm_f.weight": (d,)}
    if not hf["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, d)
    for i in range(hf["num_hidden_layers"]):
        p = f"backbone.layers.{i}."
        shapes[p + "norm.weight"] = (d,)
        shapes.update(mixer_shapes(hf, p + "mixer."))
    return shapes


def mixer_shapes(hf: dict, m: str) -> dict[str, tuple[int, ...]]:
    """The tensors of one Mamba-2 mixer under `m` (`backbone.layers.{i}.mixer.`), of config
    `hf` (mamba2's field names: hidden_size, num_heads, head_dim, state_size, n_groups,
    conv_kernel, use_conv_bias), with their shapes."""
    d, k = hf["hidden_size"], hf["conv_kernel"]
    h, _, n, g, inner = _sizes(hf)
    conv = inner + 2 * g * n
    shapes = {
        m + "in_proj.weight": (2 * inner + 2 * g * n + h, d),
        m + "conv1d.weight": (conv, 1, k),
        m + "dt_bias": (h,),
        m + "A_log": (h,),
        m + "D": (h,),
        m + "norm.weight": (inner,),
        m + "out_proj.weight": (d, inner),
    }
    if hf["use_conv_bias"]:
        shapes[m + "conv1d.bias"] = (conv,)
    return shapes


def _conv_order(hf: dict) -> np.ndarray:
    """The conv channels here (C, B, x) as indices into transformers' (x, B, C)."""
    _, _, n, g, inner = _sizes(hf)
    x, b, c = np.arange(inner), inner + np.arange(g * n), inner + g * n + np.arange(g * n)
    return np.concatenate([c, b, x])


def to_params(hf: dict, get) -> dict:
    """This library's parameters (a nested dict as `nnx.to_pure_dict` gives, float32 arrays)
    from the tensors `get(name) -> np.ndarray float32` of a checkpoint of config `hf`."""
    blocks = {}
    for i in range(hf["num_hidden_layers"]):
        p = f"backbone.layers.{i}."
        blocks[i] = {
            "mixer_norm": {"scale": get(p + "norm.weight")},
            "mixer": mixer_params(hf, get, p + "mixer."),
        }
    params = {
        "embed": {"embedding": get("backbone.embeddings.weight")},
        "final_norm": {"scale": get("backbone.norm_f.weight")},
        "blocks": blocks,
    }
    if not hf["tie_word_embeddings"]:
        params["head"] = {"kernel": get("lm_head.weight").T}
    return params


def mixer_params(hf: dict, get, m: str) -> dict:
    """The `gated` mixer's parameters of the Mamba-2 mixer under `m` (as `mixer_shapes`)."""
    _, _, n, g, inner = _sizes(hf)
    order = _conv_order(hf)
    z, x, b, c, dt = np.split(get(m + "in_proj.weight"), np.cumsum([inner, inner, g * n, g * n]))
    conv = {"kernel": get(m + "conv1d.weight")[order, 0, :].T}
    if hf["use_conv_bias"]:
        conv["bias"] = get(m + "conv1d.bias")[order]
    return {
        "inputs": {"qkv_proj": {"kernel": np.concatenate([c, b, x]).T}, "conv": conv},
        "decay": {
            "proj": {"kernel": dt.T},
            "a_log": get(m + "A_log"),
            "dt_bias": get(m + "dt_bias"),
        },
        "skip": get(m + "D"),
        "output": {
            "norm": {"scale": get(m + "norm.weight").reshape(g, inner // g)},
            "gate_proj": {"kernel": z.T},
            "out_proj": {"kernel": get(m + "out_proj.weight").T},
        },
    }


def from_params(hf: dict, params: dict) -> dict[str, np.ndarray]:
    """The checkpoint tensors (float32) of `params`, the inverse of `to_params`."""
    out = {
        "backbone.embeddings.weight": params["embed"]["embedding"],
        "backbone.norm_f.weight": params["final_norm"]["scale"],
    }
    if not hf["tie_word_embeddings"]:
        out["lm_head.weight"] = params["head"]["kernel"].T
    for i in range(hf["num_hidden_layers"]):
        p, block = f"backbone.layers.{i}.", params["blocks"][i]
        out[p + "norm.weight"] = block["mixer_norm"]["scale"]
        out.update(mixer_tensors(hf, block["mixer"], p + "mixer."))
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def mixer_tensors(hf: dict, mixer: dict, m: str) -> dict[str, np.ndarray]:
    """The Mamba-2 mixer's tensors under `m` of the `gated` mixer's parameters `mixer`, the
    inverse of `mixer_params`."""
    _, _, n, g, inner = _sizes(hf)
    back = np.argsort(_conv_order(hf))  # transformers' channel j is ours back[j]
    c, b, x = np.split(mixer["inputs"]["qkv_proj"]["kernel"].T, [g * n, 2 * g * n])
    z = mixer["output"]["gate_proj"]["kernel"].T
    dt = mixer["decay"]["proj"]["kernel"].T
    conv = mixer["inputs"]["conv"]
    out = {
        m + "in_proj.weight": np.concatenate([z, x, b, c, dt]),
        m + "conv1d.weight": conv["kernel"].T[back][:, None, :],
        m + "A_log": mixer["decay"]["a_log"],
        m + "dt_bias": mixer["decay"]["dt_bias"],
        m + "D": mixer["skip"],
        m + "norm.weight": mixer["output"]["norm"]["scale"].reshape(inner),
        m + "out_proj.weight": mixer["output"]["out_proj"]["kernel"].T,
    }
    if hf["use_conv_bias"]:
        out[m + "conv1d.bias"] = conv["bias"][back]
    return out
