"""SwiGLU feed-forward block: `y = W₂ (silu(W₁ x) ⊙ W₃ x)`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention.fields import check_int


class SwiGLU(nnx.Module):
    """SwiGLU MLP with hidden width `hidden_dim` (None: `int(mlp_ratio · d_model)`), no biases."""

    def __init__(
        self,
        d_model: int,
        *,
        mlp_ratio: float = 4.0,
        hidden_dim: int | None = None,
        dtype=None,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        hidden = int(mlp_ratio * d_model) if hidden_dim is None else hidden_dim
        if hidden_dim is not None:
            check_int("hidden_dim", hidden_dim)
        if hidden < 1:
            raise ValueError(
                f"mlp_ratio={mlp_ratio!r} gives hidden width {hidden} for d_model={d_model}"
            )
        kw = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.w_gate = nnx.Linear(d_model, hidden, **kw)
        self.w_up = nnx.Linear(d_model, hidden, **kw)
        self.w_down = nnx.Linear(hidden, d_model, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.w_down(jax.nn.silu(self.w_gate(x)) * self.w_up(x))
