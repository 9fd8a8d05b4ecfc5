"""Parameters for layer tests: every parameter moved off its initial value, so that a mapping
or an option that is wrong for a part (a norm scale that starts at one, a zero bias) shows."""

import jax
from flax import nnx


def perturb_params(module: nnx.Module, seed: int, scale: float = 0.3) -> None:
    """Add ``scale`` · N(0, 1) noise to every `nnx.Param` of ``module``, in place."""
    state = nnx.state(module, nnx.Param)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = [
        x + scale * jax.random.normal(k, x.shape, x.dtype)
        for x, k in zip(leaves, keys, strict=True)
    ]
    nnx.update(module, jax.tree.unflatten(tree, new))
