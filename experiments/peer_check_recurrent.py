"""Peer check: the `mamba` and `rglru` mixers against transformers' torch blocks, weights copied.

    python experiments/peer_check_recurrent.py [--out docs/results/peer_check_recurrent.json]

`mamba` against `MambaMixer` (its slow path: the torch causal conv and `mamba_selective_scan`'s
loop, no cache, eval mode so the fused kernels are not tried) and `rglru` against
`RecurrentGemmaRecurrentBlock` (`use_cache=False`, positions 0..T−1: the first token a reset).
Each peer runs in float32 and in float64, the float64 run with the peer's float32 casts lifted
(`Tensor.float` made the identity during it; the RG-LRU's accumulation dtype set to float64), so
that it is a float64 reference of the same code. For the output and the gradient of every
parameter and of the input (of Σ y ⊙ w, w fixed), it reports `ours`, the error
max |ours − peer32| / max |peer32| of this library's float32 mixer, and `bound`, the larger of
the peer's own float32 error against its float64 run and 1e-5: the check passes where
ours ≤ bound everywhere. `tests/layers/test_recurrent_peers.py` (`-m hf`) holds it; torch and
transformers are not dependencies, so it runs outside the default test run.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from linear_attention.benchmarks import machine_info
from linear_attention.layers import get_mixer

B, T, D = 2, 12, 16
HEADS = 2  # the RG-LRU's gate blocks (transformers' num_attention_heads)
MAMBA = dict(state_dim=4, expand=2, dt_rank=3, conv=4)
RGLRU = dict(lru_width=24, conv=4)
FLOOR = 1e-5


def rel_err(ours, theirs) -> float:
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return float(np.max(np.abs(ours - theirs)) / max(np.max(np.abs(theirs)), 1e-12))


def _flat(tree) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(tree))
    return {jax.tree_util.keystr(p, simple=True, separator="."): np.asarray(v) for p, v in leaves}


def _ours(mixer, x, w):
    """This library's output and the gradients of Σ y ⊙ w: `(y, {param: grad}, dx)`."""

    def loss(mixer, x):
        y = mixer(x)
        return jnp.sum(y * w), y

    (grads, dx), y = nnx.grad(loss, argnums=(0, 1), has_aux=True)(mixer, jnp.asarray(x))
    return np.asarray(y), _flat(nnx.state(grads, nnx.Param)), np.asarray(dx)


def _peer(module, forward, x, w, dtype, *, lift=()):
    """The peer's output and gradients in `dtype`: `(y, {name: grad}, dx)`; `lift` are
    context managers entered around the run (the float64 run's lifted casts)."""
    import torch

    module = module.to(dtype)
    module.zero_grad()
    xt = torch.tensor(x, dtype=dtype, requires_grad=True)
    with contextlib.ExitStack() as stack:
        for manager in lift:
            stack.enter_context(manager)
        y = forward(module, xt)
        (y * torch.tensor(w, dtype=dtype)).sum().backward()
    grads = {n: p.grad.detach().numpy().copy() for n, p in module.named_parameters()}
    return y.detach().numpy(), grads, xt.grad.numpy()


@contextlib.contextmanager
def _float_is_identity():
    """`Tensor.float()` returns the tensor itself (the peer's float32 casts lifted)."""
    import torch

    original = torch.Tensor.float
    torch.Tensor.float = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.float = original


def compare(ours, peer32, peer64, names: dict[str, tuple[str, callable]]) -> dict:
    """{quantity: {"ours": error vs peer32, "bound": max(peer32 vs peer64, FLOOR)}}; `names`
    maps our parameter to (the peer's parameter, a layout change of the peer's array)."""
    (y, grads, dx), (y32, g32, dx32), (y64, g64, dx64) = ours, peer32, peer64
    pairs = {"y": (y, y32, y64), "dx": (dx, dx32, dx64)}
    for ours_name, (peer_name, layout) in names.items():
        pairs[f"d{ours_name}"] = (grads[ours_name], layout(g32[peer_name]), layout(g64[peer_name]))
    return {
        k: {"ours": rel_err(a, p32), "bound": max(rel_err(p32, p64), FLOOR)}
        for k, (a, p32, p64) in pairs.items()
    }


def _linear(prefix: str) -> dict:
    transpose = lambda a: a.T  # noqa: E731  torch [out, in] → ours [in, out]
    return {
        f"{prefix}.kernel": (prefix.split(".")[-1] + ".weight", transpose),
        f"{prefix}.bias": (prefix.split(".")[-1] + ".bias", lambda a: a),
    }


def _conv(ours: str, peer: str) -> dict:
    return {f"{ours}.kernel": (f"{peer}.weight", lambda a: a[:, 0].T), f"{ours}.bias": (
        f"{peer}.bias", lambda a: a)}  # fmt: skip


def _copy(mixer, module, names) -> None:
    """Our parameters into the torch module, by `names` (the layout's inverse: transpose the
    linear kernels back, the conv to [C, 1, K])."""
    import torch

    ours = _flat(nnx.state(mixer, nnx.Param))
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, (peer_name, _) in names.items():
            value = ours[name]
            if name.endswith("kernel") and "conv" in name:
                value = value.T[:, None]
            elif name.endswith("kernel"):
                value = value.T
            params[peer_name].copy_(torch.tensor(np.ascontiguousarray(value)))


