"""One command for an accelerator (a lent GPU, a TPU, or the CPU): are the kernels right here,
how fast are they against flash-linear-attention, and does a training step fit as sized?

    python experiments/accelerator_check.py --out runs/check              # a GPU: < 7.5 min
    python experiments/accelerator_check.py --out /tmp/c --preset tiny    # the CPU: ~3 min

The guide `docs/guides/device_check.md` gives the one command for a lent GPU (the wheels of
`device_bundle.py` installed offline, then this). The parent process only orchestrates: it reads
the machine (``nvidia-smi``, the packages' versions, the load) and runs each part in its own
process with its share of ``--budget_s``, so that a part that crashes (a segfault, a CUDA
error), hangs or runs out of memory is recorded and the others still run, and so that each
training step's measured peak memory is its own. A part past its deadline stops starting new
work; one past its share plus a grace is killed (and recorded so). The parts:

1. ``checks``: every kernel family, forward and gradient (float32, at
   ``jax.default_matmul_precision("highest")``: on GPUs XLA may otherwise run float32 matmuls in
   TF32, a precision choice, not a kernel error) and the forward on bfloat16 inputs, on the
   accelerator, against a float64 reference computed on the host CPU (`on_host_float64`: the
   reference variant's code under ``jax.enable_x64`` on the ``cpu`` device, its ``jnp.float32``
   states and sums read as float64). Linear attention: every method (``pallas`` too, where it is
   refused that is recorded as unavailable) for decays none / per head [H] / per token [B,T,H] / per
   key [B,T,H,K], an initial state and normalisation, against its quadratic form. The delta rule
   with a per-token decay (Gated DeltaNet) and a per-key decay (KDA), DPLR and DeltaProduct in
   ``chunk`` against ``scan``, and the delta rule, KDA and DeltaProduct in ``pallas`` too (bfloat16
   inputs, forward and gradient, chunks of 64: the Mosaic GPU walk on a GPU; unavailable where the
   backend has no Pallas kernel); log-linear attention and its delta rule, forgetting attention and
   PaTH in their fast form against their quadratic form; MesaNet's ``chunk`` against ``exact``;
   softmax blockwise and the sliding window against the quadratic form. At ``check_T`` tokens, not a
   multiple of the chunk.
2. ``timings``: forward + backward (the gradient of <o, do> with respect to every input) of the
   five operations FLA also has (`fla_timings.OPS`: the delta rule, gated delta rule, KDA,
   simple GLA, GLA) at T = 4K, 16K, 64K in bfloat16, B·H fixed (B 1, H 16), K = V = 128,
   chunk 64: XLA's ``chunk``, ``chunk_parallel`` (the two GLA forms; every chunk at once) and
   ``pallas`` (its error recorded where this backend has no Pallas kernel for it). Each point
   is compiled, its temporaries held to 80 % of the device's memory, then timed in interleaved
   rounds (`timing.interleaved`); median and min.
3. ``fla``: the same operations and shapes by flash-linear-attention's Triton kernels, in torch
   (`fla_timings.py`, its own process: no jax there), or why not (fla absent, no CUDA device).
4. ``train``: one training step (the loop's `train_step`: AdamW, float32 loss) of
   ``gated_deltanet_400m`` and ``transformer_340m`` at `depth` layers, each in its own process:
   the step time (median after a warm-up), tokens/s, the model FLOPs per token
   (`training.flops`), the MFU against the chip's bfloat16 peak (`PEAK_FLOPS`, or
   ``--peak_flops``), and the memory: the device's measured peak (``memory_stats()``) against
   the deviceless compile's prediction for the same shapes (`sizing.dry_run` with
   ``config.mesh.target = gpu:<chip>:1``, the chip this GPU is, or H100 off a GPU) and against
   this device's own compile (`memory_analysis()`).

Writes ``results.json`` (the machine, every part's records, status and seconds) and
``summary.md`` (a short table) into ``--out``; each part's JSON and log stay in ``parts/``.

jax from 0.10.2 to 0.12 (the lent image runs 0.11.2): the changelogs of jax and Pallas list no
removed API that the package uses, and a static check of every ``jax.*``, ``jnp.*``, ``lax.*``
and Pallas name of ``linear_attention/``, ``experiments/`` and ``configs/`` against jax 0.11.2's
and 0.12.1's modules found none missing (docs/guides/device_check.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from linear_attention import kernels as K
from linear_attention.benchmarks import machine_info
from linear_attention.benchmarks.timing import interleaved
from linear_attention.training.cli import load_config_file
from linear_attention.training.config import experiment_config
from linear_attention.training.flops import flops_per_token
from linear_attention.training.mesh import make_mesh, shard_batch
from linear_attention.training.optim import make_optimizer
from linear_attention.training.sizing import abstract_batch
from linear_attention.training.target_base import memory_parts, step_bytes
from linear_attention.training.trainer import build_model, train_step

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
DECAYS = ("none", "per_head", "per_token", "per_key")
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}  # relative to the largest reference entry
FAMILIES = (
    "delta_rule", "kda", "dplr", "delta_product", "log_linear", "log_linear_delta",
    "forgetting", "path", "mesa_net", "softmax", "sliding_window",
)  # fmt: skip
# The families whose `method="pallas"` is checked too, on bfloat16 inputs (the GPU kernels'
# wgmma operands) in chunks of 64 (wgmma's rows), "unavailable" where this backend has no Pallas
# kernel for them (the CPU).
PALLAS_FAMILIES = ("delta_rule", "kda", "delta_product")
PALLAS_CHUNK = 64
OPS = ("delta_rule", "gated_delta_rule", "kda", "simple_gla", "gla")  # as fla_timings.OPS
# the library's methods timed per op: chunk_parallel (every chunk at once) exists for linear
# attention only
OP_METHODS = ("chunk", "chunk_parallel", "pallas")
DELTA_OPS = ("delta_rule", "gated_delta_rule", "kda")
TRAIN_PRESETS = ("gated_deltanet_400m", "transformer_340m")
PARTS = ("checks", "timings", "fla", "train")
# bfloat16 dense peak FLOP/s by the device kind's words (NVIDIA's SXM datasheets), for the MFU.
PEAK_FLOPS = {"H100": 989.4e12, "H200": 989.4e12, "A100": 312e12, "B200": 2.25e15}
# A preset: the checks' length and decays, the timed shapes, the training step, the whole
# budget in seconds and each part's share of it ("train" shares its share between presets).
PRESETS = {
    "full": dict(
        check_T=300, decays=DECAYS, T=(4096, 16384, 65536), shape=dict(B=1, H=16, K=128, V=128),
        repeats=5, step=dict(depth=2, narrow=False, seq_len=None, batch=8, repeats=5),
        budget_s=400.0, shares=dict(checks=0.25, timings=0.25, fla=0.2, train=0.3),
    ),
    "tiny": dict(
        check_T=37, decays=("per_key",), T=(128,), shape=dict(B=1, H=2, K=16, V=16),
        repeats=2, step=dict(depth=1, narrow=True, seq_len=32, batch=2, repeats=2),
        budget_s=600.0, shares=dict(checks=0.5, timings=0.15, fla=0.05, train=0.3),
    ),
}  # fmt: skip
SPENT = "the part's time budget is spent"
GRACE_S = 45.0  # past its deadline a part finishes the compile or step it is in, then is killed


def rel_err(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-30))


def first_line(error: BaseException) -> str:
    text = next((line for line in str(error).splitlines() if line.strip()), "")
    return f"{type(error).__name__}: {text}"[:300]


def on_host_float64(fn, *args):
    """``fn(*args)`` computed in float64 on the host CPU; NumPy leaves. The floating arrays of
    ``args`` are cast to float64, jax's 64-bit mode is on, the ``cpu`` device is the default,
    and while ``fn`` is traced ``jnp.float32`` is float64: the kernels hold their states,
    decays and sums in ``jnp.float32`` (the library's numerics rule), which would otherwise
    make the reference float32 arithmetic."""
    cast = lambda x: np.asarray(x, np.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x  # noqa: E731
    float32 = jnp.float32
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        try:
            jnp.float32 = jnp.float64
            out = jax.jit(fn)(*jax.tree.map(cast, args))
        finally:
            jnp.float32 = float32
        return jax.tree.map(np.asarray, out)


def weighted_sum(tree):
    """A scalar of every output with fixed weights (cos of the flat index): its gradient is a
    cotangent that differs per entry."""
    return sum(
        jnp.sum(x.astype(jnp.float32) * jnp.cos(jnp.arange(x.size).reshape(x.shape)))
        for x in jax.tree.leaves(tree)
    )


def compare(got, want, **fields) -> dict:
    err = max(
        rel_err(g, r) for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    )
    ok = bool(np.isfinite(err) and err < TOLERANCE[fields["dtype"]])
    return dict(fields, rel_err=err, ok=ok)


# ---- 1. correctness against float64 references on the host ----


def run_checks(
    T: int, decay_kinds=DECAYS, chunk_size: int = 16, deadline: float = float("inf"), progress=None
) -> list[dict]:
    """Linear attention: every method and decay kind, forward (float32; bfloat16 inputs for
    chunk, chunk_parallel and pallas) and gradient (chunk, chunk_parallel, pallas), against the
    quadratic form in float64 on the host. ``progress(records)`` after each decay kind."""
    M, Dv = 8, 8
    rng = np.random.default_rng(0)
    arr = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    q, k = np.abs(arr(2, T, 2, M)) + 0.1, np.abs(arr(2, T, 2, M)) + 0.1
    v = arr(2, T, 2, Dv)
    state = K.LinearAttentionState(arr(2, 2, M, Dv), np.abs(arr(2, 2, M)) + 0.5)
    decays = {
        "none": None,
        "per_head": np.log(np.array([0.9, 0.6], np.float32)),
        "per_token": -rng.uniform(0, 1.5, (2, T, 2)).astype(np.float32),
        "per_key": -rng.uniform(0, 1.5, (2, T, 2, M)).astype(np.float32),
    }

    def f(method, q, k, v, a):
        o, final = K.causal_linear_attention(
            q, k, v, log_decay=a, method=method, chunk_size=chunk_size, initial_state=state,
            return_state=True,
        )  # fmt: skip
        return o, final.kv

    def grads(method):
        return jax.grad(lambda *x: weighted_sum(f(method, *x)), argnums=(0, 1, 2))

    out = []
    with jax.default_matmul_precision("highest"):
        for kind in decay_kinds:
            a = decays[kind]
            if time.time() > deadline:
                out.append(dict(check="forward", decay=kind, skipped=SPENT))
                continue
            try:
                ref = on_host_float64(lambda *x: f("quadratic", *x), q, k, v, a)
                ref_grads = on_host_float64(grads("quadratic"), q, k, v, a)
            except ValueError as e:  # a decay kind this version does not accept
                out.append(dict(check="forward", decay=kind, unsupported=first_line(e)))
                continue
            for method in K.METHODS + K.PALLAS_METHODS:
                low = method in ("chunk", "chunk_parallel", "pallas")
                cases = [("forward", "float32")] + [
                    ("forward", "bfloat16"),
                    ("gradient", "float32"),
                ] * low
                for check, dtype in dict.fromkeys(cases):
                    fields = dict(check=check, decay=kind, method=method, dtype=dtype)
                    x = [jnp.asarray(t, dtype) for t in (q, k, v)]
                    try:
                        if check == "forward":
                            got = jax.jit(f, static_argnums=0)(method, *x, a)
                            out.append(compare(got, ref, **fields))
                        else:
                            out.append(compare(jax.jit(grads(method))(*x, a), ref_grads, **fields))
                    except Exception as e:  # noqa: BLE001 (recorded: the check goes on)
                        key = "unavailable" if method in K.PALLAS_METHODS else "error"
                        out.append(dict(fields, **{key: first_line(e)}))
                        if key == "error":
                            out[-1]["ok"] = False
            (progress or _ignore)(out)
    return out


def _family_case(family: str, T: int, rng):
    """``(function of (variant, *arrays) -> outputs, arrays (NumPy float32), reference variant,
    checked variant, how many leading arrays are cast to bfloat16)`` of a kernel family."""
    B, H, Kd, Dv, n = 2, 2, 8, 8, 2
    arr = lambda *s: rng.normal(size=s).astype(np.float32)  # noqa: E731
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    uniform = lambda lo, hi, *s: rng.uniform(lo, hi, s).astype(np.float32)  # noqa: E731
    beta, per_token = uniform(0.1, 1.5, B, T, H), -uniform(0, 0.5, B, T, H)
    per_key = -uniform(0, 0.5, B, T, H, Kd)
    state = K.LinearAttentionState(0.3 * arr(B, H, Kd, Dv), None)
    q, k, v = arr(B, T, H, Kd), unit(arr(B, T, H, Kd)), arr(B, T, H, Dv)
    levels = uniform(0.2, 1.0, B, T, H, (T - 1).bit_length() + 1)

    def chunk(method):
        return PALLAS_CHUNK if method == "pallas" else 16

    def delta(method, q, k, v, beta, a):
        o, s = K.delta_rule(
            q, k, v, beta, log_decay=a, method=method, chunk_size=chunk(method),
            initial_state=state, return_state=True,
        )  # fmt: skip
        return o, s.kv

    def dplr(method, q, k, v, kk, beta, w):
        kk = kk / jnp.linalg.norm(kk, axis=-1, keepdims=True)
        o, s = K.dplr_delta_rule(
            q, k, v, -kk, beta[..., None] * kk, log_decay=w, method=method, chunk_size=16,
            initial_state=state, return_state=True,
        )  # fmt: skip
        return o, s.kv

    def product(method, q, k, v, beta, a):
        o, s = K.delta_product(
            q, k, v, beta, log_decay=a, method=method, chunk_size=chunk(method),
            initial_state=state, return_state=True,
        )  # fmt: skip
        return o, s.kv

    def log_linear(method, q, k, v, a, lam):
        return K.log_linear_attention(q, k, v, a, lam, method=method, chunk_size=16)

    def log_linear_delta(method, q, k, v, beta, a, lam):
        return K.log_linear_delta_rule(q, k, v, beta, a, lam, method=method, chunk_size=16)

    def forgetting(method, q, k, v, a):
        return K.forgetting_attention(q, k, v, a, method=method, block_size=16)

    def path(method, q, k, v, w, beta, a):
        return K.path_attention(q, k, v, w, beta, a, method=method, block_size=16)

    def mesa(method, q, k, v, a, beta):
        lam = jnp.ones((H, Kd), jnp.float32)
        return K.mesa_net(q, k, v, a, beta, lam, method=method, chunk_size=16, cg_steps=Kd * 4)

    def softmax(method, q, k, v):
        if method == "quadratic":
            return K.softmax_attention(q, k, v, causal=True)
        return K.blockwise_softmax_attention(q, k, v, causal=True, block_size=16)

    window = 7

    def sliding(method, q, k, v):
        if method == "quadratic":  # causal softmax over the band j in (i - window, i]
            s = jnp.einsum("bihd,bjhd->bhij", q, k) / np.sqrt(q.shape[-1])
            i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
            s = jnp.where((j <= i) & (j > i - window), s, -jnp.inf)
            return jnp.einsum("bhij,bjhd->bihd", jax.nn.softmax(s, axis=-1), v)
        return K.sliding_window_attention(q, k, v, window=window, block_size=16)

    match family:
        case "delta_rule":
            return delta, (q, k, v, beta, per_token), "scan", "chunk", 3
        case "kda":
            return delta, (q, k, v, beta, per_key), "scan", "chunk", 3
        case "dplr":
            return dplr, (q, 0.5 * k, v, arr(B, T, H, Kd), beta, per_key), "scan", "chunk", 4
        case "delta_product":
            ks, betas = unit(arr(B, T, H, n, Kd)), uniform(0.1, 1.5, B, T, H, n)
            return product, (q, ks, arr(B, T, H, n, Dv), betas, per_token), "scan", "chunk", 3
        case "log_linear":
            return log_linear, (q, k, v, per_token, levels), "quadratic", "chunk", 3
        case "log_linear_delta":
            args = (q, k, v, beta, per_token, levels)
            return log_linear_delta, args, "quadratic", "chunk", 3
        case "forgetting":
            return forgetting, (q, k, v, per_token), "quadratic", "chunk", 3
        case "path":
            args = (q, k, v, unit(arr(B, T, H, Kd)), uniform(0.1, 1.9, B, T, H), per_token)
            return path, args, "quadratic", "chunk", 3
        case "mesa_net":
            return mesa, (q, k, v, per_token, uniform(0.1, 1.0, B, T, H)), "exact", "chunk", 3
        case "softmax":
            return softmax, (q, k, v), "quadratic", "blockwise", 3
        case "sliding_window":
            return sliding, (q, k, v), "quadratic", "blockwise", 3
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")


def run_family_checks(
    T: int, families=FAMILIES, deadline: float = float("inf"), progress=None
) -> list[dict]:
    """For each family: its checked variant on the accelerator, forward and gradient in float32
    and forward on bfloat16 inputs, against its reference variant in float64 on the host.
    ``progress(records)`` after each family."""
    rng = np.random.default_rng(1)
    out = []
    with jax.default_matmul_precision("highest"):
        for family in families:
            case = _family_case(family, T, rng)
            if time.time() > deadline:
                out.append(dict(family=family, check="forward", skipped=SPENT))
                continue
            out += _check_family(family, *case)
            (progress or _ignore)(out)
    return out


def _check_family(family, f, args, ref_variant, variant, n_cast) -> list[dict]:
    argnums = tuple(range(len(args)))

    def grad(name):
        return jax.grad(lambda *x: weighted_sum(f(name, *x)), argnums)

    base = dict(family=family, method=variant, reference=f"{ref_variant} (float64, host)")
    try:
        ref = on_host_float64(lambda *x: f(ref_variant, *x), *args)
        ref_grads = on_host_float64(grad(ref_variant), *args)
    except Exception as e:  # noqa: BLE001
        return [dict(base, check="reference", dtype="float64", error=first_line(e), ok=False)]
    low = [x.astype(jnp.bfloat16) if i < n_cast else x for i, x in enumerate(args)]
    cases = [
        (variant, "forward", "float32", args),
        (variant, "gradient", "float32", args),
        (variant, "forward", "bfloat16", low),
    ]
    if family in PALLAS_FAMILIES:
        cases += [("pallas", "forward", "bfloat16", low), ("pallas", "gradient", "bfloat16", low)]
    out = []
    for method, check, dtype, x in cases:
        fields = dict(base, method=method, check=check, dtype=dtype)
        x = [jnp.asarray(t) for t in x]
        try:
            if check == "forward":
                got = jax.jit(lambda *x, m=method: f(m, *x))(*x)
                out.append(compare(got, ref, **fields))
            else:
                out.append(compare(jax.jit(grad(method))(*x), ref_grads, **fields))
        except Exception as e:  # noqa: BLE001 (recorded: the check goes on)
            if method == "pallas":  # no Pallas kernel for this family on this backend
                out.append(dict(fields, unavailable=first_line(e)))
            else:
                out.append(dict(fields, error=first_line(e), ok=False))
    return out


# ---- 2. forward + backward times of the operations FLA also has ----


def op_inputs(op: str, T: int, B: int, H: int, K: int, V: int) -> tuple:
    """The inputs of `op` in its argument order, as `fla_timings.inputs` makes them (bfloat16
    q, k, v, beta; float32 log decays), and the output cotangent."""
    keys = iter(jax.random.split(jax.random.key(0), 8))
    normal = lambda *s: jax.random.normal(next(keys), s, jnp.float32)  # noqa: E731
    q, k = normal(B, T, H, K), normal(B, T, H, K)
    if op in DELTA_OPS:
        q, k = (x / jnp.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
    q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, normal(B, T, H, V)))
    beta = jax.nn.sigmoid(normal(B, T, H)).astype(jnp.bfloat16)
    g, g_key = jax.nn.log_sigmoid(normal(B, T, H)) / 16, jax.nn.log_sigmoid(normal(B, T, H, K)) / 16
    do = normal(B, T, H, V).astype(jnp.bfloat16)
    args = {
        "delta_rule": (q, k, v, beta),
        "gated_delta_rule": (q, k, v, beta, g),
        "kda": (q, k, v, beta, g_key),
        "simple_gla": (q, k, v, g),
        "gla": (q, k, v, g_key),
    }[op]
    return args, do


def op_fn(op: str, method: str, chunk_size: int = 64):
    """``f(*op_inputs(...)[0]) -> o`` of `op` by the library's ``method``."""
    if op in DELTA_OPS:
        return lambda q, k, v, beta, a=None: K.delta_rule(
            q, k, v, beta, log_decay=a, method=method, chunk_size=chunk_size
        )
    return lambda q, k, v, a: K.causal_linear_attention(
        q, k, v, log_decay=a, normalize=False, method=method, chunk_size=chunk_size
    )


def compile_fwd_bwd(op: str, method: str, args, do):
    """The compiled gradient of <o, do> with respect to every input, and its arguments."""
    f = op_fn(op, method)
    loss = lambda *x: jnp.vdot(f(*x[:-1]).astype(jnp.float32), x[-1].astype(jnp.float32))  # noqa: E731
    grad = jax.grad(loss, argnums=tuple(range(len(args))))
    return jax.jit(grad).lower(*args, do).compile(), (*args, do)


def memory_budget() -> float:
    """80 % of the device's memory where JAX reports it, else 8 GiB (the CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    return 0.8 * stats["bytes_limit"] if "bytes_limit" in stats else 8.0 * 2**30


def run_op_timings(T_list, shape, repeats, deadline, ops=OPS, log=print, progress=None):
    """A record per (T, op, method): median and min seconds of forward + backward, or why it
    was skipped (the deadline, over the memory budget, failed at a smaller T) or its error.
    ``progress(records)`` after each T."""
    records, failed, budget = [], {}, memory_budget()
    for T in T_list:
        points, recs = {}, {}
        for op in ops:
            args = None
            for method in [m for m in OP_METHODS if op not in DELTA_OPS or m != "chunk_parallel"]:
                rec = recs[op, method] = dict(op=op, method=method, T=T, dtype="bfloat16", **shape)
                records.append(rec)
                if time.time() > deadline:
                    rec["skipped"] = SPENT
                elif (op, method) in failed:
                    rec["skipped"] = f"failed at a smaller T ({failed[op, method]})"
                if "skipped" in rec:
                    continue
                try:
                    args = args or op_inputs(op, T, **shape)
                    compiled, call = compile_fwd_bwd(op, method, *args)
                    rec["temp_bytes"] = compiled.memory_analysis().temp_size_in_bytes
                except Exception as e:  # noqa: BLE001 (no kernel for this backend, out of memory)
                    rec["error"] = failed[op, method] = first_line(e)
                    continue
                if rec["temp_bytes"] > budget:
                    rec["skipped"] = f"temporaries {rec['temp_bytes'] / 2**30:.3g} GiB > budget"
                    continue
                points[op, method] = (compiled, call)
        for key, ts in interleaved(points, repeats, slow_s=10.0).items():
            timed = ts[1:] or ts
            recs[key].update(times_s=ts, median_s=statistics.median(timed), min_s=min(timed))
        del points
        done = [
            f"{o}/{m} {r['median_s'] * 1e3:.2f} ms" for (o, m), r in recs.items() if "median_s" in r
        ]
        log(f"T={T}: " + (", ".join(done) or "nothing timed"))
        (progress or _ignore)(records)
    return records


# ---- 4. a training step: time, MFU and memory against the prediction ----


def step_config(preset: str, depth: int, narrow: bool, seq_len: int | None, batch: int):
    """The preset's config at ``depth`` layers, ``batch`` rows of ``seq_len`` tokens (None:
    the preset's) in one step; ``narrow``: d 64 and 2 heads of 32 (the vocabulary kept)."""
    config = load_config_file(f"{ROOT / 'configs' / 'lm.py'}:{preset}")
    config.model.num_layers = depth
    if narrow:
        config.model.d_model, config.model.num_heads = 64, 2
        if config.model.head_dim is not None:
            config.model.head_dim = 32
    if seq_len:
        config.data.seq_len = seq_len
    config.train.batch_size, config.train.grad_accum_steps = batch, 1
    config.mesh.num_devices = 1
    return experiment_config(config)


def gpu_target_name(device_kind: str) -> str:
    """``gpu:<chip>:1`` of the chip whose CUDA name is ``device_kind`` (H100 where none is:
    off a GPU the prediction is the H100's, to compare with a later run on one)."""
    from linear_attention.training.gpu_chips import CHIPS

    chip = next((key for key, c in CHIPS.items() if c.name == device_kind), None)
    if chip is None:
        chip = next((key for key in CHIPS if key.upper() in device_kind.upper()), "h100")
    return f"gpu:{chip}:1"


def predict_memory(cfg) -> dict:
    """The deviceless compile's bytes for one GPU of the chip this is (`sizing.dry_run`)."""
    from linear_attention.training.sizing import dry_run

    target = gpu_target_name(jax.devices()[0].device_kind)
    mesh = dataclasses.replace(cfg.mesh, target=target)
    try:
        sized = dry_run(dataclasses.replace(cfg, mesh=mesh))
    except Exception as e:  # noqa: BLE001 (no CUDA plugin or ptxas here: said, not fatal)
        return dict(target=target, error=first_line(e))
    return dict(
        target=target, bytes=sized["train_step_bytes_per_device"], memory=sized["memory"],
        fits=sized["fits"], compile_s=sized["compile_s"], versions=sized["versions"],
    )  # fmt: skip


def peak_flops_of(device_kind: str) -> float | None:
    return next((f for name, f in PEAK_FLOPS.items() if name in device_kind.upper()), None)


def run_train_step(cfg, repeats: int, peak_flops: float | None) -> dict:
    """One device: the loop's `train_step` compiled, run once to warm up, then ``repeats``
    timed steps on random tokens (one document per row); the device's memory around it."""
    device = jax.devices()[0]
    mesh = make_mesh(1, 1)
    tx, _ = make_optimizer(cfg.optimizer, cfg.train.num_steps)
    model, optimizer = build_model(cfg, tx)
    flops = flops_per_token(model, cfg.data.seq_len)["total"]
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    graphdef, state = nnx.split((model, optimizer))
    rng = np.random.default_rng(0)
    shape = (cfg.train.batch_size, cfg.data.seq_len)
    batch = {
        name: np.ones(shape, np.int32)
        if name == "segment_ids"
        else rng.integers(0, cfg.model.vocab_size, shape, dtype=np.int32)
        for name in abstract_batch(cfg, mesh)
    }
    batch = shard_batch(batch, mesh)
    kwargs = dict(graphdef=graphdef, mesh=mesh, fsdp=False, accum=1, loss_chunks=cfg.loss_chunks)
    start = time.perf_counter()
    compiled = train_step.lower(state, batch, **kwargs).compile()
    compile_s = time.perf_counter() - start
    before = device.memory_stats() or {}
    state, metrics = compiled(state, batch)
    first_loss = float(metrics["train/loss"])
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    after = device.memory_stats() or {}
    step_s = statistics.median(times)
    tokens_per_sec = shape[0] * shape[1] / step_s
    return dict(
        parameters=int(params), d_model=cfg.model.d_model, num_layers=cfg.model.num_layers,
        seq_len=shape[1], batch=shape[0], dtype=cfg.model.dtype, compile_s=compile_s,
        first_loss=first_loss, times_s=times, step_s=step_s, tokens_per_sec=tokens_per_sec,
        flops_per_token=flops, peak_flops=peak_flops,
        mfu=None if not peak_flops else flops * tokens_per_sec / peak_flops,
        compiled_bytes=step_bytes(memory_parts(compiled)),
        bytes_in_use_before_step=before.get("bytes_in_use"),
        measured_peak_bytes=after.get("peak_bytes_in_use"),
        bytes_limit=after.get("bytes_limit"),
    )  # fmt: skip


def run_train_part(
    preset: str, step: dict, peak_flops: float | None, save=None, deadline=float("inf")
) -> dict:
    """`run_train_step`, then (``save``-d before it; before ``deadline``) the deviceless
    prediction of the same shapes."""
    cfg = step_config(preset, step["depth"], step["narrow"], step["seq_len"], step["batch"])
    peak_flops = peak_flops or peak_flops_of(jax.devices()[0].device_kind)
    rec = dict(preset=preset, **run_train_step(cfg, step["repeats"], peak_flops))
    (save or _ignore)({**rec, "predicted": {"error": "not reached"}})
    rec["predicted"] = predict_memory(cfg) if time.time() < deadline else {"error": SPENT}
    measured, predicted = rec["measured_peak_bytes"], rec["predicted"].get("bytes")
    if measured and predicted:
        rec["measured_over_predicted"] = measured / predicted
    return rec


# ---- the parts, each in its own process, and the parent that runs them ----


def _ignore(records) -> None:
    pass


def run_part(name, preset, deadline, peak_flops, train_preset=None, save=_ignore) -> dict:
    """The JSON of one part (in this process); ``save(result so far)`` as its records come, so
    that a part killed past its deadline keeps what it did."""
    cfg = PRESETS[preset]
    if name == "checks":
        result = dict(machine=machine_info(), checks=[], family_checks=[])

        def keep(key):
            return lambda records: save({**result, key: records})

        result["checks"] = run_checks(cfg["check_T"], cfg["decays"], deadline=deadline,
                                      progress=keep("checks"))  # fmt: skip
        result["family_checks"] = run_family_checks(
            cfg["check_T"], deadline=deadline, progress=keep("family_checks")
        )
        return result
    if name == "timings":
        info = dict(device_kind=jax.devices()[0].device_kind, backend=jax.default_backend())
        records = run_op_timings(
            cfg["T"], cfg["shape"], cfg["repeats"], deadline,
            progress=lambda records: save(dict(device=info, records=records)),
        )  # fmt: skip
        return dict(device=info, records=records)
    if name == "train":
        return run_train_part(train_preset, cfg["step"], peak_flops, save, deadline)
    raise ValueError(f"part must be one of checks, timings, train; got {name!r}")


def gpu_facts() -> dict:
    """``nvidia-smi``'s GPUs (name, driver, memory, the maximum SM clock); empty without one."""
    fields = "name,driver_version,memory.total,clocks.max.sm"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError) as e:
        return {"nvidia_smi": first_line(e)}
    gpus = [dict(zip(fields.split(","), map(str.strip, line.split(",")), strict=False))
            for line in out.splitlines() if line.strip()]  # fmt: skip
    return {"gpus": gpus}


