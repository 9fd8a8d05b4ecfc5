"""Mamba-1 (transformers' `mamba`, `MambaForCausalLM`, and `falcon_mamba`,
`FalconMambaForCausalLM`): their config and tensors as this library's `ModelConfig` and
parameters, both ways, declared as data (`models/hf/common.py`): `MAMBA_MAPPING` and
`FALCON_MAMBA` differ by one field, Falcon-Mamba's `mixer_rms_eps`, the mixer's `bcdt_norm_eps`
(weightless RMSNorms of δ, B and C).

Every layer is `x + mixer(RMSNorm(x))`, no MLP (`mlp=False`), the mixer `mamba`
(`layers.mamba.MambaMixer`), whose parameters carry transformers' `MambaMixer` names and
layouts: `FIELDS` maps the config, `WEIGHTS` the tensors (an `nn.Linear` weight is the
transpose of the kernel here, the depthwise conv's [E, 1, K] its [K, E]). Mamba's RMSNorms apply
w (the scale here is w). What a checkpoint's config holds that changes only the initialisation
is read and left alone; `not_imported` lists a value other than transformers' default.
"""

from __future__ import annotations

import dataclasses
import math

from linear_attention.layers.mamba import MambaMixer
from linear_attention.layers.options import conv_kernel_size
from linear_attention.models.hf.common import (
    Unsupported,
    Weight,
    check_fields,
    initializer_field,
    initializer_range,
    left_alone,
    params_to_weights,
    require,
    weight_shapes,
    weights_to_params,
)

MAMBA = MambaMixer.NAME
MIXERS = {"linear_attention": MAMBA}
# Blocks without an MLP; the mamba mixer reads no num_heads (its E channels have no heads).
MLP, HEADS = False, False

# transformers' field → `ModelConfig` field or `mamba.<option>` (`layer_options.mamba`), or None:
# checked by `MambaMapping.model_options`.
FIELDS = {
    "model_type": None,
    "vocab_size": "vocab_size",
    "hidden_size": "d_model",
    "num_hidden_layers": "num_layers",
    "layer_norm_epsilon": "norm_eps",
    "tie_word_embeddings": "tie_embeddings",
    "state_size": "mamba.state_dim",
    "expand": "mamba.expand",
    "conv_kernel": "mamba.conv",
    "use_conv_bias": "mamba.conv_bias",
    "time_step_rank": "mamba.dt_rank",
    "intermediate_size": None,  # expand · hidden_size
    "use_bias": None,
    "hidden_act": None,
}
# Values the mixer here computes only with (no bias on in_proj / out_proj, silu).
REQUIRED = {"use_bias": False, "hidden_act": "silu"}
# How the torch path computes the same float32 numbers (its residual stream in float32, which a
# float32 import keeps too; its scan implementation).
COMPUTE_ONLY = ("residual_in_fp32", "use_mambapy", "use_associative_scan")
# The initialisation only: `{field: (transformers' default, why)}`. `models.init` draws as the
# defaults do; another value is imported all the same and listed by `hf.not_imported`.
INIT_ONLY = {
    name: (default, "initialisation only (this library initialises with transformers' default "
           f"{default!r})")
    for name, default in (
        ("time_step_scale", 1.0),
        ("time_step_min", 0.001),
        ("time_step_max", 0.1),
        ("time_step_floor", 1e-4),
        ("time_step_init_scheme", "random"),
        ("rescale_prenorm_residual", False),
    )
}  # fmt: skip

_LAYER, _BLOCK = "backbone.layers.{i}.", ("blocks", "{i}")


def _mixer(name: str, shape: tuple, path: tuple, layout="as_is", when=None) -> Weight:
    return Weight(_LAYER + "mixer." + name, shape, (*_BLOCK, "mixer", *path), layout, when)


WEIGHTS = (
    Weight("backbone.embeddings.weight", ("V", "D"), ("embed", "embedding")),
    Weight("backbone.norm_f.weight", ("D",), ("final_norm", "scale")),
    Weight("lm_head.weight", ("V", "D"), ("head", "kernel"), "transposed", "!tie_word_embeddings"),
    Weight(_LAYER + "norm.weight", ("D",), (*_BLOCK, "mixer_norm", "scale")),
    _mixer("in_proj.weight", ("2E", "D"), ("inputs", "in_proj", "kernel"), "transposed"),
    _mixer("conv1d.weight", ("E", "1", "K"), ("inputs", "conv1d", "kernel"), "depthwise"),
    _mixer("conv1d.bias", ("E",), ("inputs", "conv1d", "bias"), when="use_conv_bias"),
    _mixer("x_proj.weight", ("R+2N", "E"), ("x_proj", "kernel"), "transposed"),
    _mixer("dt_proj.weight", ("E", "R"), ("dt_proj", "kernel"), "transposed"),
    _mixer("dt_proj.bias", ("E",), ("dt_proj", "bias")),
    _mixer("A_log", ("E", "N"), ("A_log",)),
    _mixer("D", ("E",), ("D",)),
    _mixer("out_proj.weight", ("D", "E"), ("out_proj", "kernel"), "transposed"),
)


def _rank(hf: dict):
    """`time_step_rank` as an int ("auto": transformers' ⌈hidden_size / 16⌉)."""
    rank = hf["time_step_rank"]
    return math.ceil(hf["hidden_size"] / 16) if rank == "auto" else rank


def _sizes(hf: dict) -> dict[str, int]:
    e, r, n = hf["expand"] * hf["hidden_size"], _rank(hf), hf["state_size"]
    d, v, k = hf["hidden_size"], hf["vocab_size"], hf["conv_kernel"]
    return {"V": v, "D": d, "E": e, "2E": 2 * e, "R": r, "N": n, "R+2N": r + 2 * n, "K": k, "1": 1}


