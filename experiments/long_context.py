"""Long context split over devices: a gated and a gated-delta layer, forward + backward.

    python experiments/long_context.py --out runs/long_context                 # ~10 min here
    python experiments/long_context.py --out /tmp/lc --log2_T 10 --devices 1 2 # smoke test

One `GatedMixer` and one `GatedDeltaNetMixer` layer (d_model 64, 2 heads, B = 1, chunk 64)
compute the gradient of Σ y² with respect to their parameters and input, with the time axis
split over n = 1, 2, 4, 8 devices (`jax.shard_map`, `split_sequence`: the kernels' sequence
parallelism, `axis_name`). For each T and n it records XLA's compiled memory per device
(`memory_analysis()`: temporaries + arguments + outputs of one device's program) and the wall
time of a step (median of `--repeats` after a warm-up). The devices are forced CPU devices
(`--xla_force_host_platform_device_count=8`, set here before JAX starts): they share this
machine's cores, so the times say what the split costs in total, not a speed-up. Writes
`results.json` and `long_context.png`.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from linear_attention.benchmarks import machine_info  # noqa: E402
from linear_attention.layers.delta import GatedDeltaNetMixer  # noqa: E402
from linear_attention.layers.linear import GatedMixer  # noqa: E402
from linear_attention.layers.sequence import split_sequence  # noqa: E402

D_MODEL, HEADS, CHUNK = 64, 2, 64
LAYERS = {"gated": GatedMixer, "gated_deltanet": GatedDeltaNetMixer}


def step_fn(layer_cls, n: int):
    """`(params, x) -> (loss, grads)` for one layer, time split over n devices (n = 1: plain)."""
    layer = layer_cls(D_MODEL, HEADS, chunk_size=CHUNK, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(layer)

    def layer_loss(params, x):
        return jnp.sum(jnp.square(nnx.merge(graphdef, params)(x).astype(jnp.float32)))

    loss = layer_loss
    if n > 1:
        mesh = Mesh(np.asarray(jax.devices()[:n]), ("seq",))

        def local(params, x):
            with split_sequence("seq"):
                return jax.lax.psum(layer_loss(params, x), "seq")

        loss = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(None, "seq")), out_specs=P())
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), params


def measure(layer: str, T: int, n: int, repeats: int) -> dict:
    fn, params = step_fn(LAYERS[layer], n)
    x = jax.random.normal(jax.random.key(1), (1, T, D_MODEL), jnp.float32)
    compiled = fn.lower(params, x).compile()
    mem = compiled.memory_analysis()
    jax.block_until_ready(compiled(params, x))  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(params, x))
        times.append(time.perf_counter() - start)
    per_device = mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
    return dict(
        layer=layer,
        T=T,
        devices=n,
        memory_per_device_MiB=per_device / 2**20,
        temp_per_device_MiB=mem.temp_size_in_bytes / 2**20,
        times_s=times,
        median_s=statistics.median(times),
    )


def run(out, *, log2_T=(14, 16, 18), devices=(1, 2, 4, 8), repeats=2, log=print):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine_info()
    records = []
    for layer in LAYERS:
        for lt in log2_T:
            for n in devices:
                rec = measure(layer, 2**lt, n, repeats)
                records.append(rec)
                log(
                    f"{layer:15s} T=2^{lt:<2d} n={n}: {rec['memory_per_device_MiB']:9.1f} MiB "
                    f"per device, {rec['median_s'] * 1e3:9.1f} ms"
                )
    for rec in records:  # memory and time against the same layer and T on one device
        base = next(
            r for r in records if (r["layer"], r["T"], r["devices"]) == (rec["layer"], rec["T"], 1)
        ) if 1 in devices else None  # fmt: skip
        if base is not None:
            rec["memory_ratio_vs_1"] = rec["memory_per_device_MiB"] / base["memory_per_device_MiB"]
            rec["time_ratio_vs_1"] = rec["median_s"] / base["median_s"]
    info["load_avg_end"] = os.getloadavg()
    result = dict(machine=info, d_model=D_MODEL, heads=HEADS, chunk=CHUNK, records=records)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    plot(records, out / "long_context.png")
    return result


def plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for layer in LAYERS:
        for T in sorted({r["T"] for r in records}):
            rs = sorted((r for r in records if r["layer"] == layer and r["T"] == T),
                        key=lambda r: r["devices"])  # fmt: skip
            if not rs:
                continue
            ns = [r["devices"] for r in rs]
            label = f"{layer} T={T}"
            axes[0].plot(ns, [r["memory_per_device_MiB"] for r in rs], "o-", label=label)
            axes[1].plot(ns, [r["median_s"] for r in rs], "o-", label=label)
    axes[0].set(xscale="log", yscale="log", xlabel="devices (time split)",
                ylabel="compiled memory per device (MiB)")  # fmt: skip
    axes[1].set(xscale="log", yscale="log", xlabel="devices (forced CPU, shared cores)",
                ylabel="forward+backward wall time (s)")  # fmt: skip
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--log2_T", type=int, nargs="+", default=[14, 16, 18])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    run(args.out, log2_T=args.log2_T, devices=args.devices, repeats=args.repeats)


if __name__ == "__main__":
    main()
