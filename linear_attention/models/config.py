"""`ModelConfig`: the frozen, validated description of a `LanguageModel`.

Training builds it from a ConfigDict at the boundary, `ModelConfig(**dict(config.model))`, so every
field is a plain Python scalar, string or tuple (a list for `mixer` is accepted and turned into a
tuple; `dtype` / `param_dtype` may be a dtype or its name and are stored as the name).

Its fields are the model's own (sizes, positions, MLP, dtypes, the options shared by every
mixer) and the mixers' own options, each declared once below. A mixer's option that is not a
field here fails at import (`_check_mixer_options`): a new option is one line here. Mixer
options default to None, "the mixer's default"; one that no layer's mixer uses raises a
ValueError naming it and the mixers.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

from linear_attention.fields import (
    POSITIVE,
    check_choice,
    check_fields,
    check_int,
    fail,
    kinds,
    spec_field,
)
from linear_attention.kernels.log_linear.fenwick import capacity
from linear_attention.layers import MIXERS, MixerConfig, get_mixer
from linear_attention.layers.block import NORM_POSITIONS
from linear_attention.layers.moe import DEFAULT_ROUTER, ROUTERS, check_moe_options
from linear_attention.layers.options import CONV
from linear_attention.layers.registry import DEFAULT_MIXER
from linear_attention.models.init import INIT_MIXERS, INITIALIZERS

POSITIONS = ("none", "learned", "rope")
# The block options `layer_options` may set per layer type, beside the mixer's own.
BLOCK_OPTIONS = ("num_heads", "norm_position")
# Rematerialisation: what the backward pass keeps of each block's forward pass (see `remat`).
REMAT = ("none", "block", "dots", "dots_no_batch")
DTYPES = ("float32", "bfloat16", "float16")
# The largest position a decoding state can count to: positions are int32 (as token ids are),
# so a counter past it would wrap to a negative position rather than fail.
MAX_POSITION = 2**31 - 1


def _dtype_name(name: str, value) -> str:
    try:
        dtype = jnp.dtype(value).name
    except TypeError:
        dtype = value
    return check_choice(name, dtype, DTYPES)


def _scalar(name: str, value):
    if isinstance(value, np.generic):
        value = value.item()
    if value is not None and not isinstance(value, bool | int | float | str):
        fail(name, "a bool, number, string or None", value, show_type=True)
    return value


class FrozenMapping(dict):
    """A dict that cannot change and hashes (a `ModelConfig` field must hash: configs key the
    caches of state shapes), written to JSON as an object, so that a run's config.json holds
    `layer_options` as `{mixer: {option: value}}` and `--config.model.layer_options.<mixer>.
    <option>=...` overrides it."""

    def __hash__(self):
        return hash(tuple(sorted(self.items())))

    def _frozen(self, *args, **kwargs):
        raise TypeError("a FrozenMapping cannot change (make a new ModelConfig)")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _frozen
    __ior__ = _frozen


def _layer_options(name: str, value) -> FrozenMapping:
    """`layer_options` as a `FrozenMapping` `{mixer: FrozenMapping({option: value})}`, sorted;
    given as a mapping or as `(mixer, options)` pairs."""
    if isinstance(value, list | tuple) and all(
        isinstance(e, list | tuple) and len(e) == 2 and isinstance(e[0], str) for e in value
    ):
        value = dict(value)
    if not isinstance(value, Mapping):
        fail(name, "a mapping {mixer: {option: value}}", value, show_type=True)
    table = {}
    for mixer, options in value.items():
        if isinstance(options, list | tuple) and all(
            isinstance(o, list | tuple) and len(o) == 2 for o in options
        ):
            options = dict(options)
        if not isinstance(mixer, str) or not isinstance(options, Mapping):
            fail(f"{name}[{mixer!r}]", "a mapping {option: value}", options)
        where = f"{name}[{mixer!r}]"
        table[mixer] = FrozenMapping(
            sorted((o, _scalar(f"{where}[{o!r}]", v)) for o, v in options.items())
        )
    return FrozenMapping(sorted(table.items()))


def _mixer_names(name: str, value):
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return tuple(value)
    if not isinstance(value, str):
        fail(name, "a name or a tuple of names", value)
    return value


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only language model: embeddings, `num_layers` residual blocks (pre-norm by
    default), RMSNorm, the output head.

    Fields:
      vocab_size, d_model, num_layers, num_heads: sizes; `head_dim` defaults to d_model/num_heads.
      mixer: a registry name (`layers.MIXERS`) for every layer, or a tuple of names: one per
        layer, or a shorter pattern whose length divides `num_layers`, repeated (`("gated",
        "softmax")` with 4 layers is gated, softmax, gated, softmax). Based: `("taylor", "swa")`
        with feature_dim=16 (README, "Based").
      conv: short causal conv on q/k/v: False, True (kernel 4) or a kernel size; None: each
        mixer's default (on for the delta-rule mixers, off for the others).
      out_norm, out_gate: per-head output RMSNorm / output gate (None: each mixer's default).
      mlp, mlp_ratio: SwiGLU MLP in every block (Zoology's MQAR models use none).
      mlp_dim: the MLP's hidden width (None: int(mlp_ratio · d_model); when set, mlp_ratio is
        not used), e.g. a released checkpoint's intermediate_size.
      num_experts, experts_per_token, moe_dim, shared_expert_dim, moe_norm_topk: with
        num_experts > 0 every block's MLP is a mixture of that many SwiGLU experts of width
        moe_dim (None: the MLP width), experts_per_token chosen per token by a softmax router
        (renormalised to sum 1 unless moe_norm_topk=False), plus a shared expert of width
        shared_expert_dim behind a sigmoid gate (None: none) — Qwen3-Next's (`layers.moe`).
      moe_router ("softmax" or "sigmoid" scores), moe_score_bias (a learned bias on the scores
        that only picks the experts), moe_groups / moe_topk_groups (the experts chosen among
        the moe_topk_groups best of moe_groups groups), moe_routed_scale (the routed experts'
        weights times this), moe_shared_gate (False: the shared expert is added ungated):
        DeepSeek-V3's and Kimi Linear's routing (`layers.moe`); None: Qwen3-Next's.
      moe_dense_layers: the first this many layers have a dense SwiGLU MLP of width mlp_dim
        instead of the experts (DeepSeek's first_k_dense_replace; default 0).
      moe_aux_loss_coef: the weight of the auxiliary load-balancing loss that training adds to
        the cross-entropy (`layers.moe.load_balancing_loss` over every MoE layer's router, as
        transformers' `router_aux_loss_coef` with `output_router_logits`); 0: none. >= 0,
        needs num_experts > 0 and the softmax router (no score bias, no groups).
      norm_position: where each block's two RMSNorms sit: "pre" (`x + f(norm(x))`, the default)
        or "post" (`x + norm(f(x))`: the sublayer's output normalised before the residual add,
        OLMo 2's reordered norm, as OLMo Hybrid's attention layers), f the mixer, then the MLP.
      layer_options: per-layer-type settings, `{mixer: {option: value}}`: the layers of that
        mixer take `num_heads`, `norm_position` and any of the mixer's options (common ones
        such as `head_dim`, `rope`, `out_gate`, or its own) from here instead of the
        model-wide fields. A hybrid whose attention layers have other head counts and dims
        than its linear layers, or rotary positions on the softmax layers only: `{"softmax":
        {"num_heads": 8, "head_dim": 32, "rope": True}}`. A mixer no layer uses, or an option
        the mixer lacks, raises.
      position: "none", "learned" (absolute embeddings, needs max_length) or "rope" (all mixers).
      reset_positions: with packed rows (`model(tokens, segment_ids)`), positions (learned or
        rope) restart at 0 at each document, as if it were run alone (default True; False:
        they count along the row). Only meaningful with position "learned" or "rope".
      max_length: the longest sequence (learned positions; the softmax KV cache in decoding);
        at most 2**31 − 1, the largest int32 position.
      redraw_interval: training redraws `favor` projections every this many steps (0: never).
      dtype, param_dtype: compute and parameter dtypes (names); param_dtype "bfloat16" keeps
        parameters and optimizer state in bfloat16 (half the memory of both).
      remat: rematerialisation of each block in training: "none" (the backward pass keeps every
        activation), "block" (keeps only each block's input and recomputes the rest: memory
        per layer drops to one [B, T, D] array, for about one more forward pass), "dots"
        (`jax.checkpoint_policies.dots_saveable`: matmul outputs kept, elementwise work
        recomputed) or "dots_no_batch" (`dots_with_no_batch_dims_saveable`: only matmuls
        without batch dimensions kept, i.e. the projections, not the attention scores). Any
        value but "none" runs the blocks as a `jax.lax.scan` over the repeats of the mixer
        pattern (see `model._scanned_blocks`): the same numbers, one compiled body.
      tie_embeddings: output head shares the token embedding.
      initializer_range: None: this library's initialisers; a value r: transformers'
        initialisation of the layers' architectures (`models.init`: Linear kernels, embeddings
        and experts ~ N(0, r²), each architecture's A_log / dt_bias / D / conv), as a converted
        checkpoint's `initializer_range`; every layer's mixer must be one of
        `models.init.INIT_MIXERS`.
      initializer: the architecture whose `_init_weights` `initializer_range` follows (a key of
        `models.init.INITIALIZERS`: qwen3_5, mamba2, kimi_linear, olmo_hybrid, bamba, mamba; each
        has its layers' mixers); None: each layer by its mixer (gated_deltanet as Qwen3.5, gated
        as Mamba-2, kda and mla as Kimi Linear, mamba as Mamba-1). Needs initializer_range.
      The mixers' own options (`method`, `chunk_size`, `eps`, `feature_map`, `feature_dim`,
      `feature_scale`, `allow_neg_eigval`, `num_value_heads`, `window`, `num_householder`,
      `forget_bias`, `cg_steps`, `num_levels`, `forget_gate`, `state_dim` (Mamba-2's N, a
      Gated DeltaNet's key width), `dt_input`, `d_skip`, `gate_before_norm`, `out_norm_groups`,
      `out_norm_eps` on `gated` and the delta rules, KDA's `gate_bias`, MLA's `kv_rank`,
      `q_rank`, `rope_dim`, `nope_dim`, softmax's `qk_norm_all_heads`, Mamba-1's `expand` and
      `dt_rank`, Griffin's `lru_width`, ...: the union of the
      fields of the mixers' `Config` dataclasses, described there and by `la-train --help`):
      None is each mixer's default; a value must be used by at least one layer and is passed
      to the layers whose mixer uses it. `mixer_config(name)` is the typed config of a layer's
      mixer, made and checked once here.

    Every field is checked in `__post_init__` by `fields.check_fields` (ValueError names it), types
    strictly: bools must be bools (not "False" or 0), numbers finite; NumPy scalars are accepted
    and stored as Python ints, floats and bools. The mixer options are checked by the mixers'
    configs (and take their converted values).
    """

    vocab_size: int
    d_model: int = 128
    num_layers: int = 2
    num_heads: int = 2
    head_dim: int | None = None
    mixer: str | tuple[str, ...] = spec_field(DEFAULT_MIXER, convert=_mixer_names)
    conv: bool | int | None = CONV.field()
    out_norm: bool | None = None
    out_gate: bool | None = None
    mlp: bool = True
    mlp_ratio: float = spec_field(4.0, **POSITIVE)
    mlp_dim: int | None = None
    num_experts: int = spec_field(0, minimum=0)
    experts_per_token: int | None = None
    moe_dim: int | None = None
    shared_expert_dim: int | None = None
    moe_norm_topk: bool | None = None
    moe_router: str | None = spec_field(None, choices=tuple(ROUTERS))
    moe_score_bias: bool | None = None
    moe_groups: int | None = None
    moe_topk_groups: int | None = None
    moe_routed_scale: float | None = spec_field(None, **POSITIVE)
    moe_shared_gate: bool | None = None
    moe_dense_layers: int = spec_field(0, minimum=0)
    moe_aux_loss_coef: float = spec_field(0.0, low=0.0)
    position: str = spec_field("none", choices=POSITIONS)
    rope_base: float = spec_field(10000.0, **POSITIVE)
    reset_positions: bool = True
    max_length: int = 2048
    norm_eps: float = spec_field(1e-6, **POSITIVE)
    redraw_interval: int = spec_field(0, minimum=0)
    dtype: str = spec_field("float32", convert=_dtype_name)
    param_dtype: str = spec_field("float32", convert=_dtype_name)
    tie_embeddings: bool = True
    initializer_range: float | None = spec_field(None, **POSITIVE)
    initializer: str | None = spec_field(None, choices=tuple(INITIALIZERS))
    norm_position: str = spec_field("pre", choices=NORM_POSITIONS)
    remat: str = spec_field("none", choices=REMAT)
    layer_options: FrozenMapping = spec_field(FrozenMapping(), convert=_layer_options)
    # The mixers' own options (None: each mixer's default), checked by the mixers' configs.
    feature_map: str | None = None
    feature_scale: float | None = None
    method: str | None = None
    chunk_size: int | None = None
    eps: float | None = None
    feature_dim: int | None = None
    allow_neg_eigval: bool | None = None
    num_value_heads: int | None = None
    state_dim: int | None = None
    dt_input: bool | None = None
    d_skip: bool | None = None
    gate_before_norm: bool | None = None
    out_norm_groups: int | None = None
    out_norm_eps: float | None = None
    window: int | None = None
    num_householder: int | None = None
    forget_bias: float | None = None
    cg_steps: int | None = None
    conv_bias: bool | None = None
    out_norm_shared: bool | None = None
    num_kv_heads: int | None = None
    qk_norm: bool | None = None
    qk_norm_all_heads: bool | None = None
    rotary_dim: int | None = None
    gate_activation: str | None = None
    num_levels: int | None = None
    forget_gate: bool | None = None
    gate_bias: bool | None = None
    kv_rank: int | None = None
    q_rank: int | None = None
    rope_dim: int | None = None
    nope_dim: int | None = None
    # new-family options
    expand: int | None = None
    dt_rank: int | None = None
    lru_width: int | None = None

    def __post_init__(self):
        check_fields(self, skip=MIXER_OPTIONS)
        if self.max_length > MAX_POSITION:
            raise ValueError(
                f"max_length must be <= {MAX_POSITION} (2**31 - 1), got {self.max_length}: "
                "decoding counts positions in int32, which would wrap to negative past it"
            )
        if isinstance(self.mixer, tuple) and (not self.mixer or self.num_layers % len(self.mixer)):
            raise ValueError(
                f"mixer has {len(self.mixer)} names, which must be num_layers={self.num_layers} "
                "or a pattern whose length divides it"
            )
        mixers = dict.fromkeys(self.layer_mixers)
        for name in mixers:
            get_mixer(name)
        if self.mlp_dim is not None and not self.mlp:
            raise ValueError(f"mlp_dim={self.mlp_dim} needs mlp=True")
        self._check_experts()
        others = [m for m in mixers if m not in INIT_MIXERS]
        if self.initializer_range is not None and others:
            raise ValueError(
                f"initializer_range={self.initializer_range!r} sets transformers' initialisation, "
                f"defined here for {', '.join(INIT_MIXERS)} layers only, not {', '.join(others)}"
            )
        self._check_initializer(mixers)
        self._check_layer_options()
        if self.mlp and self.mlp_dim is None and int(self.mlp_ratio * self.d_model) < 1:
            raise ValueError(f"mlp_ratio={self.mlp_ratio} leaves no hidden units")
        if not self.reset_positions and self.position == "none":
            raise ValueError("reset_positions=False needs position 'learned' or 'rope'")
        self._check_mixer_fields(mixers)
        configs = {}
        for name in mixers:
            try:
                configs[name] = MIXERS[name].make_config(
                    self.d_model, self.layer_num_heads(name), **self.mixer_options(name)
                )
            except ValueError as e:
                if name not in self.layer_options:
                    raise
                raise ValueError(f"{e} (with layer_options[{name!r}])") from None
        object.__setattr__(self, "_mixer_configs", configs)
        self._check_levels(configs)
        for field in MIXER_OPTIONS:  # (the value as the mixers' configs converted it)
            users = [c for c in configs.values() if field in c.own_options()]
            if users and getattr(self, field) is not None:
                object.__setattr__(self, field, getattr(users[0], field))

    def _check_levels(self, configs) -> None:
        """A log-linear layer's `num_levels` covers `max_length` (positions below
        2^(num_levels − 1)): the kernel would refuse a full-length row only when traced."""
        for name, config in configs.items():
            levels = getattr(config, "num_levels", None)
            if levels is not None and self.max_length > capacity(levels):
                raise ValueError(
                    f"num_levels={levels} of mixer {name!r} covers positions below "
                    f"2^(num_levels-1) = {capacity(levels)}, but max_length={self.max_length} "
                    f"needs num_levels >= {(self.max_length - 1).bit_length() + 1} "
                    "(log2(max_length) + 1)"
                )

    def _check_experts(self) -> None:
        if not self.num_experts:
            for name in MOE_OPTIONS:
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}={getattr(self, name)!r} needs num_experts > 0")
            if self.moe_dense_layers:
                raise ValueError(f"moe_dense_layers={self.moe_dense_layers} needs num_experts > 0")
            if self.moe_aux_loss_coef:
                raise ValueError(
                    f"moe_aux_loss_coef={self.moe_aux_loss_coef!r} needs num_experts > 0 (the "
                    "load-balancing loss reads the routers of MoE layers)"
                )
            return
        if self.moe_dense_layers >= self.num_layers:
            raise ValueError(
                f"moe_dense_layers={self.moe_dense_layers} must be < num_layers={self.num_layers} "
                "(num_experts=0 makes every MLP dense)"
            )
        if self.moe_shared_gate is not None and not self.shared_expert_dim:
            raise ValueError(f"moe_shared_gate={self.moe_shared_gate} needs shared_expert_dim")
        if not self.mlp:
            raise ValueError(f"num_experts={self.num_experts} needs mlp=True")
        if self.experts_per_token is None or self.experts_per_token > self.num_experts:
            raise ValueError(
                f"experts_per_token must be an int in [1, num_experts={self.num_experts}] with "
                f"num_experts > 0, got {self.experts_per_token!r}"
            )
        check_moe_options(**self.moe_options, names=MOE_NAMES)
        moe = self.moe_options  # (DEFAULT_ROUTER: the softmax router)
        if self.moe_aux_loss_coef and (
            moe["router"] != DEFAULT_ROUTER or moe["score_bias"] or moe["num_groups"] > 1
        ):
            raise ValueError(
                f"moe_aux_loss_coef={self.moe_aux_loss_coef!r} needs the softmax router without "
                f"score bias or groups (the loss transformers defines on softmax top-k choices), "
                f"got moe_router={self.moe_router!r}, moe_score_bias={self.moe_score_bias!r}, "
                f"moe_groups={self.moe_groups!r}"
            )

    @property
    def moe_options(self) -> dict | None:
        """`layers.moe.MoE` keyword arguments of every block's MLP, or None (a SwiGLU)."""
        if not self.num_experts:
            return None
        width = self.mlp_dim or int(self.mlp_ratio * self.d_model)
        return dict(
            num_experts=self.num_experts,
            top_k=self.experts_per_token,
            hidden_dim=self.moe_dim or width,
            shared_dim=self.shared_expert_dim or 0,
            norm_topk=True if self.moe_norm_topk is None else self.moe_norm_topk,
            router=self.moe_router or DEFAULT_ROUTER,
            score_bias=bool(self.moe_score_bias),
            num_groups=self.moe_groups or 1,
            topk_groups=self.moe_topk_groups or 1,
            routed_scale=1.0 if self.moe_routed_scale is None else self.moe_routed_scale,
            shared_gate=True if self.moe_shared_gate is None else self.moe_shared_gate,
        )

    def layer_moe_options(self, index: int) -> dict | None:
        """`moe_options` for layer `index`, or None where its MLP is dense (`moe_dense_layers`
        first, or no experts)."""
        return None if index < self.moe_dense_layers else self.moe_options

    def _check_initializer(self, mixers) -> None:
        if self.initializer is None:
            return
        if self.initializer_range is None:
            raise ValueError(
                f"initializer={self.initializer!r} needs initializer_range (a positive float)"
            )
        others = [m for m in mixers if m not in INITIALIZERS[self.initializer]]
        if others:
            raise ValueError(
                f"initializer={self.initializer!r} initialises "
                f"{', '.join(INITIALIZERS[self.initializer])} layers, not {', '.join(others)}"
            )

    def _check_layer_options(self) -> None:
        """Each `layer_options` entry names a mixer some layer uses, and options it takes."""
        used = dict.fromkeys(self.layer_mixers)
        for name, options in self.layer_options.items():
            if name not in used:
                raise ValueError(
                    f"layer_options names mixer {name!r}, which no layer uses "
                    f"(mixers: {', '.join(used)})"
                )
            allowed = (*BLOCK_OPTIONS, *(f.name for f in dataclasses.fields(MIXERS[name].Config)))
            for option, value in options.items():
                if option not in allowed:
                    raise ValueError(
                        f"layer_options[{name!r}] sets {option}={value!r}, which mixer {name!r} "
                        f"does not take; allowed: {', '.join(allowed)}"
                    )
                if option == "num_heads":
                    check_int(f"layer_options[{name!r}]['num_heads']", value)
                if option == "norm_position":
                    check_choice(f"layer_options[{name!r}]['norm_position']", value, NORM_POSITIONS)

    def layer_num_heads(self, name: str) -> int:
        """The heads of the layers of mixer `name` (`layer_options`, else `num_heads`)."""
        return self.layer_options.get(name, {}).get("num_heads", self.num_heads)

    def layer_norm_position(self, name: str) -> str:
        """Where the norms of the layers of mixer `name` sit (`layer_options`, else
        `norm_position`)."""
        return self.layer_options.get(name, {}).get("norm_position", self.norm_position)

    def _check_mixer_fields(self, mixers) -> None:
        """Each mixer option and common option set must be used by some layer."""
        names = ", ".join(sorted(mixers))
        for field in MIXER_OPTIONS:
            value = getattr(self, field)
            if value is not None and not any(
                field in MIXERS[m].Config.own_options() for m in mixers
            ):
                raise ValueError(f"{field}={value!r} is not used by any layer (mixers: {names})")
        redrawn = [name for name, cls in MIXERS.items() if cls.REDRAWS]
        if self.redraw_interval and not any(MIXERS[m].REDRAWS for m in mixers):
            raise ValueError(
                f"redraw_interval={self.redraw_interval} needs a {' or '.join(redrawn)} layer "
                f"(mixers: {names})"
            )
        # A common option some mixers refuse (rwkv7: conv, rope) applies to the layers that take
        # it, and raises when it is set and no layer takes it.
        for option, field, off, is_set in (
            ("conv", "conv", "0", bool(self.conv)),
            ("rope", "position", "none", self.position == "rope"),
        ):
            refusing = [m for m in mixers if option in MIXERS[m].NOT_TAKEN]
            if is_set and len(refusing) == len(mixers):
                why = MIXERS[refusing[0]].NOT_TAKEN[option]
                raise ValueError(
                    f"{field}={getattr(self, field)!r} is not used by any layer: "
                    f"{', '.join(refusing)} takes no {option} ({why}); set "
                    f"--config.model.{field}={off}"
                )

    @property
    def layer_mixers(self) -> tuple[str, ...]:
        """The mixer name of every layer (the pattern repeated to `num_layers`)."""
        if isinstance(self.mixer, str):
            return (self.mixer,) * self.num_layers
        return self.mixer * (self.num_layers // len(self.mixer))

    def mixer_options(self, name: str) -> dict:
        """Keyword options for the mixer class `name`: the common ones and those of its own
        that are set (None: the mixer's default). A common option the mixer refuses
        (`NOT_TAKEN`) is left out: it applies to the other layers of a hybrid."""
        options = dict(
            head_dim=self.head_dim,
            conv=self.conv,
            out_norm=self.out_norm,
            out_gate=self.out_gate,
            rope=self.position == "rope",
            rope_base=float(self.rope_base),
            reset_positions=self.reset_positions,
        )
        for field in MIXERS[name].Config.own_options():
            if getattr(self, field) is not None:
                options[field] = getattr(self, field)
        for option in MIXERS[name].NOT_TAKEN:
            options.pop(option, None)
        overrides = dict(self.layer_options.get(name, {}))
        for option in BLOCK_OPTIONS:
            overrides.pop(option, None)
        options.update(overrides)
        return options

    def mixer_config(self, name: str) -> MixerConfig:
        """The checked `Config` of mixer `name` (one of this model's), made once."""
        return self._mixer_configs[name]

    @property
    def backend_layers(self) -> dict[str, tuple[str, ...]]:
        """The layer mixers whose `method` (the model's, or one layer type's through
        `layer_options`) needs a Pallas backend, with the backends it has (its family's
        descriptor, `MixerConfig.backends`), in layer order."""
        names = dict.fromkeys(self.layer_mixers)
        return {n: b for n in names if (b := self.mixer_config(n).backends())}

    @property
    def uses_pallas(self) -> bool:
        """Whether some layer runs the Pallas kernels (`backend_layers`)."""
        return bool(self.backend_layers)

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def parameter_dtype(self):
        return jnp.dtype(self.param_dtype)


# The experts' options (None unless num_experts > 0).
MOE_OPTIONS = (
    "experts_per_token",
    "moe_dim",
    "shared_expert_dim",
    "moe_norm_topk",
    "moe_router",
    "moe_score_bias",
    "moe_groups",
    "moe_topk_groups",
    "moe_routed_scale",
    "moe_shared_gate",
)
# `layers.moe.MoE`'s arguments by the fields that set them.
MOE_NAMES = dict(
    num_experts="num_experts",
    top_k="experts_per_token",
    hidden_dim="moe_dim",
    router="moe_router",
    num_groups="moe_groups",
    topk_groups="moe_topk_groups",
    routed_scale="moe_routed_scale",
)
# Every option a mixer adds to the common ones, by name.
MIXER_OPTIONS: tuple[str, ...] = tuple(
    f.name
    for f in dataclasses.fields(ModelConfig)
    if f.name not in {g.name for g in dataclasses.fields(MixerConfig)}
    and any(f.name in cls.Config.own_options() for cls in MIXERS.values())
)


def _check_mixer_options() -> None:
    """Every mixer's own option is a field here, of a type the mixer's field allows."""
    hints = typing.get_type_hints(ModelConfig)
    for cls in MIXERS.values():
        own = typing.get_type_hints(cls.Config)
        for name in cls.Config.own_options():
            if name not in hints:
                raise TypeError(f"mixer {cls.NAME!r}: option {name!r} is not a ModelConfig field")
            wanted = {k for k in kinds(own[name]) if k is not type(None)}
            if not wanted <= set(kinds(hints[name])):
                raise TypeError(f"mixer {cls.NAME!r}: option {name!r} has another type here")


_check_mixer_options()
