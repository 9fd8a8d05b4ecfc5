"""Bad input at the model's boundaries (issue 14): token ids out of range (eager: ValueError;
under jit: NaN at their own positions only), `generate`'s arguments, `ModelConfig`'s types,
and decoding states from another model."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_attention.models import LanguageModel, ModelConfig, generate, step_fn

V, B, T = 16, 2, 8
BASE = dict(vocab_size=V, d_model=16, num_layers=2, num_heads=2, max_length=12, mlp_ratio=2.0)
HYBRID = dict(mixer=("gated", "softmax"), conv=True)


def make(seed: int = 0, **fields):
    return LanguageModel(ModelConfig(**{**BASE, **HYBRID, **fields}), rngs=nnx.Rngs(seed))


def tokens(seed=0, shape=(B, T)):
    return jax.random.randint(jax.random.key(seed), shape, 0, V)


# Compiled once for the file (a model of the same structure and shapes reuses the program):
# the references that need no concrete-input check run through these, not eagerly op by op.
forward = nnx.jit(lambda model, tokens_BT: model(tokens_BT))
prefill = nnx.jit(lambda model, tokens_BT, state: model.prefill(tokens_BT, state))


# ----------------------------------------------------------------------------- token ids
@pytest.mark.parametrize("bad", [-1, -100, V, V + 7])
def test_out_of_range_tokens_raise_on_concrete_input(bad):
    model = make()
    toks = np.asarray(tokens()).copy()
    toks[1, 5] = bad
    match = rf"tokens must be token ids in \[0, vocab_size={V}\), got {bad} at index \(1, 5\)"
    with pytest.raises(ValueError, match=match) as info:
        model(toks)
    assert ("ignore index" in str(info.value)) == (bad == -100)
    with pytest.raises(ValueError, match=match):
        model.prefill(jnp.asarray(toks), model.init_state(B))
    with pytest.raises(ValueError, match=rf"got {bad} at index \(1,\)"):
        model.step(jnp.asarray(toks[:, 5]), model.init_state(B))
    with pytest.raises(ValueError, match=rf"prompt must be token ids .* got {bad}"):
        generate(model, toks, 2, rng=jax.random.key(0))


def _zero_row_model(model):
    """The same model with a vocabulary of V + 1 whose extra token embeds as zeros: the
    reference for what a bad token must do under jit (its logits' first V columns)."""
    config = ModelConfig(**{**BASE, **HYBRID, "vocab_size": V + 1})
    ref = LanguageModel(config, rngs=nnx.Rngs(0))
    pure = nnx.to_pure_dict(nnx.state(model))
    table = pure["embed"]["embedding"]
    pure["embed"]["embedding"] = jnp.concatenate([table, jnp.zeros((1, table.shape[1]))])
    state = nnx.state(ref)
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(ref, state)
    return ref


@pytest.mark.parametrize("bad", [-100, V])
def test_under_jit_a_bad_token_is_nan_at_its_own_position_only(bad):
    model = make()
    t = 3
    clean = tokens()
    dirty = clean.at[0, t].set(bad)
    logits = np.asarray(forward(model, dirty))
    assert np.isnan(logits[0, t]).all()
    mask = np.ones(logits.shape[:2], bool)
    mask[0, t] = False
    assert np.isfinite(logits[mask]).all()
    # Positions before t: as if the bad token were not there (causality).
    want = forward(model, clean)
    np.testing.assert_allclose(logits[0, :t], want[0, :t], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits[1], want[1], rtol=1e-5, atol=1e-5)
    # Positions after t: they saw a zero input vector at t.
    ref = forward(_zero_row_model(model), dirty.at[0, t].set(V))[..., :V]
    np.testing.assert_allclose(logits[0, t + 1 :], ref[0, t + 1 :], rtol=1e-5, atol=1e-5)

    # The same through the decoding paths, jitted.
    state = model.init_state(B)
    pre, state = prefill(model, dirty[:, :5], state)
    np.testing.assert_allclose(pre, logits[:, :5], rtol=1e-4, atol=1e-4, equal_nan=True)
    step = step_fn(model)
    for i in range(5, T):
        out, state = step(dirty[:, i], state)
        np.testing.assert_allclose(out, logits[:, i], rtol=1e-4, atol=1e-4)


def test_learned_positions_past_max_length():
    model = make(position="learned", mixer="gated")
    n = BASE["max_length"]
    full = forward(model, tokens(shape=(B, n)))
    state = model.init_state(B)
    _, state = prefill(model, tokens(shape=(B, n))[:, : n - 2], state)
    with pytest.raises(ValueError, match=f"position {n - 2} \\+ 3 token\\(s\\) exceeds max_length"):
        model.prefill(tokens(shape=(B, 3)), state)
    # Under jit: the positions within max_length are right, those past it NaN.
    extra = jnp.concatenate([tokens(shape=(B, n))[:, n - 2 :], tokens(1, (B, 1))], axis=1)
    out, _ = prefill(model, extra, state)
    np.testing.assert_allclose(out[:, :2], full[:, n - 2 :], rtol=1e-4, atol=1e-4)
    assert np.isnan(np.asarray(out[:, 2])).all()


def test_softmax_cache_overflow_is_refused():
    model = make()
    state = model.init_state(B, 4)
    with pytest.raises(ValueError, match=r"holds 4 tokens .* it has 0 and cannot take 5 more"):
        model.prefill(tokens()[:, :5], state)
    _, state = prefill(model, tokens()[:, :4], state)
    with pytest.raises(ValueError, match="it has 4 and cannot take 1 more"):
        model.step(tokens()[:, 4], state)


# ----------------------------------------------------------------------------- generate
def test_generate_validates_its_arguments():
    model = make()
    prompt = tokens()[:, :3]
    key = jax.random.key(0)
    with pytest.raises(ValueError, match="at least one token per row"):
        generate(model, prompt[:, :0], 2, rng=key)
    for temperature in (float("nan"), float("inf"), -0.5, True, "0.5", None):
        with pytest.raises(ValueError, match="temperature must be a number >= 0 and finite"):
            generate(model, prompt, 2, rng=key, temperature=temperature)
    for rng in ("0", 1.5, jnp.zeros(3), None, True):
        with pytest.raises(ValueError, match=r"rng must be a PRNG key \(jax.random.key"):
            generate(model, prompt, 2, rng=rng)
    with pytest.raises(ValueError, match="num_tokens must be an integer"):
        generate(model, prompt, 2.0, rng=key)

    # Valid spellings of the same request give the same tokens.
    want = generate(model, prompt, 3, rng=jax.random.key(7), temperature=0.5, top_k=4)
    for kwargs in (
        dict(rng=7),
        dict(rng=np.int64(7)),
        dict(rng=jax.random.key(7), temperature=np.float32(0.5)),
        dict(rng=jax.random.key(7), top_k=np.int64(4)),
        dict(rng=jax.random.key(7), num=np.int32(3)),
    ):
        args = {**dict(rng=jax.random.key(7), temperature=0.5, top_k=4, num=3), **kwargs}
        num = args.pop("num")
        out = generate(model, prompt, num, **args)
        np.testing.assert_array_equal(out, want)
    legacy = generate(model, prompt, 3, rng=jax.random.PRNGKey(7), temperature=0.5, top_k=4)
    assert legacy.shape == (B, 3)


# ----------------------------------------------------------------------------- ModelConfig
@pytest.mark.parametrize(
    "fields,match",
    [
        (dict(mlp="False"), "mlp must be a bool, got 'False'"),
        (dict(tie_embeddings="no"), "tie_embeddings must be a bool, got 'no'"),
        (dict(mlp=1), "mlp must be a bool, got 1"),
        (dict(out_norm="yes"), "out_norm must be a bool"),
        (dict(options=dict(eps=float("inf"))), "eps must be a finite number > 0, got inf"),
        (dict(options=dict(eps=float("nan"))), "eps must be a finite number > 0, got nan"),
        (dict(norm_eps=np.float32("inf")), "norm_eps must be a finite number > 0"),
        (dict(rope_base=True), "rope_base must be a finite number > 0"),
        (dict(mlp_ratio="4"), "mlp_ratio must be a finite number > 0"),
        (dict(d_model=16.0), "d_model must be an integer"),
        (dict(conv="4"), "conv must be a bool or an integer kernel size"),
        (dict(num_heads=True), "num_heads must be an integer"),
        (dict(position=None), "position must be a string"),
    ],
)
def test_model_config_types_are_strict(fields, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{**BASE, **fields})


def test_model_config_accepts_numpy_scalars_as_python_values():
    config = ModelConfig(
        **{
            **BASE,
            "vocab_size": np.int64(V),
            "d_model": np.int32(16),
            "conv": np.int64(3),
            "mlp": np.True_,
            "options": {"eps": np.float32(0.5), "chunk_size": np.int64(4)},
            "head_dim": np.int64(8),
        }
    )
    assert config == ModelConfig(
        **{**BASE, "conv": 3, "mlp": True, "options": dict(eps=0.5, chunk_size=4), "head_dim": 8}
    )
    for field in ("vocab_size", "d_model", "conv", "head_dim"):
        assert type(getattr(config, field)) is int
    assert type(config.options["chunk_size"]) is int
    assert type(config.mlp) is bool and type(config.options["eps"]) is float
    hash(config)
    json.dumps(dataclasses.asdict(config))


# ----------------------------------------------------------------------------- states
@pytest.mark.parametrize(
    "other,match",
    [
        (dict(conv=3), r"state.layers\[0\] \(gated\).*conv has shape \(2, 2, 48\)"),
        (dict(conv=False), r"state.layers\[0\] \(gated\) has the structure"),
        (dict(num_heads=4), r"state.layers\[0\] \(gated\).*core.* has shape"),
        # (the state names its mixer: a softmax cache is refused before its shapes are read)
        (
            dict(mixer=("softmax", "gated")),
            r"state.layers\[0\] \(gated\) was made by a 'softmax' mixer",
        ),
    ],
)
def test_a_state_from_another_model_is_rejected(other, match):
    model = make()  # conv kernel 4: the conv tail is [B, 3, 3·d]
    foreign = make(**other).init_state(B)
    with pytest.raises(ValueError, match=match):
        model.step(tokens()[:, 0], foreign)
    with pytest.raises(ValueError, match=match):
        model.prefill(tokens(), foreign)
    with pytest.raises(ValueError, match=match):
        step_fn(model)(tokens()[:, 0], foreign)  # caught while tracing, under jit
    with pytest.raises(ValueError, match=r"for batch 3"):
        model.step(tokens(shape=(3,)), model.init_state(B))
    # Its own state, with any cache length up to max_length, is accepted.
    model.step(tokens()[:, 0], model.init_state(B, 5))


def test_positions_past_int32_are_refused():
    # Positions are int32: a max_length past 2**31 - 1, or a decode past it, would wrap negative.
    with pytest.raises(ValueError, match=r"max_length must be <= 2147483647 \(2\*\*31 - 1\)"):
        ModelConfig(**{**BASE, "max_length": 2**31})
    assert ModelConfig(**{**BASE, "max_length": 2**31 - 1}).max_length == 2**31 - 1
    # A linear model's decoding is not bounded by max_length; its int32 counter is.
    model = make(mixer="gated", position="rope")
    state = model.init_state(B)._replace(position=jnp.asarray(2**31 - 2, jnp.int32))
    _, state = model.step(tokens()[:, 0], state)
    assert int(state.position) == 2**31 - 1
    with pytest.raises(ValueError, match=r"state.position 2147483647 \+ 1 token\(s\) would pass"):
        model.step(tokens()[:, 1], state)
    with pytest.raises(ValueError, match=r"state.position 2147483646 \+ 2 token\(s\) would pass"):
        model.prefill(tokens()[:, :2], state._replace(position=state.position - 1))
