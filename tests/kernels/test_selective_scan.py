"""Mamba-1's selective scan (`K.selective_scan`): both methods against the float64 loop —
outputs, final state and the gradient of every input (by finite differences of the loop) —
across packed rows, an initial state, strong and weak decays and T = 1; the step form token by
token; bfloat16 inputs; the NaN guard; the method check; time split over 4 CPU devices (with
the RG-LRU's, one subprocess); and
(`-m hf`) the scan of transformers' torch `MambaMixer` slow path."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention import kernels as K
from tests.kernels.reference import finite_difference_grads, rel_err, selective_scan_loop
from tests.scripts import checked_names, run_on_cpu_devices

B, T, D, N = 2, 7, 3, 2
SEGMENTS = np.array([[0, 0, 0, 1, 1, 1, 1], [2, 2, 2, 2, 2, 3, 3]], np.int32)
METHODS = ("scan", "associative_scan")
NAMES = ("x", "delta", "A", "Bm", "C", "D", "h0")


def inputs(seed=0, T=T, scale=1.0):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(B, T, D)),
        "delta": scale * rng.uniform(0.05, 1.0, size=(B, T, D)),
        "A": -rng.uniform(0.2, 2.0, size=(D, N)),
        "Bm": rng.normal(size=(B, T, N)),
        "C": rng.normal(size=(B, T, N)),
        "D": rng.normal(size=(D,)),
        "h0": rng.normal(size=(B, D, N)),
    }


def f32(xs):
    return [jnp.asarray(xs[k], jnp.float32) for k in NAMES]


@functools.cache
def kernel(method, segments):
    seg = jnp.asarray(SEGMENTS) if segments else None

    def run(x, delta, A, Bm, C, Dd, h0):
        return K.selective_scan(
            x, delta, A, Bm, C, Dd, initial_state=h0, segment_ids=seg, method=method
        )

    return jax.jit(run)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("segments", [False, True])
def test_matches_loop(method, segments):
    xs = inputs()
    y, h = kernel(method, segments)(*f32(xs))
    y_ref, h_ref = selective_scan_loop(**xs, segment_ids=SEGMENTS if segments else None)
    assert h.dtype == jnp.float32
    assert rel_err(y, y_ref) < 1e-5 and rel_err(h, h_ref) < 1e-5


@pytest.mark.parametrize("method", METHODS)
def test_gradients_match_finite_differences(method):
    xs = inputs(1)
    rng = np.random.default_rng(7)
    wy, wh = rng.normal(size=(B, T, D)), rng.normal(size=(B, D, N))

    def loss_ref(**kw):
        y, h = selective_scan_loop(**kw, segment_ids=SEGMENTS)
        return np.sum(wy * y) + np.sum(wh * h)

    run = kernel(method, True)

    def loss(*args):
        y, h = run(*args)
        return jnp.sum(wy * y) + jnp.sum(wh * h)

    grads = jax.grad(loss, argnums=tuple(range(len(NAMES))))(*f32(xs))
    refs = finite_difference_grads(loss_ref, xs)
    for name, g in zip(NAMES, grads, strict=True):
        assert rel_err(g, refs[name]) < 1e-5, (name, rel_err(g, refs[name]))


@pytest.mark.parametrize("method", METHODS)
def test_strong_and_weak_decay_and_one_token(method):
    for xs in (inputs(2, scale=40.0), inputs(3, scale=1e-4), inputs(4, T=1)):
        y, h = kernel(method, False)(*f32(xs))
        y_ref, h_ref = selective_scan_loop(**xs)
        assert rel_err(y, y_ref) < 1e-5 and rel_err(h, h_ref) < 1e-5


def test_step_reproduces_scan():
    x, delta, A, Bm, C, Dd, h0 = (np.float32(v) for v in f32(inputs(5)))  # NumPy slices
    y, h = kernel("scan", False)(x, delta, A, Bm, C, Dd, h0)
    state = h0
    step = jax.jit(K.selective_scan_step)
    for t in range(T):
        y_t, state = step(x[:, t], delta[:, t], A, Bm[:, t], C[:, t], Dd, state)
        np.testing.assert_allclose(y_t, y[:, t], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(state, h, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("method", METHODS)
def test_bfloat16_inputs(method):
    xs = {k: jnp.asarray(v, jnp.bfloat16) for k, v in inputs(6).items()}
    args = [xs[k] for k in NAMES[:-1]]
    run = jax.jit(functools.partial(K.selective_scan, method=method))
    y, h = run(*args, segment_ids=jnp.asarray(SEGMENTS))
    assert y.dtype == jnp.bfloat16 and h.dtype == jnp.float32
    # the loop on the rounded inputs: only the output's own rounding differs
    rounded = {k: np.float32(xs[k]) for k in NAMES[:-1]}
    y_ref, h_ref = selective_scan_loop(**rounded, segment_ids=SEGMENTS)
    assert rel_err(y, y_ref) < 1e-2 and rel_err(h, h_ref) < 1e-5


@pytest.mark.parametrize("method", METHODS)
def test_nan_stays_in_its_channel_until_a_reset(method):
    xs = inputs(8)
    xs["delta"][0, 1, 2] = np.nan  # row 0: documents [0, 3) and [3, 7)
    y, h = kernel(method, True)(*f32(xs))
    bad = np.zeros((B, T, D), bool)
    bad[0, 1:3, 2] = True
    assert np.all(np.isnan(np.asarray(y)[bad])) and np.all(np.isfinite(np.asarray(y)[~bad]))
    y_ref, _ = selective_scan_loop(**xs, segment_ids=SEGMENTS)
    assert rel_err(np.asarray(y)[~bad], y_ref[~bad]) < 1e-5
    assert np.all(np.isfinite(h))


def test_bad_method_names_the_allowed_ones():
    x, delta, A, Bm, C, Dd, h0 = f32(inputs())
    with pytest.raises(ValueError, match="scan, associative_scan"):
        K.selective_scan(x, delta, A, Bm, C, method="chunk")
    with pytest.raises(ValueError, match="A"):
        K.selective_scan(x, delta, A[:2], Bm, C)


SPLIT = r"""
import sys
import jax.numpy as jnp, numpy as np
from linear_attention import kernels as K
from tests.kernels import test_rg_lru
from tests.kernels.reference import rel_err, rg_lru_loop, selective_scan_loop
from tests.kernels.test_sequence_parallel import check
from tests.kernels.test_selective_scan import inputs

