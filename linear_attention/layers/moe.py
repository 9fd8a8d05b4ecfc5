"""Mixture-of-experts SwiGLU MLP with a softmax router and an optional shared expert (Qwen3-Next).

    p      = softmax(x W_r)                         router probabilities over E experts, float32
    top    = the k largest p (renormalised to sum 1 with `norm_topk`)
    y      = Σ_{e ∈ top} p_e · SwiGLU_e(x)  +  σ(x w_s) · SwiGLU_shared(x)

The experts are computed densely (every expert for every token, weighted by the routing
weights, zero outside the top k): the same sum as a dispatch to the chosen experts, simple and
exact under jit, at E/k times the FLOPs of the sparse form, so it suits checking and
fine-tuning small models, not serving large ones. The expert weights are `[E, D, I]` /
`[E, I, D]` parameters (named `w_*`, not `kernel`: the FLOPs count, which counts `kernel`s as
dense matmuls, leaves them out). No auxiliary load-balancing loss is computed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention.fields import check_int
from linear_attention.layers.mlp import SwiGLU


class MoE(nnx.Module):
    """`num_experts` SwiGLU experts of width `hidden_dim`, `top_k` per token, and a shared
    SwiGLU expert of width `shared_dim` behind a sigmoid gate (0: none)."""

    def __init__(
        self,
        d_model: int,
        *,
        num_experts: int,
        top_k: int,
        hidden_dim: int,
        shared_dim: int = 0,
        norm_topk: bool = True,
        dtype=None,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        num_experts = check_int("num_experts", num_experts)
        top_k = check_int("top_k", top_k)
        hidden_dim = check_int("hidden_dim", hidden_dim)
        if top_k > num_experts:
            raise ValueError(f"top_k={top_k} must be <= num_experts={num_experts}")
        self.num_experts, self.top_k, self.norm_topk = num_experts, top_k, norm_topk
        self.dtype = dtype
        # routing is float32 whatever the compute dtype (the choice of experts must not flip)
        self.router = nnx.Linear(
            d_model,
            num_experts,
            use_bias=False,
            dtype=jnp.float32,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        init = nnx.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=0)
        e, d, i = num_experts, d_model, hidden_dim
        self.w_gate = nnx.Param(init(rngs.params(), (e, d, i), jnp.float32).astype(param_dtype))
        self.w_up = nnx.Param(init(rngs.params(), (e, d, i), jnp.float32).astype(param_dtype))
        self.w_down = nnx.Param(init(rngs.params(), (e, i, d), jnp.float32).astype(param_dtype))
        common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        if shared_dim:
            self.shared = SwiGLU(d_model, hidden_dim=shared_dim, **common)
            self.shared_gate = nnx.Linear(d_model, 1, use_bias=False, **common)
        else:
            self.shared = self.shared_gate = None

    def routing(self, x) -> jax.Array:
        """The weight of each expert for each token `[..., E]` float32 (zero outside the top k)."""
        probs = jax.nn.softmax(self.router(x.astype(jnp.float32)), axis=-1)
        top, index = jax.lax.top_k(probs, self.top_k)
        if self.norm_topk:
            top = top / jnp.sum(top, axis=-1, keepdims=True)
        return jnp.sum(
            jax.nn.one_hot(index, self.num_experts, dtype=jnp.float32) * top[..., None], -2
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = self.dtype or x.dtype
        xc = x.astype(dtype)
        w = {n: getattr(self, n)[...].astype(dtype) for n in ("w_gate", "w_up", "w_down")}
        h = jax.nn.silu(jnp.einsum("...d,edi->...ei", xc, w["w_gate"]))
        h = h * jnp.einsum("...d,edi->...ei", xc, w["w_up"])
        y = jnp.einsum("...ei,eid->...ed", h, w["w_down"])
        out = jnp.einsum("...ed,...e->...d", y, self.routing(x).astype(dtype))
        if self.shared is not None:
            out = out + jax.nn.sigmoid(self.shared_gate(xc)) * self.shared(xc)
        return out.astype(dtype)
