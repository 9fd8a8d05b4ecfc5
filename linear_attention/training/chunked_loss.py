"""Chunked linear cross-entropy: the cross-entropy and argmax of ``logits = x · W`` per token,
over token and vocabulary chunks, never holding the ``[N, V]`` logits nor their gradient.

Forward, for each chunk of ``Ct`` tokens (`jax.lax.map`), an online log-sum-exp over chunks of
``Cv`` vocabulary columns (`jax.lax.scan`), every state float32::

    m, s, z = -inf, 0, 0
    for each column chunk c:   l = x_C · W[:, c]                         [Ct, Cv] float32
        m' = max(m, max_c l);   s = s · exp(m − m') + Σ_c exp(l − m');   m = m'
        z += l[label]           (when the label is in c)
        argmax: the column of the first strict new maximum (``jnp.argmax``'s first index)
    lse = m + log s;   ce = lse − z

Backward (`jax.custom_vjp`): the residuals are x, W, the labels and ``lse [N]``, and each
chunk's logits are recomputed, so the gradient holds one ``[Ct, Cv]`` block at a time::

    dl = (exp(l − lse) − onehot(label)) · g                             [Ct, Cv] float32
    dx_C += dl · W[:, c]ᵀ,     dW[:, c] += x_Cᵀ · dl                     float32 sums

The residuals hold no logits, so remat around the loss (or the model's own) never recomputes
the whole ``[N, V]`` either. The last column chunk starts at ``V − Cv`` (W is never padded or
copied) and its columns already counted by the previous chunk are set to -inf before ``exp``,
so they add nothing to the sums, the label logit or dW; the tokens are padded to a multiple of
``Ct`` (an ``[N, D]`` copy, small next to the logits) and the padded rows' cotangent is zero.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from linear_attention.fields import check_choice, check_int

# The vocabulary from which `loss_chunks` chooses the chunked loss under "auto": from about
# 100,000 on, the plain loss's logits (float32 [B, T, V], their softmax and gradient) are more
# than half of the train step's temporaries (XLA:TPU, the default LM preset at 4,096 tokens:
# 41% at 65,536, 52% at 100,000, 62% at 248,320; BENCHMARKS.md, "The chunked cross-entropy").
CHUNKED_LOSS_MIN_VOCAB = 100_000
CHUNKED_LOSS_MODES = ("auto", "on", "off")


def loss_chunks(mode: str, vocab_size: int, tokens: int, vocab: int) -> tuple[int, int] | None:
    """The ``(token_chunk, vocab_chunk)`` the train and eval steps run the chunked loss with,
    or None for the plain ``[B, T, V]`` loss: ``mode`` "on" / "off" force it, "auto" chunks
    when ``vocab_size >= CHUNKED_LOSS_MIN_VOCAB``."""
    check_choice("mode", mode, CHUNKED_LOSS_MODES)
    check_int("token_chunk", tokens)
    check_int("vocab_chunk", vocab)
    on = mode == "on" or (mode == "auto" and vocab_size >= CHUNKED_LOSS_MIN_VOCAB)
    return (tokens, vocab) if on else None


def chunked_cross_entropy(
    x_BTD: jax.Array, w_DV: jax.Array, labels_BT: jax.Array, *, token_chunk: int, vocab_chunk: int
) -> tuple[jax.Array, jax.Array]:
    """``(ce_BT, argmax_BT)``: the cross-entropy (float32) of ``logits = x · W`` (float32
    accumulation of ``x``'s dtype, as the model's own projection) against ``labels`` (ids in
    ``[0, V)``: mask ignored positions before and after), and the logits' argmax (int32),
    computed by chunks (module docstring). Differentiable in ``x`` and ``w`` (same dtype)."""
    if x_BTD.ndim < 2 or w_DV.ndim != 2 or x_BTD.shape[-1] != w_DV.shape[0]:
        raise ValueError(
            f"x must be [..., D] and w [D, V] with the same D, got {x_BTD.shape} and {w_DV.shape}"
        )
    if labels_BT.shape != x_BTD.shape[:-1]:
        raise ValueError(f"labels must have shape {x_BTD.shape[:-1]}, got {labels_BT.shape}")
    if x_BTD.dtype != w_DV.dtype:
        raise ValueError(f"x and w must share a dtype, got {x_BTD.dtype} and {w_DV.dtype}")
    token_chunk = check_int("token_chunk", token_chunk)
    vocab_chunk = check_int("vocab_chunk", vocab_chunk)
    lead = labels_BT.shape
    # Inside `jax.shard_map` with x split (rows, time), W enters typed as varying like x: each
    # shard's dW is then a partial sum, which JAX's transpose of this cast sums over the shards.
    axes = _varying_axes(x_BTD) - _varying_axes(w_DV)
    if axes:
        w_DV = jax.lax.pcast(w_DV, tuple(sorted(axes)), to="varying")
    x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
    n, v = x_ND.shape[0], w_DV.shape[1]
    ce_N, arg_N = _chunked_ce(
        x_ND,
        w_DV,
        labels_BT.reshape(-1).astype(jnp.int32),
        min(token_chunk, n),
        min(vocab_chunk, v),
    )
    return ce_N.reshape(lead), arg_N.reshape(lead)


def _column_block(x_CD, w_DV, j, cv):
    """Column chunk ``j``'s float32 logits (already counted columns at -inf), its column ids,
    which of them are new, and its ``W`` columns."""
    v = w_DV.shape[1]
    start = jnp.minimum(j * cv, v - cv)
    w_Dc = jax.lax.dynamic_slice_in_dim(w_DV, start, cv, axis=1)
    logits_Cc = jnp.einsum("cd,dv->cv", x_CD, w_Dc, preferred_element_type=jnp.float32)
    cols_c = start + jnp.arange(cv, dtype=jnp.int32)
    new_c = cols_c >= j * cv
    return jnp.where(new_c, logits_Cc, -jnp.inf), cols_c, new_c, w_Dc


def _varying_axes(x) -> frozenset:
    """The mesh axes ``x`` varies over inside `jax.shard_map` (empty outside)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def _varying_like(value, *like):
    """``value`` (a tuple of arrays) typed as varying over every mesh axis any of ``like``
    varies over (inside `jax.shard_map`, e.g. sequence parallelism; else unchanged): a scan's
    initial carry must have the type of the carry its body returns, which the chunks of ``x``
    make varying. Adding zeros shaped from ``like`` carries its type (XLA drops the adds)."""
    zero = sum(jnp.zeros_like(a.reshape(-1)[:1], jnp.float32) for a in like)
    return tuple(v + zero.astype(v.dtype) for v in value)


