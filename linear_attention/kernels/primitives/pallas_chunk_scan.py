"""The walk of `chunk_scan.affine_chunk_scan` as Pallas TPU kernels: the delta family's
sequential part (KDA, the delta rule through it, DPLR) with `method="pallas"`.

`affine_chunk_scan` walks chunks whose state map is affine (see its module docstring for the
terms W, X₀, Q, P, O₀, E, U₀, g and the lines of the forward and backward walk). Here a
`lax.scan` walks groups of chunks (TOKENS_PER_GROUP tokens: one chunk of 64); per group, the
family's `forward` (the UT transform, decays, scores: everything that does not depend on the
state) runs in XLA on the group's chunks at once, and the walk across them is a Pallas kernel,
one grid step per (batch·head row, chunk), the state carried in VMEM:

- forward: X = W S (+ X₀), O = Q S + P X (+ O₀), S' = g ⊙ S + Eᵀ X (+ U₀), keeping the state
  entering each chunk (one [K, Dv] state per chunk) for the backward pass;
- backward, groups and chunks last to first carrying dS: the family's `forward` again on the
  group (its terms and per-chunk residuals are never stored for the whole sequence), the terms'
  cotangents (dW, dX₀, dQ, dP, dO₀, dE, dU₀, dg) by the kernel, which the family's pullback maps
  to its inputs in XLA (batched over the group's chunks).

So the Mosaic kernels cover the walk (the part a `lax.scan` serialises); the UT transform and
its pullback stay XLA matmuls beside them, unless the family gives its forward pass as one
kernel (`fused`: the delta rule's and DPLR's, `delta/pallas.py`, the UT transform inside it),
which then replaces the forward groups, and its backward pass as one kernel (`fused_backward`:
the delta rule's), which then replaces the backward groups and this walk. The terms and their
cotangents live one group at a time: made for all chunks at once, they held 2.6× the chunk
form's temporaries for KDA at T = 4096 (v5e compiler figures, BENCHMARKS.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from linear_attention.kernels.primitives.pallas import (
    carry_state,
    check_pallas_backend,
    compiler_params,
    cost_estimate,
    mxu_dot,
    result_struct,
    vary_together,
    vmem_f32,
)

_TERMS = ("w", "x0", "q", "p", "o0", "e", "u0", "g")
# Tokens per group of chunks: the family's state-independent part (`forward`, `backward` and its
# pullback) runs on one group's chunks at once, beside the Pallas walk over them. One chunk of 64
# per group gave the smallest temporaries (KDA, train, T = 4096, v5e, when the family's
# residuals were still stored per chunk: 24.6 MiB against the chunk form's 34.9; groups of 128
# tokens 40.9, of 256 76.9). Compiler figures, BENCHMARKS.md.
TOKENS_PER_GROUP = 64


def pallas_affine_chunk_scan(s0_BHKD, xs, forward, backward, fused=None, fused_backward=None):
    """`affine_chunk_scan(s0_BHKD, xs, forward, N, backward)` with the walk in Pallas kernels:
    `forward` and `backward` are the family's, called on groups of chunks (`xs` chunk-major
    `[N, B, H, C, ...]`). Returns `(O [N, B, H, C, Dv], S_final)`.

    `fused(s0_BHKD, xs, interpret, keep) -> (O, S_final, entering [N, B·H, K, Dv] or None)`:
    the family's forward pass as one Pallas kernel over every chunk (its terms made inside it
    from `xs`, the UT transform included), in place of the groups of `forward` and the walk.
    The backward pass is the same either way, unless the family gives it as one kernel too:

    `fused_backward(dS_final, xs, entering, dO, interpret) -> (dS₀, dxs)`: its terms made again
    and their pullback inside the kernel (`delta/pallas.py`'s `ut_walk_back`), in place of the
    groups of `backward` beside the walk back; needs `fused` (the states it keeps)."""
    interpret = check_pallas_backend('method="pallas"')
    return _scan(forward, backward, fused, fused_backward, interpret, s0_BHKD, tuple(xs))


def _group_size(N, C):
    """The largest divisor of N that keeps a group within TOKENS_PER_GROUP tokens."""
    most = max(1, TOKENS_PER_GROUP // C)
    return max(g for g in range(1, min(N, most) + 1) if N % g == 0)


def _groups(trees, G):
    """Each array `[N, ...]` of the trees as `[N / G, G, ...]` (a `lax.scan` over groups)."""
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // G, G, *x.shape[1:]), trees)


def _ungroup(trees):
    return jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), trees)


def _carry_like(s_BHKD, xs):
    """The scan's carried state typed as varying over the mesh axes the inputs vary over
    (inside `shard_map`): the walk's state comes out so, and a carry keeps its type."""
    leaves = [x for x in jax.tree.leaves(xs) if x is not None]
    return vary_together([*leaves, s_BHKD])[-1]


def _chunks(xs):
    """(N, C) of the chunk-major inputs `[N, B, H, C, ...]`."""
    leaves = [x for x in jax.tree.leaves(xs) if x is not None]
    return leaves[0].shape[0], leaves[0].shape[3]


def rows_major(x):
    """[N, B, H, ...] -> [N, B·H, ...] (None stays None)."""
    return None if x is None else x.reshape(x.shape[0], -1, *x.shape[3:])


def chunk_spec(block, reverse, N):
    """A per-chunk block of an [N, R, ...] array for the (rows, chunks) grid."""
    rest = (0,) * (len(block) - 2)
    if reverse:
        return pl.BlockSpec(block, lambda r, j: (N - 1 - j, r, *rest))
    return pl.BlockSpec(block, lambda r, j: (j, r, *rest))


def state_spec(K, Dv):
    """A state `[B·H, K, Dv]` for the (rows, chunks) grid: the row's, the same every chunk."""
    return pl.BlockSpec((None, K, Dv), lambda r, j: (r, 0, 0))


def _flatten(terms):
    """The present terms by name, rows-major, g as a column [N, R, X, 1] (it scales S's rows)."""
    named = dict(zip(_TERMS, terms, strict=True))
    out = {}
    for name, x in named.items():
        if x is None:
            continue
        x = rows_major(x)
        out[name] = x[..., None] if name == "g" else x
    return out


def _walk_kernel(*refs, names, keep):
    n = len(names)
    ins = dict(zip(names, refs[:n], strict=True))
    s0_ref = refs[n]
    o_ref, s_ref = refs[n + 1 : n + 3]
    keep_ref = refs[n + 3] if keep else None

    def step(S):
        get = {name: ref[...].astype(jnp.float32) for name, ref in ins.items()}
        x = mxu_dot(get["w"], S)
        if "x0" in get:
            x = x + get["x0"]
        o = mxu_dot(get["q"], S) + mxu_dot(get["p"], x)
        if "o0" in get:
            o = o + get["o0"]
        o_ref[...] = o
        if "g" in get:
            S = get["g"] * S
        S = S + mxu_dot(get["e"], x, trans_a=True)
        if "u0" in get:
            S = S + get["u0"]
        return S

    carry_state(s0_ref, s_ref, refs[-1], keep_ref, step)


def _walk(s0_BHKD, terms, interpret, keep):
    flat = _flatten(terms)
    names = list(flat)
    w = flat["w"]
    N, R, C, K = w.shape
    Dv = s0_BHKD.shape[-1]
    B, H = s0_BHKD.shape[:2]
    inputs = vary_together([flat[n] for n in names] + [s0_BHKD.reshape(R, K, Dv)])
    struct = functools.partial(result_struct, like=inputs[0])
    in_specs = [chunk_spec((None, None, *flat[n].shape[2:]), False, N) for n in names]
    in_specs.append(state_spec(K, Dv))
    out_shape = [struct((N, R, C, Dv), jnp.float32), struct((R, K, Dv), jnp.float32)]
    out_specs = [chunk_spec((None, None, C, Dv), False, N), state_spec(K, Dv)]
    if keep:
        out_shape.append(struct((N, R, K, Dv), jnp.float32))
        out_specs.append(chunk_spec((None, None, K, Dv), False, N))
    flops = 2 * N * R * (C * K * Dv * 3 + C * C * Dv)
    outs = pl.pallas_call(
        functools.partial(_walk_kernel, names=tuple(names), keep=keep),
        out_shape=out_shape,
        grid=(R, N),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[vmem_f32((K, Dv))],
        compiler_params=compiler_params(),
        cost_estimate=cost_estimate(flops=flops, transcendentals=0, arrays=inputs + out_shape),
        interpret=interpret,
        name="affine_chunk_walk_fwd",
    )(*inputs)
    o = outs[0].reshape(N, B, H, C, Dv)
    entering = outs[2] if keep else None
    return o, outs[1].reshape(B, H, K, Dv), entering


def _forward_walk(forward, interpret, s0_BHKD, xs, keep):
    """Groups of chunks in turn (`lax.scan`): the family's `forward` on a group's chunks, then
    the Pallas walk over them. Returns O, S_final and, with `keep`, the state entering each
    chunk `[N, ...]`."""
    N, C = _chunks(xs)

    def step(s_BHKD, xs_group):
        terms, _ = forward(*xs_group)
        o, s_BHKD, entering = _walk(s_BHKD, terms, interpret, keep)
        return s_BHKD, (o, entering)

    s0_BHKD = _carry_like(s0_BHKD, xs)
    s_BHKD, outs = jax.lax.scan(step, s0_BHKD, _groups(xs, _group_size(N, C)))
    return s_BHKD, _ungroup(outs)


def _forward_pass(forward, fused, interpret, s0_BHKD, xs, keep):
    if fused is None:
        return _forward_walk(forward, interpret, s0_BHKD, xs, keep)
    o, s, entering = fused(_carry_like(s0_BHKD, xs), xs, interpret, keep)
    return s, (o, entering)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _scan(forward, backward, fused, fused_backward, interpret, s0_BHKD, xs):
    s, (o, _) = _forward_pass(forward, fused, interpret, s0_BHKD, xs, keep=False)
    return o, s


def _scan_fwd(forward, backward, fused, fused_backward, interpret, s0_BHKD, xs):
    s, (o, entering) = _forward_pass(forward, fused, interpret, s0_BHKD, xs, keep=True)
    # Residuals: the inputs and the state entering each chunk. The family's per-chunk residuals
    # are made again in the backward pass: kept for every chunk (DPLR's four [C, C] and two
    # [C, K] float32 arrays, a [C, C] one padded from 64 to 128 lanes in HBM), they held more
    # temporaries than the chunk form (DPLR, v6e, train, T = 4096: 67.0 MiB against 61.5; made
    # again: 31.1, its forward pass then still in XLA groups. Compiler figures, BENCHMARKS.md).
    return (o, s), (xs, entering)


def _scan_bwd(forward, backward, fused, fused_backward, interpret, residuals, cotangents):
    """Groups last to first (`lax.scan`, carrying dS): per group, the family's `forward` again
    (its residuals), its terms, the Pallas walk back over its chunks (the terms' cotangents),
    and the family's pullback of them to its inputs; or the family's `fused_backward`."""
    xs, entering = residuals
    do_NBHCD, ds_BHKD = cotangents
    if fused_backward is not None:
        return fused_backward(_carry_like(ds_BHKD, xs), xs, entering, do_NBHCD, interpret)
    N, C = _chunks(xs)
    has_u0 = _has_u0(forward, xs)

    def step(ds_BHKD, group):
        xs_g, entering_g, do_g = group
        terms, pullback = backward(xs_g, forward(*xs_g)[1])
        d_terms, ds_BHKD = _walk_back(ds_BHKD, terms, entering_g, do_g, has_u0, interpret)
        return ds_BHKD, tuple(pullback(*d_terms))

    groups = _groups((xs, entering, do_NBHCD), _group_size(N, C))
    ds0_BHKD, dxs = jax.lax.scan(step, _carry_like(ds_BHKD, xs), groups, reverse=True)
    return ds0_BHKD, _ungroup(dxs)


def _walk_back(ds_BHKD, terms, entering, do_NBHCD, has_u0, interpret):
    """The backward walk over a group's chunks, last to first, from dS after its last chunk:
    the cotangents of the terms `(dW, dX₀, dQ, dP, dO₀, dE, dU₀, dg)` and dS before its first.
    It stays one function because it is one `pallas_call`: its inputs, block specs, output
    shapes and the list of cotangents written are parallel lists over the same named terms, and
    apart each part would take and return all of them."""
    B, H, K, Dv = ds_BHKD.shape
    w, x0, q, p, e, g = terms
    flat = _flatten((w, x0, q, p, None, e, None, g))
    names = list(flat)
    N, R, C, _ = flat["w"].shape
    X = None if g is None else g.shape[-1]
    inputs = [flat[n] for n in names] + [entering, rows_major(do_NBHCD), ds_BHKD.reshape(R, K, Dv)]
    inputs = vary_together(inputs)
    struct = functools.partial(result_struct, like=inputs[0])
    in_specs = [chunk_spec((None, None, *flat[n].shape[2:]), True, N) for n in names]
    in_specs += [chunk_spec((None, None, K, Dv), True, N), chunk_spec((None, None, C, Dv), True, N)]
    in_specs.append(state_spec(K, Dv))
    shapes = {
        "w": (C, K),
        "x0": (C, Dv),
        "q": (C, K),
        "p": (C, C),
        "e": (C, K),
        "u0": (K, Dv),
        "g": (X, 1),
    }
    # dX₀ whether or not the family has an X₀ (its pullback reads it as U's cotangent, say)
    written = ["w", "x0", "q", "p", "e"] + ["u0"] * has_u0 + ["g"] * (g is not None)
    out_shape = [struct((N, R, *shapes[n]), jnp.float32) for n in written]
    out_specs = [chunk_spec((None, None, *shapes[n]), True, N) for n in written]
    out_shape.append(struct((R, K, Dv), jnp.float32))
    out_specs.append(state_spec(K, Dv))
    kernel = functools.partial(
        _walk_back_kernel, names=tuple(names), written=tuple(written), scalar_g=X == 1
    )
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(R, N),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[vmem_f32((K, Dv))],
        compiler_params=compiler_params(),
        cost_estimate=cost_estimate(
            flops=2 * N * R * (C * K * Dv * 6 + C * C * Dv * 2),
            transcendentals=0,
            arrays=inputs + out_shape,
        ),
        interpret=interpret,
        name="affine_chunk_walk_bwd",
    )(*inputs)
    got = dict(zip(written, outs[:-1], strict=True))

    def back(name, tail):
        x = got.get(name)
        return None if x is None else x.reshape(N, B, H, *tail)

    dg = None if g is None else got["g"].reshape(N, B, H, X)
    d_terms = (
        back("w", (C, K)),
        back("x0", (C, Dv)),
        back("q", (C, K)),
        back("p", (C, C)),
        do_NBHCD,
        back("e", (C, K)),
        back("u0", (K, Dv)),
        dg,
    )
    return d_terms, outs[-1].reshape(B, H, K, Dv)


