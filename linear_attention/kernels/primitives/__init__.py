"""Shared chunk primitives, public inside `kernels/` and used by every family:

- `layout`: pad time to whole chunks, view `[B, T, H, ...]` chunk-major and back;
- `decays`: reset-aware decay factors of a chunk (`ChunkDecays`, per head or per key channel,
  inclusive or exclusive of the token's own decay), pairwise factors (`pair_decays`), and the
  sub-block factorisation of per-key decayed scores that keeps −30 per token exact (`SubBlocks`,
  with its hand-written VJP including the decays' cotangents);
  the cumulative sums themselves are `segments.cumulative_log_decay`;
- `triangular`: the unit-lower-triangular inverse of the UT transform (`invert_unit_lower`)
  and the cotangents of a solve with it (`unit_lower_solve_vjp`);
- `chunk_scan`: the walk across chunks of an affine per-chunk map (`affine_chunk_scan`), with a
  hand-written VJP when the family gives its pullback (one state per chunk kept);
- `combine`: sequence parallelism, one affine combine `S_out = A S_in + U` over a mesh axis
  that takes any local kernel (`affine_sequence_parallel`, `prefix`);
- `nan_guard`: a NaN input reaches only its document's later outputs (`nan_guard`, `clean`,
  `poison`): every family's methods run inside it;
- `driver`: the one sequence call of the affine-state families (`affine_call`: the core,
  the sequence-parallel combine, the cast), after their checks and resets.

A new family (e.g. log-linear attention, PaTH) is a new folder beside `linear/`, `delta/` and
`softmax/` built from these parts, with its reference (scan/quadratic) beside its fast form.
"""
