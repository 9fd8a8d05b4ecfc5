"""Peer check: this library's kernels against flash-linear-attention's pure-PyTorch references.

    python experiments/peer_check.py --fla /path/to/flash-linear-attention [--out FILE.json]

`--fla` is a local checkout of flash-linear-attention (nothing is downloaded); each family's
`fla/ops/<family>/naive.py` is loaded by path, so triton is not needed, only `torch` and
`einops`. For each family it draws random inputs (float32, several shapes), runs FLA's naive
form and this library's kernel, and reports the largest relative error
max |ours − theirs| / max |theirs|; `--out` keeps the figures of the families not checked in
this run (`--family`). It runs outside the default test run (torch is not a
dependency); BENCHMARKS.md records its figures.

Families checked (`--family`, all by default): forgetting attention (`naive_forgetting_attn`
against `kernels.forgetting_attention`, both methods); log-linear attention
(`naive_log_linear_attn` against `kernels.log_linear_attention`, every method, with one more
level weight than the length needs); MesaNet (`naive_mesa_net_exact` against `kernels.mesa_net`
with every method, outputs and both final states; `naive_mesa_net_CG` against the chunked CG at
the same iteration count; `naive_mesa_net_decoding_one_step` against `kernels.mesa_net_step`);
PaTH attention (`naive_path_attn` against `kernels.path_attention`, both methods, with the
forget gate; and the blockwise gradients of q, k, v, w, β and the gate against torch's autograd
of the naive form); Comba (`naive_recurrent_comba` against `kernels.comba`, both methods,
outputs and final state, the chunk form's gradients of every input against torch's autograd of
the naive recurrence; and FLA's `naive_chunk_comba` against its recurrence).
Issue 69's mixers over existing kernels, each mapping against FLA's naive
form of that family: RWKV-6 (`rwkv6_attention` against `naive_recurrent_rwkv6`, every method,
outputs and final state); HGRN2 (`hgrn2_terms` on `causal_linear_attention` against
`naive_recurrent_gla` given HGRN2's q, k and gate); lightning attention (the mixer's fixed
per-head decay on `causal_linear_attention` against `naive_chunk_simple_gla`); Gated
DeltaNet-2 (`gdn2_attention` against `naive_recurrent_gdn2`, chunk and scan, outputs and final
state).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from linear_attention import kernels as K
from linear_attention.benchmarks import machine_info

SHAPES = ((1, 64, 2, 16, 16), (2, 100, 4, 32, 32), (1, 300, 2, 64, 64))  # B, T, H, D, Dv


def load_naive(fla_root: Path, family: str, file: str = "naive.py"):
    """FLA's `fla/ops/<family>/naive.py` (or another `file` there) as a module, by path."""
    path = fla_root / "fla" / "ops" / family / file
    if not path.is_file():
        raise SystemExit(f"peer_check.py: error: {path} not found (is --fla a checkout?)")
    spec = importlib.util.spec_from_file_location(f"fla_{family}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rel_err(ours, theirs) -> float:
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return float(np.max(np.abs(ours - theirs)) / max(np.max(np.abs(theirs)), 1e-12))


def _record(reference: str, ours: str, errors: dict) -> dict:
    """A family's figures: the largest relative error per method over `SHAPES`, and each."""
    return {
        "reference": reference,
        "ours": ours,
        "shapes_BTHDDv": SHAPES,
        "max_rel_err": {m: max(e) for m, e in errors.items()},
        "rel_err_per_shape": errors,
    }


def forgetting(fla_root: Path) -> dict:
    import torch

    naive = load_naive(fla_root, "forgetting_attn").naive_forgetting_attn
    rng = np.random.default_rng(0)
    errors = {"chunk": [], "quadratic": []}
    for b, t, h, d, dv in SHAPES:
        q, k = (rng.standard_normal((b, t, h, d), np.float32) for _ in range(2))
        v = rng.standard_normal((b, t, h, dv), np.float32)
        g = np.log(1.0 / (1.0 + np.exp(-rng.standard_normal((b, t, h)) - 2.0))).astype(np.float32)
        theirs = naive(*(torch.from_numpy(x) for x in (q, k, v, g))).numpy()
        for method in errors:
            ours = K.forgetting_attention(q, k, v, g, method=method, block_size=64)
            errors[method].append(rel_err(ours, theirs))
    return _record(
        "fla/ops/forgetting_attn/naive.py: naive_forgetting_attn",
        "kernels.forgetting_attention",
        errors,
    )


def log_linear(fla_root: Path) -> dict:
    import torch

    naive = load_naive(fla_root, "log_linear_attn").naive_log_linear_attn
    rng = np.random.default_rng(0)
    errors = {method: [] for method in K.LOG_LINEAR_METHODS}
    for b, t, h, d, dv in SHAPES:
        levels = int(t - 1).bit_length() + 2  # one more than positions 0..t−1 need
        q, k = (rng.standard_normal((b, t, h, d), np.float32) for _ in range(2))
        v = rng.standard_normal((b, t, h, dv), np.float32)
        g = np.log(1.0 / (1.0 + np.exp(-rng.standard_normal((b, t, h)) - 2.0))).astype(np.float32)
        lam = np.log1p(np.exp(rng.standard_normal((b, t, h, levels)))).astype(np.float32)
        theirs = naive(*(torch.from_numpy(x) for x in (q, k, v, g, lam))).numpy()
        for method in errors:
            ours = K.log_linear_attention(q, k, v, g, lam, method=method, chunk_size=16)
            errors[method].append(rel_err(ours, theirs))
    return _record(
        "fla/ops/log_linear_attn/naive.py: naive_log_linear_attn",
        "kernels.log_linear_attention (chunk_size 16)",
        errors,
    )


def mesa_net(fla_root: Path) -> dict:
    """MesaNet from initial states, unit q and k (as the layer gives them). FLA's naive forms
    take Dv = D and, for CG, T a multiple of their chunk (C below); ours runs chunks of 64 with
    T not a multiple. FLA's CG adds 1e-5 to the denominators of its step sizes, ours masks a
    zero one: both are compared with the exact solve, and with each other at 30 iterations."""
    import torch

    naive = load_naive(fla_root, "mesa_net")
    rng = np.random.default_rng(0)
    steps = 30  # FLA's default (max_CG_iteration), training and decoding
    errors = {
        "exact_vs_exact": [],
        "recurrent_cg_vs_exact": [],
        "chunk_cg_vs_exact": [],
        "chunk_cg_vs_fla_cg": [],
        "final_states_vs_exact": [],
        "step_vs_fla_decoding": [],
        "step_cg_vs_exact_solve": [],
        # FLA against itself: how far its CG forms are from its exact solve (their 1e-5 terms)
        "fla_cg_vs_fla_exact": [],
        "fla_decoding_vs_exact_solve": [],
    }

    def unit(x):
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    for b, t, h, d, _ in SHAPES:
        q, k = (unit(rng.standard_normal((b, t, h, d))).astype(np.float32) for _ in range(2))
        v = rng.standard_normal((b, t, h, d), np.float32)
        g = np.log(1.0 / (1.0 + np.exp(-rng.standard_normal((b, t, h)) - 2.0))).astype(np.float32)
        beta = (1.0 / (1.0 + np.exp(-rng.standard_normal((b, t, h))))).astype(np.float32)
        lam = (np.log1p(np.exp(rng.standard_normal((h, d)))) + 0.25).astype(np.float32)
        kk0 = unit(rng.standard_normal((b, h, d, d))).astype(np.float32)
        kk0 = (kk0 @ np.swapaxes(kk0, -1, -2)).astype(np.float32)  # positive semi-definite
        kv0 = rng.standard_normal((b, h, d, d), np.float32)
        torch_in = [torch.from_numpy(x) for x in (q, k, v, g, lam, beta)]
        init = dict(h_kk_init=torch.from_numpy(kk0), h_kv_init=torch.from_numpy(kv0))
        o_ex, kk_ex, kv_ex = (x.numpy() for x in naive.naive_mesa_net_exact(*torch_in, **init))
        chunk = max(c for c in range(1, 65) if t % c == 0)
        o_cg = naive.naive_mesa_net_CG(*torch_in, chunk, steps, **init)[0].numpy()
        errors["fla_cg_vs_fla_exact"].append(rel_err(o_cg, o_ex))
        state = K.MesaNetState(kk0, kv0)
        for method in ("exact", "scan", "chunk"):
            o, s = K.mesa_net(q, k, v, g, beta, lam, initial_state=state, method=method,
                              chunk_size=64, cg_steps=steps, return_state=True)  # fmt: skip
            name = "exact_vs_exact" if method == "exact" else f"{method}_cg_vs_exact"
            errors[name].append(rel_err(o, o_ex))
            errors["final_states_vs_exact"].append(max(rel_err(s.kk, kk_ex), rel_err(s.kv, kv_ex)))
            if method == "chunk":
                errors["chunk_cg_vs_fla_cg"].append(rel_err(o, o_cg))
        # one decoding step from the states after the sequence
        x = [rng.standard_normal((b, h, d), np.float32) for _ in range(3)]
        qs, ks = unit(x[0]).astype(np.float32), unit(x[1]).astype(np.float32)
        gs, bs = g[:, 0], beta[:, 0]
        theirs = naive.naive_mesa_net_decoding_one_step(
            *(torch.from_numpy(z) for z in (qs, ks, x[2], gs, lam, bs)),
            torch.from_numpy(kk_ex), torch.from_numpy(kv_ex), steps,
        )  # fmt: skip
        ours = K.mesa_net_step(K.MesaNetState(kk_ex, kv_ex), qs, ks, x[2], gs, bs, lam,
                               cg_steps=steps)  # fmt: skip
        exact = K.mesa_net_step(K.MesaNetState(kk_ex, kv_ex), qs, ks, x[2], gs, bs, lam,
                                cg_steps=None)[0]  # fmt: skip
        errors["step_cg_vs_exact_solve"].append(rel_err(ours[0], exact))
        errors["fla_decoding_vs_exact_solve"].append(rel_err(theirs[0], exact))
        errors["step_vs_fla_decoding"].append(
            max(rel_err(ours[0], theirs[0]), rel_err(ours[1].kk, theirs[1]),
                rel_err(ours[1].kv, theirs[2]))
        )  # fmt: skip
    return _record(
        "fla/ops/mesa_net/naive.py: naive_mesa_net_exact, naive_mesa_net_CG, "
        "naive_mesa_net_decoding_one_step",
        "kernels.mesa_net (exact, recurrent, chunk; chunk_size 64, cg_steps 30), "
        "kernels.mesa_net_step",
        errors,
    )


def _projected_path(q, k, v, w, beta, a, proj):
    return (K.path_attention(q, k, v, w, beta, a, method="chunk", block_size=32) * proj).sum()


def path(fla_root: Path) -> dict:
    """FLA scales the gate with the logits, softmax(scale·(qᵀPk + G_i − G_j)); this library adds
    it unscaled (FoX's convention), so FLA is given g = log f / scale. Unit w, β ∈ (0, 2), as
    FLA's layer makes them."""
    import torch

    naive = load_naive(fla_root, "path_attn").naive_path_attn
    rng = np.random.default_rng(0)
    errors = {"chunk": [], "quadratic": []}
    grad_errors = []
    for b, t, h, d, dv in SHAPES:
        q, k, w = (rng.standard_normal((b, t, h, d), np.float32) for _ in range(3))
        w /= np.linalg.norm(w, axis=-1, keepdims=True)
        v = rng.standard_normal((b, t, h, dv), np.float32)
        beta = (2.0 / (1.0 + np.exp(-rng.standard_normal((b, t, h))))).astype(np.float32)
        a = np.log(1.0 / (1.0 + np.exp(-rng.standard_normal((b, t, h)) - 2.0))).astype(np.float32)
        scale = d**-0.5
        ours_in = (q, k, v, w, beta, a)
        theirs_in = [torch.from_numpy(x).requires_grad_(True) for x in ours_in]
        out = naive(*theirs_in[:5], theirs_in[5] / scale, scale)
        proj = rng.standard_normal(out.shape).astype(np.float32)
        (out * torch.from_numpy(proj)).sum().backward()
        theirs = out.detach().numpy()
        for method in errors:
            ours = K.path_attention(*ours_in, method=method, block_size=32)
            errors[method].append(rel_err(ours, theirs))

        grads = jax.grad(_projected_path, argnums=tuple(range(6)))(*ours_in, proj)
        grad_errors.append(
            {
                n: rel_err(g, x.grad.numpy())
                for n, g, x in zip("qkvwbg", grads, theirs_in, strict=True)
            }
        )
    return {
        "reference": "fla/ops/path_attn/naive.py: naive_path_attn (g = log f / scale)",
        "ours": "kernels.path_attention (block_size 32; FLA's naive chunk 64)",
        "shapes_BTHDDv": SHAPES,
        "max_rel_err": {m: max(e) for m, e in errors.items()},
        "rel_err_per_shape": errors,
        "grad_max_rel_err_blockwise": max(max(g.values()) for g in grad_errors),
        "grad_rel_err_per_shape_blockwise": grad_errors,
    }


def comba(fla_root: Path) -> dict:
    """Comba from an initial state, unit k, p = k · 0.7 (the layer's p = k · σ(decay)), against
    `naive_recurrent_comba`: outputs and final states of both methods, and the gradients of q,
    k, v, p, β, the log decay and the initial state of the chunk form against torch's autograd
    of the naive recurrence (a weighted sum of the outputs and the final state); FLA's own
    `naive_chunk_comba` against its recurrence beside them."""
    import torch

    naive = load_naive(fla_root, "comba")
    rng = np.random.default_rng(0)
    errors = {"chunk": [], "scan": [], "final_state_chunk": [], "fla_chunk_vs_fla_recurrent": []}
    grads = []
    names = ("q", "k", "v", "p", "beta", "g", "h0")
    for b, t, h, d, dv in SHAPES:
        q, k = (rng.standard_normal((b, t, h, d), np.float32) for _ in range(2))
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
        x = dict(q=q, k=k, v=rng.standard_normal((b, t, h, dv), np.float32), p=0.7 * k)
        x["beta"] = (1 / (1 + np.exp(-rng.standard_normal((b, t, h))))).astype(np.float32)
        x["g"] = -np.log1p(np.exp(rng.standard_normal((b, t, h)) - 2.0)).astype(np.float32)
        x["h0"] = rng.standard_normal((b, h, d, dv)).astype(np.float32)
        wo = rng.standard_normal((b, t, h, dv)).astype(np.float32)
        ws = rng.standard_normal((b, h, d, dv)).astype(np.float32)
        tx = {n: torch.tensor(x[n], requires_grad=True) for n in names}
        o_t, s_t = naive.naive_recurrent_comba(
            *(tx[n] for n in names[:6]), initial_state=tx["h0"], output_final_state=True
        )
        ((o_t * torch.from_numpy(wo)).sum() + (s_t * torch.from_numpy(ws)).sum()).backward()
        o_c, _ = naive.naive_chunk_comba(
            *(torch.from_numpy(x[n]) for n in ("q", "k", "v", "p", "g", "beta")),
            chunk_size=64, initial_state=torch.from_numpy(x["h0"]),
        )  # fmt: skip
        theirs = o_t.detach().numpy()
        errors["fla_chunk_vs_fla_recurrent"].append(rel_err(o_c.numpy(), theirs))
        for method in ("chunk", "scan"):

            def loss(q, k, v, p, beta, g, h0, method=method, wo=wo, ws=ws):
                o, s = K.comba(
                    q, k, v, p, beta, log_decay=g, method=method, chunk_size=64,
                    initial_state=K.LinearAttentionState(h0, None), return_state=True,
                )  # fmt: skip
                return jnp.sum(o * wo) + jnp.sum(s.kv * ws), (o, s.kv)

            g_ours, (o, s) = jax.grad(loss, argnums=tuple(range(7)), has_aux=True)(
                *(x[n] for n in names)
            )
            errors[method].append(rel_err(o, theirs))
            if method == "chunk":
                errors["final_state_chunk"].append(rel_err(s, s_t.detach().numpy()))
                grads.append(
                    {n: rel_err(g, tx[n].grad.numpy()) for n, g in zip(names, g_ours, strict=True)}
                )
    return {
        "reference": "fla/ops/comba/naive.py: naive_recurrent_comba (and naive_chunk_comba)",
        "ours": "kernels.comba (chunk_size 64)",
        "shapes_BTHDDv": SHAPES,
        "max_rel_err": {m: max(e) for m, e in errors.items()},
        "rel_err_per_shape": errors,
        "grad_max_rel_err_chunk": {n: max(g[n] for g in grads) for n in names},
    }


def _torch_heads_first(*arrays):
    """[B, T, H, ·] float32 NumPy arrays as torch tensors [B, H, T, ·] (FLA's older layout)."""
    import torch

    return [torch.from_numpy(np.ascontiguousarray(np.swapaxes(x, 1, 2))) for x in arrays]


def rwkv6(fla_root: Path) -> dict:
    """The `rwkv6` mixer's mapping (`layers.rwkv6.rwkv6_attention`: the linear kernel on k, v
    and log w shifted one token, plus the bonus) against FLA's token loop at scale 1, from a
    random initial state; log w = −exp(N(0, 1)), as the layer makes it."""
    import torch

    from linear_attention.layers.rwkv6 import rwkv6_attention

    naive = load_naive(fla_root, "rwkv6", "recurrent_naive.py").naive_recurrent_rwkv6
    rng = np.random.default_rng(0)
    errors = {m: [] for m in K.METHODS}
    for b, t, h, d, dv in SHAPES:
        r, k = (rng.standard_normal((b, t, h, d), np.float32) for _ in range(2))
        v = rng.standard_normal((b, t, h, dv), np.float32)
        log_w = -np.exp(rng.standard_normal((b, t, h, d))).astype(np.float32)
        u = rng.standard_normal((h, d)).astype(np.float32)
        s0 = rng.standard_normal((b, h, d, dv)).astype(np.float32)
        o, s = naive(*_torch_heads_first(r, k, v, log_w), torch.from_numpy(u), scale=1.0,
                     initial_state=torch.from_numpy(s0), output_final_state=True)  # fmt: skip
        theirs = np.swapaxes(o.numpy(), 1, 2)
        for method in errors:
            ours, state = rwkv6_attention(
                r, k, v, log_w, u, method=method, chunk_size=64,
                initial_state=K.LinearAttentionState(kv=s0, k_sum=None),
            )  # fmt: skip
            errors[method].append(max(rel_err(ours, theirs), rel_err(state.kv, s.numpy())))
    return _record(
        "fla/ops/rwkv6/recurrent_naive.py: naive_recurrent_rwkv6 (scale 1)",
        "layers.rwkv6.rwkv6_attention over kernels.causal_linear_attention "
        "(chunk_size 64), outputs and final state",
        errors,
    )


def _linear_from_state(errors: dict, qkv, log_decay, s0, theirs) -> None:
    """Append per method the larger relative error of `causal_linear_attention`'s outputs and
    final state (from `s0`, no denominator, chunks of 64) against FLA's `theirs` (o, state)."""
    for method in errors:
        ours, state = K.causal_linear_attention(
            *qkv, log_decay=log_decay, normalize=False, method=method, chunk_size=64,
            initial_state=K.LinearAttentionState(kv=s0, k_sum=None), return_state=True,
        )  # fmt: skip
        o, s = (x.numpy() for x in theirs)
        errors[method].append(max(rel_err(ours, o), rel_err(state.kv, s)))


def hgrn2(fla_root: Path) -> dict:
    """The `hgrn2` mixer's mapping (`layers.linear.hgrn2_terms` on the linear kernel) against
    FLA's GLA token loop given what FLA's HGRN2 layer gives it: silu(q), k = 1 − exp(g),
    g = logsigmoid(f), from a random initial state; f ~ N(0, 4)."""
    import torch

    from linear_attention.layers.linear import hgrn2_terms

    naive = load_naive(fla_root, "gla").naive_recurrent_gla
    rng = np.random.default_rng(0)
    errors = {m: [] for m in K.METHODS}
    for b, t, h, d, dv in SHAPES:
        q = rng.standard_normal((b, t, h, d), np.float32)
        f = (2.0 * rng.standard_normal((b, t, h, d))).astype(np.float32)
        v = rng.standard_normal((b, t, h, dv), np.float32)
        s0 = rng.standard_normal((b, h, d, dv)).astype(np.float32)
        tq, tf = torch.from_numpy(q), torch.from_numpy(f)
        g = torch.nn.functional.logsigmoid(tf)
        o, s = naive(torch.nn.functional.silu(tq), 1 - g.exp(), torch.from_numpy(v), g,
                     initial_state=torch.from_numpy(s0), output_final_state=True)  # fmt: skip
        phi_q, phi_k, log_g = hgrn2_terms(q, f, d)
        _linear_from_state(errors, (phi_q, phi_k, v), log_g, s0, (o, s))
    return _record(
        "fla/ops/gla/naive.py: naive_recurrent_gla, given HGRN2's q, k, g (fla/layers/hgrn2.py)",
        "layers.linear.hgrn2_terms on kernels.causal_linear_attention (chunk_size 64), "
        "outputs and final state",
        errors,
    )


def lightning(fla_root: Path) -> dict:
    """The `lightning` mixer's kernel call (a `[H]` log decay −s at MiniMax's slopes of the first
    layer, the fastest decays; silu q, k, v; no scale) against FLA's simple-GLA reference given
    g = −s at every token and scale 1 (FLA's `lightning_attn` has no naive form of its own and
    its slopes are not MiniMax's), from a random initial state."""
    import torch

    from linear_attention.layers.lightning import lightning_slopes

    naive = load_naive(fla_root, "simple_gla").naive_chunk_simple_gla
    rng = np.random.default_rng(0)
    errors = {m: [] for m in K.METHODS}
    for b, t, h, d, dv in SHAPES:
        silu = lambda x: x / (1.0 + np.exp(-x))  # noqa: E731
        q, k = (silu(rng.standard_normal((b, t, h, d))).astype(np.float32) for _ in range(2))
        v = silu(rng.standard_normal((b, t, h, dv))).astype(np.float32)
        s0 = rng.standard_normal((b, h, d, dv)).astype(np.float32)
        log_decay = -lightning_slopes(h, 0.0).astype(np.float32)
        g = np.broadcast_to(log_decay, (b, t, h)).copy()
        o, s = naive(*(torch.from_numpy(x) for x in (q, k, v, g)), scale=1.0,
                     initial_state=torch.from_numpy(s0), output_final_state=True)  # fmt: skip
        _linear_from_state(errors, (q, k, v), log_decay, s0, (o, s))
    return _record(
        "fla/ops/simple_gla/naive.py: naive_chunk_simple_gla (g = -s, scale 1)",
        "kernels.causal_linear_attention with the [H] log decay -s of "
        "layers.lightning.lightning_slopes(H, 0) (chunk_size 64), outputs and final state",
        errors,
    )


def gdn2(fla_root: Path) -> dict:
    """The `gdn2` mixer's mapping (`layers.gdn2.gdn2_attention`: the DPLR kernel with the decay
    folded into its low-rank read, α = −b ⊙ k ⊙ γ, β = k, value w ⊙ v) against FLA's token loop,
    from a random initial state; unit q and k (q scaled by K^-½ on both sides), log γ =
    log σ(N(0, 1)), b = 2σ(N(0, 1)) (`allow_neg_eigval`'s range), w = σ(N(0, 1))."""
    import torch

    from linear_attention.layers.gdn2 import gdn2_attention

    naive = load_naive(fla_root, "gdn2").naive_recurrent_gdn2
    rng = np.random.default_rng(0)
    errors = {m: [] for m in K.DPLR.supported if not K.DPLR.backends(m)}
    sigmoid = lambda x: 1.0 / (1.0 + np.exp(-x))  # noqa: E731
    for b, t, h, d, dv in SHAPES:
        q, k = (rng.standard_normal((b, t, h, d)) for _ in range(2))
        q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
        v = rng.standard_normal((b, t, h, dv))
        log_g = np.log(sigmoid(rng.standard_normal((b, t, h, d))))
        erase = 2.0 * sigmoid(rng.standard_normal((b, t, h, d)))
        write = sigmoid(rng.standard_normal((b, t, h, dv)))
        s0 = rng.standard_normal((b, h, d, dv))
        inputs = [x.astype(np.float32) for x in (q, k, v, log_g, erase, write, s0)]
        o, s = naive(*(torch.from_numpy(x) for x in inputs[:6]), output_final_state=True,
                     initial_state=torch.from_numpy(inputs[6]))  # fmt: skip
        ours_in = [inputs[0] * np.float32(d**-0.5), *inputs[1:6]]
        for method in errors:
            ours, state = gdn2_attention(
                *ours_in, method=method, chunk_size=64,
                initial_state=K.LinearAttentionState(kv=inputs[6], k_sum=None),
            )  # fmt: skip
            errors[method].append(max(rel_err(ours, o.numpy()), rel_err(state.kv, s.numpy())))
    return _record(
        "fla/ops/gdn2/naive.py: naive_recurrent_gdn2",
        "layers.gdn2.gdn2_attention over kernels.dplr_delta_rule (chunk_size 64), "
        "outputs and final state",
        errors,
    )


CHECKS = {
    "forgetting_attn": forgetting,
    "log_linear_attn": log_linear,
    "mesa_net": mesa_net,
    "path_attn": path,
    "comba": comba,
    "rwkv6": rwkv6,
    "hgrn2": hgrn2,
    "lightning": lightning,
    "gdn2": gdn2,
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="peer_check.py", description=__doc__.split("\n")[0])
    parser.add_argument("--fla", required=True, type=Path, help="local flash-linear-attention")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--fla_commit", default="", help="the checkout's commit, for the record")
    parser.add_argument(
        "--family", choices=sorted(CHECKS), action="append", help="check only these (repeatable)"
    )
    args = parser.parse_args(argv)
    try:
        import einops  # noqa: F401
        import torch  # noqa: F401
    except ImportError as e:
        parser.error(f"needs torch and einops ({e}); pip install torch==2.13.0 einops")
    jax.config.update("jax_default_matmul_precision", "highest")
    chosen = args.family or list(CHECKS)
    results = {name: check(args.fla) for name, check in CHECKS.items() if name in chosen}
    record = {
        "fla_commit": args.fla_commit,
        "machine": machine_info(),
        "jax": jax.__version__,
        "torch": sys.modules["torch"].__version__,
        "families": results,
    }
    if args.out:
        if args.out.is_file():  # a check of some families keeps the others' figures
            kept = json.loads(args.out.read_text()).get("families", {})
            record["families"] = {**kept, **results}
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    for name, r in results.items():
        grads = r.get("grad_max_rel_err_blockwise") or r.get("grad_max_rel_err_chunk")
        print(
            f"{name}: max relative error {r['max_rel_err']}"
            + (f", gradients {grads}" if grads else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
