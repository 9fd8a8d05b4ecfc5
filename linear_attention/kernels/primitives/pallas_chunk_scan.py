"""The delta family's chunk form with `method="pallas"` as one custom VJP over a pair of
Pallas TPU kernels, and the block specs of their (rows, chunks) grid.

The family gives its forward pass as one kernel over every chunk (`fused`: the chunk's terms,
the UT transform included, and the walk step, the state carried in VMEM; `delta/pallas.py`'s
`ut_walk`, `dplr_walk`), which keeps the state entering each chunk (one [K, Dv] state per
chunk) for the backward pass, and its backward pass as one kernel (`fused_backward`:
`ut_walk_back`, `dplr_walk_back`), which walks the chunks last to first carrying dS, makes each
chunk's terms again from the state entering it and maps dO and dS to the inputs' cotangents.
Nothing else per chunk is stored between the two: the family's [C, C] residuals, kept for
every chunk, held more temporaries than the chunk form (a [C, C] float32 array per chunk is
padded from 64 to 128 lanes in HBM; DPLR, v6e, train, T = 4096: 67.0 MiB against 61.5;
compiler figures of that design).
"""

from __future__ import annotations

import functools

import jax
from jax.experimental import pallas as pl

from linear_attention.kernels.primitives.pallas import check_pallas_backend, vary_together


def pallas_affine_chunk_scan(s0_BHKD, xs, fused, fused_backward):
    """The family's chunk form over chunk-major inputs `xs` (`[N, B, H, C, ...]`) from the
    state `s0_BHKD`, by its two kernels. Returns `(O [N, B, H, C, Dv], S_final)`.

    `fused(s0_BHKD, xs, interpret, keep) -> (O, S_final, entering [N, B·H, K, Dv] or None)`:
    the forward pass (with `keep`, the state entering each chunk).
    `fused_backward(dS_final, xs, entering, dO, interpret) -> (dS₀, dxs)`: the backward pass,
    `dxs` shaped as `xs` (None for an integer input)."""
    interpret = check_pallas_backend('method="pallas"')
    return _scan(fused, fused_backward, interpret, s0_BHKD, tuple(xs))


def _carry_like(s_BHKD, xs):
    """The state typed as varying over the mesh axes the inputs vary over (inside
    `shard_map`): the kernels' states come out so, and a cotangent keeps its primal's type."""
    leaves = [x for x in jax.tree.leaves(xs) if x is not None]
    return vary_together([*leaves, s_BHKD])[-1]


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _scan(fused, fused_backward, interpret, s0_BHKD, xs):
    o, s, _ = fused(_carry_like(s0_BHKD, xs), xs, interpret, False)
    return o, s


def _scan_fwd(fused, fused_backward, interpret, s0_BHKD, xs):
    o, s, entering = fused(_carry_like(s0_BHKD, xs), xs, interpret, True)
    return (o, s), (xs, entering)  # the inputs and the state entering each chunk


def _scan_bwd(fused, fused_backward, interpret, residuals, cotangents):
    xs, entering = residuals
    do_NBHCD, ds_BHKD = cotangents
    return fused_backward(_carry_like(ds_BHKD, xs), xs, entering, do_NBHCD, interpret)


_scan.defvjp(_scan_fwd, _scan_bwd)
