"""Residual block: a mixer, then a SwiGLU MLP when the MLP is on (or a mixture of SwiGLU
experts with `moe`), each with its RMSNorm, in one of two places (`norm_position`):

    "pre":   x ← x + mixer(norm₁(x)),   x ← x + mlp(norm₂(x))
    "post":  x ← x + norm₁(mixer(x)),   x ← x + norm₂(mlp(x))

"post" normalises each sublayer's output before the residual add (OLMo 2's reordered norm, the
attention layers of OLMo Hybrid), not the sum as the original Transformer did; the residual
stream itself is never normalised. The norms are `mixer_norm` and `mlp_norm` in both."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention.layers.base import MixerState
from linear_attention.layers.mlp import SwiGLU
from linear_attention.layers.moe import MoE, RouterStats
from linear_attention.layers.norm import RMSNorm
from linear_attention.layers.options import MixerConfig
from linear_attention.layers.registry import DEFAULT_MIXER, get_mixer

NORM_POSITIONS = ("pre", "post")


class Block(nnx.Module):
    """One layer: a mixer (by registry name, with keyword `mixer_options` or its checked
    `mixer_config`) and an optional SwiGLU MLP (hidden width `mlp_dim`, None: from
    `mlp_ratio`), or with `moe` (keyword arguments of `MoE`) a mixture of experts; the norms
    before (`norm_position="pre"`) or after ("post") each."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        mixer: str = DEFAULT_MIXER,
        *,
        mixer_options: dict | None = None,
        mixer_config: MixerConfig | None = None,
        mlp: bool = True,
        mlp_ratio: float = 4.0,
        mlp_dim: int | None = None,
        moe: dict | None = None,
        norm_eps: float = 1e-6,
        norm_position: str = "pre",
        dtype=None,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        if norm_position not in NORM_POSITIONS:
            raise ValueError(
                f"unknown norm_position {norm_position!r}; allowed: {', '.join(NORM_POSITIONS)}"
            )
        self.post_norm = norm_position == "post"
        mixer_cls = get_mixer(mixer)
        common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.mixer_norm = RMSNorm(d_model, eps=norm_eps, **common)
        self.mixer = mixer_cls(
            d_model, num_heads, config=mixer_config, **(mixer_options or {}), **common
        )
        if mlp:
            self.mlp_norm = RMSNorm(d_model, eps=norm_eps, **common)
            self.mlp = (
                SwiGLU(d_model, mlp_ratio=mlp_ratio, hidden_dim=mlp_dim, **common)
                if moe is None
                else MoE(d_model, **moe, **common)
            )
        else:
            self.mlp_norm = self.mlp = None

    def mixer_input(self, x_BTD: jax.Array) -> jax.Array:
        """What the mixer reads of the residual stream `x`: `mixer_norm(x)` (pre), or `x`."""
        return x_BTD if self.post_norm else self.mixer_norm(x_BTD)

    def _mixed(self, x, y):
        """The residual stream after the mixer's output `y`."""
        return x + (self.mixer_norm(y) if self.post_norm else y)

    def _mlp(self, x):
        return self._mlp_routed(x)[0]

    def _mlp_routed(self, x):
        """The residual stream after the MLP, and its router's `RouterStats` (None unless the
        MLP is a mixture of experts)."""
        if self.mlp is None:
            return x, None
        h = x if self.post_norm else self.mlp_norm(x)
        y, stats = self.mlp.routed(h) if isinstance(self.mlp, MoE) else (self.mlp(h), None)
        return x + (self.mlp_norm(y) if self.post_norm else y), stats

    def init_state(self, batch_size: int, max_length: int) -> MixerState:
        return self.mixer.init_state(batch_size, max_length)

    def __call__(self, x_BTD: jax.Array, segments=None) -> jax.Array:
        """`segments` (a `Segments`, or `segment_ids[B, T]`): packed documents, passed to the
        mixer (the MLP is per token)."""
        return self.routed(x_BTD, segments)[0]

    def routed(self, x_BTD: jax.Array, segments=None) -> tuple[jax.Array, RouterStats | None]:
        """`__call__`'s output and the `RouterStats` of its MoE router over these tokens (None
        when the MLP is not a mixture of experts)."""
        return self._mlp_routed(self._mixed(x_BTD, self.mixer(self.mixer_input(x_BTD), segments)))

    def prefill(self, x_BTD, state: MixerState):
        y, state = self.mixer.prefill(self.mixer_input(x_BTD), state)
        return self._mlp(self._mixed(x_BTD, y)), state

    def step(self, x_BD, state: MixerState):
        y, state = self.mixer.step(self.mixer_input(x_BD), state)
        return self._mlp(self._mixed(x_BD, y)), state