@dataclasses.dataclass(frozen=True)
class MambaMapping:
    """The mapping of a Mamba-1 model type (`hf.ARCHITECTURES`' protocol): its `MODEL_TYPE`,
    `ARCHITECTURE` (the transformers class) and `FIELDS`, transformers' field → `ModelConfig`
    field or `mamba.<option>` (`layer_options.mamba`), or None (checked here); the tensors are
    `WEIGHTS` for every Mamba-1 type."""

    MODEL_TYPE: str
    ARCHITECTURE: str
    FIELDS: dict
    MIXERS = MIXERS
    MLP = MLP
    HEADS = HEADS

    def model_options(self, hf: dict) -> dict:
        """`ModelConfig` keyword arguments for the transformers config `hf`; `Unsupported`
        naming the first field it cannot represent."""
        check_fields(hf, self.MODEL_TYPE, self.FIELDS, (*COMPUTE_ONLY, *INIT_ONLY))
        for name, wanted in REQUIRED.items():
            require(hf, name, wanted)
        d, rank = hf["hidden_size"], _rank(hf)
        if hf["intermediate_size"] != hf["expand"] * d:
            raise Unsupported(
                f"intermediate_size={hf['intermediate_size']} differs from expand="
                f"{hf['expand']} · hidden_size={d}"
            )
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise Unsupported(f"time_step_rank={rank!r} is not a positive integer or 'auto'")
        values = {k: hf[k] for k in self.FIELDS}
        values.update(
            tie_word_embeddings=bool(hf["tie_word_embeddings"]),
            use_conv_bias=bool(hf["use_conv_bias"]),
            layer_norm_epsilon=float(hf["layer_norm_epsilon"]),
            # (the automatic rank is None here, so that an export writes what it reads back)
            time_step_rank=None if rank == math.ceil(d / 16) else rank,
        )
        if "mixer_rms_eps" in self.FIELDS:
            eps = hf["mixer_rms_eps"]
            if not isinstance(eps, int | float) or isinstance(eps, bool) or not eps > 0:
                raise Unsupported(
                    f"mixer_rms_eps={eps!r} is not a positive number (the mamba mixer's "
                    "bcdt_norm_eps)"
                )
            values["mixer_rms_eps"] = float(eps)
        top, mixer = {}, {}
        for field, target in self.FIELDS.items():
            if target is not None and target.startswith("mamba."):
                mixer[target.removeprefix("mamba.")] = values[field]
            elif target is not None:
                top[target] = values[field]
        return dict(
            **top,
            mixer=MAMBA,
            mlp=False,
            position="none",
            layer_options={MAMBA: mixer},
            initializer_range=initializer_range(hf),
        )

    def hf_config(self, config) -> dict:
        """The transformers config (config.json's dict) of a `ModelConfig` in this type's
        shape, the inverse of `model_options` (the caller checks that it is one)."""
        opts = config.mixer_config(MAMBA)
        extra = {"mixer_rms_eps": opts.bcdt_norm_eps} if "mixer_rms_eps" in self.FIELDS else {}
        return dict(
            architectures=[self.ARCHITECTURE],
            model_type=self.MODEL_TYPE,
            vocab_size=config.vocab_size,
            hidden_size=config.d_model,
            num_hidden_layers=config.num_layers,
            layer_norm_epsilon=config.norm_eps,
            tie_word_embeddings=config.tie_embeddings,
            state_size=opts.state_dim,
            expand=opts.expand,
            intermediate_size=opts.expand * config.d_model,
            conv_kernel=conv_kernel_size(opts.conv),
            use_conv_bias=opts.conv_bias,
            time_step_rank=opts.dt_rank or math.ceil(config.d_model / 16),
            **extra,
            use_bias=False,
            hidden_act="silu",
            residual_in_fp32=True,
            dtype="float32",
            # (Falcon-Mamba initialises as Mamba: `models.init`'s "mamba")
            **initializer_field(config, "mamba"),
        )

    @staticmethod
    def tensor_shapes(hf: dict) -> dict[str, tuple[int, ...]]:
        """Every tensor the causal LM of config `hf` holds, with its shape."""
        return weight_shapes(WEIGHTS, hf, _sizes(hf), hf["num_hidden_layers"])

    @staticmethod
    def to_params(hf: dict, get) -> dict:
        """This library's parameters (a nested dict as `nnx.to_pure_dict` gives, float32
        arrays) from the tensors `get(name) -> np.ndarray float32` of a checkpoint of `hf`."""
        return weights_to_params(WEIGHTS, hf, get, hf["num_hidden_layers"])

    @staticmethod
    def from_params(hf: dict, params: dict) -> dict:
        """The checkpoint tensors (float32) of `params`, the inverse of `to_params`."""
        return params_to_weights(WEIGHTS, hf, params, hf["num_hidden_layers"])

    @staticmethod
    def not_imported_fields(hf: dict) -> list[str]:
        """The fields of config `hf` that the import leaves out with a value other than
        transformers' default (`INIT_ONLY`), one line each."""
        return left_alone(hf, INIT_ONLY)


MAMBA_MAPPING = MambaMapping("mamba", "MambaForCausalLM", FIELDS)
# Falcon-Mamba: Mamba-1 with weightless RMSNorms of δ, B and C (eps `mixer_rms_eps`).
FALCON_MAMBA = MambaMapping(
    "falcon_mamba",
    "FalconMambaForCausalLM",
    {**FIELDS, "mixer_rms_eps": "mamba.bcdt_norm_eps"},
)
