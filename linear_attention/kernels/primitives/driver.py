"""The one driver of the affine-state families (the delta rule, DPLR, DeltaProduct).

Every such family's sequence call is the same walk around its own core:

    check → initial state → resets from segments → core → sequence-parallel combine → cast

The family checks its inputs and builds its float32 arrays (the checks differ: β's range, the
low-rank vectors, the sub-steps), then `affine_call` does the rest. The core is the family's
local kernel, `core(v, s_init) -> (o, s_final)` over this call's (or this shard's) tokens, picked
by the family's own `match` over its methods; it must be linear in (s_init, v) jointly and read
o_t = S_tᵀ q_t, which is what `primitives.combine.affine_sequence_parallel` needs to split time
over a mesh axis with the same numbers.

A NaN stays where it arose (`primitives.nan_guard`): the family finds the bad tokens from its
write inputs and cleans them (`guard_inputs`), `affine_call` poisons what they reach.

Resets have one source: `segments.segment_resets`, which takes raw ids or the `Segments` a model
built once, and knows a span's first token under a time split. A family turns them into −inf
log decays (`segments.fold_resets`), DPLR also zeroes its low-rank read there.
"""

from __future__ import annotations

from linear_attention.kernels.primitives.combine import affine_sequence_parallel
from linear_attention.kernels.primitives.nan_guard import NanGuard, poison, poison_state
from linear_attention.kernels.state import LinearAttentionState


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
