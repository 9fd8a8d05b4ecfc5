"""Time the Mosaic GPU kernels against the XLA chunk form on a GPU (the device check's part for
issue 68): forward + backward of `causal_linear_attention`, bfloat16, per decay kind.

For each decay kind and length T: the outputs and gradients of `method="pallas"` against
`method="chunk"` (relative error, bfloat16 inputs), then the median wall time of one jitted
forward + backward (a linear loss on the outputs, whose cotangent does not depend on the
bfloat16-rounded outputs, so the error compares the kernels and not the loss's sensitivity;
gradients with respect to q, k, v and the log decay) over `--repeats` runs after a warm-up,
and `speedup` = t_chunk / t_pallas. Shapes: B=1, H=4, K=V=128, chunk 64. On a machine without
a GPU, `--interpret` runs the same in Mosaic GPU's interpret mode at a tiny shape (a check of
this script, not a measurement).

    python experiments/pallas_gpu_timing.py --lengths 4096,16384 \
        --out docs/results/pallas_gpu_timing_h100.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from linear_attention import kernels as K

DECAYS = ("none", "per_token", "per_key")


def inputs(T, decay, *, B=1, H=4, M=128):
    keys = jax.random.split(jax.random.key(0), 4)
    q, k = (jax.nn.elu(jax.random.normal(x, (B, T, H, M))) + 1 for x in keys[:2])
    q, k = (x / M**0.5 for x in (q, k))
    v = jax.random.normal(keys[2], (B, T, H, M))
    shape = {"none": None, "per_token": (B, T, H), "per_key": (B, T, H, M)}[decay]
    a = None if shape is None else -jax.random.uniform(keys[3], shape, maxval=0.2)
    return [x.astype(jnp.bfloat16) for x in (q, k, v)], a


def program(method):
    def loss(q, k, v, a):
        o = K.causal_linear_attention(
            q, k, v, log_decay=a, normalize=False, method=method, chunk_size=64
        )
        w = jnp.cos(jnp.arange(o.shape[-1], dtype=jnp.float32))  # fixed weights: a linear loss
        return jnp.sum(o.astype(jnp.float32) * w), o

    argnums = (0, 1, 2, 3)
    return jax.jit(
        lambda q, k, v, a: jax.grad(loss, argnums=argnums[: 3 + (a is not None)], has_aux=True)(
            q, k, v, a
        )
    )


def rel_err(x, ref):
    x, ref = jnp.asarray(x, jnp.float32), jnp.asarray(ref, jnp.float32)
    return float(jnp.max(jnp.abs(x - ref)) / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-12))


def median_seconds(fn, args, repeats):
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(T, decay, repeats, interpret):
    (q, k, v), a = inputs(T, decay, **(dict(H=2, M=64) if interpret else {}))
    chunk = program("chunk")
    mode = K.pallas_interpret("gpu") if interpret else K.pallas_lowering("gpu")
    with mode:  # the kernel is chosen as the program is traced
        pallas = program("pallas")
        grads, o = pallas(q, k, v, a)
    grads_c, o_c = chunk(q, k, v, a)
    errors = [rel_err(o, o_c)] + [rel_err(g, g_c) for g, g_c in zip(grads, grads_c, strict=True)]
    row = {"T": T, "decay": decay, "max_rel_err_vs_chunk": max(errors)}
    if not interpret:
        row["pallas_s"] = median_seconds(pallas, (q, k, v, a), repeats)
        row["chunk_s"] = median_seconds(chunk, (q, k, v, a), repeats)
        row["speedup"] = row["chunk_s"] / row["pallas_s"]
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="4096,16384")
    parser.add_argument("--decays", default=",".join(DECAYS))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--interpret", action="store_true", help="no GPU: a check of the script")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if not args.interpret and jax.default_backend() != "gpu":
        parser.error(
            f"the default backend is {jax.default_backend()!r}: run it on a GPU, or "
            "pass --interpret for a tiny interpreted check"
        )
    device = jax.devices()[0].device_kind
    rows = []
    for T in (int(x) for x in args.lengths.split(",")):
        for decay in args.decays.split(","):
            row = {"device": device, **measure(T, decay, args.repeats, args.interpret)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"jax": jax.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
