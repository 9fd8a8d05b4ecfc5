"""Output part of a mixer: per-head norm, output gate, output projection.

    y = (norm?(o) ⊙ act(x W_g)?) W_o            o: [B, T, H, Dv] -> y: [B, T, d_model]

`norm` is a per-head RMSNorm (RetNet, Mamba-2, the delta-rule mixers); the gate is swish (silu,
RetNet / GLA / DeltaNet) or sigmoid (the gated RMSNorm of Kimi Linear's KDA). `gate_rank` r > 0
makes the gate projection low rank (`x W_down W_up + b`, r = head_dim in KDA).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention.layers.norm import RMSNorm

GATE_ACTIVATIONS = {"silu": jax.nn.silu, "sigmoid": jax.nn.sigmoid}


class OutputStage(nnx.Module):
    """norm → gate → projection for `num_heads` heads of width `head_dim`."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        head_dim: int,
        *,
        norm: bool,
        gate: bool,
        gate_activation: str = "silu",
        gate_rank: int = 0,
        dtype=None,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        if gate_activation not in GATE_ACTIVATIONS:
            raise ValueError(
                f"unknown gate_activation {gate_activation!r}; allowed: {sorted(GATE_ACTIVATIONS)}"
            )
        self.num_heads, self.head_dim = num_heads, head_dim
        self.gate_activation = gate_activation
        common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.norm = RMSNorm((num_heads, head_dim), **common) if norm else None
        f = num_heads * head_dim
        if not gate:
            self.gate_proj = self.gate_up = None
        elif gate_rank:
            self.gate_proj = nnx.Linear(d_model, gate_rank, use_bias=False, **common)
            self.gate_up = nnx.Linear(gate_rank, f, use_bias=True, **common)
        else:
            self.gate_proj = nnx.Linear(d_model, f, use_bias=False, **common)
            self.gate_up = None
        self.out_proj = nnx.Linear(f, d_model, use_bias=False, **common)

    def gate(self, x_BTD: jax.Array) -> jax.Array | None:
        """act(x W_g) `[B, T, H·Dv]`, or None without a gate."""
        if self.gate_proj is None:
            return None
        z = self.gate_proj(x_BTD)
        if self.gate_up is not None:
            z = self.gate_up(z)
        return GATE_ACTIVATIONS[self.gate_activation](z)

    def __call__(self, x_BTD: jax.Array, o_BTHD: jax.Array) -> jax.Array:
        b, t = o_BTHD.shape[:2]
        if self.norm is not None:
            o_BTHD = self.norm(o_BTHD)
        o_BTF = o_BTHD.reshape(b, t, self.num_heads * self.head_dim)
        gate_BTF = self.gate(x_BTD)
        if gate_BTF is not None:
            o_BTF = o_BTF * gate_BTF
        return self.out_proj(o_BTF)
