"""The mixture-of-experts MLP against a float64 NumPy form that dispatches each token to its
chosen experts, and in a model: decoding equal to the full pass, bad settings refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_attention.layers import MoE
from linear_attention.models import LanguageModel, ModelConfig, step_fn


def moe64(p, x, top_k, norm_topk, *, sigmoid=False, groups=1, topk_groups=1, scale=1.0):
    """Token by token: softmax (or sigmoid) router scores, the top k experts by score (plus the
    score bias, among the `topk_groups` groups whose two best scores sum highest), weighted by
    their scores (renormalised, times `scale`), their SwiGLUs summed, plus the shared expert
    (sigmoid-gated when it has a gate)."""
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    x = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    out = np.zeros_like(x)
    for n, xt in enumerate(x):
        logits = xt @ p["router"]["kernel"]
        if sigmoid:
            probs = 1 / (1 + np.exp(-logits))
        else:
            probs = np.exp(logits - logits.max())
            probs /= probs.sum()
        choice = probs + p.get("score_bias", 0.0)
        per_group = len(choice) // groups
        group_scores = [sorted(g)[-2:] for g in choice.reshape(groups, per_group)]
        best = np.argsort(-np.sum(group_scores, axis=1))[:topk_groups] if groups > 1 else [0]
        allowed = [e for e in range(len(choice)) if e // per_group in best]
        chosen = sorted(allowed, key=lambda e: -choice[e])[:top_k]
        weights = probs[chosen] / (probs[chosen].sum() if norm_topk else 1.0) * scale
        for e, w in zip(chosen, weights, strict=True):
            h = silu(xt @ p["w_gate"][e]) * (xt @ p["w_up"][e])
            out[n] += w * (h @ p["w_down"][e])
        s = p["shared"]
        shared = (silu(xt @ s["w_gate"]["kernel"]) * (xt @ s["w_up"]["kernel"])) @ s["w_down"][
            "kernel"
        ]
        if "shared_gate" in p:
            shared = shared / (1 + np.exp(-(xt @ p["shared_gate"]["kernel"])))
        out[n] += shared
    return out


@pytest.mark.parametrize("norm_topk", [True, False])
def test_moe_matches_the_dispatching_float64_form(norm_topk):
    moe = MoE(
        16,
        num_experts=5,
        top_k=2,
        hidden_dim=8,
        shared_dim=12,
        norm_topk=norm_topk,
        rngs=nnx.Rngs(0),
    )
    x = jax.random.normal(jax.random.key(1), (2, 7, 16))
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(nnx.state(moe)))
    want = moe64(p, x, 2, norm_topk).reshape(2, 7, 16)
    np.testing.assert_allclose(moe(x), want, rtol=1e-4, atol=1e-5)
    # each token's routing weights: k non-zero, summing to 1 when renormalised
    weights = moe.routing(x)
    assert ((weights > 0).sum(-1) == 2).all()
    if norm_topk:
        np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-6)


def test_grouped_sigmoid_routing_matches_the_dispatching_float64_form():
    """DeepSeek-V3's / Kimi Linear's routing: sigmoid scores, a score bias that only picks,
    the best 2 of 4 groups, renormalised weights times 2.5, an ungated shared expert."""
    moe = MoE(
        16, num_experts=8, top_k=3, hidden_dim=8, shared_dim=12, router="sigmoid",
        score_bias=True, num_groups=4, topk_groups=2, routed_scale=2.5, shared_gate=False,
        rngs=nnx.Rngs(0),
    )  # fmt: skip
    assert moe.shared_gate is None and moe.score_bias.shape == (8,)
    moe.score_bias[...] = jax.random.normal(jax.random.key(3), (8,)) * 0.3
    x = jax.random.normal(jax.random.key(1), (2, 7, 16))
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(nnx.state(moe)))
    want = moe64(p, x, 3, True, sigmoid=True, groups=4, topk_groups=2, scale=2.5)
    np.testing.assert_allclose(moe(x), want.reshape(2, 7, 16), rtol=1e-4, atol=1e-5)
    weights = np.asarray(moe.routing(x)).reshape(-1, 4, 2)
    assert ((weights > 0).any(-1).sum(-1) <= 2).all()  # at most 2 groups hold the experts
    np.testing.assert_allclose(weights.sum((-1, -2)), 2.5, rtol=1e-6)


def test_dense_first_layers_decode_and_remat_as_the_full_pass():
    """moe_dense_layers=1: layer 0 a dense SwiGLU, layers 1-2 experts; decoding and the
    rematerialised pass (scanned: the dense layer apart) equal the plain full pass."""
    common = dict(
        vocab_size=30, d_model=16, num_layers=3, num_heads=2, mixer="softmax", mlp_dim=24,
        num_experts=4, experts_per_token=2, moe_dim=8, moe_dense_layers=1,
    )  # fmt: skip
    model = LanguageModel(ModelConfig(**common), rngs=nnx.Rngs(0))
    dense = model.blocks[0].mlp
    assert not isinstance(dense, MoE) and dense.w_up.kernel.shape == (16, 24)
    assert all(isinstance(b.mlp, MoE) for b in model.blocks[1:])
    tokens = jax.random.randint(jax.random.key(2), (2, 5), 0, 30)
    full = nnx.jit(lambda m, t: m(t))(model, tokens)
    remat = LanguageModel(ModelConfig(**common, remat="block"), rngs=nnx.Rngs(0))
    np.testing.assert_allclose(nnx.jit(lambda m, t: m(t))(remat, tokens), full, rtol=1e-6)
    logits, _ = nnx.jit(lambda m, t, s: m.prefill(t, s))(model, tokens, model.init_state(2, 5))
    np.testing.assert_allclose(logits, full, rtol=1e-5, atol=1e-5)


def test_moe_model_decodes_as_the_full_pass():
    config = ModelConfig(
        vocab_size=30,
        d_model=16,
        num_layers=1,
        num_heads=2,
        mixer="softmax",
        num_experts=4,
        experts_per_token=2,
        moe_dim=8,
        shared_expert_dim=8,
    )
    model = LanguageModel(config, rngs=nnx.Rngs(0))
    assert isinstance(model.blocks[0].mlp, MoE) and model.blocks[0].mlp.w_up.shape == (4, 16, 8)
    tokens = jax.random.randint(jax.random.key(2), (2, 6), 0, 30)
    full = nnx.jit(lambda m, t: m(t))(model, tokens)
    state = model.init_state(2, 6)
    logits, state = nnx.jit(lambda m, t, s: m.prefill(t, s))(model, tokens[:, :3], state)
    steps, step_once = [logits], step_fn(model)
    for t in range(3, 6):
        step, state = step_once(tokens[:, t], state)
        steps.append(step[:, None])
    np.testing.assert_allclose(jnp.concatenate(steps, 1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(experts_per_token=2), "experts_per_token=2 needs num_experts > 0"),
        (dict(num_experts=4), "experts_per_token must be an int in \\[1, num_experts=4\\]"),
        (dict(num_experts=4, experts_per_token=5), "got 5"),
        (dict(num_experts=4, experts_per_token=1, mlp=False), "num_experts=4 needs mlp=True"),
        (dict(moe_router="sigmoid"), "moe_router='sigmoid' needs num_experts > 0"),
        (dict(moe_dense_layers=1), "moe_dense_layers=1 needs num_experts > 0"),
        (dict(num_experts=4, experts_per_token=2, moe_groups=3), "moe_groups=3 must divide"),
        (dict(num_experts=4, experts_per_token=2, moe_groups=4), "groups of at least 2"),
        (
            dict(num_experts=8, experts_per_token=3, moe_groups=4, moe_topk_groups=1),
            "moe_topk_groups=1 must be <= moe_groups=4 and hold experts_per_token=3",
        ),
        (dict(num_experts=4, experts_per_token=2, moe_router="relu"), "unknown moe_router"),
        (dict(num_experts=4, experts_per_token=2, moe_routed_scale=0.0), "moe_routed_scale"),
        (dict(num_experts=4, experts_per_token=2, moe_shared_gate=False), "needs shared_expert"),
        (dict(num_experts=4, experts_per_token=2, moe_dense_layers=1), "must be < num_layers=1"),
    ],
)
def test_bad_expert_settings_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(vocab_size=30, d_model=16, num_layers=1, num_heads=2, **fields)
