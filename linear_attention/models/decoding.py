"""Decoding: a compiled `step`, sampling (`generate`), and the state size (`state_size_bytes`).

Compilation uses split/merge + `jax.jit` with the `GraphDef` static: the compiled function is
cached on the graph definition and shapes, so the same step function serves every position and
every model with the same config (positions live in the state, not in the trace).
"""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from linear_attention.fields import check_int
from linear_attention.models.config import ModelConfig
from linear_attention.models.model import LanguageModel, ModelState
from linear_attention.models.tokens import check_token_ids


@functools.partial(jax.jit, static_argnums=0, donate_argnums=3)
def _step(graphdef, params, tokens, state):
    return nnx.merge(graphdef, params).step(tokens, state)


def step_fn(model: LanguageModel):
    """`model.step` as one compiled function `(tokens[B], state) -> (logits[B, V], state)`.

    The state is donated: its buffers are updated in place (a softmax KV cache is not copied
    per token), so the state passed in must not be used again; keep the returned one. The
    model's variables are captured now (split); call `step_fn` again after updating them.
    """
    graphdef, params = nnx.split(model)
    return functools.partial(_step, graphdef, params)


def _sample(logits_BV, key, temperature: float, top_k: int | None):
    if temperature == 0.0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits_BV = logits_BV.astype(jnp.float32) / temperature
    if top_k is not None:
        kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV >= kth_B1, logits_BV, -jnp.inf)
    return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "num_tokens", "temperature", "top_k"))
def _generate(graphdef, params, prompt, rng, *, num_tokens, temperature, top_k):
    model = nnx.merge(graphdef, params)
    batch, prompt_len = prompt.shape
    state = model.init_state(batch, prompt_len + num_tokens)
    logits, state = model.prefill(prompt, state)
    first = _sample(logits[:, -1], jax.random.fold_in(rng, 0), temperature, top_k)

    def body(carry, i):
        token_B, state = carry
        logits_BV, state = model.step(token_B, state)
        return (_sample(logits_BV, jax.random.fold_in(rng, i), temperature, top_k), state), token_B

    (last, _), tokens_NB = jax.lax.scan(body, (first, state), jnp.arange(1, num_tokens))
    return jnp.concatenate([tokens_NB.T, last[:, None]], axis=1)


def _key(name: str, rng) -> jax.Array:
    """A PRNG key from ``jax.random.key`` (or a legacy ``uint32[2]`` one), or an int seed."""
    if isinstance(rng, int | np.integer) and not isinstance(rng, bool | np.bool_):
        return jax.random.key(int(rng))
    dtype = getattr(rng, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key) and jnp.ndim(rng) == 0:
        return rng
    if dtype == jnp.uint32 and jnp.shape(rng) == (2,):
        return rng
    raise ValueError(
        f"{name} must be a PRNG key (jax.random.key(seed)) or an int seed, got "
        f"{type(rng).__name__} {getattr(rng, 'dtype', '')}{getattr(rng, 'shape', '')}"
    )


def generate(
    model: LanguageModel,
    prompt: jax.Array,
    num_tokens: int,
    *,
    rng: jax.Array | int,
    temperature: float = 1.0,
    top_k: int | None = None,
) -> jax.Array:
    """Sample `num_tokens` tokens after `prompt[B, T0]`; returns the new tokens `[B, num_tokens]`.

    Prefill of the prompt, then `num_tokens − 1` steps in one `lax.scan`, all in one compiled
    function. Token i is drawn from `fold_in(rng, i)` with `softmax(logits / temperature)`,
    restricted to the `top_k` largest logits if set; `temperature=0` is greedy (argmax).
    `rng` is a key (`jax.random.key(seed)`) or an int seed. Every argument is checked first,
    the prompt's token ids included.
    """
    num_tokens, temperature, top_k, rng = _check_generate_args(
        model, prompt, num_tokens, temperature, top_k, rng
    )
    graphdef, params = nnx.split(model)
    return _generate(
        graphdef,
        params,
        jnp.asarray(prompt, jnp.int32),
        rng,
        num_tokens=num_tokens,
        temperature=temperature,
        top_k=top_k,
    )


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "top_k"))
def _prefill_sample(graphdef, params, prompt, state, key, *, temperature, top_k):
    logits, state = nnx.merge(graphdef, params).prefill(prompt, state)
    return _sample(logits[:, -1], key, temperature, top_k), state


