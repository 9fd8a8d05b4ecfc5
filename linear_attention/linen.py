"""Linen access to the NNX mixers through `flax.nnx.bridge.ToLinen`.

    layer = linen.mixer("retnet", d_model=64, num_heads=4, conv=True)   # a flax.linen Module
    variables = layer.init(key, x)                # {"params": ..., "FeatureProjection": ...}
    y = layer.apply(variables, x)                 # same numbers as the NNX mixer's __call__
    y, state = layer.apply(variables, x, state, nnx_method="prefill")

`variables["params"]` has the tree of `nnx.state(mixer, nnx.Param)` (e.g. `inputs/qkv_proj/kernel`);
FAVOR+ projections sit in the `FeatureProjection` collection. Options are checked (ValueError
naming the option) when the wrapper is created, not at the first `init`.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax.nnx import bridge

from linear_attention.layers import MIXERS, get_mixer

_BUILD_ONLY = ("dtype", "param_dtype")


def mixer(name: str, d_model: int, num_heads: int, *, linen_name: str | None = None, **options):
    """The NNX mixer `name` (see `layers.MIXERS`) as a Linen module.

    `options` are the mixer's keyword options (`head_dim`, `conv`, `feature_map`, `method`, …,
    `dtype`, `param_dtype`); `linen_name` names the submodule inside a parent Linen module.
    """
    cls = get_mixer(name)
    check = {k: v for k, v in options.items() if k not in _BUILD_ONLY}
    cls.check_options(d_model, num_heads, **check)
    options.setdefault("param_dtype", jnp.float32)
    return bridge.to_linen(cls, d_model, num_heads, name=linen_name, **options)


def __getattr__(attr: str):
    # `linen.softmax(d_model, num_heads, ...)` etc.: one wrapper factory per registered mixer.
    if attr in MIXERS:
        return lambda d_model, num_heads, **options: mixer(attr, d_model, num_heads, **options)
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


__all__ = ["mixer", *MIXERS]
