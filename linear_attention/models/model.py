"""`LanguageModel`: a decoder-only LM over the mixer registry, with O(1)-state decoding paths.

    x = embed(tokens) (+ learned position embedding)
    x = block_l(x) for each layer l            pre-norm mixer (+ SwiGLU MLP) residual blocks
    logits = RMSNorm(x) · Eᵀ  (tied) or  RMSNorm(x) W_out          float32

Three paths give the same logits: `__call__(tokens[B, T])`, `prefill(tokens, state)` and
`step(tokens[B], state)`. The state is a plain pytree (`ModelState`): one `MixerState` per layer
(a fixed-size `LinearAttentionState` for linear mixers, a KV cache for softmax) and a position
counter, so a jitted step is compiled once and reused at every position.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from linear_attention.layers import Block, FavorMixer, MixerState, RMSNorm
from linear_attention.models.config import ModelConfig


class ModelState(NamedTuple):
    """Decoding state: per-layer `MixerState`s and `position` (int32 scalar, tokens seen)."""

    layers: tuple[MixerState, ...]
    position: jax.Array


def _check_tokens(tokens, rank: int, layout: str) -> None:
    if jnp.ndim(tokens) != rank or not jnp.issubdtype(jnp.asarray(tokens).dtype, jnp.integer):
        raise ValueError(
            f"tokens must be integers of rank {rank} {layout}, got shape {jnp.shape(tokens)} "
            f"dtype {jnp.asarray(tokens).dtype}"
        )


class LanguageModel(nnx.Module):
    """Decoder-only language model described by a `ModelConfig`."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, ModelConfig):
            raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}")
        self.config = config
        dtype, param_dtype = config.compute_dtype, config.parameter_dtype
        common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        embed_init = nnx.initializers.normal(stddev=0.02)
        self.embed = nnx.Embed(
            config.vocab_size, config.d_model, embedding_init=embed_init, **common
        )
        self.pos_embed = (
            nnx.Embed(config.max_length, config.d_model, embedding_init=embed_init, **common)
            if config.position == "learned"
            else None
        )
        self.blocks = nnx.List(
            [
                Block(
                    config.d_model,
                    config.num_heads,
                    name,
                    mixer_options=config.mixer_options(name),
                    mlp=config.mlp,
                    mlp_ratio=config.mlp_ratio,
                    norm_eps=config.norm_eps,
                    **common,
                )
                for name in config.layer_mixers
            ]
        )
        self.final_norm = RMSNorm(config.d_model, eps=config.norm_eps, **common)
        self.head = (
            None
            if config.tie_embeddings
            else nnx.Linear(config.d_model, config.vocab_size, use_bias=False, **common)
        )

    # ------------------------------------------------------------------ pieces
    def _embed(self, tokens, position):
        x = self.embed(tokens)
        if self.pos_embed is not None:
            t = tokens.shape[-1] if tokens.ndim == 2 else 1
            positions = position + jnp.arange(t, dtype=jnp.int32)
            pos = self.pos_embed(positions)
            x = x + (pos if tokens.ndim == 2 else pos[0])
        return x

    def _logits(self, x):
        x = self.final_norm(x)
        w_DV = self.embed.embedding[...].T if self.head is None else self.head.kernel[...]
        # float32 accumulation and output, whatever the compute dtype
        return jnp.einsum(
            "...d,dv->...v", x, w_DV.astype(x.dtype), preferred_element_type=jnp.float32
        )

    # ------------------------------------------------------------------ paths
    def __call__(self, tokens: jax.Array) -> jax.Array:
        """`tokens[B, T]` -> `logits[B, T, vocab]` float32; position t sees tokens ≤ t only."""
        _check_tokens(tokens, 2, "[B, T]")
        if tokens.shape[1] > self.config.max_length:
            raise ValueError(
                f"tokens has length {tokens.shape[1]} > max_length={self.config.max_length}"
            )
        x = self._embed(tokens, 0)
        for block in self.blocks:
            x = block(x)
        return self._logits(x)

    def init_state(self, batch_size: int, max_length: int | None = None) -> ModelState:
        """Empty decoding state for `batch_size` sequences of up to `max_length` tokens
        (default and upper bound: `config.max_length`; it sizes the softmax KV caches)."""
        max_length = self.config.max_length if max_length is None else max_length
        if not isinstance(max_length, int) or not 1 <= max_length <= self.config.max_length:
            raise ValueError(
                f"max_length must be an int in [1, config.max_length={self.config.max_length}], "
                f"got {max_length!r}"
            )
        layers = tuple(block.init_state(batch_size, max_length) for block in self.blocks)
        return ModelState(layers=layers, position=jnp.zeros((), jnp.int32))

    def _check_state(self, state) -> None:
        if not isinstance(state, ModelState) or len(state.layers) != len(self.blocks):
            raise ValueError(
                f"state must be a ModelState with {len(self.blocks)} layer states "
                "(from model.init_state)"
            )

    def prefill(self, tokens: jax.Array, state: ModelState) -> tuple[jax.Array, ModelState]:
        """Run `tokens[B, T]` after `state`; returns `(logits[B, T, V], new state)`."""
        _check_tokens(tokens, 2, "[B, T]")
        self._check_state(state)
        x = self._embed(tokens, state.position)
        layers = []
        for block, layer_state in zip(self.blocks, state.layers, strict=True):
            x, layer_state = block.prefill(x, layer_state)
            layers.append(layer_state)
        return self._logits(x), ModelState(tuple(layers), state.position + tokens.shape[1])

    def step(self, tokens: jax.Array, state: ModelState) -> tuple[jax.Array, ModelState]:
        """One token per sequence `tokens[B]`; returns `(logits[B, V], new state)`."""
        _check_tokens(tokens, 1, "[B]")
        self._check_state(state)
        x = self._embed(tokens, state.position)
        layers = []
        for block, layer_state in zip(self.blocks, state.layers, strict=True):
            x, layer_state = block.step(x, layer_state)
            layers.append(layer_state)
        return self._logits(x), ModelState(tuple(layers), state.position + 1)


def redraw_features(model: nnx.Module, rng: jax.Array) -> int:
    """Redraw the random projection of every `favor` mixer in `model` (any NNX module tree).

    Layer i (in module order) draws from `fold_in(rng, i)`. Works eagerly or inside `nnx.jit`.
    Returns the number of mixers redrawn.
    """
    count = 0
    for _, module in nnx.iter_modules(model):
        if isinstance(module, FavorMixer):
            module.redraw(jax.random.fold_in(rng, count))
            count += 1
    return count