def versions() -> dict:
    found = {"python": platform.python_version()}
    for dist in (
        "linear_attention", "jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax",
        "optax", "numpy", "torch", "triton", "fla-core", "flash-linear-attention",
        "ml_collections", "grain",
    ):  # fmt: skip
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def part_command(name, preset, out: Path, deadline, peak_flops, train_preset=None) -> list[str]:
    if name == "fla":
        cfg = PRESETS[preset]
        shape = [f"--{k}={v}" for k, v in cfg["shape"].items()]
        return [
            sys.executable, str(HERE / "fla_timings.py"), "--out", str(out), "--T",
            *map(str, cfg["T"]), *shape, f"--repeats={cfg['repeats']}", f"--deadline={deadline}",
        ]  # fmt: skip
    command = [sys.executable, str(Path(__file__).resolve()), "--part", name, "--preset", preset]
    command += ["--part_out", str(out), "--deadline", str(deadline)]
    if train_preset:
        command += ["--train_preset", train_preset]
    if peak_flops:
        command += ["--peak_flops", str(peak_flops)]
    return command


def part_env() -> dict:
    env = dict(os.environ)
    # jax's allocator grows as needed instead of taking 75 % of the GPU at its start: each
    # part's peak is then its own, and no part finds the GPU held by the one before it exiting.
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if "CUDA_ROOT" not in env and Path("/usr/local/cuda/bin/ptxas").exists():
        env["CUDA_ROOT"] = "/usr/local/cuda"  # where the deviceless compile finds ptxas
    return env