def mamba_check(seed: int = 0) -> dict:
    import torch
    from transformers import MambaConfig
    from transformers.models.mamba.modeling_mamba import MambaMixer

    mixer = get_mixer("mamba")(D, 1, **MAMBA, rngs=nnx.Rngs(seed))
    names = {
        "inputs.in_proj.kernel": ("in_proj.weight", lambda a: a.T),
        **_conv("inputs.conv1d", "conv1d"),
        "x_proj.kernel": ("x_proj.weight", lambda a: a.T),
        **_linear("dt_proj"),
        "A_log": ("A_log", lambda a: a),
        "D": ("D", lambda a: a),
        "out_proj.kernel": ("out_proj.weight", lambda a: a.T),
    }
    config = MambaConfig(
        hidden_size=D, state_size=MAMBA["state_dim"], expand=MAMBA["expand"],
        time_step_rank=MAMBA["dt_rank"], conv_kernel=MAMBA["conv"], num_hidden_layers=1,
        use_bias=False, use_conv_bias=True, hidden_act="silu",
    )  # fmt: skip
    torch.manual_seed(seed)
    module = MambaMixer(config, layer_idx=0).eval()
    _copy(mixer, module, names)
    rng = np.random.default_rng(seed + 1)
    x, w = rng.normal(size=(B, T, D)).astype(np.float32), rng.normal(size=(B, T, D))
    forward = lambda m, x: m(x)  # noqa: E731
    peer32 = _peer(module, forward, x, w, torch.float32)
    peer64 = _peer(module, forward, x, w, torch.float64, lift=(_float_is_identity(),))
    return compare(_ours(mixer, x, w.astype(np.float32)), peer32, peer64, names)


def rglru_check(seed: int = 0) -> dict:
    import torch
    from transformers import RecurrentGemmaConfig
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import (
        RecurrentGemmaRecurrentBlock,
    )

    mixer = get_mixer("rglru")(D, HEADS, **RGLRU, rngs=nnx.Rngs(seed))
    # trained-looking gates and biases (the init's are small or zero)
    rng = np.random.default_rng(seed + 2)
    for name in ("input_gate", "recurrent_gate"):
        for part, scale in (("weight", 0.3), ("bias", 0.5)):
            param = getattr(mixer, f"{name}_{part}")
            param.set_value(jnp.asarray(scale * rng.normal(size=param.shape), jnp.float32))
    names = {
        **_linear("inputs.linear_y"),
        **_linear("inputs.linear_x"),
        **_conv("inputs.conv_1d", "conv_1d"),
        "out_proj.kernel": ("linear_out.weight", lambda a: a.T),
        "out_proj.bias": ("linear_out.bias", lambda a: a),
        **{
            f"{g}_{p}": (f"rg_lru.{g}_{p}", lambda a: a)
            for g in ("input_gate", "recurrent_gate")
            for p in ("weight", "bias")
        },
        "recurrent_param": ("rg_lru.recurrent_param", lambda a: a),
    }
    config = RecurrentGemmaConfig(
        hidden_size=D, lru_width=RGLRU["lru_width"], num_attention_heads=HEADS,
        conv1d_width=RGLRU["conv"], num_hidden_layers=1, hidden_activation="gelu_pytorch_tanh",
    )  # fmt: skip
    torch.manual_seed(seed)
    module = RecurrentGemmaRecurrentBlock(config, layer_idx=0)
    _copy(mixer, module, names)
    x, w = rng.normal(size=(B, T, D)).astype(np.float32), rng.normal(size=(B, T, D))
    positions = torch.arange(T)[None].expand(B, T)

    def forward(m, x):
        return m(x, positions, None, use_cache=False)[0]

    @contextlib.contextmanager
    def float64_accumulation():
        scan = module.rg_lru._rnn_scan
        module.rg_lru._rnn_scan = functools.partial(scan, acc_dtype=torch.float64)
        try:
            yield
        finally:
            module.rg_lru._rnn_scan = scan

    peer32 = _peer(module, forward, x, w, torch.float32)
    peer64 = _peer(module, forward, x, w, torch.float64, lift=(float64_accumulation(),))
    return compare(_ours(mixer, x, w.astype(np.float32)), peer32, peer64, names)


def main(argv=None) -> int:
    import torch
    import transformers

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the figures to this JSON file")
    args = parser.parse_args(argv)
    checks = {
        "mamba": ("transformers MambaMixer (slow path)", mamba_check),
        "rglru": ("transformers RecurrentGemmaRecurrentBlock", rglru_check),
    }
    result = {
        "machine": machine_info(),
        "jax": jax.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "shapes": {"B": B, "T": T, "d_model": D, "mamba": MAMBA, "rglru": dict(RGLRU, heads=HEADS)},
        "mixers": {},
    }
    failed = []
    for name, (peer, check) in checks.items():
        errors = check()
        ok = all(e["ours"] <= e["bound"] for e in errors.values())
        result["mixers"][name] = {"peer": peer, "passed": ok, "errors": errors}
        worst = max(errors.values(), key=lambda e: e["ours"] / e["bound"])
        print(f"{name}: {'ok' if ok else 'FAILED'} (worst ours/bound {worst})")
        failed += [] if ok else [name]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