def _token_blocks(ct, *arrays):
    """Each ``[N, ...]`` array zero-padded to a multiple of ``ct`` rows: ``[N / ct, ct, ...]``."""
    n = arrays[0].shape[0]
    pad = -n % ct
    return tuple(
        jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)).reshape(-1, ct, *a.shape[1:])
        for a in arrays
    )


def _forward(x_ND, w_DV, y_N, ct, cv):
    n, v = x_ND.shape[0], w_DV.shape[1]
    num_cols = -(-v // cv)

    def token_block(args):
        x_CD, y_C = args
        c = x_CD.shape[0]

        def column_block(carry, j):
            m_C, s_C, z_C, arg_C = carry
            logits, cols, new, _ = _column_block(x_CD, w_DV, j, cv)
            top_C = jnp.max(logits, axis=-1)
            m_new = jnp.maximum(m_C, top_C)
            s_C = s_C * jnp.exp(m_C - m_new) + jnp.sum(jnp.exp(logits - m_new[:, None]), -1)
            hit = (cols[None, :] == y_C[:, None]) & new[None, :]
            z_C = z_C + jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
            arg_C = jnp.where(top_C > m_C, cols[jnp.argmax(logits, axis=-1)], arg_C)
            return (m_new, s_C, z_C, arg_C), None

        init = (
            jnp.full((c,), -jnp.inf, jnp.float32),
            jnp.zeros((c,), jnp.float32),
            jnp.zeros((c,), jnp.float32),
            jnp.zeros((c,), jnp.int32),
        )
        init = _varying_like(init, x_CD, y_C, w_DV)
        (m_C, s_C, z_C, arg_C), _ = jax.lax.scan(column_block, init, jnp.arange(num_cols))
        return m_C + jnp.log(s_C), z_C, arg_C

    lse, z, arg = jax.lax.map(token_block, _token_blocks(ct, x_ND, y_N))
    lse, z, arg = (a.reshape(-1)[:n] for a in (lse, z, arg))
    return lse - z, arg, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _chunked_ce(x_ND, w_DV, y_N, ct, cv):
    ce, arg, _ = _forward(x_ND, w_DV, y_N, ct, cv)
    return ce, arg


def _chunked_ce_fwd(x_ND, w_DV, y_N, ct, cv):
    ce, arg, lse = _forward(x_ND, w_DV, y_N, ct, cv)
    return (ce, arg), (x_ND, w_DV, y_N, lse)


def _chunked_ce_bwd(ct, cv, residuals, cotangents):
    x_ND, w_DV, y_N, lse_N = residuals
    g_N = cotangents[0].astype(jnp.float32)  # (the argmax has no cotangent)
    n, d = x_ND.shape
    num_cols = -(-w_DV.shape[1] // cv)

    def token_block(dw_DV, args):
        x_CD, y_C, lse_C, g_C = args

        def column_block(carry, j):
            dw_DV, dx_CD = carry
            logits, cols, new, w_Dc = _column_block(x_CD, w_DV, j, cv)
            hit = (cols[None, :] == y_C[:, None]) & new[None, :]
            dl_Cc = (jnp.exp(logits - lse_C[:, None]) - hit) * g_C[:, None]
            dl_Cc = dl_Cc.astype(x_CD.dtype)
            dx_CD = dx_CD + jnp.einsum("cv,dv->cd", dl_Cc, w_Dc, preferred_element_type=jnp.float32)
            start = jnp.minimum(j * cv, w_DV.shape[1] - cv)
            dw_Dc = jax.lax.dynamic_slice_in_dim(dw_DV, start, cv, axis=1) + jnp.einsum(
                "cd,cv->dv", x_CD, dl_Cc, preferred_element_type=jnp.float32
            )
            return (jax.lax.dynamic_update_slice_in_dim(dw_DV, dw_Dc, start, axis=1), dx_CD), None

        init = (dw_DV, *_varying_like((jnp.zeros((x_CD.shape[0], d), jnp.float32),), x_CD, w_DV))
        (dw_DV, dx_CD), _ = jax.lax.scan(column_block, init, jnp.arange(num_cols))
        return dw_DV, dx_CD

    blocks = _token_blocks(ct, x_ND, y_N, lse_N, g_N)  # (padded rows: g = 0)
    (dw_init,) = _varying_like((jnp.zeros(w_DV.shape, jnp.float32),), x_ND, w_DV, g_N)
    dw_DV, dx = jax.lax.scan(token_block, dw_init, blocks)
    dx_ND = dx.reshape(-1, d)[:n]
    return dx_ND.astype(x_ND.dtype), dw_DV.astype(w_DV.dtype), None


_chunked_ce.defvjp(_chunked_ce_fwd, _chunked_ce_bwd)