# packed rows with boundaries at shard edges (2, 6 of 4 shards) and inside a shard (5)
seg = jnp.asarray([[0, 0, 1, 1, 1, 1, 2, 2], [3, 3, 3, 3, 3, 4, 4, 4]], jnp.int32)
# the default run: each family on one local method (the primitive is shared); slow: the others
mamba_methods, rg_methods = (["scan"], ["associative_scan"]) if sys.argv[1] == "default" else (
    ["associative_scan"], ["scan"])

xs = dict(zip(("x", "delta", "A", "Bm", "C", "D", "s0"),
              (jnp.asarray(v, jnp.float32) for v in inputs(9, T=8).values())))
for method in mamba_methods:
    def kernel(xs, seg, *, axis_name):
        return K.selective_scan(xs["x"], xs["delta"], xs["A"], xs["Bm"], xs["C"], xs["D"],
                                initial_state=xs["s0"], segment_ids=seg, method=method,
                                axis_name=axis_name)
    y, h = check(f"selective_scan/{method}/n=4", kernel, xs, seg, 4)
    y_ref, h_ref = selective_scan_loop(*(xs[k] for k in ("x", "delta", "A", "Bm", "C", "D")),
                                       h0=xs["s0"], segment_ids=np.asarray(seg))
    assert rel_err(y, y_ref) < 1e-5 and rel_err(h, h_ref) < 1e-5, rel_err(y, y_ref)
    print("CHECKED selective_scan loop", flush=True)

rs = {k: jnp.asarray(v, jnp.float32) for k, v in test_rg_lru.inputs(9, T=8).items()}
rs = {"x": rs["x"], "log_a": rs["log_a"], "s0": rs["h0"]}
for method in rg_methods:
    def kernel(xs, seg, *, axis_name):
        return K.rg_lru(xs["x"], xs["log_a"], initial_state=xs["s0"], segment_ids=seg,
                        method=method, axis_name=axis_name)
    y, h = check(f"rg_lru/{method}/n=4", kernel, rs, seg, 4)
    y_ref, h_ref = rg_lru_loop(rs["x"], rs["log_a"], rs["s0"], np.asarray(seg))
    assert rel_err(y, y_ref) < 1e-5 and rel_err(h, h_ref) < 1e-5, rel_err(y, y_ref)
    print("CHECKED rg_lru loop", flush=True)

