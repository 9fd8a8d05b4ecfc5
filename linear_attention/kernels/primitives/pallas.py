"""Shared parts of the Pallas kernels (`method="pallas"`): where they run, and their block specs.

The kernels are written for TPUs (Mosaic), and some for Hopper GPUs (Mosaic GPU). Where they run
is read when a kernel is traced:

- on a TPU backend, the Mosaic kernel; on a GPU backend, the Mosaic GPU (Hopper) kernel where
  one exists (`mosaic_gpu.py`, `linear/pallas_gpu.py`, `delta/pallas_gpu.py`: `GPU_KERNELS`),
  an error elsewhere;
- inside `pallas_interpret()` (or `pallas_interpret("tpu")`), the TPU kernel in Pallas's
  interpret mode on any backend (the tests run it on the CPU: the same block walk, the same
  arithmetic); inside `pallas_interpret("gpu")`, the GPU kernel in Mosaic GPU's interpret mode;
- inside `pallas_lowering("tpu")` (alias `pallas_mosaic()`) or `pallas_lowering("gpu")`, that
  backend's kernel whatever the default backend: for compiling ahead of time for a TPU or GPU
  topology from another machine
  (`jax.jit(f).trace(...).lower(lowering_platforms=("tpu",))` or `("cuda",)`, as the compile
  tests and `experiments/pallas_compile.py` do);
- elsewhere, `pallas_target` raises a `ValueError`: there is no silent fallback to another
  method, and a kernel with no form for the chosen backend raises naming what has one.

The mode is read at trace time, so a function jitted inside one of the context managers keeps the
kernel it was traced with (JAX's jit cache does not see the mode). Inside `jax.shard_map` the
Mosaic kernels' operands and results are typed as varying over the mesh (`vary_together`,
`result_struct`); the interpreter does not type its kernel body's constants so, and needs
`check_vma=False` there. Over several devices without `shard_map`, XLA cannot partition a
Mosaic kernel (the trainer runs such a model in `shard_map`).

What has a Pallas form: `causal_linear_attention` (`linear/pallas.py`: the whole chunk kernel,
every decay kind, in two kernels, forward and backward), and the delta family (`delta_rule`,
`dplr_delta_rule`, `delta_product`): the forward pass of `delta_rule`, `delta_product`
(through it) and `dplr_delta_rule` is one kernel, the UT transform inside it
(`delta/pallas.py`: block forward substitution over 16-row sub-blocks); so is each backward
pass (the UT transform made again and its pullback, the transposed solve by block back
substitution, inside it), the pair joined by `pallas_chunk_scan.py`. On GPU (Mosaic GPU,
Hopper): `causal_linear_attention` (`linear/pallas_gpu.py`, `linear/pallas_gpu_key.py`), and
`delta_rule` and `delta_product` (through it), the UT transform from XLA and the chunk walk in
two kernels (`delta/pallas_gpu.py`); DPLR has no GPU kernel.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from linear_attention.kernels.primitives.combine import varying_axes

# Chunk sizes of the Pallas kernels are multiples of this: bfloat16 blocks tile by 16 rows, and
# the sub-blocks of a decay per key channel are 16 queries.
CHUNK_MULTIPLE = 16

# The Pallas backends: "tpu" (Mosaic TPU, this file's helpers) and "gpu" (Mosaic GPU, Hopper:
# `mosaic_gpu.py`).
BACKENDS = ("tpu", "gpu")
# What has a GPU kernel (`method="pallas"` under a "gpu" mode or on a GPU backend).
GPU_KERNELS = (
    "causal_linear_attention (every decay kind), delta_rule (DeltaNet, Gated DeltaNet, KDA) and "
    "delta_product"
)

# (how, backend) set by the context managers: how is "interpret" or "lower"; None: read the
# default backend.
_MODE: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar(
    "pallas_mode", default=None
)


def _check_backend(backend) -> str:
    if backend not in BACKENDS:
        raise ValueError(
            f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}"
        )
    return backend


@contextlib.contextmanager
def _mode(how: str, backend: str):
    token = _MODE.set((how, _check_backend(backend)))
    try:
        yield
    finally:
        _MODE.reset(token)


def pallas_interpret(backend: str = "tpu"):
    """Run the Pallas kernels (`method="pallas"`) of `backend` ("tpu": Mosaic TPU, "gpu":
    Mosaic GPU) in Pallas's interpret mode on any backend.

    Example: `with K.pallas_interpret("gpu"): o = K.causal_linear_attention(q, k, v,
    method="pallas")` runs the GPU kernel on the CPU. Slow (every block is interpreted): for
    tests and debugging, not training."""
    return _mode("interpret", backend)


def pallas_lowering(backend: str):
    """Emit `backend`'s Pallas kernels ("tpu" or "gpu") whatever the default backend: for
    compiling ahead of time for that backend (`lower(lowering_platforms=("tpu",))`, or
    `("cuda",)` with a GPU topology). Running the result needs that accelerator."""
    return _mode("lower", backend)


def pallas_mosaic():
    """`pallas_lowering("tpu")`: lower the Pallas kernels for Mosaic (TPU) whatever the default
    backend."""
    return pallas_lowering("tpu")


def pallas_target(what: str) -> tuple[str, bool]:
    """`(backend, interpret)`: which Pallas kernels `method="pallas"` runs here ("tpu" or "gpu")
    and whether interpreted; raise a `ValueError` naming `what` when none applies (a CPU
    backend and no context manager)."""
    mode = _MODE.get()
    if mode is not None:
        return mode[1], mode[0] == "interpret"
    backend = jax.default_backend()
    if backend in ("gpu", "cuda"):
        return "gpu", False
    if backend != "tpu":
        raise ValueError(
            f"{what}: the Pallas kernels target TPU (Mosaic) and NVIDIA Hopper GPUs (Mosaic "
            f"GPU), and the default backend is {backend!r}. Run on a TPU or GPU, or inside "
            'linear_attention.kernels.pallas_interpret() (or pallas_interpret("gpu")) to run '
            "the same kernels in Pallas interpret mode on any backend (slow: for tests), "
            'or use method="chunk"'
        )
    return "tpu", False


def check_pallas_backend(what: str) -> bool:
    """For the kernels with only a TPU form: whether they run interpreted (True) or as Mosaic
    kernels (False); raise a `ValueError` naming `what` where they cannot run (no TPU backend
    and no TPU context manager, or the GPU kernels asked for)."""
    backend, interpret = pallas_target(what)
    if backend == "gpu":
        raise ValueError(
            f"{what}: this has no Pallas GPU kernel (Mosaic GPU kernels exist for "
            f'{GPU_KERNELS}); on a GPU use method="chunk" (or another non-Pallas method), or '
            "run the TPU kernel interpreted inside linear_attention.kernels.pallas_interpret()"
        )
    return interpret


# Mosaic's default scoped VMEM is 16 MiB on v5e and 32 on v6e; the backward kernels of the
# delta family at K = V = 256 and chunk 128 need more on v5e (DPLR's: 21.4 MiB). 32 MiB is the
# v6e default, and within the VMEM of v4 and later chips.
BACKWARD_VMEM_BYTES = 32 * 2**20


def compiler_params(num_sequential: int = 1, vmem_limit_bytes: int | None = None):
    """Mosaic parameters for a grid of independent rows (batch × heads) followed by
    `num_sequential` axes walked in order (a state carried across chunks); `vmem_limit_bytes`
    raises the scoped VMEM limit (None: Mosaic's default for the chip)."""
    return pltpu.CompilerParams(
        dimension_semantics=("parallel",) + ("arbitrary",) * num_sequential,
        vmem_limit_bytes=vmem_limit_bytes,
    )


def cost_estimate(*, flops: int, transcendentals: int, arrays) -> pl.CostEstimate:
    """A `pl.CostEstimate` whose bytes are those of the arrays a call reads and writes (each
    read or written once), so that XLA's scheduler and `cost_analysis()` see the kernel's work."""
    nbytes = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in arrays)
    return pl.CostEstimate(
        flops=int(flops), transcendentals=int(transcendentals), bytes_accessed=nbytes
    )


