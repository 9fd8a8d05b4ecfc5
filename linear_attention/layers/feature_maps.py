"""Feature-map modules φ: `[B, T, H, D] -> [B, T, H, M]`, wrapping `kernels.feature_maps`.

Each module has `feature_dim` (the width M of φ) and `__call__(x, *, is_query)`. The maps are
computed in float32 and returned in the input dtype.

- `FixedFeatureMap`: a parameter-free map by name (`elu_plus_one`, `relu`, `taylor2`, `identity`).
- `FavorFeatures`: Performer FAVOR+ positive random features `exp(W x' − |x'|²/2)/√m` with an
  orthogonal random projection `W[m, D]` held in a `FeatureProjection` variable (not a `Param`, so
  optimizers and gradients skip it) and a `redraw(key)` method.
- `HedgehogFeatures`: learnable per-head map `[softmax(x W_h), softmax(−x W_h)]` (Hedgehog).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention import kernels as K
from linear_attention.fields import check_int

FIXED_FEATURE_MAPS = ("elu_plus_one", "relu", "taylor2", "identity")


class FeatureProjection(nnx.Variable):
    """A random projection that is redrawn, never trained (excluded from `nnx.Param`)."""


def _feature_width(fn, dim: int) -> int:
    """Output width of a feature map on inputs of width `dim` (traced abstractly, no compute)."""
    return int(jax.eval_shape(fn, jax.ShapeDtypeStruct((1, dim), jnp.float32)).shape[-1])


class FixedFeatureMap(nnx.Module):
    """A fixed feature map by name; one of `FIXED_FEATURE_MAPS`."""

    def __init__(self, name: str, dim: int):
        if name not in FIXED_FEATURE_MAPS:
            raise ValueError(
                f"unknown feature_map {name!r} for a fixed feature map; allowed: "
                f"{', '.join(FIXED_FEATURE_MAPS)}"
            )
        self.name = name
        self.feature_dim = _feature_width(K.feature_maps.get(name), dim)

    def __call__(self, x: jax.Array, *, is_query: bool) -> jax.Array:
        del is_query  # the same map for queries and keys
        return K.feature_maps.get(self.name)(x.astype(jnp.float32)).astype(x.dtype)


class FavorFeatures(nnx.Module):
    """FAVOR+ positive orthogonal random features with a redrawable projection `[M, D]`.

    Both use `favor_plus(stabilize=True)`: queries with the per-token shift (`is_query=True`),
    keys with the projection-only shift; both cancel in normalized attention and neither looks at
    other positions, so the whole-sequence and token-by-token paths agree.
    """

    def __init__(self, dim: int, num_features: int, *, orthogonal: bool = True, rngs: nnx.Rngs):
        check_int("feature_dim (random features)", num_features)
        self.dim = dim
        self.feature_dim = num_features
        self.orthogonal = orthogonal
        self.projection = FeatureProjection(self._draw(rngs.params()))

    def _draw(self, key: jax.Array) -> jax.Array:
        return K.feature_maps.random_projection(
            key, self.feature_dim, self.dim, orthogonal=self.orthogonal
        ).astype(jnp.float32)

    def redraw(self, key: jax.Array) -> None:
        """Replace the projection with a fresh draw from `key`."""
        self.projection[...] = self._draw(key)

    def __call__(self, x: jax.Array, *, is_query: bool) -> jax.Array:
        phi = K.feature_maps.favor_plus(
            x.astype(jnp.float32), self.projection[...], stabilize=True, is_query=is_query
        )
        return phi.astype(x.dtype)


class HedgehogFeatures(nnx.Module):
    """Hedgehog: φ_h(x) = [softmax(x W_h), softmax(−x W_h)] over the feature axis, W_h `[D, F]`.

    Width `M = 2F`. `W` starts as the (truncated) identity, as in the paper, and is trained.
    """

    def __init__(
        self, num_heads: int, dim: int, feature_dim: int, *, param_dtype=jnp.float32, rngs: nnx.Rngs
    ):
        check_int("feature_dim", feature_dim)
        del rngs  # deterministic identity initialization
        self.feature_dim = 2 * feature_dim
        eye_DF = jnp.eye(dim, feature_dim, dtype=param_dtype)
        self.weight = nnx.Param(jnp.broadcast_to(eye_DF, (num_heads, dim, feature_dim)))

    def __call__(self, x_BTHD: jax.Array, *, is_query: bool) -> jax.Array:
        del is_query
        z_BTHF = jnp.einsum(
            "...hd,hdf->...hf", x_BTHD.astype(jnp.float32), self.weight[...].astype(jnp.float32)
        )
        phi = jnp.concatenate([jax.nn.softmax(z_BTHF, -1), jax.nn.softmax(-z_BTHF, -1)], -1)
        return phi.astype(x_BTHD.dtype)
