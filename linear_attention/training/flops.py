"""Model FLOPs per token, counted by hand from the shapes of a (possibly abstract) model.

A training step costs three times the forward pass (the backward pass is two matmuls per
forward matmul), so ``train = 3 · forward`` per token. The forward pass per token is

    matmuls:  2 · (every weight matrix's size: projections, MLP, short conv, the output head)
    mixing:   per layer, from its mixer's heads H, key width dk (after the feature map) and
              value width dv, the sequence length T, the chunk size C, the window W:
      softmax         2·H·T·(dk + dv)            QKᵀ and the weighted sum over all T keys (the
                                                 convention of PaLM's MFU, Chowdhery et al. 2022,
                                                 appendix B: causal masking is not discounted)
      swa             2·H·min(W, T)·(dk + dv)    the same over the window
      linear family   chunk: 2·H·(C·(dk + dv) + 2·dk·dv)
                      (intra-chunk scores and sum; reading and updating the dk×dv state)
                      scan / recurrent: 4·H·dk·dv (read and update)
      delta rule      chunk (WY/UT form): 2·H·(3·C·dk + 2·C·dv + C²/3 + 3·dk·dv)
                      (βKKᵀ, QKᵀ, W = T·βK; U = T·βV and the intra sum; the triangular solve,
                      C³/3 multiply-adds per chunk; W·S, Q·S and the state update)
                      scan: 6·H·dk·dv
                      (deltanet, gated_deltanet, kda, gated_deltaproduct; H counts the value
                      heads, which carry the states; KDA's decay per key channel is
                      elementwise, so it costs what Gated DeltaNet's does; DeltaProduct's n
                      Householder steps are n delta-rule sub-tokens: H·n, and C counts
                      sub-tokens, min(chunk, n·T))
      dplr (rwkv7)    chunk (generalised UT form): 2·H·(5·C·dk + 5·C·dv + C²/3 + 5·dk·dv)
                      (the four decayed score matrices L_ab, L_ak, M_qb, M_qk and the inverse
                      applied to A; the triangular solve; W₀ = (I − L_ab)⁻¹ L_ak V, three
                      intra-chunk sums into O; the reads of S through A and Q and the state
                      update through B and K)
                      scan: 8·H·dk·dv (aᵀS, b·(aᵀS), k vᵀ, qᵀS)

A mixer with no count here raises a ValueError naming it (a new mixer adds its count).

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

# Mixers whose sequence mixing is attention over keys: the window each token sees.
_ATTENTION = {"softmax": None, "swa": "window"}
# Mixers whose kernel is the delta rule (chunked in the WY/UT form).
_DELTA = ("deltanet", "gated_deltanet", "kda", "gated_deltaproduct")
# Mixers whose kernel is the diagonal-plus-low-rank delta rule.
_DPLR = ("rwkv7",)
# Mixers whose kernel is chunked linear attention (with or without decay).
_LINEAR = ("linear", "favor", "taylor", "hedgehog", "retnet", "gated", "gla")


def mixing_flops(mixer, name: str, seq_len: int, *, method: str, chunk_size: int) -> float:
    """Forward FLOPs per token of one mixer's sequence mixing (see the module docstring). A
    mixer without a count here (a new one) raises a ValueError naming it: its FLOPs are never
    guessed from another mixer's shapes."""
    if name not in (*_ATTENTION, *_DELTA, *_DPLR, *_LINEAR):
        known = ", ".join((*_ATTENTION, *_DELTA, *_DPLR, *_LINEAR))
        raise ValueError(
            f"no FLOPs count for mixer {name!r} (counted: {known}); add its count to "
            "linear_attention/training/flops.py"
        )
    h, dv = mixer.num_heads, mixer.head_dim
    dk = getattr(mixer, "state_feature_dim", mixer.qk_dim)
    if name in _ATTENTION:
        keys = seq_len if name == "softmax" else min(mixer.window, seq_len)
        return 2.0 * h * keys * (dk + dv)
    c = min(chunk_size or seq_len, seq_len)
    if name in _DELTA:
        # value heads carry the states (grouped value heads); DeltaProduct's n steps per token
        # are n sub-tokens of the delta rule, and its chunk counts sub-tokens
        n = getattr(mixer, "num_householder", 1)
        h, c = mixer.num_value_heads * n, min(chunk_size or n * seq_len, n * seq_len)
        if method == "chunk":
            return 2.0 * h * (3 * c * dk + 2 * c * dv + c * c / 3 + 3 * dk * dv)
        return 6.0 * h * dk * dv
    if name in _DPLR:
        if method == "chunk":
            return 2.0 * h * (5 * c * dk + 5 * c * dv + c * c / 3 + 5 * dk * dv)
        return 8.0 * h * dk * dv
    if method == "chunk":
        return 2.0 * h * (c * (dk + dv) + 2 * dk * dv)
    return 4.0 * h * dk * dv


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