def heads_per_step(H: int) -> int:
    """Heads a grid step holds: all H, or groups of 8 when H is a multiple of 8 (a block's
    second-to-last axis is whole or a multiple of 8)."""
    return 8 if H % 8 == 0 else H


class HeadBlocks:
    """Block specs for a grid `(B·H/G, chunks)` whose step holds G heads (`heads_per_step`) of
    one batch row and one chunk, reading `[B, T, H, X]` arrays as they lie in HBM.

    Mosaic takes no block that picks one head out of `[B, T, H, X]` (a block's last two axes
    are whole or (8, 128)-tiled, so the head axis cannot be squeezed); a block of all the
    step's heads `[C, G, X]` is legal, and the kernel walks its heads in turn (`per_head`).
    A row-major copy `[B·H, T, X]` for one head per step would be a transpose around each
    `pallas_call`: temporaries the size of q, k, v and the outputs, which made the Pallas form's
    temporaries exceed the chunk form's (BENCHMARKS.md)."""

    def __init__(self, B: int, H: int, N: int, reverse: bool = False):
        self.G = heads_per_step(H)
        self.groups = H // self.G
        self.rows = B * self.groups
        self.N, self.reverse = N, reverse

    def _index(self, r, j, tail, time=True):
        # r ≥ 0: lax's truncating division (`//` lowers through `sign`, absent in Mosaic)
        b, g = jax.lax.div(r, self.groups), jax.lax.rem(r, self.groups)
        j = self.N - 1 - j if self.reverse else j
        return (b, j, g, *(0,) * tail) if time else (b, g, *(0,) * tail)

    def time(self, C: int, X: int):
        """`[B, T, H, X]`: the step's chunk of its heads, a `[C, G, X]` block."""
        return pl.BlockSpec((None, C, self.G, X), lambda r, j: self._index(r, j, 1))

    def per_chunk(self, *tail: int):
        """`[B, N, H, *tail]`: the step's chunk's entry for its heads, a `[G, *tail]` block."""
        block = (None, None, self.G, *tail)
        return pl.BlockSpec(block, lambda r, j: self._index(r, j, len(tail)))

    def per_row(self, *tail: int):
        """`[B, H, *tail]` (a state): the step's heads, the same block for every chunk."""
        block = (None, self.G, *tail)
        return pl.BlockSpec(block, lambda r, j: self._index(r, j, len(tail), time=False))


