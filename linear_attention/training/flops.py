"""Model FLOPs per token, counted by hand from the shapes of a (possibly abstract) model.

A training step costs three times the forward pass (the backward pass is two matmuls per
forward matmul), so ``train = 3 · forward`` per token. The forward pass per token is

    matmuls:  2 · (every weight matrix's size: projections, MLP, short conv, the output head)
    mixing:   per layer, its mixer's own count, `Mixer.mixing_flops(seq_len)`, from its heads,
              key and value widths, the sequence length, its kernel method and chunk size:
              its kernel family's count of the method (`Mixer.FAMILY`, the descriptor beside
              the kernel, whose FLOPs functions' docstrings give the formulas), or for a mixer
              without a method its layer's `mixing_flops` (softmax and windows, MLA, LSTM).

A mixer without a count raises a ValueError naming it (a new mixer adds its count).

Embedding lookups, norms, gates, decays and softmax exponentials are elementwise and not counted
(as in the papers' 6·N counts). The matmuls are the ``kernel`` parameters (of `nnx.Linear` and
the short convolutions, whose depthwise cost per token is also their size); the token and
position embedding tables are lookups (a tied output head is counted once, as V·D). FAVOR's
random projection is a buffer, not a parameter, and is not counted (2·H·dk·F per token for q
and for k: small beside the rest).
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from linear_attention.layers import MIXERS
from linear_attention.layers.base import Mixer


def mixing_flops(mixer, name: str, seq_len: int, *, method: str, chunk_size: int) -> float:
    """Forward FLOPs per token of one mixer's sequence mixing (its `mixing_flops`). A mixer
    without a count (a new one) raises a ValueError naming it: its FLOPs are never guessed
    from another mixer's shapes."""
    counted = [
        n
        for n, cls in MIXERS.items()
        if cls.FAMILY is not None or cls.mixing_flops is not Mixer.mixing_flops
    ]
    if name not in counted:
        raise ValueError(
            f"no FLOPs count for mixer {name!r} (counted: {', '.join(counted)}); give it a "
            "kernel family (`Mixer.FAMILY`) or its `mixing_flops` in its layer module"
        )
    return mixer.mixing_flops(seq_len, method=method, chunk_size=chunk_size)


def matmul_params(model) -> int:
    """Entries of the weight matrices a token is multiplied by: every ``kernel`` (the
    embedding tables are lookups; a tied head multiplies by the token table once)."""
    total = 0
    for path, x in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]:
        keys = [str(getattr(k, "key", k)) for k in path]
        if "kernel" in keys and keys[0] not in ("embed", "pos_embed"):
            total += int(np.prod(x.shape))
    if model.config.tie_embeddings:
        total += model.config.vocab_size * model.config.d_model
    return total


def flops_per_token(model, seq_len: int) -> dict[str, float]:
    """Training FLOPs per token (3 × forward) of ``model`` (a `LanguageModel`, concrete or from
    `nnx.eval_shape`) on rows of ``seq_len`` tokens: ``total``, ``matmul`` and one
    ``mixer/<name>`` entry per mixer kind (summed over its layers)."""
    config = model.config
    out = {"matmul": 3.0 * 2.0 * matmul_params(model)}
    for block, name in zip(model.blocks, config.layer_mixers, strict=True):
        # (each mixer's own method and chunk size, its options with defaults filled in)
        options = block.mixer.options
        mix = mixing_flops(
            block.mixer,
            name,
            seq_len,
            method=options.get("method"),
            chunk_size=options.get("chunk_size"),
        )
        out[f"mixer/{name}"] = out.get(f"mixer/{name}", 0.0) + 3.0 * mix
    out["total"] = sum(out.values())
    return out
