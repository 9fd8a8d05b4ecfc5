"""Mixture-of-experts SwiGLU MLP: a router, the top k of E experts per token, shared experts.

    s      = softmax(x W_r)  or  sigmoid(x W_r)      router scores over E experts, float32
    c      = s + b                                   the choice scores (`score_bias` b; else s)
    top    = the k largest c (among the `topk_groups` best of `num_groups` groups, a group
             scored by the sum of its two largest c: DeepSeek-V3's grouped routing)
    w_e    = s_e for e ∈ top (renormalised to sum 1 with `norm_topk`) · `routed_scale`
    y      = Σ_{e ∈ top} w_e · SwiGLU_e(x)  +  g(x) · SwiGLU_shared(x)

with g(x) = σ(x w_s) (`shared_gate`, Qwen3-Next) or 1 (DeepSeek-V3 / Kimi Linear: several
shared experts are one SwiGLU of their summed width). The bias b only picks experts (the
weights are the scores s), so its gradient is zero and training leaves it as loaded
(DeepSeek-V3 moves it by a load rule outside the gradient, which is not done here).

The experts are computed densely (every expert for every token, weighted by the routing
weights, zero outside the top k): the same sum as a dispatch to the chosen experts, simple and
exact under jit, at E/k times the FLOPs of the sparse form, so it suits checking and
fine-tuning small models, not serving large ones. The expert weights are `[E, D, I]` /
`[E, I, D]` parameters (named `w_*`, not `kernel`: the FLOPs count, which counts `kernel`s as
dense matmuls, leaves them out).

Under `expert_parallel` (expert parallelism, `training.mesh`) the same sum is written as a
dispatch: the tokens are laid out per expert, `[E, N, D]` with a token's row zero for the
experts outside its top k (dropless: every expert has a slot for every token, so nothing is
dropped and the numbers are the dense form's, SwiGLU(0) = 0), that tensor is moved from the
token layout to the expert layout (an all-to-all), each device runs its experts, and the
outputs go back the same way before the weighted sum.

The auxiliary load-balancing loss (Switch Transformer, eqs. 4-6; Mixtral's and Qwen3-Next's as
transformers' `load_balancing_loss_func` computes it) reads `RouterStats`, sums over the tokens
of every MoE layer: with R rows (tokens × layers), c_e the rows whose top k hold expert e and
p_e the sum of the rows' router probabilities of e,

    aux = E · Σ_e (c_e / R) · (p_e / R)

The router logits are never kept: the sums are [E] each, and being sums they add over layers,
micro-batches and devices before the product is taken. The counts carry no gradient (they are
top-k choices), so the loss pushes the probabilities of the most chosen experts down. The
probabilities and choices are the softmax router's (p = s, top k of p), as transformers defines
the loss; `ModelConfig` takes it with that router only (no score bias, no groups).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention.fields import check_choice, check_int
from linear_attention.layers.mlp import SwiGLU

ROUTERS = {"softmax": lambda z: jax.nn.softmax(z, axis=-1), "sigmoid": jax.nn.sigmoid}
DEFAULT_ROUTER = "softmax"
# (token layout, expert layout) of the dispatched [E, N, D] tensor while `expert_parallel` holds
_DISPATCH = contextvars.ContextVar("moe_dispatch", default=None)


@contextlib.contextmanager
def expert_parallel(tokens, experts):
    """Trace `MoE` layers as a dispatch over devices (module docstring): their dispatched
    `[E, N, D]` tensors are constrained to the sharding ``tokens`` (where the tokens are: rows
    split, experts whole), then ``experts`` (experts split), and their outputs back."""
    reset = _DISPATCH.set((tokens, experts))
    try:
        yield
    finally:
        _DISPATCH.reset(reset)


def check_moe_options(
    *,
    num_experts,
    top_k,
    hidden_dim,
    router,
    num_groups,
    topk_groups,
    routed_scale,
    names=None,
    **_,
) -> None:
    """ValueError naming the first of `MoE`'s sizes and routing options that is out of range
    (called by `MoE` and by `ModelConfig` before any parameter exists); `names` maps an
    argument to the name the message gives it (`ModelConfig`'s fields)."""
    args = ("num_experts", "top_k", "hidden_dim", "router", "num_groups", "topk_groups")
    n = {k: (names or {}).get(k, k) for k in (*args, "routed_scale")}
    for name, value in (
        ("num_experts", num_experts),
        ("top_k", top_k),
        ("hidden_dim", hidden_dim),
        ("num_groups", num_groups),
        ("topk_groups", topk_groups),
    ):
        check_int(n[name], value)
    if top_k > num_experts:
        raise ValueError(f"{n['top_k']}={top_k} must be <= {n['num_experts']}={num_experts}")
    check_choice(n["router"], router, tuple(ROUTERS))
    if num_groups > 1 and (num_experts % num_groups or num_experts // num_groups < 2):
        raise ValueError(
            f"{n['num_groups']}={num_groups} must divide {n['num_experts']}={num_experts} into "
            "groups of at least 2 experts (a group is scored by its two best)"
        )
    if topk_groups > num_groups or top_k > topk_groups * (num_experts // num_groups):
        raise ValueError(
            f"{n['topk_groups']}={topk_groups} must be <= {n['num_groups']}={num_groups} and "
            f"hold {n['top_k']}={top_k} experts ({num_experts // num_groups} per group)"
        )
    if not routed_scale > 0:
        raise ValueError(f"{n['routed_scale']} must be > 0, got {routed_scale!r}")


class RouterStats(NamedTuple):
    """What the routers of MoE layers chose, summed over tokens (and layers), float32.

    counts_E  [E] the number of rows whose top k hold each expert (Σ over rows = k · rows)
    probs_E   [E] the sum of the rows' router probabilities of each expert
    rows      ()  the number of rows: tokens, once per MoE layer
    """

    counts_E: jax.Array
    probs_E: jax.Array
    rows: jax.Array


def router_stats(logits_NE: jax.Array, top_k: int, mask_N: jax.Array | None = None) -> RouterStats:
    """The `RouterStats` of router logits `[..., E]` routing `top_k` experts per row; with
    `mask_N` (broadcastable to the rows, 1 or True: counted) only the masked-in rows count,
    as transformers' `attention_mask` leaves out padding. A row with non-finite logits (a NaN
    token's) is left out too, by a select: the sums of the other rows stay finite and exact."""
    probs_NE = jax.nn.softmax(logits_NE.astype(jnp.float32), axis=-1)
    _, index = jax.lax.top_k(probs_NE, top_k)
    chosen_NE = jnp.sum(jax.nn.one_hot(index, probs_NE.shape[-1], dtype=jnp.float32), axis=-2)
    weight_N = jnp.ones(probs_NE.shape[:-1], jnp.float32)
    if mask_N is not None:
        weight_N = weight_N * jnp.asarray(mask_N, jnp.float32)
    weight_N = jnp.where(jnp.all(jnp.isfinite(probs_NE), -1), weight_N, 0.0)
    kept_N1 = (weight_N != 0)[..., None]
    rows = tuple(range(probs_NE.ndim - 1))
    return RouterStats(
        counts_E=jax.lax.stop_gradient(
            jnp.sum(jnp.where(kept_N1, chosen_NE * weight_N[..., None], 0.0), axis=rows)
        ),
        probs_E=jnp.sum(jnp.where(kept_N1, probs_NE * weight_N[..., None], 0.0), axis=rows),
        rows=jnp.sum(weight_N),
    )


def add_router_stats(a: RouterStats | None, b: RouterStats | None) -> RouterStats | None:
    """The stats of two sets of rows together (None: no MoE layer)."""
    if a is None or b is None:
        return b if a is None else a
    return RouterStats(*(x + y for x, y in zip(a, b, strict=True)))


def load_balancing_loss(stats: RouterStats) -> jax.Array:
    """The auxiliary load-balancing loss `E · Σ_e (c_e / R)(p_e / R)` of `stats` (module
    docstring), float32 scalar; 0 when no row is counted.

    Its minimum over routers is `top_k`, reached by a uniform router (p_e = R / E, so the sum
    is Σ_e c_e / R = k whatever the choices) and by any perfectly balanced one."""
    num_experts = stats.counts_E.shape[-1]
    rows = jnp.maximum(stats.rows, 1.0)
    return num_experts * jnp.sum((stats.counts_E / rows) * (stats.probs_E / rows))


class MoE(nnx.Module):
    """`num_experts` SwiGLU experts of width `hidden_dim`, `top_k` per token, and a shared
    SwiGLU expert of width `shared_dim` (0: none) behind a sigmoid gate (`shared_gate`);
    `router`, `score_bias`, `num_groups`, `topk_groups` and `routed_scale` as the module
    docstring says (the defaults: Qwen3-Next's softmax router)."""

    def __init__(
        self,
        d_model: int,
        *,
        num_experts: int,
        top_k: int,
        hidden_dim: int,
        shared_dim: int = 0,
        norm_topk: bool = True,
        router: str = DEFAULT_ROUTER,
        score_bias: bool = False,
        num_groups: int = 1,
        topk_groups: int = 1,
        routed_scale: float = 1.0,
        shared_gate: bool = True,
        dtype=None,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        check_moe_options(
            num_experts=num_experts,
            top_k=top_k,
            hidden_dim=hidden_dim,
            router=router,
            num_groups=num_groups,
            topk_groups=topk_groups,
            routed_scale=routed_scale,
        )
        self.num_experts, self.top_k, self.norm_topk = num_experts, top_k, norm_topk
        self.scoring, self.num_groups, self.topk_groups = router, num_groups, topk_groups
        self.routed_scale = float(routed_scale)
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
        self.score_bias = nnx.Param(jnp.zeros((num_experts,), param_dtype)) if score_bias else None
        init = nnx.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=0)
        e, d, i = num_experts, d_model, hidden_dim
        self.w_gate = nnx.Param(init(rngs.params(), (e, d, i), jnp.float32).astype(param_dtype))
        self.w_up = nnx.Param(init(rngs.params(), (e, d, i), jnp.float32).astype(param_dtype))
        self.w_down = nnx.Param(init(rngs.params(), (e, i, d), jnp.float32).astype(param_dtype))
        common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        if shared_dim:
            self.shared = SwiGLU(d_model, hidden_dim=shared_dim, **common)
            self.shared_gate = (
                nnx.Linear(d_model, 1, use_bias=False, **common) if shared_gate else None
            )
        else:
            self.shared = self.shared_gate = None

    def routing(self, x) -> jax.Array:
        """The weight of each expert for each token `[..., E]` float32 (zero outside the top k)."""
        return self._weights(self.router(x.astype(jnp.float32)))

    def _weights(self, logits) -> jax.Array:
        scores = ROUTERS[self.scoring](logits)
        choice = scores
        if self.score_bias is not None:
            choice = choice + self.score_bias[...].astype(jnp.float32)
        if self.num_groups > 1:
            grouped = choice.reshape(*choice.shape[:-1], self.num_groups, -1)
            group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
            _, best = jax.lax.top_k(group_score, self.topk_groups)
            kept = jnp.sum(jax.nn.one_hot(best, self.num_groups, dtype=jnp.bool_), axis=-2)
            grouped = jnp.where(kept[..., None], grouped, -jnp.inf)
            choice = grouped.reshape(choice.shape)
        _, index = jax.lax.top_k(choice, self.top_k)
        top = jnp.take_along_axis(scores, index, axis=-1)
        if self.norm_topk:
            top = top / jnp.sum(top, axis=-1, keepdims=True)
        top = top * self.routed_scale
        return jnp.sum(
            jax.nn.one_hot(index, self.num_experts, dtype=jnp.float32) * top[..., None], -2
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.routed(x)[0]

    def routed(self, x: jax.Array) -> tuple[jax.Array, RouterStats]:
        """`__call__`'s output and the `RouterStats` of the tokens `x` (all of them counted)."""
        logits = self.router(x.astype(jnp.float32))
        dtype = self.dtype or x.dtype
        xc = x.astype(dtype)
        w = {n: getattr(self, n)[...].astype(dtype) for n in ("w_gate", "w_up", "w_down")}
        weights = self._weights(logits).astype(dtype)
        if _DISPATCH.get() is None:
            h = jax.nn.silu(jnp.einsum("...d,edi->...ei", xc, w["w_gate"]))
            h = h * jnp.einsum("...d,edi->...ei", xc, w["w_up"])
            y = jnp.einsum("...ei,eid->...ed", h, w["w_down"])
            out = jnp.einsum("...ed,...e->...d", y, weights)
        else:
            out = _dispatched(xc, weights, w, *_DISPATCH.get())
        if self.shared_gate is not None:
            out = out + jax.nn.sigmoid(self.shared_gate(xc)) * self.shared(xc)
        elif self.shared is not None:
            out = out + self.shared(xc)
        return out.astype(dtype), router_stats(logits, self.top_k)


def _dispatched(x, weights, w, tokens, experts):
    """`MoE.routed`'s routed sum as a dispatch between a token and an expert layout."""
    x_ND = x.reshape(-1, x.shape[-1])
    w_NE = weights.reshape(-1, weights.shape[-1])
    # a token's slot of an expert it did not choose holds zeros: SwiGLU(0) = 0, as its weight
    x_END = jnp.where((w_NE != 0).T[..., None], x_ND[None], 0).astype(x.dtype)
    # Both layouts are stated, so the move is between two fixed layouts (an all-to-all), not
    # left to sharding propagation (on XLA:CPU the expert layout alone gave the same program).
    x_END = jax.lax.with_sharding_constraint(x_END, tokens)
    x_END = jax.lax.with_sharding_constraint(x_END, experts)
    h_ENI = jax.nn.silu(jnp.einsum("end,edi->eni", x_END, w["w_gate"]))
    h_ENI = h_ENI * jnp.einsum("end,edi->eni", x_END, w["w_up"])
    y_END = jnp.einsum("eni,eid->end", h_ENI, w["w_down"])
    y_END = jax.lax.with_sharding_constraint(y_END, experts)
    y_END = jax.lax.with_sharding_constraint(y_END, tokens)
    return jnp.einsum("end,ne->nd", y_END, w_NE).reshape(x.shape)