class _HeadRef:
    """Head h of a block of G heads, read and written as `ref[...]`: `[C, X]` of a `[C, G, X]`
    time block (head axis 1), `[M, Dv]` of a `[G, M, Dv]` block, `[1, X]` of a `[G, X]` block
    (head axis 0)."""

    def __init__(self, ref, h: int, axis: int):
        index = [slice(None)] * len(ref.shape)
        index[axis] = h if len(ref.shape) > 2 else slice(h, h + 1)
        self.ref, self.index, self.dtype = ref, tuple(index), ref.dtype

    def __getitem__(self, key):
        _whole(key)
        return self.ref[self.index]

    def __setitem__(self, key, value):
        _whole(key)
        self.ref[self.index] = value


def _whole(key):
    if key is not Ellipsis:
        raise TypeError(f"a head's view is read and written whole (ref[...]), not ref[{key!r}]")


def per_head(body, axes, G: int):
    """A kernel running `body(*refs)` once for each of the step's G heads in turn, ref i seen
    as its head's slice along `axes[i]` (1 for `HeadBlocks.time` blocks, 0 for the others and
    for scratch buffers `[G, ...]`). Unrolled: a body per head in the compiled kernel."""

    def kernel(*refs):
        for h in range(G):
            body(*(_HeadRef(ref, h, axis) for ref, axis in zip(refs, axes, strict=True)))

    return kernel


def carry_state(s0_ref, s_ref, s_acc, keep_ref, step):
    """A walk kernel's state across its sequential chunk axis (grid axis 1): S starts from
    ``s0_ref`` at the first chunk and lives in the VMEM scratch ``s_acc``; ``keep_ref`` (or None)
    takes the state entering each chunk, for the backward pass; the last chunk writes the final
    state to ``s_ref``. ``step(S) -> S'`` is the chunk's own work."""
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _():
        s_acc[...] = s0_ref[...]

    S = s_acc[...]
    if keep_ref is not None:
        keep_ref[...] = S
    S = step(S)
    s_acc[...] = S

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        s_ref[...] = S


def mxu_dot(a, b, *, trans_a: bool = False, trans_b: bool = False):
    """a @ b in float32 on the MXU, with either operand read transposed (no transpose made)."""
    contract = ((0 if trans_a else a.ndim - 1,), (b.ndim - 1 if trans_b else 0,))
    return jax.lax.dot_general(
        a,
        b,
        (contract, ((), ())),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )


def vmem_f32(shape):
    """A float32 VMEM scratch buffer (a state carried across the chunks of a row)."""
    return pltpu.VMEM(shape, jnp.float32)


def vary_together(arrays):
    """The arrays typed as varying over every mesh axis any of them varies over, and that set.

    Inside `jax.shard_map` (sequence parallelism), a `pallas_call`'s operands and results must
    say how they vary over the mesh: a state replicated over the axis enters a kernel beside
    queries split over it."""
    axes = set()
    for x in arrays:
        axes |= set(varying_axes(x))
    out = []
    for x in arrays:
        missing = tuple(sorted(axes - set(varying_axes(x))))
        out.append(jax.lax.pcast(x, missing, to="varying") if missing else x)
    return out


def result_struct(shape, dtype, like):
    """A `pallas_call` result typed as varying over the mesh like the operand `like`."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).mat)


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple
