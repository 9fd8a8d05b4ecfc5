"""Sequence parallelism (`axis_name`): kernels with time split over 2/4/8 forced CPU devices
inside `jax.shard_map` (default checks) equal the unsplit call — outputs, gradients to every
input, and the global final state on every shard — for every decay kind, normalised or not,
every method, packed rows, and the delta rule. One subprocess runs each group of checks (JAX
starts once); one split result is also checked against the float64 NumPy loop. The default run
keeps one check per kernel family and path; the other device counts, decay kinds and methods
run under `-m slow`."""

import functools

import numpy as np
import pytest

from tests.kernels.reference import rel_err  # NumPy only: safe before JAX is configured
from tests.scripts import checked_names, run_on_cpu_devices

B, T, H, M, DV = 2, 24, 2, 3, 4
SEGMENTS = np.array(  # boundaries at shard edges (6, 12 of 4 shards) and inside shards
    [[0] * 6 + [1] * 6 + [2] * 3 + [3] * 9, [5] * 7 + [6] * 10 + [7] * 7], np.int32
)


REPLICATED = ("kv0", "z0", "s0")  # the initial state is the same on every shard


def check(name, kernel, xs, seg, n, tol=1e-4, check_vma=True):
    """Split over n devices vs unsplit: outputs and the gradients of a weighted loss on them.

    `kernel(xs, seg, *, axis_name)` returns `(o, state)`; `xs` is a dict of the float inputs
    (split along time, except a fixed `[H]` decay and the initial state), `seg` the segment ids
    or None. Returns the split outputs. `check_vma=False` for Pallas's interpret mode, whose
    interpreted kernel body does not type its constants as varying over the mesh (a Mosaic
    kernel is one typed primitive).
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.asarray(jax.devices()[:n]), ("seq",))
    time = P(None, "seq")
    specs = {name: P() if name in REPLICATED or x.ndim < 3 else time for name, x in xs.items()}
    split = jax.shard_map(
        functools.partial(kernel, axis_name="seq"),
        mesh=mesh,
        in_specs=(specs, time),
        out_specs=(time, P()),
        check_vma=check_vma,
    )
    unsplit = functools.partial(kernel, axis_name=None)

    def loss(fn, xs, seg):
        out = fn(xs, seg)
        return sum(
            jnp.sum(jnp.sin(1.0 + 0.3 * i) * jnp.cos(x) * (1.0 + 0.1 * x))
            for i, x in enumerate(jax.tree.leaves(out))
        )

    def both(fn):  # one compilation for outputs and gradients
        return jax.jit(
            lambda xs, seg: (fn(xs, seg), jax.grad(functools.partial(loss, fn))(xs, seg))
        )

    (out_s, g_s), (out_u, g_u) = both(split)(xs, seg), both(unsplit)(xs, seg)
    assert jax.tree.structure(g_s) == jax.tree.structure(g_u)
    ys = jax.tree.leaves((out_u, g_u))
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path((out_s, g_s)), ys, strict=True):
        assert np.all(np.isfinite(np.asarray(y))), (name, path)
        err = rel_err(x, y)
        where = jax.tree_util.keystr(path)
        assert err <= tol, f"{name}: {where} (of outputs, gradients) differs, rel err {err:.2e}"
    print("CHECKED", name, flush=True)
    return out_s


def main(part):
    import jax
    import jax.numpy as jnp

    from linear_attention import kernels as K
    from tests.kernels.reference import causal_linear_attention_loop, delta_rule_loop

    assert jax.device_count() == 8, jax.devices()
    rng = np.random.default_rng(0)
    f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    base = {
        "q": jnp.abs(f(B, T, H, M)) + 0.1,
        "k": jnp.abs(f(B, T, H, M)) + 0.1,
        "v": f(B, T, H, DV),
        "kv0": f(B, H, M, DV),
        "z0": jnp.abs(f(B, H, M)) + 0.5,
    }
    decays = {
        "none": None,
        "H": -0.3 * jnp.abs(f(H)),
        "BTH": -0.5 * jnp.abs(f(B, T, H)),
        "BTHM": -0.5 * jnp.abs(f(B, T, H, M)),
    }

    def linear(xs, seg, *, axis_name, normalize, method, chunk_size=4):
        return K.causal_linear_attention(
            xs["q"], xs["k"], xs["v"], log_decay=xs.get("a"),
            initial_state=K.LinearAttentionState(xs["kv0"], xs["z0"]), segment_ids=seg,
            normalize=normalize, method=method, chunk_size=chunk_size, return_state=True,
            axis_name=axis_name,
        )  # fmt: skip

    def run(name, n, decay, normalize=True, method="chunk", segments=False, chunk_size=4):
        xs = dict(base) if decays[decay] is None else {**base, "a": decays[decay]}
        kernel = functools.partial(
            linear, normalize=normalize, method=method, chunk_size=chunk_size
        )
        seg = jnp.asarray(SEGMENTS) if segments else None
        return check(name, kernel, xs, seg, n, check_vma=method != "pallas")

    # "split" (the default run) covers every kernel family with packed rows, a per-key decay
    # over 8 shards, an unnormalised output and the float64 loop; "split_more" (slow) the rest.
    if part == "split":
        out = run("chunk/BTHM/segments/n=8", 8, "BTHM", segments=True)
        run("chunk/none/unnormalised", 4, "none", normalize=False)
        run("scan/BTHM/segments", 4, "BTHM", method="scan", segments=True)

        # The split result against the float64 recurrence itself.
        o_ref, kv_ref, z_ref = causal_linear_attention_loop(
            base["q"], base["k"], base["v"], decays["BTHM"], base["kv0"], base["z0"],
            segment_ids=SEGMENTS,
        )  # fmt: skip
        o, state = out
        for x, ref in ((o, o_ref), (state.kv, kv_ref), (state.k_sum, z_ref)):
            assert rel_err(x, ref) <= 1e-4, rel_err(x, ref)
        print("CHECKED loop/BTHM/segments/n=8", flush=True)
    if part == "pallas":  # the Pallas kernel (interpreted) gives each shard's summary
        with K.pallas_interpret():
            run("pallas/BTHM/segments", 4, "BTHM", method="pallas", segments=True, chunk_size=16)
    if part == "split_more":
        # Every device count, a data-dependent decay, from an initial state.
        for n in (2, 4, 8):
            run(f"chunk/BTH/n={n}", n, "BTH")
        # Every decay kind, normalised or not, packed rows.
        run("chunk/H", 4, "H")
        run("chunk/BTHM/unnormalised", 4, "BTHM", normalize=False)
        run("chunk/none/segments", 4, "none", segments=True)
        # Every method.
        for method in ("associative_scan", "quadratic", "chunk_parallel"):
            run(f"{method}/BTHM/segments", 4, "BTHM", method=method, segments=True)

    # The delta rule: L2-normalised keys, β in (0, 2), gated or not, packed rows.
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    delta_base = {
        "q": f(B, T, H, M),
        "k": unit(f(B, T, H, M)),
        "v": f(B, T, H, DV),
        "beta": jax.nn.sigmoid(f(B, T, H)) * 1.5,
        "s0": f(B, H, M, DV),
    }

    def delta(xs, seg, *, axis_name, method, chunk_size=4):
        return K.delta_rule(
            xs["q"], xs["k"], xs["v"], xs["beta"], log_decay=xs.get("a"),
            initial_state=K.LinearAttentionState(xs["s0"], None), segment_ids=seg,
            method=method, chunk_size=chunk_size, return_state=True, axis_name=axis_name,
        )  # fmt: skip

    delta_checks = {
        "split": (("delta/chunk/gated/segments/n=8", 8, True, "chunk", True),),
        "split_more": (
            ("delta/chunk/n=2", 2, False, "chunk", False),
            ("delta/scan/gated/n=4", 4, True, "scan", False),
        ),
    }
    if part in delta_checks:
        for name, n, gated, method, segments in delta_checks[part]:
            xs = {**delta_base, "a": decays["BTH"]} if gated else delta_base
            seg = jnp.asarray(SEGMENTS) if segments else None
            check(name, functools.partial(delta, method=method), xs, seg, n)
    if part == "pallas":  # the delta rule's forward kernel (UT transform inside) per shard
        kernel = functools.partial(delta, method="pallas", chunk_size=16)
        xs = {**delta_base, "a": decays["BTH"]}
        with K.pallas_interpret():
            check(
                "pallas/delta/gated/segments", kernel, xs, jnp.asarray(SEGMENTS), 4, check_vma=False
            )

    if part == "nan":
        # A NaN value in one shard reaches its document only, as unsplit: not past the resets at a
        # shard edge (row 0: NaN at 2, reset at 6) or inside a later shard (row 1: 8 and 17).
        nan_v = base["v"].at[0, 2, 0, 1].set(jnp.nan).at[1, 8, 1, 0].set(jnp.nan)
        nan_xs = {**base, "v": nan_v, "a": decays["BTHM"]}
        for method in ("chunk", "scan"):
            kernel = functools.partial(linear, normalize=True, method=method)
            check_nan(f"nan/{method}", kernel, nan_xs, jnp.asarray(SEGMENTS), 4)
        # a NaN log decay (per key channel) in shard 0: it too stops at the reset at 6
        nan_a = {**base, "a": decays["BTHM"].at[0, 2, 0, 1].set(jnp.nan)}
        kernel = functools.partial(linear, normalize=True, method="chunk")
        check_nan("nan/chunk/decay", kernel, nan_a, jnp.asarray(SEGMENTS), 4)
        delta_nan = {**delta_base, "v": nan_v, "a": decays["BTH"]}
        o = check_nan("nan/delta", functools.partial(delta, method="chunk"), delta_nan, None, 4)[0]
        # and the split outputs after each reset equal the float64 loop over that document alone
        for row, start, end in ((0, 6, 12), (1, 17, 24)):
            doc = (slice(row, row + 1), slice(start, end))
            xs = [np.asarray(delta_nan[x])[doc] for x in ("q", "k", "v", "beta")]
            ref = delta_rule_loop(*xs, np.asarray(decays["BTH"])[doc])[0]
            assert rel_err(o[row : row + 1, start:end], ref) <= 1e-4
        print("CHECKED nan/delta/loop", flush=True)


def check_nan(name, kernel, xs, seg, n):
    """Split vs unsplit with NaN inputs: NaN at the same outputs, equal finite outputs, and
    finite gradients of a loss on the finite outputs, equal to the unsplit ones (`seg` None:
    resets in the decay instead, as the delta rule takes them)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.asarray(jax.devices()[:n]), ("seq",))
    time = P(None, "seq")
    specs = {k: P() if k in REPLICATED or x.ndim < 3 else time for k, x in xs.items()}
    split = jax.shard_map(
        functools.partial(kernel, axis_name="seq"), mesh=mesh, in_specs=(specs, time),
        out_specs=(time, P()),
    )  # fmt: skip
    unsplit = functools.partial(kernel, axis_name=None)
    if seg is None:  # resets from the decay: −inf at a shard edge (6) and inside one (17)
        xs = {**xs, "a": xs["a"].at[0, 6].set(-jnp.inf).at[1, 17].set(-jnp.inf)}
        seg = jnp.zeros(xs["q"].shape[:2], jnp.int32)
    o_split = jax.jit(split)(xs, seg)[0]
    finite = np.isfinite(np.asarray(o_split))

    def loss(fn, xs):
        return jnp.sum(jnp.where(finite, jnp.cos(fn(xs, seg)[0]), 0.0))

    g_split = jax.jit(jax.grad(functools.partial(loss, split)))(xs)
    nan_token = np.zeros(xs["q"].shape[:2], bool)  # a token with any non-finite input
    for x in xs.values():
        if x.ndim >= 3 and x.shape[:2] == nan_token.shape:
            nan_token |= ~np.all(np.isfinite(np.asarray(x)), axis=tuple(range(2, x.ndim)))
    for path, g in jax.tree_util.tree_leaves_with_path(g_split):
        g = np.asarray(g)
        ok = g[~nan_token] if g.shape[:2] == nan_token.shape else g  # per token, or a state
        assert np.all(np.isfinite(ok)), (name, jax.tree_util.keystr(path))
    out_unsplit = jax.jit(unsplit)(xs, seg)
    o_unsplit = np.asarray(out_unsplit[0])
    assert np.array_equal(finite, np.isfinite(o_unsplit)), name
    assert rel_err(np.asarray(o_split)[finite], o_unsplit[finite]) <= 1e-4, name
    g_unsplit = jax.jit(jax.grad(functools.partial(loss, unsplit)))(xs)
    for x, y in zip(jax.tree.leaves(g_split), jax.tree.leaves(g_unsplit), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        keep = ~nan_token if x.shape[:2] == nan_token.shape else ...
        assert rel_err(x[keep], y[keep]) <= 1e-4, name
    print("CHECKED", name, flush=True)
    return o_split, g_split


EXPECTED = [
    "chunk/BTHM/segments/n=8",
    "chunk/none/unnormalised",
    "scan/BTHM/segments",
    "loop/BTHM/segments/n=8",
    "delta/chunk/gated/segments/n=8",
]
EXPECTED_MORE = [
    "chunk/BTH/n=2",
    "chunk/BTH/n=4",
    "chunk/BTH/n=8",
    "chunk/H",
    "chunk/BTHM/unnormalised",
    "chunk/none/segments",
    "associative_scan/BTHM/segments",
    "quadratic/BTHM/segments",
    "chunk_parallel/BTHM/segments",
    "delta/chunk/n=2",
    "delta/scan/gated/n=4",
]


EXPECTED_NAN = ["nan/chunk", "nan/scan", "nan/chunk/decay", "nan/delta", "nan/delta/loop"]
EXPECTED_PALLAS = ["pallas/BTHM/segments", "pallas/delta/gated/segments"]


def run_checks(part):
    """Run `main(part)` in a subprocess with 8 forced CPU devices; the names it checked.

    The checks compile ~20 sharded programs: minutes on a loaded 2-core machine (600 s did not
    suffice at load 20). A timeout reports the checks done so far."""
    code = f"from tests.kernels.test_sequence_parallel import main; main({part!r})"
    return checked_names(run_on_cpu_devices(code, 8))


def test_split_over_devices_equals_unsplit():
    assert run_checks("split") == EXPECTED


@pytest.mark.slow
def test_split_over_devices_more_equals_unsplit():
    """Every device count, decay kind and method (minutes: 11 sharded programs)."""
    assert run_checks("split_more") == EXPECTED_MORE


def test_split_over_devices_pallas_equals_unsplit():
    """method="pallas" (interpret mode) composes with `axis_name` as "chunk" does: linear
    attention with a decay per key channel and Gated DeltaNet, packed rows, 4 shards."""
    assert run_checks("pallas") == EXPECTED_PALLAS


def test_nan_in_one_shard_stops_at_a_reset_as_unsplit():
    """A NaN value in shard 0 or 1 reaches outputs and the final state only up to the next
    reset (at a shard edge, or inside a later shard), as the unsplit call; gradients of a loss
    on the finite outputs are finite (but at the NaN token) and equal the unsplit ones (causal
    linear attention, "chunk" and "scan", a NaN value or log decay; the delta rule, "chunk").
    The delta rule's split outputs after a reset also equal the float64 loop."""
    assert run_checks("nan") == EXPECTED_NAN
