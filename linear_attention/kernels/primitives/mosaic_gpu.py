"""Every use of the Mosaic GPU API (Pallas's Hopper backend) in one place: the kernel call, its
interpret mode, shared-memory buffers, TMA copies and the wgmma matmul.

The GPU kernels (`linear/pallas_gpu.py`, `linear/pallas_gpu_key.py`) are written against the
helpers here, so that a
change of the API between jax releases is mended in this file alone. What they rely on, read
against the Pallas changelog up to jax 0.12 (`docs/pallas/CHANGELOG.md`):

- `plgpu.kernel(body, out_type=..., scratch_types=..., grid=..., grid_names=...)`: the entry
  point (`pl.pallas_call` for Mosaic GPU warns "migrate to `plgpu.kernel`" from 0.10; jax 0.10
  renamed `out_shape`/`scratch_shapes` to `out_type`/`scratch_types`, the names used here);
  `jax.lax.axis_index` of a grid name gives the block's index.
- `plgpu.SMEM(shape, dtype, transforms=(TilingTransform, SwizzleTransform))`, `plgpu.Barrier`,
  `plgpu.copy_gmem_to_smem` / `barrier_wait` (TMA in), `plgpu.commit_smem`,
  `plgpu.copy_smem_to_gmem` / `wait_smem_to_gmem` (TMA out), `plgpu.Barrier(num_barriers=2)`
  indexed by stage and `pl.when` (the two-stage pipeline of `walk`), `plgpu.wgmma` into a
  `plgpu.ACC` accumulator (`pl.run_scoped`, `pl.run_state` with `ACC.init`),
  `plgpu.transpose_ref`, `plgpu.layout_cast` with `plgpu.Layout.WGMMA` (and `.reduce(axis)`),
  `plgpu.broadcasted_iota`. None of these is removed or renamed up to 0.12 (0.11 removed
  `plgpu.TransposeTransform`, which is not used; `pl.core_map` is deprecated, not used;
  0.12.1 also exports Pallas as `jax.pallas`, and `jax.experimental.pallas` stays valid).
- Interpret mode: `interpret=InterpretGPUParams()` from the private
  `jax._src.pallas.mosaic_gpu.interpret.params` (as jax's own
  `tests/pallas/gpu_pallas_interpret_test.py` uses it; it needs `absl-py`). It runs the kernel
  on the CPU, simulating shared memory, TMA and barriers. Its jax 0.10.2 form has three gaps
  that the helpers step around, in interpret mode only: `layout_cast` and
  `broadcasted_iota(layout=...)` have no CPU rule (layouts mean nothing there: the helpers
  leave them out), and `wgmma` takes no transposed operand (`matmul` reads the operands and
  multiplies them with `jax.lax.dot_general` instead: the same products of the same
  input-dtype values, accumulated in float32). Everything else (TMA, barriers, shared memory,
  the loop) is the kernel's own.

The matmul is Hopper's wgmma: operands in shared memory in the input dtype, bfloat16 or float16,
float32 accumulation (a float32 operand would be tf32 and the lowering takes no transposed
one: the kernels refuse float32 when compiled, and interpret it). Interpret mode
accepts more than the compiler, so every kernel is also compiled for sm_90a in the tests.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

# The rows of one wgmma (a warpgroup's M tile): chunk sizes and value tiles are multiples of it.
WGMMA_ROWS = 64
# Shared memory a block may ask for on Hopper (227 KiB, cudaDevAttrMaxSharedMemoryPerBlockOptin).
SMEM_BYTES_H100 = 227 * 2**10
_SWIZZLE = 128  # bytes: the widest swizzle, for operands whose rows span at least 128 bytes


def interpret_params():
    """The Mosaic GPU interpreter's parameters (a private module in jax 0.10 to 0.12)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def kernel(body, *, out_type, scratch_types, rows: int, tiles: int, interpret: bool, name: str):
    """`body(*inputs, *outputs, *scratch)` as a Mosaic GPU kernel over a grid of `rows` (batch
    rows · heads) by `tiles` (value tiles) blocks, one warpgroup each (`block_position`),
    interpreted on any backend with `interpret`."""
    body.__name__ = name
    return plgpu.kernel(
        body,
        out_type=out_type,
        scratch_types=scratch_types,
        grid=(rows, tiles),
        grid_names=("row", "tile"),
        interpret=interpret_params() if interpret else None,
    )


