"""Decoding: compiled step reuse, generate against a naive loop, state size against formulas."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_attention.models import (
    LanguageModel,
    ModelConfig,
    decoding,
    generate,
    generate_stream,
    state_size_bytes,
    step_fn,
)

V, B = 32, 2
BASE = dict(vocab_size=V, d_model=16, num_layers=2, num_heads=2, max_length=16, mlp_ratio=2.0)


def make(seed: int = 0, **fields):
    return LanguageModel(ModelConfig(**{**BASE, **fields}), rngs=nnx.Rngs(seed))


HYBRID = dict(mixer=("gated", "softmax"), position="rope", conv=True)


def test_step_fn_compiles_once_and_matches_full_call():
    model = make(d_model=8, **HYBRID)  # a shape no other test compiles
    toks = jax.random.randint(jax.random.key(0), (B, 10), 0, V)
    step = step_fn(model)
    state = model.init_state(B, 10)
    logits = []
    for t in range(10):
        logits_BV, state = step(toks[:, t], state)
        if t == 0:
            compiled = decoding._step._cache_size()
        logits.append(logits_BV)
    assert decoding._step._cache_size() == compiled  # positions 1..9 reused the same executable
    full = nnx.jit(lambda m, x: m(x))(model, toks)
    np.testing.assert_allclose(jnp.stack(logits, 1), full, rtol=1e-4, atol=1e-4)


@nnx.jit
def _last_logits(model, padded_BL, length):
    """Logits at position length − 1 of a zero-padded sequence (causal: padding is unseen)."""
    return model(padded_BL)[:, length - 1]


def test_generate_greedy_matches_a_naive_full_forward_loop():
    model = make(**HYBRID)
    prompt = jax.random.randint(jax.random.key(1), (B, 4), 0, V)
    n = 6
    out = generate(model, prompt, n, rng=jax.random.key(0), temperature=0.0)
    assert out.shape == (B, n) and out.dtype == jnp.int32
    seq = jnp.zeros((B, 16), jnp.int32).at[:, :4].set(prompt)
    for i in range(n):
        nxt = jnp.argmax(_last_logits(model, seq, 4 + i), axis=-1)
        seq = seq.at[:, 4 + i].set(nxt)
    np.testing.assert_array_equal(out, seq[:, 4 : 4 + n])
    # top_k=1 sampling is greedy whatever the temperature
    top1 = generate(model, prompt, n, rng=jax.random.key(5), temperature=2.0, top_k=1)
    np.testing.assert_array_equal(top1, out)


def test_generate_stream_yields_the_tokens_of_generate():
    model = make(**HYBRID)
    prompt = jax.random.randint(jax.random.key(2), (B, 3), 0, V)
    for kwargs in (dict(temperature=0.0), dict(temperature=0.9, top_k=5)):
        whole = generate(model, prompt, 5, rng=jax.random.key(3), **kwargs)
        stream = list(generate_stream(model, prompt, 5, rng=jax.random.key(3), **kwargs))
        assert len(stream) == 5 and stream[0].shape == (B,)
        np.testing.assert_array_equal(jnp.stack(stream, 1), whole)
    with pytest.raises(ValueError, match="num_tokens must be an integer >= 1"):
        next(generate_stream(model, prompt, 0, rng=jax.random.key(0)))


def test_step_fn_donates_the_state():
    model = make(**HYBRID)
    state = model.init_state(B, 4)
    _, new_state = step_fn(model)(jnp.zeros((B,), jnp.int32), state)
    cache = state.layers[1].core.k  # the softmax layer's KV cache was updated in place
    assert cache.is_deleted() and not new_state.layers[1].core.k.is_deleted()


def test_generate_sampling_respects_top_k_and_rng():
    model = make(**HYBRID)
    prompt = jnp.tile(jax.random.randint(jax.random.key(2), (1, 3), 0, V), (64, 1))
    out = generate(model, prompt, 2, rng=jax.random.key(0), top_k=3)
    again = generate(model, prompt, 2, rng=jax.random.key(0), top_k=3)
    np.testing.assert_array_equal(out, again)  # deterministic by rng
    first_logits = _last_logits(model, jnp.zeros((64, 16), jnp.int32).at[:, :3].set(prompt), 3)
    allowed = set(np.asarray(jax.lax.top_k(first_logits[0], 3)[1]).tolist())
    drawn = set(np.asarray(out[:, 0]).tolist())
    assert drawn <= allowed and len(drawn) > 1  # sampled, and only from the top 3


BAD_GENERATE = [
    (dict(prompt=jnp.zeros((B, 3))), "prompt must be integer tokens"),
    (dict(num_tokens=0), "num_tokens"),
    (dict(num_tokens=14), "exceeds max_length=16"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=V + 1), "top_k"),
]


@pytest.mark.parametrize("override,match", BAD_GENERATE, ids=[m for _, m in BAD_GENERATE])
def test_generate_bad_arguments_raise(override, match):
    model = make()
    kwargs = dict(prompt=jnp.zeros((B, 3), jnp.int32), num_tokens=4, rng=jax.random.key(0))
    kwargs.update(override)
    prompt, num_tokens = kwargs.pop("prompt"), kwargs.pop("num_tokens")
    with pytest.raises(ValueError, match=match):
        generate(model, prompt, num_tokens, **kwargs)


def _config(**fields):
    return ModelConfig(**{**BASE, **fields})


def test_state_size_bytes_against_formulas():
    h, dv = 2, 8  # per layer: kv H·M·Dv + k_sum H·M, float32
    linear = lambda m: 4 * (h * m * dv + h * m)  # noqa: E731
    assert state_size_bytes(_config(mixer="linear")) == 2 * linear(8)
    assert state_size_bytes(_config(mixer="favor", options=dict(feature_dim=20))) == 2 * linear(20)
    # taylor: M = 1 + d + d(d+1)/2 (upper triangle of x⊗x) = 15 at d = 4; by hand, 2 layers ×
    # 4 bytes × (kv 2·15·8 + k_sum 2·15) = 2160
    assert state_size_bytes(_config(mixer="taylor", options=dict(feature_dim=4))) == 2 * linear(
        1 + 4 + 10
    )
    assert state_size_bytes(_config(mixer="taylor", options=dict(feature_dim=4))) == 2160
    assert state_size_bytes(_config(mixer="hedgehog", options=dict(feature_dim=5))) == 2 * linear(
        10
    )
    # conv tail: (K − 1) · 3·H·Dh channels, float32
    assert state_size_bytes(_config(mixer="gated", conv=True)) == 2 * (linear(8) + 4 * 3 * 48)
    # delta rule: kv H·Dk·Dv only (no k_sum), conv on by default
    assert state_size_bytes(_config(mixer="deltanet")) == 2 * (4 * h * 8 * dv + 4 * 3 * 48)
    assert state_size_bytes(_config(mixer="gated_deltanet", conv=False)) == 2 * 4 * h * 8 * dv
    # grouped value heads: a state per value head; the conv over q, k (H heads) and v (HV)
    grouped = 2 * 4 * 4 * 8 * dv + 2 * 4 * 3 * (2 * h * 8 + 4 * dv)
    assert (
        state_size_bytes(_config(mixer="gated_deltanet", options=dict(num_value_heads=4)))
        == grouped
    )
    assert state_size_bytes(_config(mixer="kda", options=dict(num_value_heads=4))) == grouped
    # DeltaProduct: one H·Dk·Dv state; the conv over q and n = 3 keys and values per head
    conv3 = 4 * 3 * (h * 8 + 3 * h * 8 + 3 * h * dv)
    assert state_size_bytes(
        _config(mixer="gated_deltaproduct", options=dict(num_householder=3))
    ) == 2 * (4 * h * 8 * dv + conv3)
    # rwkv7: kv H·Dk·Dv, and the token shift's last input (d_model = 16 floats), no conv
    assert state_size_bytes(_config(mixer="rwkv7")) == 2 * (4 * h * 8 * dv + 4 * 16)
    # mesanet: both statistics, H_kk H·Dk·Dk and H_kv H·Dk·Dv, and the conv tail over q and k
    # only (v has no conv)
    mesa = 4 * h * 8 * 8 + 4 * h * 8 * dv + 4 * 3 * 2 * h * 8
    assert state_size_bytes(_config(mixer="mesanet")) == 2 * mesa
    assert state_size_bytes(_config(mixer="mesanet", max_length=1 << 20)) == 2 * mesa
    # gla: the same state (a vector decay changes the update, not the size), M = Dk = 8
    assert state_size_bytes(_config(mixer="gla")) == 2 * linear(8)
    # softmax: K and V caches at max_length, in the compute dtype
    assert state_size_bytes(_config(mixer="softmax", max_length=16)) == 2 * 2 * 16 * h * dv * 4
    assert state_size_bytes(_config(mixer="softmax", max_length=16, dtype="bfloat16")) == (
        2 * 2 * 16 * h * dv * 2
    )
    # the linear state does not grow with the context; the KV cache does, linearly
    assert state_size_bytes(_config(mixer="retnet", max_length=1 << 20)) == 2 * linear(8)
    hybrid = lambda n: state_size_bytes(_config(mixer=("retnet", "softmax"), max_length=n))  # noqa: E731
    assert hybrid(64) - hybrid(32) == 2 * 32 * h * dv * 4
    # swa: a ring buffer of `window` keys and values (compute dtype), whatever max_length
    for n in (16, 1 << 20):
        swa = _config(mixer="swa", max_length=n, dtype="bfloat16", options=dict(window=5))
        assert state_size_bytes(swa) == 2 * 2 * 5 * h * dv * 2
    based = lambda n: state_size_bytes(  # noqa: E731
        _config(mixer=("taylor", "swa"), max_length=n, options=dict(feature_dim=4, window=5))
    )
    taylor_layer = state_size_bytes(_config(mixer="taylor", options=dict(feature_dim=4))) // 2
    assert based(16) == based(1 << 20) == taylor_layer + 2 * 5 * h * dv * 4


def test_state_size_bytes_is_what_a_real_state_holds():
    model = make(**HYBRID)
    per_sequence = sum(
        leaf.nbytes for leaf in jax.tree.leaves(model.init_state(1, 16)) if leaf.ndim > 0
    )
    assert state_size_bytes(model.config) == per_sequence
