"""Solutions known to be exact check the state-tracking tasks, their labels and the trainer's
metric: hand-set delta rules, run by the library's kernels on the presets' own evaluation sets
and scored by the trainer's `evaluate`.

Parity. With β = 2 on a fixed unit key k, the delta rule's transition I − 2kkᵀ is a reflection:
every 1-token flips the sign of the state's component along k and leaves the rest. From
S₀ = k·1ᵀ + u·½ (u ⊥ k) with q = k, v = 0 and β_t = 2·token_t, the read-out is
o_t = kᵀS_t = (−1)^(bits so far), the running parity (Grazzi et al.: negative eigenvalues
solve parity in one layer). Accuracy 1.0 at every evaluation length. β = 1 (a projection,
eigenvalues in [0, 1]) forgets the parity and scores near chance.

Group word problems (S3, A5, S5, S5 with transpositions only). With k = (e_i − e_j)/√2 and
β = 2, I − 2kkᵀ is M(τ), the permutation matrix of the transposition τ = (i j), where
M(p)e_x = e_{p(x)} and so M(p ∘ g) = M(p)M(g). A cycle (a₁ … a_r) is
(a₁ a_r) ∘ … ∘ (a₁ a₂), so an element h of S_n is a product of n − (its cycles) ≤ n − 1
transpositions; DeltaProduct applies its n_h steps in order, S ← (I − β_j k_j k_jᵀ)S, which
composes them (Siems et al.: n − 1 steps carry S_n). Setting token g's steps to the
transpositions of g⁻¹ (β = 0 pads the unused ones), S_t = M(g_t⁻¹)⋯M(g_1⁻¹)S₀ = M(p_t⁻¹) from
S₀ = I, where p_t = g_1 ∘ … ∘ g_t is the label. Head x reads q = e_x:
o_x = S_tᵀe_x = M(p_t)e_x = e_{p_t(x)}, and the logit of class c counts the points where c
agrees with p_t (n for c = p_t, at most n − 2 otherwise). With n − 2 steps per token the
n-cycles are wrong and the accuracy falls near chance (S3 0.18, S5 0.07).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from linear_attention import kernels as K
from linear_attention.data import IGNORE_INDEX
from linear_attention.data.state_tracking import group_elements
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


def scores(model, preset="parity"):
    """The trainer's evaluation of `model` on `preset`'s evaluation sets."""
    config = experiment_config(load_config("state_tracking", preset))
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


def transpositions(perm):
    """Transpositions (i, j), first applied first, whose composition is the permutation `perm`
    (each cycle (a₁ … a_r) as (a₁ a₂), then (a₁ a₃), …, then (a₁ a_r))."""
    seen, steps = set(), []
    for start in range(len(perm)):
        cycle, x = [], start
        while x not in seen:
            seen.add(x)
            cycle.append(x)
            x = perm[x]
        steps += [(cycle[0], other) for other in cycle[1:]]
    return steps


def reflection_inputs(task, steps_per_token):
    """Per group element g: `keys [|G|, n_h, n]` and `betas [|G|, n_h]` whose DeltaProduct steps
    compose M(g⁻¹); with fewer steps than g⁻¹ needs, only its first transpositions."""
    elements = group_elements(task)
    n = elements.shape[1]
    keys = np.zeros((len(elements), steps_per_token, n))
    keys[:, :, 0] = 1.0  # a unit key for the β = 0 (identity) steps
    betas = np.zeros((len(elements), steps_per_token))
    for index, g in enumerate(elements.tolist()):
        inverse = np.argsort(g).tolist()
        for step, (i, j) in enumerate(transpositions(inverse)[:steps_per_token]):
            keys[index, step] = 0.0
            keys[index, step, i], keys[index, step, j] = 2**-0.5, -(2**-0.5)
            betas[index, step] = 2.0
    return keys, betas


class GroupReflections(nnx.Module):
    """Group-product logits `[B, T, |G|]` from element ids `[B, T]`: one hand-set DeltaProduct
    head per point x of {0..n−1}, each reading S_tᵀe_x = e_{p_t(x)}."""

    def __init__(self, task, *, steps_per_token, method):
        elements = group_elements(task)
        keys, betas = reflection_inputs(task, steps_per_token)
        self.keys, self.betas = jnp.asarray(keys, jnp.float32), jnp.asarray(betas, jnp.float32)
        self.elements = jnp.asarray(elements)
        self.n, self.method = elements.shape[1], method

    def __call__(self, tokens_BT, segment_ids=None):
        del segment_ids  # one sequence per row
        b, t, n = *tokens_BT.shape, self.n
        k = jnp.broadcast_to(self.keys[tokens_BT][:, :, None], (b, t, n, *self.keys.shape[1:]))
        beta = jnp.broadcast_to(self.betas[tokens_BT][:, :, None], (b, t, n, self.betas.shape[1]))
        q = jnp.broadcast_to(jnp.eye(n), (b, t, n, n))  # head x reads e_x
        v = jnp.zeros((*k.shape[:-1], n), jnp.float32)
        state = K.LinearAttentionState(kv=jnp.broadcast_to(jnp.eye(n), (b, n, n, n)), k_sum=None)
        o_BTXY = K.delta_product(
            q, k, v, beta, method=self.method, chunk_size=16, initial_state=state
        )
        # class c's logit: Σ_x o_x[c(x)], the number of points where c agrees with p_t
        agree_BTC = jnp.take_along_axis(
            o_BTXY[:, :, None], self.elements[None, None, :, :, None], axis=-1
        )[..., 0].sum(-1)
        return 8.0 * agree_BTC


@pytest.mark.parametrize(
    ("task", "method"), [("s3", "chunk"), ("a5", "scan"), ("s5", "scan"), ("s5_swaps", "scan")]
)
def test_householder_products_solve_the_group_word_problems_exactly(task, method):
    steps = max(len(transpositions(g)) for g in group_elements(task).tolist())
    assert steps == group_elements(task).shape[1] - 1  # n − 1: an n-cycle needs them all
    config, data, metrics = scores(
        GroupReflections(task, steps_per_token=steps, method=method), task
    )
    for length in config.data.eval_lengths:
        assert metrics[f"eval/length_{length}/accuracy"] == 1.0, (length, metrics)
    assert metrics["eval/accuracy"] == 1.0 and metrics["eval/scaled_accuracy"] == 1.0
    # every position is scored with its running product, recomputed here by composing maps
    inputs, labels = data.eval_sets[min(config.data.eval_lengths)]
    elements = group_elements(task)
    index = {tuple(p): i for i, p in enumerate(elements.tolist())}
    for row in range(3):
        p = np.arange(elements.shape[1])
        for t, token in enumerate(inputs[row]):
            p = p[elements[token]]  # (p ∘ g)(x) = p(g(x))
            assert labels[row, t] == index[tuple(p)]


@pytest.mark.parametrize("task", ["s3", "s5"])
def test_one_step_too_few_does_not_solve_the_group(task):
    """n − 2 steps per token, the first transpositions of g⁻¹: the n-cycles (S3's 3-cycles, S5's
    5-cycles) go wrong and the error carries to every later position."""
    steps = group_elements(task).shape[1] - 2
    _, _, metrics = scores(GroupReflections(task, steps_per_token=steps, method="scan"), task)
    assert metrics["eval/accuracy"] < 0.5, metrics