def block_position(H: int, V: int):
    """`(b, h, tile, tile_slice)`: this block's batch row, head, value tile and the slice of the
    value channels it holds (`kernel`'s grid; V channels a tile)."""
    r, tile = jax.lax.axis_index("row"), jax.lax.axis_index("tile")
    return jax.lax.div(r, H), jax.lax.rem(r, H), tile, pl.ds(tile * V, V)


def walk(
    step,
    n: int,
    state_in,
    state_out,
    f32_s,
    bar,
    *,
    reverse: bool,
    interpret: bool,
    inputs=None,
    input_bars=None,
):
    """`S = step(j, S)` over chunks j = 0 … n−1 (n−1 … 0 with `reverse`), the float32 state
    (or its cotangent) in registers, brought in from `state_in` and sent to `state_out` (global
    `[M, V]` slices) through the shared float32 buffer `f32_s`.

    With `inputs(j, slot)` (the `(global, shared)` copies of chunk j's inputs into the buffers'
    stage `slot` of 2: `smem(..., stages=2)`), the walk is a two-stage pipeline: chunk j + 1's
    copies are issued before chunk j's work and awaited on `input_bars.at[slot]`
    (`barrier(len(copies), stages=2)`), so TMA brings the next chunk while this one computes;
    `step(j, slot, S)` then reads stage `slot`."""
    load([(state_in, f32_s)], bar)

    def chunk(i):
        return n - 1 - i if reverse else i

    def issue(i, slot):
        for src, dst in inputs(chunk(i), slot):
            plgpu.copy_gmem_to_smem(src, dst, input_bars.at[slot])

    def body(i, S):
        if inputs is None:
            return step(chunk(i), S)
        slot = jax.lax.rem(i, 2)

        @pl.when(i + 1 < n)
        def _():
            issue(i + 1, 1 - slot)

        plgpu.barrier_wait(input_bars.at[slot])
        return step(chunk(i), slot, S)

    if inputs is not None:
        issue(0, 0)
    S = jax.lax.fori_loop(0, n, body, read(f32_s, interpret=interpret))
    drain()
    f32_s[...] = S
    store([(f32_s, state_out)])
    drain()


def ds(start, size):
    """The slice [start, start + size) of a ref's axis (a TMA copy's window)."""
    return pl.ds(start, size)


def smem(shape, dtype, stages: int | None = None):
    """A shared-memory buffer (`stages` of them, `[stages, *shape]`, for a pipeline: `walk`);
    2-D buffers are tiled and swizzled as wgmma and TMA read them."""
    full = shape if stages is None else (stages, *shape)
    if len(shape) == 2:
        columns = _SWIZZLE // jnp.dtype(dtype).itemsize
        transforms = (plgpu.TilingTransform((8, columns)), plgpu.SwizzleTransform(_SWIZZLE))
        return plgpu.SMEM(full, dtype, transforms=transforms)
    return plgpu.SMEM(full, dtype)


def barrier(num_arrivals: int, stages: int | None = None):
    """A barrier that `num_arrivals` TMA copies arrive on (one `load` of as many arrays); with
    `stages`, one per pipeline stage (`walk`)."""
    if stages is None:
        return plgpu.Barrier(num_arrivals=num_arrivals)
    return plgpu.Barrier(num_arrivals=num_arrivals, num_barriers=stages)


def smem_bytes(buffers) -> int:
    """Bytes of shared-memory buffers made by `smem`."""
    return sum(jnp.dtype(b.dtype).itemsize * math.prod(b.shape) for b in buffers)