if sys.argv[1] == "default":  # a NaN write and a NaN initial state reach the same tokens split
    import jax
    from jax.sharding import Mesh, PartitionSpec as P
    x = rs["x"].at[1, 1, 1].set(jnp.nan)  # row 1's first document, [0, 5), spans 3 shards
    s0 = rs["s0"].at[0, 2].set(jnp.nan)  # row 0's first document is [0, 2)
    def run(x, log_a, s0, seg, axis_name=None):
        return K.rg_lru(x, log_a, initial_state=s0, segment_ids=seg, axis_name=axis_name)
    mesh = Mesh(np.asarray(jax.devices()[:4]), ("seq",))
    time = P(None, "seq")
    split = jax.shard_map(lambda *a: run(*a, "seq"), mesh=mesh,
                          in_specs=(time, time, P(), time), out_specs=(time, P()))
    args = (x, rs["log_a"], s0, seg)
    (y_s, h_s), (y_u, h_u) = split(*args), run(*args)
    bad = np.zeros(y_u.shape, bool)
    bad[1, 1:5, 1] = bad[0, 0:2, 2] = True
    assert np.array_equal(np.isnan(y_u), bad) and np.array_equal(np.isnan(y_s), bad)
    assert rel_err(np.asarray(y_s)[~bad], np.asarray(y_u)[~bad]) < 1e-6
    assert np.all(np.isfinite(h_s)) and rel_err(h_s, h_u) < 1e-6
    print("CHECKED nan", flush=True)
"""


@pytest.mark.parametrize("part", ["default", pytest.param("more", marks=pytest.mark.slow)])
def test_time_split_over_four_devices(part):
    """Both families split over 4 devices vs unsplit (outputs, gradients of every input, the
    global final state) and vs the float64 loop, packed rows, from an initial state; a NaN
    input and a NaN initial state poison the same outputs split as unsplit."""
    assert len(checked_names(run_on_cpu_devices(SPLIT, 4, part))) == (5 if part == "default" else 4)


@pytest.mark.hf
@pytest.mark.parametrize("method", METHODS)
def test_against_transformers_mamba_scan(method):
    """The selective-scan core of transformers' torch `MambaMixer` slow path
    (`mamba_selective_scan`'s PyTorch loop, no gate): outputs, final state and the gradients of
    x, Δ, A, B, C and D agree with the peer's float32 run within its own float32 error against
    float64 (the loop, its finite differences), or 1e-5 relative, whichever is larger."""
    torch = pytest.importorskip("torch")
    modeling_mamba = pytest.importorskip("transformers.models.mamba.modeling_mamba")
    xs = inputs(10)
    del xs["h0"]  # the peer's scan starts from zeros
    rng = np.random.default_rng(11)
    wy, wh = rng.normal(size=(B, T, D)), rng.normal(size=(B, D, N))

    def peer(dtype):
        t = {k: torch.tensor(v, dtype=dtype, requires_grad=True) for k, v in xs.items()}
        to_BDT = lambda v: v.transpose(1, 2)  # noqa: E731  [B, T, ·] → the peer's [B, ·, T]
        y_BDT, h_BDN = modeling_mamba.mamba_selective_scan(
            to_BDT(t["x"]), to_BDT(t["delta"]), t["A"], to_BDT(t["Bm"]), to_BDT(t["C"]),
            D=t["D"], return_last_state=True,
        )  # fmt: skip
        y = y_BDT.transpose(1, 2)
        loss = (y * torch.tensor(wy, dtype=dtype)).sum() + (
            h_BDN * torch.tensor(wh, dtype=dtype)
        ).sum()
        loss.backward()
        out = [y.detach().numpy(), h_BDN.detach().numpy()]
        return out + [t[k].grad.numpy() for k in xs]

    # the float64 reference: the loop and its finite differences (the peer casts B and Δ·B·x
    # to float32 even in a float64 run, so it cannot be its own float64 reference)
    peer32 = peer(torch.float32)

    def loss_ref(**kw):
        y, h = selective_scan_loop(**kw)
        return np.sum(wy * y) + np.sum(wh * h)

    fd = finite_difference_grads(loss_ref, xs)
    ref64 = [*selective_scan_loop(**xs), *(fd[k] for k in xs)]

    def loss(*args):
        y, h = K.selective_scan(*args, method=method)
        return jnp.sum(wy * y) + jnp.sum(wh * h), (y, h)

    args = [jnp.asarray(xs[k], jnp.float32) for k in xs]
    grads, (y, h) = jax.grad(loss, argnums=tuple(range(len(args))), has_aux=True)(*args)
    ours = [y, h, *grads]
    for name, a, p32, r64 in zip(["y", "h", *xs], ours, peer32, ref64, strict=True):
        bound = max(rel_err(p32, r64), 1e-5)
        assert rel_err(a, p32) <= bound, (name, rel_err(a, p32), bound)


@pytest.mark.parametrize("method", METHODS)
def test_no_token_passes_the_state_through(method):
    xs = inputs(14, T=0)
    *args, h0 = f32(xs)
    y, h = K.selective_scan(*args, initial_state=h0, method=method)
    assert y.shape == (B, 0, D) and np.array_equal(h, h0)
