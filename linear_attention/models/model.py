"""`LanguageModel`: a decoder-only LM over the mixer registry, with O(1)-state decoding paths.

    x = embed(tokens) (+ learned position embedding)
    x = block_l(x) for each layer l            mixer (+ SwiGLU MLP) residual blocks, pre-norm
                                               (or post-norm: `config.norm_position`)
    logits = RMSNorm(x) · Eᵀ  (tied) or  RMSNorm(x) W_out          float32

Packed rows: `__call__(tokens, segment_ids[B, T])` runs each document of a row on its own (every
mixer, its conv and rotary positions, and learned positions, which restart at each document
when `config.reset_positions`), so a packed row gives the logits of its documents run alone.

Three paths give the same logits: `__call__(tokens[B, T])`, `prefill(tokens, state)` and
`step(tokens[B], state)`. The state is a plain pytree (`ModelState`): one `MixerState` per layer
(a fixed-size `LinearAttentionState` for linear mixers, a KV cache for softmax) and a position
counter, so a jitted step is compiled once and reused at every position.

Checks: token ids outside [0, vocab) and learned positions past max_length raise on concrete
input; under jit they give NaN logits at their own positions only (see `tokens`). A state
must fit the model: its structure, shapes and dtypes are those of `init_state` (`_check_state`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from linear_attention.layers import (
    Block,
    FavorMixer,
    MixerState,
    RMSNorm,
    RouterStats,
    add_router_stats,
    segments_of,
)
from linear_attention.layers.sequence import sequence_offset
from linear_attention.models.config import MAX_POSITION, ModelConfig
from linear_attention.models.init import transformers_init
from linear_attention.models.tokens import check_token_ids, is_concrete


class ModelState(NamedTuple):
    """Decoding state: per-layer `MixerState`s and `position` (int32 scalar, tokens seen)."""

    layers: tuple[MixerState, ...]
    position: jax.Array


class Hidden(NamedTuple):
    """What `LanguageModel.hidden_states` reads on the way through the layers.

    residuals     num_layers + 1 arrays `[B, T, D]`: the stream entering each block (the
                  embeddings first), then the last block's output (before the final norm)
    mixer_inputs  num_layers arrays `[B, T, D]`: each block's mixer input (its `mixer_norm` of
                  the entering stream; the stream itself in a post-norm block)
    segments      the `Segments` of packed rows the mixers saw, or None
    logits        `[B, T, vocab]` float32, equal to the model's `__call__`
    """

    residuals: tuple
    mixer_inputs: tuple
    segments: object
    logits: jax.Array


def _check_tokens(tokens, rank: int, layout: str) -> None:
    if jnp.ndim(tokens) != rank or not jnp.issubdtype(jnp.asarray(tokens).dtype, jnp.integer):
        raise ValueError(
            f"tokens must be integers of rank {rank} {layout}, got shape {jnp.shape(tokens)} "
            f"dtype {jnp.asarray(tokens).dtype}"
        )


# (config, batch, cache length) -> the shapes of init_state's result, for `_check_state`.
_STATE_SHAPES: dict = {}


# The checkpoint policy of each `ModelConfig.remat` other than "none".
_REMAT_POLICIES = {
    "block": None,  # save nothing inside a block: only its input is kept
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _scanned_blocks(blocks, pattern_length: int, policy, x_BTD, segments):
    """The blocks applied in order, as a `jax.lax.scan` over the repeats of the mixer pattern
    (the body: one block of each pattern position, each under `jax.checkpoint` with ``policy``);
    returns the output and the blocks' `RouterStats` summed (None without experts).

    Why a scan: a checkpointed block's recomputation must run in the backward pass, next to
    where its result is used. Inside a scan body XLA cannot hoist it out (it can only run in
    the backward loop's own iteration); in an unrolled loop of layers XLA's CPU backend
    scheduled the recomputations early and the compiled step's memory did not drop (seen while
    building this: the same bytes with and without `jax.checkpoint` on 4 softmax layers). The
    block states are stacked at call time (the parameters stay one per layer, as without
    remat), so the stacked copy of the blocks' parameters is the price."""
    repeats = len(blocks) // pattern_length
    graphdefs, stacked = [], []
    for j in range(pattern_length):
        states = []
        for r in range(repeats):
            graphdef, state = nnx.split(blocks[r * pattern_length + j])
            states.append(state)
        graphdefs.append(graphdef)
        stacked.append(jax.tree.map(lambda *xs: jnp.stack(xs), *states))

    def body(x_BTD, states):
        router = None
        for graphdef, state in zip(graphdefs, states, strict=True):
            run = lambda state, x: nnx.merge(graphdef, state).routed(x, segments)  # noqa: B023, E731
            x_BTD, stats = jax.checkpoint(run, policy=policy, prevent_cse=False)(state, x_BTD)
            router = add_router_stats(router, stats)
        return x_BTD, router

    # (the stats of each repeat come out stacked, [repeats, ...], and are summed here)
    x_BTD, router = jax.lax.scan(body, x_BTD, stacked)
    return x_BTD, jax.tree.map(lambda a: jnp.sum(a, axis=0), router)