def run(out, preset="full", parts=PARTS, *, budget_s=None, peak_flops=None, log=print) -> dict:
    """Every part of ``parts`` in its own process within ``budget_s`` (the preset's by default):
    ``results.json`` and ``summary.md`` in ``out``; returns the results."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise ValueError(f"parts must be a non-empty list from {list(PARTS)}, got {list(parts)}")
    if peak_flops is not None and not peak_flops > 0:
        raise ValueError(f"peak_flops must be > 0 (the device's FLOP/s), got {peak_flops}")
    cfg = PRESETS[preset]
    budget_s = cfg["budget_s"] if budget_s is None else budget_s
    if not budget_s > 0:
        raise ValueError(f"budget_s must be > 0 seconds, got {budget_s}")
    out = Path(out)
    (out / "parts").mkdir(parents=True, exist_ok=True)
    start = time.time()
    results = dict(
        machine=dict(gpu_facts(), versions=versions(), cpu_count=os.cpu_count(),
                     load_avg_start=os.getloadavg()),
        config=dict(preset=preset, parts=list(parts), budget_s=budget_s,
                    **{k: v for k, v in cfg.items() if k not in ("budget_s",)}),
        parts={},
    )  # fmt: skip
    jobs = [(p, t) for p in parts for t in (TRAIN_PRESETS if p == "train" else (None,))]
    shares = [cfg["shares"][p] / (len(TRAIN_PRESETS) if p == "train" else 1) for p, _ in jobs]
    for i, (name, train_preset) in enumerate(jobs):
        key = f"train_{train_preset}" if train_preset else name
        left = budget_s - (time.time() - start)
        if left <= 0:  # the parts before took the whole budget
            results["parts"][key] = dict(seconds=0.0, error=f"not started: {SPENT}")
            log(f"{key}: not started, {SPENT}")
            continue
        deadline = time.time() + max(left, 0) * shares[i] / sum(shares[i:])
        part_out = out / "parts" / f"{key}.json"
        command = part_command(name, preset, part_out, deadline, peak_flops, train_preset)
        begin = time.time()
        status = dict(seconds=None)
        with open(out / "parts" / f"{key}.log", "w") as logfile:
            try:
                done = subprocess.run(
                    command, stdout=logfile, stderr=subprocess.STDOUT, env=part_env(),
                    timeout=max(deadline - time.time(), 0) + GRACE_S,
                )  # fmt: skip
                status["returncode"] = done.returncode
            except subprocess.TimeoutExpired:
                status["error"] = f"killed: past its deadline plus {GRACE_S:g} s"
        status["seconds"] = round(time.time() - begin, 1)
        if part_out.exists():
            status["result"] = json.loads(part_out.read_text())
            if status.get("returncode") and "error" not in status:  # crashed after saving
                status["error"] = f"exit {status['returncode']}: {_tail(out, key)}"
        elif "error" not in status:
            status["error"] = f"exit {status['returncode']}: {_tail(out, key)}"
        results["parts"][key] = status
        log(f"{key}: {status['seconds']} s, " + (status.get("error") or "done"))
    results["machine"].update(load_avg_end=os.getloadavg(), wall_s=time.time() - start)
    results["checks_passed"] = checks_passed(results)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    try:
        text = summary(results)
    except Exception as e:  # noqa: BLE001 (a part's odd record must not lose results.json)
        text = f"summary failed: {first_line(e)}; results.json holds everything\n"
    (out / "summary.md").write_text(text)
    log(text)
    return results


def _tail(out: Path, key: str) -> str:
    """The last lines of a part's log."""
    lines = (out / "parts" / f"{key}.log").read_text().strip().splitlines()[-3:]
    return " | ".join(lines)[-600:]


