"""Output part of a mixer: per-head norm, output gate, output projection.

    y = ((norm?(o) + bonus?) ⊙ gate(x)?) W_o       o: [B, T, H, Dv] -> y: [B, T, d_model]

`norm` is per head (`norm_shared`: one scale `[Dv]` shared by the heads, each head still
normalised on its own, as Qwen3-Next's gated RMSNorm): RMSNorm (`norm_type="rms"`: RetNet,
Mamba-2, the delta-rule mixers) or LayerNorm (`"layer"`: RWKV's GroupNorm with one group per
head). `bonus` `[B, T, H, Dv]` is a term the mixer adds after the norm (RWKV-7's current-token
bonus). The gate is
`act(x W_g)` with act swish (silu: RetNet / GLA / DeltaNet) or sigmoid (the gated RMSNorm of
Kimi Linear's KDA); `gate_rank` r > 0 makes it low rank, `act(x W_down W_up + b)` (r = head_dim
in KDA), or with `gate_inside` `act(x W_down) W_up` (RWKV-7: the activation between the factors,
no bias, the gate unbounded).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention.layers.norm import LayerNorm, RMSNorm

GATE_ACTIVATIONS = {"silu": jax.nn.silu, "sigmoid": jax.nn.sigmoid}
NORMS = {"rms": RMSNorm, "layer": LayerNorm}


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
        gate_inside: bool = False,
        norm_type: str = "rms",
        norm_shared: bool = False,
        norm_eps: float = 1e-6,
        dtype=None,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        if gate_activation not in GATE_ACTIVATIONS:
            raise ValueError(
                f"unknown gate_activation {gate_activation!r}; allowed: {sorted(GATE_ACTIVATIONS)}"
            )
        if norm_type not in NORMS:
            raise ValueError(f"unknown norm_type {norm_type!r}; allowed: {sorted(NORMS)}")
        if gate_inside and not gate_rank:
            raise ValueError("gate_inside needs a low-rank gate (gate_rank > 0)")
        self.num_heads, self.head_dim = num_heads, head_dim
        self.gate_activation = gate_activation
        self.gate_inside = gate_inside
        common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        norm_cls = NORMS[norm_type]
        features = head_dim if norm_shared else (num_heads, head_dim)
        self.norm = norm_cls(features, eps=norm_eps, **common) if norm else None
        f = num_heads * head_dim
        if not gate:
            self.gate_proj = self.gate_up = None
        elif gate_rank:
            self.gate_proj = nnx.Linear(d_model, gate_rank, use_bias=False, **common)
            self.gate_up = nnx.Linear(gate_rank, f, use_bias=not gate_inside, **common)
        else:
            self.gate_proj = nnx.Linear(d_model, f, use_bias=False, **common)
            self.gate_up = None
        self.out_proj = nnx.Linear(f, d_model, use_bias=False, **common)

    def gate(self, x_BTD: jax.Array) -> jax.Array | None:
        """act(x W_g) `[B, T, H·Dv]`, or None without a gate."""
        if self.gate_proj is None:
            return None
        act = GATE_ACTIVATIONS[self.gate_activation]
        z = self.gate_proj(x_BTD)
        if self.gate_inside:
            return self.gate_up(act(z))
        if self.gate_up is not None:
            z = self.gate_up(z)
        return act(z)

    def __call__(self, x_BTD: jax.Array, o_BTHD: jax.Array, bonus_BTHD=None) -> jax.Array:
        """`y [B, T, d_model]` from the gate's input `x` and the heads' output `o`; `bonus`
        (or None) is added after the norm."""
        b, t = o_BTHD.shape[:2]
        if self.norm is not None:
            o_BTHD = self.norm(o_BTHD)
        if bonus_BTHD is not None:
            o_BTHD = o_BTHD + bonus_BTHD.astype(o_BTHD.dtype)
        o_BTF = o_BTHD.reshape(b, t, self.num_heads * self.head_dim)
        gate_BTF = self.gate(x_BTD)
        if gate_BTF is not None:
            o_BTF = o_BTF * gate_BTF
        return self.out_proj(o_BTF)
