"""Sequence parallelism (`axis_name`) of KDA with grouped value heads, `dplr_delta_rule` and
`delta_product`: time split over forced CPU devices inside `jax.shard_map` equals the unsplit
call — outputs, gradients to every input and the global final state — through the one affine
combine, with packed rows whose boundaries fall on shard edges and inside shards. One
subprocess runs every check (JAX starts once)."""

import functools

import numpy as np

from tests.kernels.test_sequence_parallel import SEGMENTS, B, T, check
from tests.scripts import checked_names, run_on_cpu_devices

H, HV, KD, DV, N = 2, 4, 3, 4, 2


def main():
    import jax
    import jax.numpy as jnp

    from linear_attention import kernels as K

    assert jax.device_count() == 8, jax.devices()
    rng = np.random.default_rng(0)
    f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    seg = jnp.asarray(SEGMENTS)

    def kda(xs, seg, *, axis_name):
        return K.delta_rule(
            xs["q"], xs["k"], xs["v"], xs["beta"], log_decay=xs["a"],
            initial_state=K.LinearAttentionState(xs["s0"], None), segment_ids=seg,
            chunk_size=4, return_state=True, axis_name=axis_name,
        )  # fmt: skip

    xs = {
        "q": f(B, T, H, KD),
        "k": unit(f(B, T, H, KD)),
        "v": f(B, T, HV, DV),
        "beta": jax.nn.sigmoid(f(B, T, HV)) * 1.5,
        "a": -0.5 * jnp.abs(f(B, T, HV, KD)),
        "s0": f(B, HV, KD, DV),
    }
    check("kda/grouped/segments/n=4", kda, xs, seg, 4)

    def dplr(xs, seg, *, axis_name):
        return K.dplr_delta_rule(
            xs["q"], xs["k"], xs["v"], xs["a"], xs["b"], log_decay=xs["w"],
            initial_state=K.LinearAttentionState(xs["s0"], None), segment_ids=seg,
            chunk_size=4, return_state=True, axis_name=axis_name,
        )  # fmt: skip

    kappa = unit(f(B, T, H, KD))
    xs = {
        "q": f(B, T, H, KD),
        "k": 0.5 * f(B, T, H, KD),
        "v": f(B, T, H, DV),
        "a": -kappa,
        "b": kappa * jax.nn.sigmoid(f(B, T, H, KD)),
        "w": -0.5 * jnp.abs(f(B, T, H, KD)),
        "s0": f(B, H, KD, DV),
    }
    check("dplr/segments/n=8", dplr, xs, seg, 8)

    def product(xs, seg, *, axis_name, method):
        return K.delta_product(
            xs["q"], xs["k"], xs["v"], xs["beta"], log_decay=xs["a"],
            initial_state=K.LinearAttentionState(xs["s0"], None), segment_ids=seg,
            method=method, chunk_size=4, return_state=True, axis_name=axis_name,
        )  # fmt: skip

    xs = {
        "q": f(B, T, H, KD),
        "k": unit(f(B, T, H, N, KD)),
        "v": f(B, T, H, N, DV),
        "beta": jax.nn.sigmoid(f(B, T, H, N)) * 1.9,
        "a": -0.5 * jnp.abs(f(B, T, H)),
        "s0": f(B, H, KD, DV),
    }
    check("product/chunk/segments/n=4", functools.partial(product, method="chunk"), xs, seg, 4)
    check("product/scan/n=2", functools.partial(product, method="scan"), xs, None, 2)


EXPECTED = [
    "kda/grouped/segments/n=4",
    "dplr/segments/n=8",
    "product/chunk/segments/n=4",
    "product/scan/n=2",
]


def test_split_over_devices_equals_unsplit():
    module = "tests.kernels.test_sequence_parallel_delta_family"
    out = run_on_cpu_devices(f"from {module} import main; main()", 8)
    assert checked_names(out) == EXPECTED
