"""The mixture-of-experts MLP against a float64 NumPy form that dispatches each token to its
chosen experts, and in a model: decoding equal to the full pass, bad settings refused. The
load-balancing loss against a float64 NumPy form of transformers' definition (and, under
`-m hf`, transformers' own `load_balancing_loss_func`), a hand-computed case and its minimum,
and a model's router statistics over every MoE layer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_attention.layers import MoE, add_router_stats, load_balancing_loss, router_stats
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


# ------------------------------------------------------------------ the load-balancing loss
def aux64(logits_layers, top_k, mask=None):
    """Switch Transformer's loss as transformers' `load_balancing_loss_func` defines it, row by
    row in float64: over the rows of every layer (masked-out rows left out), the fraction of
    top-k choices of each expert times its mean router probability, summed, times E."""
    num_experts = logits_layers[0].shape[-1]
    counts, probs, rows = np.zeros(num_experts), np.zeros(num_experts), 0.0
    for logits in logits_layers:
        logits = np.asarray(logits, np.float64).reshape(-1, num_experts)
        weights = np.ones(len(logits)) if mask is None else np.asarray(mask, np.float64).ravel()
        for row, w in zip(logits, weights, strict=True):
            p = np.exp(row - row.max())
            p /= p.sum()
            counts[np.argsort(-p)[:top_k]] += w
            probs += w * p
            rows += w
    return num_experts * np.sum((counts / rows) * (probs / rows))


def summed_stats(logits_layers, top_k, mask=None):
    stats = None
    for logits in logits_layers:
        stats = add_router_stats(stats, router_stats(jnp.asarray(logits), top_k, mask))
    return stats


@pytest.mark.parametrize("masked", [False, True])
def test_aux_loss_matches_the_float64_form(masked):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 2, 7, 6)).astype(np.float32)  # 3 layers, [B, T, E]
    mask = rng.random((2, 7)) < 0.6 if masked else None
    got = load_balancing_loss(summed_stats(logits, 2, mask))
    np.testing.assert_allclose(got, aux64(logits, 2, mask), rtol=1e-6)


def test_aux_loss_hand_computed_and_its_minimum():
    # 2 experts, top 1, both tokens p = (0.75, 0.25): expert 0 takes every token,
    # aux = 2 · (1 · 0.75 + 0 · 0.25) = 1.5
    logits = jnp.log(jnp.asarray([[0.75, 0.25], [0.75, 0.25]]))
    np.testing.assert_allclose(load_balancing_loss(router_stats(logits, 1)), 1.5, rtol=1e-6)
    # a uniform router gives the minimum, top_k, whatever its (tied) choices
    for top_k in (1, 2, 3):
        stats = router_stats(jnp.zeros((5, 4, 8)), top_k)
        np.testing.assert_allclose(load_balancing_loss(stats), top_k, rtol=1e-6)
    # a masked-out row counts for nothing; no row counted gives 0, not NaN
    masked = router_stats(jnp.asarray([[2.0, 0.0], [-5.0, 5.0]]), 1, jnp.asarray([1, 0]))
    np.testing.assert_allclose(masked.counts_E, [1.0, 0.0])
    assert float(masked.rows) == 1.0
    assert float(load_balancing_loss(router_stats(logits, 1, jnp.zeros(2)))) == 0.0


@pytest.mark.hf
@pytest.mark.parametrize("model", ["qwen3_next", "mixtral"])
def test_aux_loss_matches_transformers(model):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    modeling = getattr(transformers.models, model)
    reference = getattr(modeling, f"modeling_{model}").load_balancing_loss_func
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(3, 2, 7, 6)).astype(np.float32)
    mask = (rng.random((2, 7)) < 0.6).astype(np.int64)
    for m in (None, mask):
        want = reference(
            tuple(torch.from_numpy(x.reshape(-1, 6)) for x in logits),
            6,
            2,
            None if m is None else torch.from_numpy(m),
        )
        got = load_balancing_loss(summed_stats(logits, 2, m))
        np.testing.assert_allclose(got, float(want), rtol=1e-6)


def moe_config(**fields):
    return ModelConfig(
        vocab_size=30,
        d_model=16,
        num_layers=2,
        num_heads=2,
        mixer="softmax",
        num_experts=4,
        experts_per_token=2,
        moe_dim=8,
        **fields,
    )


def router_inputs(model, tokens):
    """Each block's MoE input, by walking the blocks one part at a time (position none)."""
    x, inputs = model.embed(tokens), []
    for block in model.blocks:
        inputs.append(block.mlp_norm(x + block.mixer(block.mixer_norm(x))))
        x = block(x)
    return inputs


@pytest.mark.parametrize(("remat", "dense_layers"), [("none", 0), ("block", 0), ("block", 1)])
def test_model_router_stats_cover_every_moe_layer(remat, dense_layers):
    """Summed over the MoE layers (not the dense-MLP ones) and every token."""
    config = moe_config(remat=remat, moe_dense_layers=dense_layers)
    model = LanguageModel(config, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(2), (2, 6), 0, 30)
    logits, stats = nnx.jit(lambda m, t: m.logits_and_router_stats(t))(model, tokens)
    np.testing.assert_allclose(logits, model(tokens), rtol=1e-5, atol=1e-6)
    moe, inputs = model.blocks[dense_layers:], router_inputs(model, tokens)[dense_layers:]
    router = [b.mlp.router(x) for b, x in zip(moe, inputs, strict=True)]
    rows = len(router) * 2 * 6
    assert float(stats.rows) == rows and float(stats.counts_E.sum()) == 2 * rows
    np.testing.assert_allclose(load_balancing_loss(stats), aux64(router, 2), rtol=1e-5)
    # a model without experts has none
    dense = LanguageModel(ModelConfig(vocab_size=30, d_model=16), rngs=nnx.Rngs(0))
    assert dense.logits_and_router_stats(tokens)[1] is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(moe_aux_loss_coef=0.01), "moe_aux_loss_coef=0.01 needs num_experts > 0"),
        (
            dict(num_experts=4, experts_per_token=2, moe_aux_loss_coef=-0.1),
            "moe_aux_loss_coef must be",
        ),
        (
            dict(num_experts=4, experts_per_token=2, moe_aux_loss_coef=0.1, moe_router="sigmoid"),
            "moe_aux_loss_coef=0.1 needs the softmax router",
        ),
        (
            dict(num_experts=4, experts_per_token=2, moe_aux_loss_coef=0.1, moe_score_bias=True),
            "moe_score_bias=True",
        ),
    ],
)
def test_bad_aux_loss_settings_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(vocab_size=30, d_model=16, num_layers=1, num_heads=2, **fields)
