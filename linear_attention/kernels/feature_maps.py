"""Feature maps φ: x[..., d] -> φ(x)[..., m] for linear attention, and random projections.

Linear attention replaces exp(q·k/√d) by φ(q)·φ(k). Every map computes in float32 (the `exp`s
overflow and lose precision otherwise) and returns the input's floating dtype.

- `elu_plus_one`  φ(x) = elu(x) + 1 > 0, m = d (Katharopoulos et al., 2020).
- `relu`          φ(x) = max(x, 0), m = d.
- `identity`      φ(x) = x, for inputs that are already features (not non-negative).
- `taylor2`       2nd-order Taylor expansion of exp, as in Based: φ(q)·φ(k) = 1 + s + s²/2
                  with s = q·k/√d (> 0 for every s), m = 1 + d + d(d+1)/2 (the upper triangle
                  of x⊗x: 153 features at d = 16, 45 at d = 8).
- `favor_plus`    Performer positive random features, unbiased for exp(q·k/√d); m = rows of W.
- `trig_random_features`  sin/cos random Fourier features of the same kernel, m = 2·rows of W;
                  unbiased too but can be negative (for comparison with FAVOR+).
- `random_projection`     the W that the random features use.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from linear_attention.kernels.checks import check_choice, check_positive_int

__all__ = [
    "NAMES",
    "get",
    "elu_plus_one",
    "relu",
    "identity",
    "taylor2",
    "favor_plus",
    "trig_random_features",
    "random_projection",
]

NAMES = ("elu_plus_one", "relu", "identity", "taylor2", "favor_plus", "trig_random_features")

# Key exponents are bounded by max_i |w_i|²/2 whatever the input (see `favor_plus`). Where that
# bound exceeds this cap, stabilized keys are shifted down by the excess, a constant, so every key
# feature stays ≤ e^80 ≈ 5.5e34 with room for sums of thousands of worst-case keys below the
# float32/bfloat16 limit 3.4e38. The cap is high so that the shift is zero up to head size ~100
# (Gaussian rows have |w|² ≈ d): a shift also shrinks the attention sums against their eps.
_KEY_EXPONENT_CAP = 80.0


def _float32_input(name: str, x):
    """x as float32 and the dtype to return (x's own if floating, else float32)."""
    x = jnp.asarray(x)
    if x.ndim < 1:
        raise ValueError(f"{name} must have rank >= 1 [..., d], got shape {x.shape}")
    out_dtype = x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.float32
    return x.astype(jnp.float32), out_dtype


def _projected(x, projection):
    """Check x [..., d] and projection [m, d]; return x' = x·d^{-1/4}, W, W x' and the dtype."""
    x32, out_dtype = _float32_input("x", x)
    w = jnp.asarray(projection)
    if w.ndim != 2 or w.shape[1] != x32.shape[-1]:
        raise ValueError(
            f"projection must have shape [num_features, d] with d = x.shape[-1] = "
            f"{x32.shape[-1]}, got {tuple(w.shape)} (x: {tuple(x32.shape)})"
        )
    w = w.astype(jnp.float32)
    x_scaled = x32 * x32.shape[-1] ** -0.25
    # Full float32 precision: an error δ in the exponent is a relative error δ in the feature.
    wx = jnp.einsum("...d,md->...m", x_scaled, w, precision=jax.lax.Precision.HIGHEST)
    return x_scaled, w, wx, out_dtype


def elu_plus_one(x):
    """φ(x) = elu(x) + 1 = x + 1 for x > 0, exp(x) otherwise; elementwise, strictly positive."""
    x32, out_dtype = _float32_input("x", x)
    # Not elu(x) + 1: (exp(x) − 1) + 1 rounds to 0 in float32 below x ≈ −17. The min keeps the
    # unused branch finite, so its zero cotangent cannot meet an inf and make a NaN.
    return jnp.where(x32 > 0, x32 + 1.0, jnp.exp(jnp.minimum(x32, 0.0))).astype(out_dtype)


def relu(x):
    """φ(x) = max(x, 0), elementwise."""
    x32, out_dtype = _float32_input("x", x)
    return jax.nn.relu(x32).astype(out_dtype)


def identity(x):
    """φ(x) = x: for queries and keys that are already features."""
    _float32_input("x", x)
    return jnp.asarray(x)


def taylor2(x):
    """Based's 2nd-order Taylor features, m = 1 + d + d(d+1)/2:

        φ(x) = [1, x/d^{1/4}, (x_i x_j · w_ij / (√2·√d))_{i ≤ j}],   w_ii = 1, w_ij = √2 (i < j)

    φ(q)·φ(k) = 1 + s + s²/2 with s = q·k/√d, the Taylor polynomial of exp(s) (positive for all
    s). The quadratic block holds the upper triangle of x⊗x only: (q·k)² = Σ_ij q_i q_j k_i k_j
    counts each off-diagonal pair twice, which the √2 on both sides restores, so the kernel equals
    that of the full vec(x⊗x)/(√2·√d) block (1 + d + d² features) with a state ~2× smaller.
    """
    x32, out_dtype = _float32_input("x", x)
    d = x32.shape[-1]
    if d == 0:  # its scales divide by d
        raise ValueError(f"taylor2 needs a feature axis of width >= 1, got x of shape {x32.shape}")
    const = jnp.ones((*x32.shape[:-1], 1), jnp.float32)
    linear = x32 * d**-0.25
    # static (i ≤ j) pairs, row-major: (0,0), (0,1), …, (0,d−1), (1,1), …
    i, j = np.triu_indices(d)
    scale = np.where(i == j, 1.0, math.sqrt(2.0)) / (math.sqrt(2.0) * math.sqrt(d))
    quadratic = x32[..., i] * x32[..., j] * jnp.asarray(scale, jnp.float32)
    return jnp.concatenate([const, linear, quadratic], axis=-1).astype(out_dtype)


def favor_plus(x, projection, *, stabilize: bool = True, is_query: bool = False):
    """Performer (FAVOR+) positive random features: φ(x) = exp(W x' − |x'|²/2)/√m, x' = x·d^{-1/4}.

    x `[..., d]`, projection W `[m, d]` (see `random_projection`) -> `[..., m]`, positive.
    With `stabilize=False` this is exactly the unbiased estimator: for w ~ N(0, I),
    E[φ(q)·φ(k)] = exp(q'·k') = exp(q·k/√d).

    `stabilize=True` rescales by factors that cancel in *normalized* attention
    o_t = Σ_s φ(q_t)·φ(k_s) v_s / Σ_s φ(q_t)·φ(k_s) (up to its eps) and that never let a position
    depend on another one, so causal attention stays causal:

    - `is_query=True`: subtract the per-token max over features of the exponent. Query t's
      features are all multiplied by one positive factor c_t, which scales the numerator and the
      denominator of o_t alike; it depends on token t alone. Every feature is then ≤ 1/√m.
      Not for keys: a per-token factor on keys would reweight them against each other.
    - `is_query=False` (keys): subtract one constant that depends on W only. Completing the
      square, w·x' − |x'|²/2 = |w|²/2 − |w − x'|²/2 ≤ |w|²/2 for every x, so no data-dependent
      max is needed: the shift is (max_i |w_i|²/2 − 80)⁺, zero for the usual head sizes (d up to
      ~100), and every feature stays ≤ e^80. Identical for every token, so it cancels in
      normalized attention and agrees between a whole sequence and token-by-token decoding.
      (A max over the sequence, as in the original Performer code, lets future keys change
      earlier outputs.) Also correct for queries, but `is_query=True` bounds them much tighter.

    The shifts carry no gradient (like the max in `jax.nn.softmax`); in normalized attention
    they cancel, so the gradient is the unstabilized one.
    """
    x_scaled, w, wx, out_dtype = _projected(x, projection)
    m = w.shape[0]
    exponent = wx - 0.5 * jnp.sum(x_scaled * x_scaled, axis=-1, keepdims=True)
    if stabilize:
        if is_query:
            shift = jnp.max(exponent, axis=-1, keepdims=True)
        else:
            shift = jnp.maximum(0.5 * jnp.max(jnp.sum(w * w, axis=-1)) - _KEY_EXPONENT_CAP, 0.0)
        exponent = exponent - jax.lax.stop_gradient(shift)
    return (jnp.exp(exponent) / math.sqrt(m)).astype(out_dtype)


def trig_random_features(x, projection):
    """Random Fourier features: φ(x) = [sin(W x'), cos(W x')] · exp(|x'|²/2)/√m, x' = x·d^{-1/4}.

    x `[..., d]`, projection W `[m, d]` -> `[..., 2m]`. Unbiased for exp(q·k/√d), since
    E[cos(w·(q' − k'))] = exp(−|q' − k'|²/2), but the features and estimates can be negative,
    which makes normalized attention unstable: kept for comparison with `favor_plus`.
    """
    x_scaled, w, wx, out_dtype = _projected(x, projection)
    m = w.shape[0]
    magnitude = jnp.exp(0.5 * jnp.sum(x_scaled * x_scaled, axis=-1, keepdims=True)) / math.sqrt(m)
    features = jnp.concatenate([jnp.sin(wx), jnp.cos(wx)], axis=-1) * magnitude
    return features.astype(out_dtype)


def random_projection(key, num_features: int, dim: int, *, orthogonal: bool = True):
    """Random feature projection W `[num_features, dim]`, float32, rows distributed as N(0, I).

    `orthogonal=True`: ⌈num_features/dim⌉ independent blocks of `dim` orthonormal rows (QR of a
    Gaussian dim×dim matrix, signs fixed so the block is Haar-distributed), stacked and cut to
    `num_features`, each row scaled by the norm of an independent Gaussian vector (a chi(dim)
    variable) so every row is marginally N(0, I) and FAVOR+ stays unbiased, with lower variance
    than iid rows. `orthogonal=False`: iid N(0, I) rows.
    """
    check_positive_int("num_features", num_features)
    check_positive_int("dim", dim)
    if not orthogonal:
        return jax.random.normal(key, (num_features, dim), jnp.float32)
    num_blocks = -(-num_features // dim)
    block_key, norm_key = jax.random.split(key)
    gaussian_NDD = jax.random.normal(block_key, (num_blocks, dim, dim), jnp.float32)
    q_NDD, r_NDD = jnp.linalg.qr(gaussian_NDD)
    # QR is unique only up to column signs; making diag(R) positive gives a Haar-distributed Q.
    q_NDD = q_NDD * jnp.sign(jnp.diagonal(r_NDD, axis1=-2, axis2=-1))[:, None, :]
    rows = jnp.swapaxes(q_NDD, -1, -2).reshape(num_blocks * dim, dim)[:num_features]
    norms = jnp.linalg.norm(jax.random.normal(norm_key, (num_features, dim), jnp.float32), axis=-1)
    return rows * norms[:, None]


def get(name: str):
    """The feature map called `name` (one of `NAMES`)."""
    check_choice("feature map", name, NAMES)
    return globals()[name]
