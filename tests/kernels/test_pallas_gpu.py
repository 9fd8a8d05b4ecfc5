"""The Mosaic GPU (Hopper) kernel of causal linear attention (`linear/pallas_gpu.py`), run by
`method="pallas"` under `pallas_interpret("gpu")` in Mosaic GPU's interpret mode on the CPU:
outputs, final states and every input's gradient against the float64 recurrence (gradients by
central differences) and against `method="chunk"`; the dispatch modes and their errors; and the
kernel compiled for an H100 (sm_90a) through the CUDA plugin, without a GPU."""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention import kernels as K
from linear_attention.training import gpu_target
from tests.kernels.reference import rel_err
from tests.kernels.test_pallas import (
    _inputs,
    _outputs_and_grads,
    _segments,
    check_pallas_against_references,
)

CHUNK = 64  # the GPU kernel's chunk: whole wgmma row tiles

# (decay, normalize, T, document starts, strong): T = 1; T not a multiple of the chunk; resets
# mid-chunk and on the chunk boundary; −30 on one token of one head; both normalisations.
# (T = 1 and the unnormalised per-token case under -m slow: ~50 s of interpretation between
# them; the default run keeps both normalisations, resets and a length off the chunk)
SLOW = pytest.mark.slow
CASES = [
    ("none", True, 37, (), False),
    ("per_head", False, 37, (), False),
    pytest.param("per_token", True, 1, (), False, marks=SLOW),
    pytest.param("per_token", False, 100, (20, 64), True, marks=SLOW),
    ("per_token", True, 100, (20, 64), True),
    ("per_key", True, 100, (20, 64), True),
    ("per_key", False, 70, (), False),
]