def check_smem(scratch, which: str, C: int, M: int, dtype, *, what: str, tile: int):
    """Raise a `ValueError` naming `what` (the entry point) before compiling where a kernel's
    shared buffers (`scratch`, made by `smem`) exceed an H100's: the compiler would refuse them.
    16-bit inputs only: float32 runs only interpreted, where shared memory has no such limit."""
    if jnp.dtype(dtype).itemsize != 2:
        return
    need = smem_bytes(scratch) // 1024
    limit = SMEM_BYTES_H100 // 1024
    if need > limit:
        raise ValueError(
            f"{what} on GPU: the {which} kernel at chunk_size {C}, key head dim {M} (padded to "
            f"{tile}s) and {jnp.dtype(dtype).name} inputs needs {need} KiB of shared memory, "
            f"over the H100's {limit} KiB; use chunk_size 64, key head dims up to 128 and "
            '16-bit inputs, or method="chunk"'
        )


def load(pairs, bar):
    """TMA copies of global-memory slices into shared buffers (`(src, dst)` pairs), awaited on
    `bar` (made with `barrier(len(pairs))`)."""
    for src, dst in pairs:
        plgpu.copy_gmem_to_smem(src, dst, bar)
    plgpu.barrier_wait(bar)


def store(pairs):
    """Make the threads' shared-memory writes visible to TMA, then copy `(src, dst)` shared
    buffers to global memory; `drain()` awaits them before the buffers are written again."""
    plgpu.commit_smem()
    for src, dst in pairs:
        plgpu.copy_smem_to_gmem(src, dst)


def drain():
    plgpu.wait_smem_to_gmem(0)


def publish():
    """Make the threads' shared-memory writes visible to the tensor cores (before a wgmma)."""
    plgpu.commit_smem()


def matmul(a_ref, b_ref, *, trans_a=False, trans_b=False, init=None, interpret: bool):
    """`init + a @ b` in float32 from two shared buffers (either read transposed), by wgmma.

    `init` (a float32 `[m, n]` array or None for zeros) is the accumulator's start."""
    if interpret:
        contract = ((0 if trans_a else 1,), (1 if trans_b else 0,))
        out = jax.lax.dot_general(
            a_ref[...],
            b_ref[...],
            (contract, ((), ())),
            precision=jax.lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32,
        )
        return out if init is None else init + out
    a = plgpu.transpose_ref(a_ref, (1, 0)) if trans_a else a_ref
    b = plgpu.transpose_ref(b_ref, (1, 0)) if trans_b else b_ref
    m = a.shape[0]
    n = b.shape[1]

    def run(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        return acc_ref[...]

    if init is None:
        return pl.run_scoped(run, plgpu.ACC((m, n), jnp.float32))

    def accumulate(acc_ref):
        plgpu.wgmma(acc_ref, a, b)

    return pl.run_state(accumulate)(plgpu.ACC.init(init))


def read(ref, *, interpret: bool):
    """A 2-D shared buffer as an array in wgmma's accumulator layout (elementwise work beside
    wgmma results)."""
    return _cast(ref[...], plgpu.Layout.WGMMA, interpret)


def read_rows(ref, *, interpret: bool):
    """A `[n]` shared vector laid out to broadcast along the rows of an `[n, ·]` wgmma array
    (one number per row)."""
    return _cast(ref[...], plgpu.Layout.WGMMA.reduce(1), interpret)


def read_columns(ref, *, interpret: bool):
    """A `[n]` shared vector laid out to broadcast along the columns of a `[·, n]` wgmma array
    (one number per column)."""
    return _cast(ref[...], plgpu.Layout.WGMMA.reduce(0), interpret)


def per_row(x_n, shape):
    """`[n]` -> `[n, m]`: one number per row."""
    return jax.lax.broadcast_in_dim(x_n, shape, (0,))


def per_column(x_n, shape):
    """`[n]` -> `[m, n]`: one number per column."""
    return jax.lax.broadcast_in_dim(x_n, shape, (1,))


def iota(shape, dimension: int, *, interpret: bool):
    """int32 indices along `dimension`, in wgmma's accumulator layout."""
    if interpret:
        return jax.lax.broadcasted_iota(jnp.int32, shape, dimension)
    return plgpu.broadcasted_iota(jnp.int32, shape, dimension, layout=plgpu.Layout.WGMMA)


def _cast(x, layout, interpret):
    return x if interpret else plgpu.layout_cast(x, layout)
