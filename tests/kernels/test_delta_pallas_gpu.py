"""The delta rule's Mosaic GPU (Hopper) walk (`delta/pallas_gpu.py`), run by
`delta_rule(method="pallas")` under `pallas_interpret("gpu")` in Mosaic GPU's interpret mode on
the CPU: outputs, final states and every input's gradient against the float64 recurrence
(`reference.kda_loop`, gradients by central differences) and against `method="chunk"`, with
grouped value heads and an initial state; bfloat16 inputs; its errors; and its kernels compiled
for an H100 (sm_90a) through the CUDA plugin, without a GPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention import kernels as K
from tests.kernels.reference import delta_product_loop, rel_err
from tests.kernels.test_pallas import (
    _delta_inputs,
    _delta_outputs_and_grads,
    _family_inputs,
    _family_losses,
    _family_outputs_and_grads,
    _finite_difference_grads,
    _segments,
    check_delta_pallas_against_references,
)
from tests.kernels.test_pallas_gpu import CHUNK, _h100, needs_cuda

# (decay, T, document starts, strong): Gated DeltaNet over two chunks (T not a multiple of the
# chunk) with resets mid-chunk and on the chunk boundary and −30 on one token of one head; KDA
# the same, −30 on one key channel throughout (`_delta_inputs`); under `-m slow` DeltaNet with
# a reset mid-chunk, and T = 1.
CASES = [
    ("per_token", 100, (20, 64), True),
    ("per_key", 100, (20, 64), False),
    pytest.param("none", 37, (5,), False, marks=pytest.mark.slow),
    pytest.param("per_token", 1, (), False, marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("decay", "T", "starts", "strong"), CASES)
def test_gpu_walk_matches_float64_recurrence_and_chunk(decay, T, starts, strong):
    args = _delta_inputs(T, decay)
    if strong:
        args[4] = args[4].at[0, T // 3, 1].set(-30.0)
    check_delta_pallas_against_references("gpu", args, starts, CHUNK)


def test_gpu_walk_bfloat16_inputs_match_chunk():
    """bfloat16 q, k, v, β in (KDA), bfloat16 out, float32 state: as close to `chunk` as bfloat16
    operands allow (U, W and the decayed q and k enter the walk's matmuls as bfloat16, the
    state and X = U − W S as bfloat16 operands too, as in flash-linear-attention's kernels)."""
    q, k, v, beta, a, s0 = _delta_inputs(70, "per_key", seed=4)
    q, k, v, beta = (x.astype(jnp.bfloat16) for x in (q, k, v, beta))
    seg = _segments(70, (9,))
    run = functools.partial(_delta_outputs_and_grads, chunk_size=CHUNK)
    with K.pallas_interpret("gpu"):
        (o, s), grads = run(q, k, v, beta, a, s0, seg, method="pallas")
    (o_c, s_c), grads_c = run(q, k, v, beta, a, s0, seg, method="chunk")
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    assert rel_err(o, o_c) < 2e-2, rel_err(o, o_c)
    assert rel_err(s, s_c) < 2e-2, rel_err(s, s_c)
    for g, g_c in zip(grads, grads_c, strict=True):
        assert g.dtype == g_c.dtype
        assert rel_err(g, g_c) < 3e-2, rel_err(g, g_c)


@pytest.mark.slow
def test_gpu_walk_has_no_races(monkeypatch):
    """Mosaic GPU's interpreter with race detection on the forward kernel (keeping each chunk's
    state) and the backward kernel of the delta walk over three chunks: no race found."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    from linear_attention.kernels.primitives import mosaic_gpu

    monkeypatch.setattr(
        mosaic_gpu, "interpret_params", lambda: InterpretGPUParams(detect_races=True)
    )
    q, k, v, beta, a, _ = _delta_inputs(130, "per_token")

    def loss(q, k, v, beta, a):
        o = K.delta_rule(q, k, v, beta, log_decay=a, method="pallas", chunk_size=CHUNK)
        return jnp.sum(jnp.sin(o))

    with K.pallas_interpret("gpu"):
        grads = jax.jit(jax.grad(loss, (0, 1, 2, 3, 4)))(q, k, v, beta, a)
    jax.block_until_ready(grads)
    assert not interpret_pallas_call.get_races().races_found


def test_gpu_walk_refuses_what_it_cannot_run():
    """A chunk that is not whole wgmma row tiles, and shared memory past an H100's (shapes
    only), raise before any work, naming the way out."""
    q, k, v, beta, a, _ = _delta_inputs(5, "per_token")
    with K.pallas_interpret("gpu"):
        with pytest.raises(ValueError, match="multiple of 64.*got 32"):
            K.delta_rule(q, k, v, beta, log_decay=a, method="pallas", chunk_size=32)
        big = jax.ShapeDtypeStruct((1, 128, 2, 256), jnp.bfloat16)
        beta_s = jax.ShapeDtypeStruct((1, 128, 2), jnp.float32)

        def forward(q, k, v, beta):
            return K.delta_rule(q, k, v, beta, method="pallas", chunk_size=CHUNK)

        message = 'delta_rule.*forward kernel.*key head dim 256.*"chunk"'
        with pytest.raises(ValueError, match=message):
            jax.eval_shape(forward, big, big, big, beta_s)


# ---- compiled for an H100 without a GPU ----


def compile_delta_for_h100(B, T, H, Kd, *, decay, dtype=jnp.bfloat16):
    """The forward and the gradient of `delta_rule(method="pallas")` lowered under
    `pallas_lowering("gpu")` and compiled for sm_90a: `{name: (stablehlo text, compiled)}`."""
    sharding = _h100()

    def spec(shape, dt=dtype):
        return jax.ShapeDtypeStruct(shape, dt, sharding=sharding)

    a = {
        "none": None,
        "per_token": spec((B, T, H), jnp.float32),
        "per_key": spec((B, T, H, Kd), jnp.float32),
    }[decay]

    def forward(q, k, v, beta, a):
        return K.delta_rule(q, k, v, beta, log_decay=a, method="pallas", chunk_size=CHUNK)

    def grads(q, k, v, beta, a):
        loss = lambda *x: jnp.sum(forward(*x).astype(jnp.float32) ** 2)  # noqa: E731
        argnums = (0, 1, 2, 3) if a is None else (0, 1, 2, 3, 4)
        return jax.grad(loss, argnums=argnums)(q, k, v, beta, a)

    out = {}
    x = spec((B, T, H, Kd))
    for name, fn in (("forward", forward), ("gradient", grads)):
        with K.pallas_lowering("gpu"):
            traced = jax.jit(fn).trace(x, x, x, spec((B, T, H), jnp.float32), a)
        lowered = traced.lower(lowering_platforms=("cuda",))
        out[name] = (lowered.as_text(), lowered.compile())
    return out


def _check_compiled(out):
    for name, (text, compiled) in out.items():
        calls = text.count("@mosaic_gpu")
        assert calls >= (1 if name == "forward" else 2), (name, calls)
        assert compiled.memory_analysis() is not None


@needs_cuda
@pytest.mark.slow  # 17 to 27 s here on a loaded machine: the CUDA plugin's compile, not T
def test_gpu_walk_compiles_for_h100():
    """Gated DeltaNet at K = V = 128 (the shared memory of the realistic shape; T = 128, one
    head, to keep the compile short): the forward and the gradient hold the Mosaic GPU custom
    calls (the walk, not an XLA fallback) and compile for sm_90a within the H100's shared
    memory."""
    _check_compiled(compile_delta_for_h100(1, 128, 1, 128, decay="per_token"))


@needs_cuda
@pytest.mark.slow
@pytest.mark.parametrize("decay", ["none", "per_token", "per_key"])
def test_gpu_walk_compiles_for_h100_at_4k(decay):
    """DeltaNet, Gated DeltaNet and KDA at B=1, T=4096, H=4, K=V=128, bfloat16."""
    _check_compiled(compile_delta_for_h100(1, 4096, 4, 128, decay=decay))


@pytest.mark.slow
def test_gpu_walk_runs_delta_product_against_float64_and_chunk():
    """Gated DeltaProduct (two Householder steps a token: T·n sub-tokens of the delta rule's
    walk, over two 64-sub-token chunks, a reset mid-chunk, an initial state)."""
    args = _family_inputs("product", 40)
    seg = _segments(40, (8,))
    run = functools.partial(_family_outputs_and_grads, family="product", chunk_size=CHUNK)
    with K.pallas_interpret("gpu"):
        (o, s), grads = run(args, seg, method="pallas")
    (o_c, s_c), grads_c = run(args, seg, method="chunk")
    seg_np = np.asarray(seg)
    ref = delta_product_loop(*args, segment_ids=seg_np)
    for name, x, x_c, r in zip(("o", "S"), (o, s), (o_c, s_c), ref, strict=True):
        assert rel_err(x, r) < 1e-4, (name, rel_err(x, r))
        assert rel_err(x, x_c) < 1e-4, (name, rel_err(x, x_c))
    losses = functools.partial(_family_losses, "product", seg_np)
    ref_grads = _finite_difference_grads(args, None, seg_np, losses=losses)
    for i, (g, g_c, r) in enumerate(zip(grads, grads_c, ref_grads, strict=True)):
        assert rel_err(g, r) < 1e-4, (i, rel_err(g, r))
        assert rel_err(g, g_c) < 1e-4, (i, rel_err(g, g_c))
