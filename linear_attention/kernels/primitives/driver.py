"""The one driver of the affine-state families (the delta rule, DPLR, DeltaProduct).

Every such family's sequence call is the same walk around its own core:

    check → initial state → resets from segments → core → sequence-parallel combine → cast

The family checks its inputs and builds its float32 arrays (the checks differ: β's range, the
low-rank vectors, the sub-steps), then `affine_call` does the rest. The core is the family's
local kernel, `core(v, s_init) -> (o, s_final)` over this call's (or this shard's) tokens, picked
by the family's own `match` over its methods; it must be linear in (s_init, v) jointly and read
o_t = S_tᵀ q_t, which is what `primitives.combine.affine_sequence_parallel` needs to split time
over a mesh axis with the same numbers.

A NaN stays where it arose (`primitives.nan_guard`): the bad tokens are found from the family's
write inputs and cleaned (`guard_inputs`), `affine_call` poisons what they reach;
`guarded_call` does both around a kernel `kernel(q, k, v, *writes, log_decay, s_init)` (the
kernel of the method, from the family's descriptor, `primitives.family`).

Resets have one source: `segments.segment_resets`, which takes raw ids or the `Segments` a model
built once, and knows a span's first token under a time split. A family turns them into −inf
log decays (`segments.fold_resets`), DPLR also zeroes its low-rank read there.
"""

from __future__ import annotations

import jax.numpy as jnp

from linear_attention.kernels.primitives.combine import affine_sequence_parallel
from linear_attention.kernels.primitives.family import Family
from linear_attention.kernels.primitives.nan_guard import (
    NanGuard,
    guard_inputs,
    poison,
    poison_state,
)
from linear_attention.kernels.segments import reset_reach
from linear_attention.kernels.state import LinearAttentionState

# `guarded_call`'s default: a reset is a −inf log decay (DPLR names its own).
_FROM_DECAY = object()


def guarded_call(
    family: Family,
    method: str,
    q,
    writes,
    log_decay,
    s0_BHKD,
    *,
    options: dict,
    dtype,
    return_state: bool,
    axis_name: str | None = None,
    heads: int | None = None,
    resets=None,
    reached_BTH=_FROM_DECAY,
):
    """The sequence call of `family`'s checked `method`: its kernel (`family.kernel(method,
    **options)`, `kernel(q, k, v, *rest, log_decay, s_init) -> (o, s)`) on q and `writes` =
    `(k, v, *rest)` `[B, T, H, ...]`, taken to float32 unless the method reads its own dtype
    (`family.float32`), q and k repeated to `heads` value heads when given (grouped value heads:
    head j reads j // (heads // H)); then guarded (`guard_inputs`: the bad tokens cleaned,
    their reach poisoned; `resets`, `[B, T]`, the resets other than a −inf log decay) and run
    by `affine_call`, v the value that the time split walks. `reached_BTH`: whether a reset
    lies at or before each token (default: from the log decay's −inf)."""
    if family.float32(method):
        q, writes = jnp.asarray(q, jnp.float32), tuple(jnp.asarray(x, jnp.float32) for x in writes)
    if heads is not None:  # a repeat, not a gather: its transpose sums the heads' cotangents
        q, k = (jnp.repeat(x, heads // x.shape[2], axis=2) for x in (q, writes[0]))
        writes = (k, *writes[1:])
    B, T, H = writes[1].shape[:3]
    guard, writes, log_decay, (s0_BHKD,) = guard_inputs(
        (B, T, H), writes, log_decay, (s0_BHKD,), resets=resets, split=axis_name is not None
    )
    k, v, *rest = writes
    kernel = family.kernel(method, **options)

    def core(v_ext, s_init):
        return kernel(q, k, v_ext, *rest, log_decay, s_init)

    return affine_call(
        core,
        v,
        s0_BHKD,
        dtype=dtype,
        return_state=return_state,
        axis_name=axis_name,
        like=q,
        reached_BTH=reset_reach(log_decay) if reached_BTH is _FROM_DECAY else reached_BTH,
        guard=guard,
    )


def affine_call(
    core,
    v,
    s0_BHKD,
    *,
    dtype,
    return_state: bool,
    axis_name: str | None = None,
    like=None,
    reached_BTH=None,
    guard: NanGuard | None = None,
):
    """Run `core(v, s_init) -> (o, s)` from `s0_BHKD`, over a time split when `axis_name` is
    given (`like`: an input that varies over the mesh; `reached_BTH`: whether a reset lies at or
    before each token, so that a NaN carried in from an earlier span stops there), and cast.
    `guard` (`primitives.nan_guard`, with every input already clean, `v` too): the outputs and
    final state of the core are poisoned where a bad token reaches, inside each span, so that a
    time split carries the NaN as the unsplit call does.

    Returns `o` in `dtype`, and with `return_state` the final `LinearAttentionState(kv, None)`.
    """
    if guard is not None:
        inner = core

        def core(v_ext, s_init):
            o, s = inner(v_ext, s_init)
            return poison(guard, o), poison_state(guard, s)

    if axis_name is None:
        o, s_BHKD = core(v, s0_BHKD)
    else:
        o, s_BHKD = affine_sequence_parallel(
            core, v, s0_BHKD, axis_name, like=like, resets_BTH=reached_BTH
        )
    o = o.astype(dtype)
    return (o, LinearAttentionState(kv=s_BHKD, k_sum=None)) if return_state else o
