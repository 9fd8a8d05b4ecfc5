"""A solution known to be exact checks the parity task, its labels and the trainer's metric.

With β = 2 on a fixed unit key k, the delta rule's transition I − 2kkᵀ is a reflection: every
1-token flips the sign of the state's component along k and leaves the rest. From
S₀ = k·1ᵀ + u·½ (u ⊥ k) with q = k, v = 0 and β_t = 2·token_t, the read-out is
o_t = kᵀS_t = (−1)^(bits so far), the running parity (Grazzi et al.: negative eigenvalues
solve parity in one layer). `kernels.delta_rule` computes it on the parity preset's own
evaluation sets, and the trainer's `evaluate` scores it: accuracy 1.0 at every evaluation
length. β = 1 (a projection, eigenvalues in [0, 1]) forgets the parity and scores near chance.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_attention import kernels as K
from linear_attention.data import IGNORE_INDEX
from linear_attention.training import experiment_config
from linear_attention.training.mesh import make_mesh
from linear_attention.training.trainer import build_data, evaluate
from tests.training.conftest import load_config

KEY = np.array([0.6, 0.8])  # a unit key, not along an axis
ORTHOGONAL = np.array([-0.8, 0.6])


class Reflection(nnx.Module):
    """Parity logits `[B, T, 2]` from bits `[B, T]`: the delta rule with hand-set inputs."""

    def __init__(self, *, beta_per_one: float, method: str):
        self.beta_per_one, self.method = beta_per_one, method

    def __call__(self, tokens_BT, segment_ids=None):
        del segment_ids  # one sequence per row
        b, t = tokens_BT.shape
        k = jnp.broadcast_to(jnp.asarray(KEY, jnp.float32), (b, t, 1, 2))
        v = jnp.zeros((b, t, 1, 1), jnp.float32)
        beta = self.beta_per_one * tokens_BT.astype(jnp.float32)[..., None]
        s0 = jnp.asarray(KEY[:, None] + 0.5 * ORTHOGONAL[:, None], jnp.float32)
        state = K.LinearAttentionState(kv=jnp.broadcast_to(s0, (b, 1, 2, 1)), k_sum=None)
        o = K.delta_rule(k, k, v, beta, method=self.method, chunk_size=16, initial_state=state)
        sign = o[:, :, 0, 0]  # (−1)^parity: class 0 (even) where positive, 1 where negative
        return 8.0 * jnp.stack([sign, -sign], axis=-1)


def scores(model):
    """The trainer's evaluation of `model` on the parity preset's evaluation sets."""
    config = experiment_config(load_config("state_tracking", "parity"))
    data = build_data(config)
    graphdef, state = nnx.split((model, None))
    return config, data, evaluate(state, data, config, graphdef, make_mesh(1))


@pytest.mark.parametrize("method", ["scan", "chunk"])
def test_reflection_solves_parity_exactly_at_every_length(method):
    config, data, metrics = scores(Reflection(beta_per_one=2.0, method=method))
    lengths = config.data.eval_lengths
    assert len(lengths) >= 2 and max(lengths) > config.data.seq_len  # beyond training lengths
    for length in lengths:
        assert metrics[f"eval/length_{length}/accuracy"] == 1.0, (length, metrics)
    assert metrics["eval/accuracy"] == 1.0 and metrics["eval/scaled_accuracy"] == 1.0
    # the labels scored are the parities of the inputs, one per sequence, both classes present
    for length in lengths:
        inputs, labels = data.eval_sets[length]
        assert (labels[:, :-1] == IGNORE_INDEX).all()
        np.testing.assert_array_equal(labels[:, -1], inputs.sum(axis=1) % 2)
        assert 0.3 < labels[:, -1].mean() < 0.7


def test_the_read_out_is_the_running_parity():
    """Every position's output, not only the scored last one: (−1)^(bits up to t)."""
    bits = np.random.default_rng(0).integers(0, 2, (3, 50))
    logits = Reflection(beta_per_one=2.0, method="chunk")(jnp.asarray(bits, jnp.int32))
    want = 1.0 - 2.0 * (np.cumsum(bits, axis=1) % 2)
    np.testing.assert_allclose(np.asarray(logits[..., 0]) / 8.0, want, atol=1e-5)


def test_a_projection_does_not_solve_parity():
    """β = 1: I − kkᵀ erases the component along k at the first 1-token, so the read-out is
    0 from then on (argmax: class 0) and the metric falls to about chance."""
    _, _, metrics = scores(Reflection(beta_per_one=1.0, method="scan"))
    assert metrics["eval/accuracy"] < 0.7 and abs(metrics["eval/scaled_accuracy"]) < 0.4