@functools.partial(
    jax.jit, static_argnames=("graphdef", "temperature", "top_k"), donate_argnames=("state",)
)
def _step_sample(graphdef, params, token, state, key, *, temperature, top_k):
    logits, state = nnx.merge(graphdef, params).step(token, state)
    return _sample(logits, key, temperature, top_k), state


def generate_stream(
    model: LanguageModel,
    prompt: jax.Array,
    num_tokens: int,
    *,
    rng: jax.Array | int,
    temperature: float = 1.0,
    top_k: int | None = None,
):
    """Yield the `num_tokens` new tokens of `generate` one at a time, each `[B]` as soon as it
    is drawn (for streaming): the same arguments, the same draws (token i from `fold_in(rng,
    i)`), one compiled prefill and one compiled step (state donated) per token."""
    num_tokens, temperature, top_k, rng = _check_generate_args(
        model, prompt, num_tokens, temperature, top_k, rng
    )
    graphdef, params = nnx.split(model)
    prompt = jnp.asarray(prompt, jnp.int32)
    options = dict(graphdef=graphdef, temperature=temperature, top_k=top_k)
    state = model.init_state(prompt.shape[0], prompt.shape[1] + num_tokens)
    token, state = _prefill_sample(
        params=params, prompt=prompt, state=state, key=jax.random.fold_in(rng, 0), **options
    )
    yield token
    for i in range(1, num_tokens):
        token, state = _step_sample(
            params=params, token=token, state=state, key=jax.random.fold_in(rng, i), **options
        )
        yield token


def _check_generate_args(model, prompt, num_tokens, temperature, top_k, rng):
    """``(num_tokens, temperature, top_k, rng)`` as Python ints/floats and a key, once every
    argument of `generate` is checked (ValueError naming the bad one)."""
    config = model.config
    if jnp.ndim(prompt) != 2 or not jnp.issubdtype(jnp.asarray(prompt).dtype, jnp.integer):
        raise ValueError(f"prompt must be integer tokens [B, T0], got shape {jnp.shape(prompt)}")
    if 0 in jnp.shape(prompt):
        raise ValueError(f"prompt must hold at least one token per row, got shape {prompt.shape}")
    check_token_ids(prompt, config.vocab_size, name="prompt")
    num_tokens = check_int("num_tokens", num_tokens)
    total = prompt.shape[1] + num_tokens
    if total > config.max_length:
        raise ValueError(
            f"prompt length {prompt.shape[1]} + num_tokens {num_tokens} = {total} exceeds "
            f"max_length={config.max_length}"
        )
    ok = isinstance(temperature, numbers.Real) and not isinstance(temperature, bool | np.bool_)
    if not ok or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a number >= 0 and finite, got {temperature!r}")
    top_k = None if top_k is None else check_int("top_k", top_k, minimum=None)
    if top_k is not None and not 1 <= top_k <= config.vocab_size:
        raise ValueError(f"top_k must be None or an int in [1, {config.vocab_size}], got {top_k!r}")
    return num_tokens, float(temperature), top_k, _key("rng", rng)


def state_size_bytes(config: ModelConfig) -> int:
    """Bytes of decoding state per sequence for a model with `config`.

    Linear mixers: the float32 `LinearAttentionState` (kv `H·M·Dv` + k_sum `H·M`) and the conv
    tail — fixed, whatever the context. Softmax mixers: the KV cache at `config.max_length`
    (`2·L·H·D` in the compute dtype), which grows linearly with the context. `swa` mixers: a ring
    buffer of `window` keys and values (`2·W·H·D`, compute dtype), fixed. Computed without
    allocating, as init_state(batch 2) − init_state(batch 1), so the per-batch position counters
    are not counted.
    """
    if not isinstance(config, ModelConfig):
        raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}")

    def total(batch: int) -> int:
        shapes = jax.eval_shape(
            lambda: LanguageModel(config, rngs=nnx.Rngs(0)).init_state(batch, config.max_length)
        )
        return sum(int(np.prod(s.shape)) * s.dtype.itemsize for s in jax.tree.leaves(shapes))

    return total(2) - total(1)


__all__ = ["ModelState", "generate", "generate_stream", "state_size_bytes", "step_fn"]