def _walk_back_kernel(*refs, names, written, scalar_g):
    """The backward walk, chunks last to first; writes the cotangents in `written` (dU₀ only
    where the family has a U₀) and, after the row's first chunk, dS₀."""
    n = len(names)
    ins = dict(zip(names, refs[:n], strict=True))
    se_ref, do_ref, dsT_ref = refs[n : n + 3]
    outs = dict(zip(written, refs[n + 3 : n + 3 + len(written)], strict=True))
    ds0_ref, ds_acc = refs[-2], refs[-1]
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _():
        ds_acc[...] = dsT_ref[...]

    ds_next, S = ds_acc[...], se_ref[...]
    do = do_ref[...]
    get = {name: ref[...].astype(jnp.float32) for name, ref in ins.items()}
    x = mxu_dot(get["w"], S)
    if "x0" in get:
        x = x + get["x0"]
    dx = mxu_dot(get["p"], do, trans_a=True) + mxu_dot(get["e"], ds_next)
    ds = mxu_dot(get["q"], do, trans_a=True) + mxu_dot(get["w"], dx, trans_a=True)
    grads = {
        "w": lambda: mxu_dot(dx, S, trans_b=True),
        "x0": lambda: dx,
        "q": lambda: mxu_dot(do, S, trans_b=True),
        "p": lambda: mxu_dot(do, x, trans_b=True),
        "e": lambda: mxu_dot(x, ds_next, trans_b=True),
        "u0": lambda: ds_next,
    }
    if "g" in get:
        dg = jnp.sum(ds_next * S, axis=-1, keepdims=True)  # [K, 1]
        dg = jnp.sum(dg, axis=0, keepdims=True) if scalar_g else dg
        grads["g"] = lambda: dg
        ds = ds + get["g"] * ds_next
    else:
        ds = ds + ds_next
    for name, ref in outs.items():
        ref[...] = grads[name]()
    ds_acc[...] = ds

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        ds0_ref[...] = ds


def _has_u0(forward, xs):
    """Whether the family's terms have a U₀ (DPLR's; KDA's has none), from their shapes only."""
    terms = jax.eval_shape(lambda *x: forward(*x)[0], *xs)
    return terms[6] is not None


_scan.defvjp(_scan_fwd, _scan_bwd)
