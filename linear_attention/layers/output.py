"""Output part of a mixer: per-head norm, output gate, output projection.

    y = ((norm?(o) + bonus?) ⊙ gate(x)?) W_o       o: [B, T, H, Dv] -> y: [B, T, d_model]
    y = norm(o ⊙ gate(x)) W_o                      (`gate_before_norm`: Mamba-2's gated RMSNorm)

`norm` is per head (`norm_shared`: one scale `[Dv]` shared by the heads, each head still
normalised on its own, as Qwen3-Next's gated RMSNorm; `norm_groups` G: over G groups of the
H·Dv channels instead, each of H·Dv/G channels spanning H/G heads, as Mamba-2's, scale
`[G, H·Dv/G]`): RMSNorm (`norm_type="rms"`: RetNet, Mamba-2, the delta-rule mixers) or
LayerNorm (`"layer"`: RWKV's GroupNorm with one group per head). `bonus` `[B, T, H, Dv]` is a
term the mixer adds after the norm (RWKV-7's current-token bonus). The gate is
`act(x W_g)` with act swish (silu: RetNet / GLA / DeltaNet) or sigmoid (the gated RMSNorm of
Kimi Linear's KDA); `gate_rank` r > 0 makes it low rank, `act(x W_down W_up + b)` (r = head_dim
in KDA), or with `gate_inside` `act(x W_down) W_up` (RWKV-7: the activation between the factors,
no bias, the gate unbounded); `gate_bias=False` drops b (transformers' Kimi Linear).
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
        gate_bias: bool = True,
        norm_type: str = "rms",
        norm_shared: bool = False,
        norm_groups: int | None = None,
        gate_before_norm: bool = False,
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
        if not gate_bias and not (gate and gate_rank and not gate_inside):
            raise ValueError("gate_bias=False needs a low-rank output gate with its bias")
        f = num_heads * head_dim
        groups = norm_groups or num_heads
        if f % groups:
            raise ValueError(
                f"norm_groups={norm_groups} must divide the {num_heads}·{head_dim} output channels"
            )
        if gate_before_norm and not (gate and norm):
            raise ValueError("gate_before_norm needs both the output gate and the norm")
        self.num_heads, self.head_dim, self.norm_groups = num_heads, head_dim, groups
        self.gate_activation = gate_activation
        self.gate_inside, self.gate_before_norm = gate_inside, gate_before_norm
        common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        norm_cls = NORMS[norm_type]
        features = f // groups if norm_shared else (groups, f // groups)
        self.norm = norm_cls(features, eps=norm_eps, **common) if norm else None
        if not gate:
            self.gate_proj = self.gate_up = None
        elif gate_rank:
            self.gate_proj = nnx.Linear(d_model, gate_rank, use_bias=False, **common)
            use_bias = gate_bias and not gate_inside
            self.gate_up = nnx.Linear(gate_rank, f, use_bias=use_bias, **common)
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
        f, g = self.num_heads * self.head_dim, self.norm_groups
        gate_BTF = self.gate(x_BTD)
        o_BTF = o_BTHD.reshape(b, t, f)
        if self.gate_before_norm:
            o_BTF = o_BTF * gate_BTF
        if self.norm is not None:
            o_BTF = self.norm(o_BTF.reshape(b, t, g, f // g)).reshape(b, t, f)
        if bonus_BTHD is not None:
            o_BTF = o_BTF + bonus_BTHD.reshape(b, t, f).astype(o_BTF.dtype)
        if gate_BTF is not None and not self.gate_before_norm:
            o_BTF = o_BTF * gate_BTF
        return self.out_proj(o_BTF)