@pytest.mark.parametrize(("decay", "normalize", "T", "starts", "strong"), CASES)
def test_gpu_kernel_matches_float64_recurrence_and_chunk(decay, normalize, T, starts, strong):
    args = _inputs(T, decay)
    if strong and decay == "per_token":  # (per_key: −30 on one channel throughout)
        args[3] = args[3].at[0, T // 3, 1].set(-30.0)
    seg = _segments(T, starts) if starts else None
    check_pallas_against_references("gpu", args, seg, normalize, CHUNK)


def test_gpu_kernel_bfloat16_matches_chunk():
    """bfloat16 in and out, float32 states: as close to `chunk` as bfloat16 operands allow."""
    args = _inputs(37, "per_token", seed=1)
    args = [x.astype(jnp.bfloat16) if i < 3 else x for i, x in enumerate(args)]
    config = dict(normalize=True, chunk_size=CHUNK)
    with K.pallas_interpret("gpu"):
        (o, kv, z), grads = _outputs_and_grads(*args, None, method="pallas", **config)
    (o_c, kv_c, z_c), grads_c = _outputs_and_grads(*args, None, method="chunk", **config)
    assert o.dtype == jnp.bfloat16 and kv.dtype == jnp.float32 and z.dtype == jnp.float32
    assert rel_err(o, o_c) < 1e-2
    # the decayed keys k ⊙ end enter the state's matmul as bfloat16 operands (wgmma's)
    assert rel_err(kv, kv_c) < 4e-3 and rel_err(z, z_c) < 2e-3
    for g, g_c in zip(grads, grads_c, strict=True):
        assert g.dtype == g_c.dtype
        assert rel_err(g, g_c) < 2e-2


@pytest.mark.slow  # (~25 s each: the interpreter's race detection)
@pytest.mark.parametrize("decay", ["per_token", "per_key"])
def test_gpu_kernels_have_no_races(monkeypatch, decay):
    """Mosaic GPU's interpreter with race detection on the forward kernel (keeping each chunk's
    state) and the backward kernel over three chunks: no race found, and every barrier is
    awaited before it completes again (a `load` without its wait fails here). The interpreter
    of jax 0.10.2 does not flag a shared buffer rewritten before its copy out was awaited (a
    `drain` left out passed), so those stay the compiled kernel's to get right."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    from linear_attention.kernels.primitives import mosaic_gpu

    monkeypatch.setattr(
        mosaic_gpu, "interpret_params", lambda: InterpretGPUParams(detect_races=True)
    )
    q, k, v, a, _, _ = _inputs(130, decay)

    def loss(q, k, v, a):
        o = K.causal_linear_attention(q, k, v, log_decay=a, method="pallas", chunk_size=CHUNK)
        return jnp.sum(jnp.sin(o))

    with K.pallas_interpret("gpu"):
        grads = jax.jit(jax.grad(loss, (0, 1, 2, 3)))(q, k, v, a)
    jax.block_until_ready(grads)
    assert not interpret_pallas_call.get_races().races_found


def test_modes_dispatch_and_refuse():
    q, k, v, a, _, _ = _inputs(5, "per_token")
    with pytest.raises(ValueError, match="backend must be one of 'tpu', 'gpu', got 'cuda'"):
        with K.pallas_interpret("cuda"):
            pass
    with pytest.raises(ValueError, match="backend must be one of"):
        K.pallas_lowering("mosaic").__enter__()
    with K.pallas_interpret("gpu"):
        with pytest.raises(ValueError, match="multiple of 64.*got 32"):
            K.causal_linear_attention(q, k, v, method="pallas", chunk_size=32)
        with pytest.raises(ValueError, match='no Pallas GPU kernel.*method="chunk"'):
            K.dplr_delta_rule(q, k, v, -k, k, method="pallas", chunk_size=16)
        # shared memory past an H100's is refused before compiling (shapes only: eval_shape)
        big = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)

        def loss(q, k, v):
            return jnp.sum(K.causal_linear_attention(q, k, v, method="pallas", chunk_size=128))

        with pytest.raises(ValueError, match="forward kernel at chunk_size 128.*293 KiB"):
            jax.eval_shape(loss, big, big, big)  # two stages of 128-token chunks
    # interpret() keeps today's meaning: the TPU kernel (chunk 16 is fine there)
    with K.pallas_interpret():
        o_tpu = K.causal_linear_attention(q, k, v, log_decay=a, method="pallas", chunk_size=16)
    with K.pallas_interpret("tpu"):
        o_tpu2 = K.causal_linear_attention(q, k, v, log_decay=a, method="pallas", chunk_size=16)
    o_c = K.causal_linear_attention(q, k, v, log_decay=a, method="chunk")
    assert rel_err(o_tpu, o_c) < 1e-4 and rel_err(o_tpu2, o_c) < 1e-4


# ---- compiled for an H100 without a GPU ----

MISSING = gpu_target.cuda_missing()
needs_cuda = pytest.mark.skipif(MISSING is not None, reason=f"compiling for GPU: {MISSING}")


def _h100():
    target = gpu_target.match_gpu("gpu:h100:1")
    return jax.sharding.SingleDeviceSharding(gpu_target.topology_devices(target)[0])


def compile_for_h100(B, T, H, Mc, *, decay="per_token", normalize=False, dtype=jnp.bfloat16):
    """The forward and the gradient of `method="pallas"` lowered under `pallas_lowering("gpu")`
    and compiled for sm_90a: `{name: (stablehlo text, compiled, seconds)}`."""
    sharding = _h100()

    def spec(shape, dt=dtype):
        return jax.ShapeDtypeStruct(shape, dt, sharding=sharding)

    a = {
        "none": None,
        "per_token": spec((B, T, H), jnp.float32),
        "per_key": spec((B, T, H, Mc), jnp.float32),
    }[decay]

    def forward(q, k, v, a):
        return K.causal_linear_attention(
            q, k, v, log_decay=a, normalize=normalize, method="pallas", chunk_size=CHUNK
        )

    def grads(q, k, v, a):
        loss = lambda *x: jnp.sum(forward(*x).astype(jnp.float32) ** 2)  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2) if a is None else (0, 1, 2, 3))(q, k, v, a)

    out = {}
    for name, fn in (("forward", forward), ("gradient", grads)):
        start = time.perf_counter()
        with K.pallas_lowering("gpu"):
            traced = jax.jit(fn).trace(
                spec((B, T, H, Mc)), spec((B, T, H, Mc)), spec((B, T, H, Mc)), a
            )
        lowered = traced.lower(lowering_platforms=("cuda",))
        text = lowered.as_text()
        compiled = lowered.compile()
        out[name] = (text, compiled, time.perf_counter() - start)
    return out


@needs_cuda
@pytest.mark.parametrize("decay", [pytest.param("per_token", marks=pytest.mark.slow), "per_key"])
def test_gpu_kernel_compiles_for_h100(decay):
    """B=1, T=4096, H=4, K=V=128, bfloat16, a decay per token or per key channel: the forward
    and the gradient hold the Mosaic GPU custom calls (the kernels, not an XLA fallback) and
    compile for sm_90a within the H100's shared memory."""
    for name, (text, compiled, _) in compile_for_h100(1, 4096, 4, 128, decay=decay).items():
        calls = text.count("mosaic_gpu")
        assert calls >= (1 if name == "forward" else 2), (name, calls)
        assert compiled.memory_analysis() is not None


@needs_cuda
@pytest.mark.slow
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("decay", ["none", "per_token", "per_key"])
def test_gpu_kernel_compiles_for_h100_long(normalize, decay):
    """T = 16384, both normalisations, every decay kind."""
    for name, (text, compiled, _) in compile_for_h100(
        1, 16384, 4, 128, decay=decay, normalize=normalize
    ).items():
        assert "mosaic_gpu" in text, name
        assert compiled.memory_analysis() is not None


@needs_cuda
def test_gpu_kernel_refuses_float32_when_compiled():
    """The compiled kernel takes 16-bit operands (wgmma's): float32 inputs, and a time split
    (`axis_name`: each shard's call computes in float32), raise before lowering, naming
    method="chunk"; interpreted, float32 runs (the cases above)."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    sharding = _h100()
    x32 = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.float32, sharding=sharding)

    def forward(q, k, v, axis_name=None):
        return K.causal_linear_attention(
            q, k, v, method="pallas", chunk_size=CHUNK, axis_name=axis_name
        )

    with K.pallas_lowering("gpu"), pytest.raises(ValueError, match='got float32.*"chunk"'):
        jax.jit(forward).trace(x32, x32, x32)
    mesh = Mesh(
        np.asarray(gpu_target.topology_devices(gpu_target.match_gpu("gpu:h100:2"))), ("seq",)
    )
    split = jax.shard_map(
        functools.partial(forward, axis_name="seq"),
        mesh=mesh,
        in_specs=(P(None, "seq"),) * 3,
        out_specs=P(None, "seq"),
        check_vma=False,
    )
    bf16 = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)
    with K.pallas_lowering("gpu"), pytest.raises(ValueError, match="with axis_name"):
        jax.jit(split).trace(bf16, bf16, bf16)
