"""The sequential part of the delta family's chunk kernels: one affine map of the entering state
per chunk, walked by a rematerialised `lax.scan` over groups of chunks."""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Tokens per scan step: the state-independent work of a step's chunks is batched (fewer, larger
# ops than one chunk per step), while a step's temporaries stay small (they are recomputed in
# the backward pass, never stored for the whole sequence).
TOKENS_PER_STEP = 256


def chunks_per_step(chunk_size: int, num_chunks: int) -> int:
    """G: the chunks one scan step takes (T is padded to a multiple of G·C)."""
    return max(1, min(num_chunks, TOKENS_PER_STEP // chunk_size))


def affine_chunk_scan(s0_BHKD, xs, prepare, group: int):
    """Walk the chunks of a kernel whose chunk maps its entering state S affinely:

        X  = W S                              [C, Dv]  (the state's effect on the chunk's writes)
        O  = Q S + P X + O₀                   [C, Dv]
        S' = diag(g) S + Eᵀ X + U₀            [K, Dv]

    `xs`: chunk-major inputs `[N, B, H, C, ...]` (N a multiple of `group`); `prepare(*xs_group)`
    maps the inputs of `group` chunks, batched, to `(W, Q, P, O0, E, U0, g)` with a leading
    `[group]` axis (g `[.., K]` or `[.., 1]`, or None for no decay). One `lax.scan` step takes
    `group` chunks: `prepare`, then the affine maps in order; the step is rematerialised, so the
    backward pass stores the state entering each step and recomputes the rest, never a state
    per token nor `prepare`'s intermediates for the whole sequence.
    Returns `(O [N, B, H, C, Dv], S_final)`.
    """
    N = xs[0].shape[0]
    grouped = [x.reshape(N // group, group, *x.shape[1:]) for x in xs]

    def step(s_BHKD, inputs):
        w, q, p, o0, e, u0, g = prepare(*inputs)
        outs = []
        for i in range(group):  # a static loop over the step's chunks, not over time
            x = w[i] @ s_BHKD
            outs.append(q[i] @ s_BHKD + p[i] @ x + o0[i])
            decayed = s_BHKD if g is None else g[i][..., :, None] * s_BHKD
            s_BHKD = decayed + jnp.swapaxes(e[i], -1, -2) @ x + u0[i]
        return s_BHKD, jnp.stack(outs)

    s_BHKD, o = jax.lax.scan(jax.checkpoint(step), s0_BHKD, grouped)
    return o.reshape(N, *o.shape[2:]), s_BHKD
