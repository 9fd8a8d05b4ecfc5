"""Pre-norm residual block: `x + mixer(norm(x))`, then `x + mlp(norm(x))` when the MLP is on (a
SwiGLU, or a mixture of SwiGLU experts with `moe`)."""

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


class Block(nnx.Module):
    """One layer: a mixer (by registry name, with keyword `mixer_options` or its checked
    `mixer_config`) and an optional SwiGLU MLP (hidden width `mlp_dim`, None: from
    `mlp_ratio`), or with `moe` (keyword arguments of `MoE`) a mixture of experts."""

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
        dtype=None,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
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

    def _mlp(self, x):
        return x if self.mlp is None else x + self.mlp(self.mlp_norm(x))

    def init_state(self, batch_size: int, max_length: int) -> MixerState:
        return self.mixer.init_state(batch_size, max_length)

    def __call__(self, x_BTD: jax.Array, segments=None) -> jax.Array:
        """`segments` (a `Segments`, or `segment_ids[B, T]`): packed documents, passed to the
        mixer (the MLP is per token)."""
        return self.routed(x_BTD, segments)[0]

    def routed(self, x_BTD: jax.Array, segments=None) -> tuple[jax.Array, RouterStats | None]:
        """`__call__`'s output and the `RouterStats` of its MoE router over these tokens (None
        when the MLP is not a mixture of experts)."""
        x_BTD = x_BTD + self.mixer(self.mixer_norm(x_BTD), segments)
        if not isinstance(self.mlp, MoE):
            return self._mlp(x_BTD), None
        y_BTD, stats = self.mlp.routed(self.mlp_norm(x_BTD))
        return x_BTD + y_BTD, stats

    def prefill(self, x_BTD, state: MixerState):
        y, state = self.mixer.prefill(self.mixer_norm(x_BTD), state)
        return self._mlp(x_BTD + y), state

    def step(self, x_BD, state: MixerState):
        y, state = self.mixer.step(self.mixer_norm(x_BD), state)
        return self._mlp(x_BD + y), state