class LanguageModel(nnx.Module):
    """Decoder-only language model described by a `ModelConfig`."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, ModelConfig):
            raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}")
        self.config = config
        dtype, param_dtype = config.compute_dtype, config.parameter_dtype
        # Built in float32, then cast: every initialiser computes in float32 (some, like the
        # orthogonal one's QR, have no bfloat16 kernel), so a bfloat16 model holds the float32
        # model's parameters, rounded.
        common = dict(dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
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
                    config.layer_num_heads(name),
                    name,
                    mixer_config=config.mixer_config(name),
                    mlp=config.mlp,
                    mlp_ratio=config.mlp_ratio,
                    mlp_dim=config.mlp_dim,
                    moe=config.layer_moe_options(i),
                    norm_eps=config.norm_eps,
                    norm_position=config.layer_norm_position(name),
                    **common,
                )
                for i, name in enumerate(config.layer_mixers)
            ]
        )
        self.final_norm = RMSNorm(config.d_model, eps=config.norm_eps, **common)
        self.head = (
            None
            if config.tie_embeddings
            else nnx.Linear(config.d_model, config.vocab_size, use_bias=False, **common)
        )
        if config.initializer_range is not None:
            transformers_init(self, config.initializer_range, rngs.params(), config.initializer)
        if param_dtype != jnp.float32:
            params = nnx.state(self, nnx.Param)
            nnx.update(self, jax.tree.map(lambda x: x.astype(param_dtype), params))
            for _, module in nnx.iter_modules(self):
                if hasattr(module, "param_dtype"):
                    module.param_dtype = param_dtype

    # ------------------------------------------------------------------ pieces
    def _embed(self, tokens, position, segments=None):
        """``(x, valid)``: embeddings, and whether each position has a token id in range (and,
        with learned positions, a position < max_length). Invalid positions embed as zeros so
        that nothing NaN reaches the mixers (`_logits` marks them NaN). With `segments`
        (packed rows) and `config.reset_positions`, learned positions restart per document."""
        config = self.config
        valid = (tokens >= 0) & (tokens < config.vocab_size)
        x = self.embed(jnp.where(valid, tokens, 0))
        if self.pos_embed is not None:
            t = tokens.shape[-1] if tokens.ndim == 2 else 1
            positions = position + jnp.arange(t, dtype=jnp.int32)
            if segments is not None and config.reset_positions:
                positions = segments.positions  # [B, T]
            in_range = positions < config.max_length
            pos = self.pos_embed(jnp.where(in_range, positions, 0))
            x = x + (pos if tokens.ndim == 2 else pos[0])
            valid = valid & (in_range if tokens.ndim == 2 else in_range[0])
        return jnp.where(valid[..., None], x, jnp.zeros((), x.dtype)), valid

    def output_embedding(self) -> jax.Array:
        """``W [D, V]`` of ``logits = RMSNorm(x) · W``: the token embedding's transpose when tied,
        else the head's kernel (in the parameter dtype)."""
        return self.embed.embedding[...].T if self.head is None else self.head.kernel[...]

    def _logits(self, x, valid):
        x = self.final_norm(x)
        # float32 accumulation and output, whatever the compute dtype
        logits = jnp.einsum(
            "...d,dv->...v",
            x,
            self.output_embedding().astype(x.dtype),
            preferred_element_type=jnp.float32,
        )
        return jnp.where(valid[..., None], logits, jnp.nan)

    # ------------------------------------------------------------------ paths
    def __call__(self, tokens: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        """`tokens[B, T]` -> `logits[B, T, vocab]` float32; position t sees tokens ≤ t only, and
        with `segment_ids[B, T]` (int; a document is a run of equal ids) only its document's."""
        return self.logits_and_router_stats(tokens, segment_ids)[0]

    def logits_and_router_stats(
        self, tokens: jax.Array, segment_ids: jax.Array | None = None
    ) -> tuple[jax.Array, RouterStats | None]:
        """`__call__`'s logits and the `RouterStats` of every MoE layer's router, summed over the
        layers and the tokens (None when the MLPs are not mixtures of experts): what training's
        load-balancing loss reads (`layers.moe.load_balancing_loss`)."""
        x, valid, router = self.features_and_router_stats(tokens, segment_ids)
        return self._logits(x, valid), router

    def features_and_router_stats(
        self, tokens: jax.Array, segment_ids: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array, RouterStats | None]:
        """``(x [B, T, D], valid [B, T], router)``: the last block's output before the final
        norm, whether each position's logits are defined (`_logits` makes the others NaN) and
        the router stats: what a loss that projects onto `output_embedding` itself reads
        (`training.chunked_loss`, which never holds the ``[B, T, V]`` logits)."""
        x, valid, segments = self._inputs(tokens, segment_ids)
        if self.config.remat == "none":
            router = None
            for block in self.blocks:
                x, stats = block.routed(x, segments)
                router = add_router_stats(router, stats)
        else:
            pattern = 1 if isinstance(self.config.mixer, str) else len(self.config.mixer)
            policy = _REMAT_POLICIES[self.config.remat]
            # The dense-MLP layers first differ from the rest: one scan step of their own, and
            # the rest by the pattern when it fits them (any run of layers repeats the pattern)
            dense, blocks = self.config.moe_dense_layers, list(self.blocks)
            if dense:  # (their MLPs have no router)
                x, _ = _scanned_blocks(blocks[:dense], dense, policy, x, segments)
            rest = len(blocks) - dense
            pattern = pattern if rest % pattern == 0 else rest
            x, router = _scanned_blocks(blocks[dense:], pattern, policy, x, segments)
        return x, valid, router

    def hidden_states(self, tokens: jax.Array, segment_ids: jax.Array | None = None) -> Hidden:
        """The full pass of `__call__` with what analysis reads on the way (`Hidden`): the
        residual stream entering each block and leaving the last, each mixer's (normalised)
        input, the `Segments` the mixers saw, and the logits, equal to `__call__`'s. Same checks,
        positions and NaN guard; the blocks run unscanned (no remat: it is not a training path).
        `layers.attention_inputs(model.blocks[i].mixer, hidden.mixer_inputs[i])` then gives a
        layer's q, k, v and decay."""
        x, valid, segments = self._inputs(tokens, segment_ids)
        residuals, mixer_inputs = [x], []
        for block in self.blocks:
            mixer_inputs.append(block.mixer_input(x))
            x = block(x, segments)
            residuals.append(x)
        logits = self._logits(x, valid)
        return Hidden(tuple(residuals), tuple(mixer_inputs), segments, logits)

    def _inputs(self, tokens, segment_ids):
        """Checked tokens embedded `(x, valid, segments)`, for the full-sequence paths."""
        _check_tokens(tokens, 2, "[B, T]")
        if tokens.shape[1] > self.config.max_length:
            raise ValueError(
                f"tokens has length {tokens.shape[1]} > max_length={self.config.max_length}"
            )
        check_token_ids(tokens, self.config.vocab_size)
        # checked and turned into document ids, starts and positions once, for every layer (with
        # time split, the whole row's ids and positions: `segments_of`)
        segments = None if segment_ids is None else segments_of(segment_ids, *tokens.shape)
        # position 0 unless time is split
        x, valid = self._embed(tokens, sequence_offset(tokens.shape[1]), segments)
        return x, valid, segments

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

    def _state_shapes(self, batch: int, length: int) -> ModelState:
        key = (self.config, batch, length)
        if key not in _STATE_SHAPES:
            _STATE_SHAPES[key] = jax.eval_shape(lambda: self.init_state(batch, length))
        return _STATE_SHAPES[key]

    def _check_state(self, state, batch: int, num_new: int) -> None:
        """``state`` must be what ``init_state(batch, ...)`` of this model's config makes (the
        softmax cache length may differ), with room for ``num_new`` more tokens (checked when
        the position is concrete)."""
        if not isinstance(state, ModelState) or len(state.layers) != len(self.blocks):
            raise ValueError(
                f"state must be a ModelState with {len(self.blocks)} layer states "
                "(from model.init_state)"
            )
        config = self.config
        # Shapes for two cache lengths: the axes where they differ may have any length.
        lengths = (1, 2) if config.max_length >= 2 else (1, 1)
        short, longer = (self._state_shapes(batch, n).layers for n in lengths)
        position = int(state.position) if is_concrete(state.position) else None
        for i, (layer, want, want2) in enumerate(zip(state.layers, short, longer, strict=True)):
            name = f"state.layers[{i}] ({config.layer_mixers[i]})"
            if isinstance(layer, MixerState) and layer.kind != want.kind:
                if layer.kind:
                    raise ValueError(
                        f"{name} was made by a {layer.kind!r} mixer: a state from another model"
                    )
                layer = layer._replace(kind=want.kind)  # built by hand: its shapes are checked
            if jax.tree.structure(layer) != jax.tree.structure(want):
                raise ValueError(
                    f"{name} has the structure {jax.tree.structure(layer)}, but this model's "
                    f"is {jax.tree.structure(want)}: a state from a model with another config"
                )
            got_leaves = jax.tree_util.tree_flatten_with_path(layer)[0]
            for (path, got), w, w2 in zip(
                got_leaves, jax.tree.leaves(want), jax.tree.leaves(want2), strict=True
            ):
                where = f"{name}{jax.tree_util.keystr(path)}"
                _check_state_leaf(where, got, w, w2, batch, position, num_new, name)
        if position is not None and position + num_new > MAX_POSITION:
            raise ValueError(
                f"state.position {position} + {num_new} token(s) would pass {MAX_POSITION} "
                "(2**31 - 1): positions are int32 and would wrap to negative"
            )
        if self.pos_embed is not None and position is not None:
            if position + num_new > config.max_length:
                raise ValueError(
                    f"position {position} + {num_new} token(s) exceeds max_length="
                    f"{config.max_length} of the learned position embedding"
                )

    def prefill(self, tokens: jax.Array, state: ModelState) -> tuple[jax.Array, ModelState]:
        """Run `tokens[B, T]` after `state`; returns `(logits[B, T, V], new state)`."""
        _check_tokens(tokens, 2, "[B, T]")
        self._check_state(state, tokens.shape[0], tokens.shape[1])
        check_token_ids(tokens, self.config.vocab_size)
        x, valid = self._embed(tokens, state.position)
        layers = []
        for block, layer_state in zip(self.blocks, state.layers, strict=True):
            x, layer_state = block.prefill(x, layer_state)
            layers.append(layer_state)
        return self._logits(x, valid), ModelState(tuple(layers), state.position + tokens.shape[1])

    def step(self, tokens: jax.Array, state: ModelState) -> tuple[jax.Array, ModelState]:
        """One token per sequence `tokens[B]`; returns `(logits[B, V], new state)`."""
        _check_tokens(tokens, 1, "[B]")
        self._check_state(state, tokens.shape[0], 1)
        check_token_ids(tokens, self.config.vocab_size)
        x, valid = self._embed(tokens, state.position)
        layers = []
        for block, layer_state in zip(self.blocks, state.layers, strict=True):
            x, layer_state = block.step(x, layer_state)
            layers.append(layer_state)
        return self._logits(x, valid), ModelState(tuple(layers), state.position + 1)


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


def _check_state_leaf(where, got, want, want2, batch, position, num_new, name) -> None:
    """One array ``got`` of a layer's state against this model's, ``want`` and ``want2`` (its
    shapes for cache lengths 1 and 2: the axes where they differ may have any length, and must
    have room for ``num_new`` more tokens after ``position`` when that is known)."""
    shape = tuple(jnp.shape(got))
    dtype = getattr(got, "dtype", None) or np.asarray(got).dtype
    pairs = enumerate(zip(want.shape, want2.shape, strict=True))
    free = {ax for ax, (a, b) in pairs if a != b}
    fits = len(shape) == len(want.shape) and all(
        n == m or ax in free for ax, (n, m) in enumerate(zip(shape, want.shape, strict=False))
    )
    if not fits or dtype != want.dtype:
        expected = tuple("L" if ax in free else n for ax, n in enumerate(want.shape))
        raise ValueError(
            f"{where} has shape {shape} {dtype}, but this model's is {expected} {want.dtype} "
            f"for batch {batch}: a state from a model with another config (e.g. conv width, "
            "heads or head size)"
        )
    if free and position is not None:
        capacity = min(shape[ax] for ax in free)
        if position + num_new > capacity:
            raise ValueError(
                f"{name} holds {capacity} tokens (init_state's max_length); it has "
                f"{position} and cannot take {num_new} more"
            )
