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


def moe64(p, x, top_k, norm_topk):
    """Token by token: softmax router, the top k experts (renormalised), their SwiGLUs summed,
    plus the sigmoid-gated shared expert."""
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    x = np.asarray(x, np.float64).reshape(-1, x.shape[-1])
    out = np.zeros_like(x)
    for n, xt in enumerate(x):
        logits = xt @ p["router"]["kernel"]
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        chosen = np.argsort(-probs)[:top_k]
        weights = probs[chosen] / (probs[chosen].sum() if norm_topk else 1.0)
        for e, w in zip(chosen, weights, strict=True):
            h = silu(xt @ p["w_gate"][e]) * (xt @ p["w_up"][e])
            out[n] += w * (h @ p["w_down"][e])
        s = p["shared"]
        shared = (silu(xt @ s["w_gate"]["kernel"]) * (xt @ s["w_up"]["kernel"])) @ s["w_down"][
            "kernel"
        ]
        out[n] += shared / (1 + np.exp(-(xt @ p["shared_gate"]["kernel"])))
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
    ],
)
def test_bad_expert_settings_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(vocab_size=30, d_model=16, num_layers=1, num_heads=2, **fields)
