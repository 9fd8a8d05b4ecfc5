"""LanguageModel: three decoding paths agree, causality, dtypes, jit / nnx.jit / split-merge."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_attention import kernels as K
from linear_attention.layers import MIXERS, KVCache
from linear_attention.models import LanguageModel, ModelConfig, ModelState, redraw_features

V, B, T, SPLIT = 32, 2, 12, 5
# Every registered mixer (in registry order a layer follows gated_deltanet: its chunk gradient
# must not leak across a reset, even rounding).
ALL_MIXERS = tuple(MIXERS)


def make(seed: int = 0, **fields):
    base = dict(vocab_size=V, d_model=16, num_layers=2, num_heads=2, max_length=16, mlp_ratio=2.0)
    return LanguageModel(ModelConfig(**{**base, **fields}), rngs=nnx.Rngs(seed))


def tokens(seed: int = 1, shape=(B, T)):
    return jax.random.randint(jax.random.key(seed), shape, 0, V)


@nnx.jit
def all_paths(model, tokens_BT):
    def scan_steps(state, tokens_BT):
        def body(state, tokens_B):
            logits_BV, state = model.step(tokens_B, state)
            return state, logits_BV

        state, logits_TBV = jax.lax.scan(body, state, tokens_BT.T)
        return jnp.swapaxes(logits_TBV, 0, 1), state

    empty = model.init_state(B, T + 2)
    full = model(tokens_BT)
    prefilled, _ = model.prefill(tokens_BT, empty)
    stepped, _ = scan_steps(empty, tokens_BT)
    head, state = model.prefill(tokens_BT[:, :SPLIT], empty)
    tail, final = scan_steps(state, tokens_BT[:, SPLIT:])
    return full, prefilled, stepped, jnp.concatenate([head, tail], axis=1), final


CASES = {
    # a hybrid with rope, conv and the MLP
    "hybrid_rope": dict(mixer=("gated", "softmax"), position="rope", conv=True),
    # learned positions, untied head, no MLP (the MQAR setting)
    "learned": dict(
        mixer=("favor", "taylor"),
        position="learned",
        tie_embeddings=False,
        mlp=False,
        options=dict(chunk_size=4),
    ),
    # the delta rule in a hybrid (its conv on by default), several chunks
    "hybrid_delta": dict(
        mixer=("gated_deltanet", "softmax"), options=dict(chunk_size=4, allow_neg_eigval=True)
    ),
    # KDA (grouped value heads) and Gated DeltaProduct (2 delta steps per token), conv on
    "kda_deltaproduct": dict(
        mixer=("kda", "gated_deltaproduct"), options=dict(chunk_size=4, num_value_heads=4)
    ),
    # RWKV-7 (token shift: its state carries the last input) beside a delta layer's conv
    "hybrid_rwkv7": dict(
        mixer=("rwkv7", "gated_deltanet"), position="learned", options=dict(chunk_size=4)
    ),
    # Based: taylor + sliding window (window 3 < SPLIT: the ring buffer wraps), rope and conv
    "based": dict(
        mixer=("taylor", "swa"), position="rope", conv=True, options=dict(feature_dim=4, window=3)
    ),
    # MesaNet (chunked CG, a partial last chunk) beside a decayed linear layer
    # PaTH (its KV cache of transported keys, the w conv's tail) with the forget gate, beside
    # softmax attention's cache, both convs on (PaTH's on w, kernel 4)
    "hybrid_path": dict(mixer=("path", "softmax"), conv=True, options=dict(forget_gate=True)),
    "hybrid_mesanet": dict(
        mixer=("mesanet", "gated"), position="rope", options=dict(chunk_size=5, cg_steps=16)
    ),
    # log-linear Mamba-2 (chunks of 4, 5 levels: positions below 16) beside softmax
    "hybrid_log_linear": dict(
        mixer=("log_linear_mamba2", "log_linear_gated_deltanet"),
        options=dict(chunk_size=4, num_levels=5),
    ),
}
# every mixer once (each path is checked per mixer in tests/layers), in two models: one
# 11-layer model's gradient was a module large enough to crash XLA's CPU compiler (segfault)
# late in a full run on a loaded machine
_THIRD = -(-len(ALL_MIXERS) // 3)
ALL_GROUPS = tuple(ALL_MIXERS[i : i + _THIRD] for i in range(0, len(ALL_MIXERS), _THIRD))
assert sum(ALL_GROUPS, ()) == ALL_MIXERS


def all_mixers_model(group):
    # feature_dim only where a layer reads it (the config rejects an unused one)
    features = dict(feature_dim=4) if {"favor", "taylor", "hedgehog"} & set(group) else {}
    return make(
        mixer=group,
        num_layers=len(group),
        position="learned",
        tie_embeddings=False,
        mlp=False,
        conv=None if "rwkv7" in group else True,  # rwkv7's token shift instead of a conv
        options=dict(chunk_size=4, **features),
    )


@pytest.mark.parametrize("case", list(CASES))
def test_call_prefill_step_agree(case):
    model, toks = make(**CASES[case]), tokens()
    full, prefilled, stepped, mixed, final = all_paths(model, toks)
    assert full.shape == (B, T, V) and full.dtype == jnp.float32
    for other in (prefilled, stepped, mixed):
        np.testing.assert_allclose(other, full, rtol=1e-4, atol=1e-4)
    assert int(final.position) == T
    assert all(int(layer.position) == T for layer in final.layers)
    assert float(jnp.std(full)) > 1e-3


@nnx.jit
def _grad_embedding(model, tokens_BT, t, w_V):
    """d Σ_v w_v logits[:, t, v] / d embedding table."""

    def loss(model):
        return jnp.sum(model(tokens_BT)[:, t] * w_V)

    return nnx.grad(loss)(model)["embed"]["embedding"][...]


@pytest.mark.parametrize("group", ALL_GROUPS, ids=lambda g: "+".join(g))
def test_causality_by_gradients(group):
    """logits at t do not depend on tokens after t (through any mixer, conv or position)."""
    model = all_mixers_model(group)
    # distinct tokens, so an embedding row belongs to one position; the head is untied
    toks = jax.random.permutation(jax.random.key(0), V)[:T][None].repeat(B, 0)
    w = jax.random.normal(jax.random.key(1), (V,))
    for t in (0, 4, T - 1):
        g_VD = _grad_embedding(model, toks, t, w)
        row_norm_T = jnp.abs(g_VD[toks[0]]).sum(-1)
        assert bool(jnp.all(row_norm_T[t + 1 :] == 0.0)), (t, row_norm_T)
        assert bool(jnp.all(row_norm_T[: t + 1] > 0.0)), (t, row_norm_T)


def test_swa_sees_exactly_its_window_by_gradients():
    """One swa layer (no conv, MLP or positions): logits at t depend on tokens t − W < s ≤ t."""
    window = 3
    model = make(
        mixer="swa", num_layers=1, mlp=False, tie_embeddings=False, options=dict(window=window)
    )
    toks = jax.random.permutation(jax.random.key(0), V)[:T][None].repeat(B, 0)
    w = jax.random.normal(jax.random.key(1), (V,))
    for t in (0, 1, 6, T - 1):
        row_norm_T = np.asarray(jnp.abs(_grad_embedding(model, toks, t, w)[toks[0]]).sum(-1))
        seen = (np.arange(T) <= t) & (np.arange(T) > t - window)
        assert (row_norm_T[~seen] == 0.0).all() and (row_norm_T[seen] > 0.0).all(), (t, row_norm_T)


def test_bfloat16_model():
    model = make(mixer=("gated", "softmax"), dtype="bfloat16", position="rope")
    toks = tokens()
    full, prefilled, _, _, final = all_paths(model, toks)
    assert full.dtype == jnp.float32 and full.shape == (B, T, V)
    assert bool(jnp.all(jnp.isfinite(full)))
    np.testing.assert_allclose(prefilled, full, rtol=0.05, atol=0.05)
    params = nnx.state(model, nnx.Param)
    assert {p.dtype for p in jax.tree.leaves(params)} == {jnp.dtype("float32")}
    linear_state, cache_state = final.layers
    assert isinstance(linear_state.core, K.LinearAttentionState)
    assert linear_state.core.kv.dtype == jnp.float32
    assert isinstance(cache_state.core, KVCache) and cache_state.core.k.dtype == jnp.bfloat16


def test_jax_jit_nnx_jit_and_split_merge_agree():
    model, toks = make(mixer=("retnet", "softmax"), position="rope"), tokens()
    by_nnx_jit = nnx.jit(lambda m, x: m(x))(model, toks)
    graphdef, state = nnx.split(model)
    by_jax_jit = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, toks)
    np.testing.assert_allclose(by_jax_jit, by_nnx_jit, rtol=1e-6, atol=1e-6)
    # a merged copy is the same model
    clone = nnx.merge(graphdef, state)
    np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(clone, toks), by_nnx_jit, rtol=1e-6)
    # step under nnx.jit equals the logits of the full call at t = 0
    step = nnx.jit(lambda m, x, s: m.step(x, s))
    logits0, state0 = step(model, toks[:, 0], model.init_state(B, T))
    np.testing.assert_allclose(logits0, by_nnx_jit[:, 0], rtol=1e-4, atol=1e-4)
    assert isinstance(state0, ModelState) and int(state0.position) == 1


def test_redraw_features_redraws_every_favor_layer():
    model = make(mixer=("favor", "linear"), num_layers=4, redraw_interval=5)
    before = [jnp.array(b.mixer.feature_map.projection[...]) for b in model.blocks[::2]]
    assert redraw_features(model, jax.random.key(3)) == 2
    after = [b.mixer.feature_map.projection[...] for b in model.blocks[::2]]
    assert all(not np.allclose(a, b) for a, b in zip(after, before, strict=True))
    assert not np.allclose(after[0], after[1])  # each layer its own draw
    logits = nnx.jit(lambda m, x: m(x))(model, tokens())
    assert bool(jnp.all(jnp.isfinite(logits)))
    nnx.jit(redraw_features)(model, jax.random.key(4))
    assert not np.allclose(model.blocks[0].mixer.feature_map.projection[...], after[0])


# Packed rows (T = 12): row 0 holds documents [0, 5) and [5, 12), row 1 [0, 3), [3, 4), [4, 12).
PACKED = np.array([[0] * 5 + [1] * 7, [4] * 3 + [9] + [4] * 8], np.int32)
PACKED_DOCUMENTS = [(0, 0, 5), (0, 5, 12), (1, 0, 3), (1, 3, 4), (1, 4, 12)]  # (row, start, end)
PACKED_CASES = {
    "softmax_rope": dict(mixer="softmax", position="rope", conv=True),
    "linear_learned": dict(mixer="linear", position="learned"),
    "gated_conv": dict(mixer="gated", conv=True, options=dict(chunk_size=4)),
    "gla_rope": dict(mixer="gla", conv=True, position="rope", options=dict(chunk_size=4)),
    "hybrid_learned": dict(mixer=("gla", "softmax"), position="learned", conv=True),
    "gated_deltanet_rope": dict(
        mixer="gated_deltanet", position="rope", options=dict(chunk_size=4)
    ),
    "mla_rope": dict(mixer="mla", position="rope"),
}


@nnx.jit
def _packed_and_alone(model, tokens_BT, segment_ids_BT, alone_NT):
    return model(tokens_BT, segment_ids_BT), model(alone_NT)


def _alone_rows(toks):
    """Each document of `PACKED_DOCUMENTS` alone, left-aligned in a row of T tokens (the rest is
    filler; by causality the document's logits do not see it)."""
    rows = np.zeros((len(PACKED_DOCUMENTS), T), np.int32)
    for i, (row, start, end) in enumerate(PACKED_DOCUMENTS):
        rows[i, : end - start] = toks[row, start:end]
        rows[i, end - start :] = (np.arange(T - end + start) * 7 + 3) % V
    return rows


@pytest.mark.parametrize("case", list(PACKED_CASES))
def test_packed_rows_give_the_logits_of_each_document_alone(case):
    model, toks = make(**PACKED_CASES[case]), np.asarray(tokens())
    packed, alone = _packed_and_alone(model, toks, PACKED, _alone_rows(toks))
    for i, (row, start, end) in enumerate(PACKED_DOCUMENTS):
        np.testing.assert_allclose(
            packed[row, start:end], alone[i, : end - start], rtol=1e-4, atol=1e-4
        )
    # not vacuous: without segments the second documents read the first ones
    whole = nnx.jit(lambda m, x: m(x))(model, toks)
    assert not np.allclose(whole[0, 5:], packed[0, 5:], atol=1e-3)


def test_reset_positions_false_keeps_counting_along_the_row():
    model, toks = make(mixer="linear", position="learned", reset_positions=False), tokens()
    packed, alone = _packed_and_alone(model, toks, PACKED, _alone_rows(np.asarray(toks)))
    np.testing.assert_allclose(packed[0, :5], alone[0, :5], rtol=1e-4, atol=1e-4)  # first doc
    assert not np.allclose(packed[0, 5:], alone[1, :7], atol=1e-3)  # positions 5.. not 0..
    with pytest.raises(ValueError, match="reset_positions=False needs position"):
        ModelConfig(vocab_size=V, reset_positions=False)


@nnx.jit
def _grad_embedding_packed(model, tokens_BT, segment_ids_BT, t, w_V):
    def loss(model):
        return jnp.sum(model(tokens_BT, segment_ids_BT)[:, t] * w_V)

    return nnx.grad(loss)(model)["embed"]["embedding"][...]


@pytest.mark.parametrize("group", ALL_GROUPS, ids=lambda g: "+".join(g))
def test_no_document_reads_another_by_gradients(group):
    """Every mixer with its conv, and learned positions: logits at t depend on the tokens of t's
    document up to t, and on nothing of the other documents."""
    model = all_mixers_model(group)
    toks = jax.random.permutation(jax.random.key(0), V)[:T][None].repeat(B, 0)
    segments = jnp.asarray([[0] * 6 + [1] * 6] * B, jnp.int32)
    w = jax.random.normal(jax.random.key(1), (V,))
    for t, (lo, hi) in ((2, (0, 2)), (6, (6, 6)), (9, (6, 9))):
        g_VD = _grad_embedding_packed(model, toks, segments, t, w)
        row_norm_T = np.asarray(jnp.abs(g_VD[toks[0]]).sum(-1))
        inside = (np.arange(T) >= lo) & (np.arange(T) <= hi)
        assert (row_norm_T[~inside] == 0.0).all(), (t, row_norm_T)
        assert (row_norm_T[inside] > 0.0).all(), (t, row_norm_T)


def test_bad_inputs_raise():
    model = make()
    with pytest.raises(ValueError, match=r"integers of rank 2 \[B, T\]"):
        model(jnp.zeros((B, T)))
    with pytest.raises(ValueError, match="length 17 > max_length=16"):
        model(jnp.zeros((B, 17), jnp.int32))
    with pytest.raises(
        ValueError, match=r"max_length must be an int in \[1, config.max_length=16\]"
    ):
        model.init_state(B, 32)
    with pytest.raises(ValueError, match=r"rank 1 \[B\]"):
        model.step(jnp.zeros((B, 1), jnp.int32), model.init_state(B))
    with pytest.raises(ValueError, match="ModelState with 2 layer states"):
        model.prefill(jnp.zeros((B, 3), jnp.int32), model.init_state(B).layers)
    toks = jnp.zeros((B, T), jnp.int32)
    with pytest.raises(ValueError, match=r"segment_ids must be integers of shape \[B, T\]"):
        model(toks, jnp.zeros((B, T - 1), jnp.int32))
    with pytest.raises(ValueError, match="dtype float32"):
        model(toks, jnp.zeros((B, T), jnp.float32))
    with pytest.raises(ValueError, match="config must be a ModelConfig"):
        LanguageModel(dict(vocab_size=V), rngs=nnx.Rngs(0))


def test_hidden_states_are_the_full_pass_by_hand():
    """`hidden_states` against the pass written out by hand in NumPy at its ends: the first
    residual is the embedding (learned positions added), the first mixer input its RMSNorm, and
    the last residual through the final norm and the tied head gives the logits, which equal
    `__call__`'s, packed rows and the remat scan included."""
    model = make(mixer=("gated", "softmax"), position="learned", remat="block")
    toks = tokens()
    seg = jnp.asarray([[0] * 5 + [1] * 7, [3] * 12], jnp.int32)
    hidden = model.hidden_states(toks, seg)
    assert len(hidden.residuals) == 3 and len(hidden.mixer_inputs) == 2
    np.testing.assert_allclose(hidden.logits, model(toks, seg), rtol=1e-5, atol=1e-5)
    table = np.asarray(model.embed.embedding[...], np.float64)
    positions = np.asarray(hidden.segments.positions)
    x0 = table[np.asarray(toks)] + np.asarray(model.pos_embed.embedding[...])[positions]
    np.testing.assert_allclose(hidden.residuals[0], x0, rtol=1e-5, atol=1e-6)

    def rms(x, weight):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + model.config.norm_eps) * weight

    w0 = np.asarray(model.blocks[0].mixer_norm.scale[...], np.float64)
    np.testing.assert_allclose(hidden.mixer_inputs[0], rms(x0, w0), rtol=1e-4, atol=1e-5)
    x_last = np.asarray(hidden.residuals[-1], np.float64)
    wf = np.asarray(model.final_norm.scale[...], np.float64)
    logits = rms(x_last, wf) @ table.T
    np.testing.assert_allclose(hidden.logits, logits, rtol=1e-4, atol=1e-4)