def checks_passed(results) -> bool | None:
    """Whether every check ran and passed (None where the checks part did not run; a Pallas
    method this backend refuses is unavailable, not failed)."""
    part = results["parts"].get("checks")
    if part is None:
        return None
    found = part.get("result", {})
    every = found.get("checks", []) + found.get("family_checks", [])
    return bool(every) and all(c.get("ok", True) and "skipped" not in c for c in every)


def summary(results) -> str:
    """Markdown: the machine, the checks, forward + backward ms per op and T, the train steps."""
    m, parts = results["machine"], results["parts"]
    gpu = (m.get("gpus") or [{}])[0]
    v = m["versions"]
    lines = [
        f"# accelerator_check ({results['config']['preset']})",
        "",
        f"{gpu.get('name', 'no GPU')}, driver {gpu.get('driver_version', '-')}; "
        + ", ".join(
            f"{k} {v[k]}" for k in ("jax", "jaxlib", "torch", "triton", "fla-core") if k in v
        )
        + f"; Python {v['python']}; {m['wall_s']:.0f} s; load {m['load_avg_start'][0]:.2f}",
        "",
    ]
    for key, status in parts.items():
        lines.append(
            f"- {key}: {status['seconds']} s"
            + (f", {status['error']}" if "error" in status else "")
        )
    checks = parts.get("checks", {}).get("result")
    if checks:
        every = checks["checks"] + checks["family_checks"]
        bad = [c for c in every if c.get("ok") is False]
        worst = max(
            (c["rel_err"] for c in every if c.get("dtype") == "float32" and "rel_err" in c),
            default=None,
        )
        names = [
            "/".join(str(c.get(k, "linear")) for k in ("family", "method", "check", "dtype"))
            for c in bad
        ]
        skipped = sum("skipped" in c for c in every)
        unavailable = sum("unavailable" in c for c in every)
        largest = "—" if worst is None else f"{worst:.2e}"
        lines += [
            "",
            f"Checks: {sum(c.get('ok') is True for c in every)} of {len(every)} ok "
            f"({unavailable} unavailable, "
            f"{skipped} skipped); largest float32 error {largest}; failed: "
            + (", ".join(names) or "none"),
        ]
    timed = parts.get("timings", {}).get("result", {}).get("records", [])
    timed += parts.get("fla", {}).get("result", {}).get("records", [])
    if timed:
        cols = [m for m in (*OP_METHODS, "fla") if any(r["method"] == m for r in timed)]
        get = {(r["op"], r["method"], r["T"]): r for r in timed}
        lines += ["", "Forward + backward, ms (median):", ""]
        lines += ["| op | T | " + " | ".join(cols) + " |", "|---|---:|" + "---:|" * len(cols)]
        for T in sorted({r["T"] for r in timed}):
            for op in OPS:
                cells = []
                for method in cols:
                    r = get.get((op, method, T), {})
                    cells.append(f"{r['median_s'] * 1e3:.3g}" if "median_s" in r
                                 else "error" if "error" in r else "—")  # fmt: skip
                lines.append(f"| {op} | {T} | " + " | ".join(cells) + " |")
    fla = parts.get("fla", {}).get("result", {})
    if "skipped" in fla:
        lines += ["", f"FLA: skipped ({fla['skipped']})"]
    steps = [s["result"] for k, s in parts.items() if k.startswith("train_") and "result" in s]
    if steps:
        lines += [
            "",
            "| train step | layers | batch × T | ms | tokens/s | MFU | peak GiB | predicted GiB "
            "| this compile GiB |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        gib = lambda b: "—" if not b else f"{b / 2**30:.2f}"  # noqa: E731
        for r in steps:
            mfu = "—" if r["mfu"] is None else f"{r['mfu']:.3f}"
            lines.append(
                f"| {r['preset']} | {r['num_layers']} | {r['batch']} × {r['seq_len']} | "
                f"{r['step_s'] * 1e3:.1f} | {r['tokens_per_sec']:.0f} | {mfu} | "
                f"{gib(r['measured_peak_bytes'])} | {gib(r['predicted'].get('bytes'))} | "
                f"{gib(r['compiled_bytes'])} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/accelerator_check", help="output directory")
    p.add_argument("--preset", choices=sorted(PRESETS), default="full")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--budget_s", type=float, help="seconds for every part (default: the preset's)")
    p.add_argument("--peak_flops", type=float, help="the device's peak FLOP/s, for the MFU")
    # one part, in this process (the parent runs each so)
    p.add_argument("--part", choices=("checks", "timings", "train"), help=argparse.SUPPRESS)
    p.add_argument("--part_out", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=float("inf"), help=argparse.SUPPRESS)
    p.add_argument("--train_preset", choices=TRAIN_PRESETS, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.part:
        out = Path(a.part_out)

        def save(result):  # whole or not at all: the parent may kill this process mid-write
            Path(f"{out}.tmp").write_text(json.dumps(result, indent=1))
            os.replace(f"{out}.tmp", out)

        save(run_part(a.part, a.preset, a.deadline, a.peak_flops, a.train_preset, save))
        return
    try:
        run(a.out, a.preset, tuple(a.parts), budget_s=a.budget_s, peak_flops=a.peak_flops)
    except ValueError as e:
        p.error(str(e))


if __name__ == "__main__":
    main()
