"""A NaN token stays in its document (issue 75): every registered mixer (from the registry), a
MoE MLP and a short convolution, in a small LanguageModel on a packed row.

The NaN token is a token id whose embedding row is NaN (untied head: the other logits do not
read that row), so that its q, k, v, gates and data-dependent log decays are NaN in every
layer (an out-of-range id would not do: it embeds as zeros and only its logits are NaN).
Document 0 is t < 10 and the NaN at t = 5: every logit before it, every logit of document 1
and the other row stay finite and equal the run with a valid token there (to float32
rounding: a chunk form may sum document 1's decays on from document 0's, and the NaN token's
decay is read as 0 there; the kernels' sweep, tests/kernels/test_nan_containment.py, asserts
exact equality with that decay 0), and the logits at t = 5 are NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_attention.layers import MIXERS
from linear_attention.layers.moe import load_balancing_loss, router_stats
from linear_attention.models import LanguageModel, ModelConfig

V, T, S, DOC_END = 16, 16, 5, 10
BASE = dict(
    vocab_size=V, d_model=16, num_layers=2, num_heads=2, max_length=T, mlp_ratio=2.0,
    tie_embeddings=False,
)  # fmt: skip
NAN_TOKEN = V - 1
CASES = [(name, {}) for name in MIXERS] + [
    ("gated", dict(num_experts=4, experts_per_token=2)),
    ("gated_deltanet", dict(conv=True)),
]
SEGMENTS = jnp.asarray([[0] * DOC_END + [1] * (T - DOC_END)] * 2, jnp.int32)

forward = nnx.jit(lambda model, tokens_BT, segment_ids: model(tokens_BT, segment_ids))


@pytest.mark.parametrize(
    "mixer, fields", CASES, ids=[n + "".join(f"-{k}" for k in f) for n, f in CASES]
)
def test_a_nan_token_stays_in_its_document(mixer, fields):
    model = LanguageModel(ModelConfig(**BASE, mixer=mixer, **fields), rngs=nnx.Rngs(0))
    model.embed.embedding[...] = model.embed.embedding[...].at[NAN_TOKEN].set(jnp.nan)
    tokens = np.array(jax.random.randint(jax.random.key(0), (2, T), 0, NAN_TOKEN))
    clean = np.asarray(forward(model, jnp.asarray(tokens), SEGMENTS))
    tokens[0, S] = NAN_TOKEN
    logits = np.asarray(forward(model, jnp.asarray(tokens), SEGMENTS))
    assert np.all(np.isfinite(clean))
    assert np.all(np.isnan(logits[0, S]))
    unreachable = np.ones((2, T), bool)
    unreachable[0, S:DOC_END] = False
    assert np.all(np.isfinite(logits[unreachable])), np.argwhere(np.isnan(logits[..., 0]))
    np.testing.assert_allclose(logits[unreachable], clean[unreachable], rtol=1e-5, atol=1e-5)


def test_a_nan_row_is_left_out_of_the_router_stats():
    """The load-balancing statistics of a batch with a NaN token equal those of the batch
    without its row (the other rows' routing is per row; the sums select, never multiply)."""
    logits_NE = jax.random.normal(jax.random.key(1), (2, 6, 4))
    bad = logits_NE.at[0, 3].set(jnp.nan)
    got = router_stats(bad, 2)
    others = jnp.concatenate([logits_NE[0, :3], logits_NE[0, 4:], logits_NE[1]])
    want = router_stats(others, 2)
    for x, y in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert float(load_balancing_loss(got)) == float(load_balancing_loss(want))
    # with a mask the NaN row stays out too (a product with a zero weight would be NaN)
    masked = router_stats(bad, 2, mask_N=jnp.ones((2, 6)).at[1, 0].set(0.0))
    rest = jnp.concatenate([logits_NE[0, :3], logits_NE[0, 4:], logits_NE[1, 1:]])
    for x, y in zip(masked, router_stats(rest, 2), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6)
