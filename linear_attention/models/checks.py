"""The rules between `ModelConfig` fields, each a small named check (`ModelConfig.__post_init__`
runs them in order; every one raises a ValueError naming the fields it ties together).
"""

from __future__ import annotations

from linear_attention.kernels.log_linear.fenwick import capacity
from linear_attention.layers import MIXERS, get_mixer
from linear_attention.layers.moe import DEFAULT_ROUTER, check_moe_options
from linear_attention.models.init import INIT_MIXERS, INITIALIZERS

# The largest position a decoding state can count to: positions are int32 (as token ids are),
# so a counter past it would wrap to a negative position rather than fail.
MAX_POSITION = 2**31 - 1
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


def check_model(config) -> None:
    """Every rule of this module but the mixers' (`check_levels`), in order."""
    rules = (check_layout, check_mlp, check_experts, check_initializer, check_positions)
    for check in (*rules, check_used):
        check(config)


def check_layout(config) -> None:
    """`max_length` fits an int32 position; the mixer pattern divides the layers; each mixer is
    registered."""
    if config.max_length > MAX_POSITION:
        raise ValueError(
            f"max_length must be <= {MAX_POSITION} (2**31 - 1), got {config.max_length}: "
            "decoding counts positions in int32, which would wrap to negative past it"
        )
    mixer = config.mixer
    if isinstance(mixer, tuple) and (not mixer or config.num_layers % len(mixer)):
        raise ValueError(
            f"mixer has {len(mixer)} names, which must be num_layers={config.num_layers} "
            "or a pattern whose length divides it"
        )
    for name in dict.fromkeys(config.layer_mixers):
        get_mixer(name)


def check_mlp(config) -> None:
    if config.mlp_dim is not None and not config.mlp:
        raise ValueError(f"mlp_dim={config.mlp_dim} needs mlp=True")
    if config.mlp and config.mlp_dim is None and int(config.mlp_ratio * config.d_model) < 1:
        raise ValueError(f"mlp_ratio={config.mlp_ratio} leaves no hidden units")


def _check_no_experts(config) -> None:
    for name in MOE_OPTIONS:
        if getattr(config, name) is not None:
            raise ValueError(f"{name}={getattr(config, name)!r} needs num_experts > 0")
    if config.moe_dense_layers:
        raise ValueError(f"moe_dense_layers={config.moe_dense_layers} needs num_experts > 0")
    if config.moe_aux_loss_coef:
        raise ValueError(
            f"moe_aux_loss_coef={config.moe_aux_loss_coef!r} needs num_experts > 0 (the "
            "load-balancing loss reads the routers of MoE layers)"
        )


def check_experts(config) -> None:
    """The MoE fields: set only with experts, and consistent with them."""
    if not config.num_experts:
        return _check_no_experts(config)
    if config.moe_dense_layers >= config.num_layers:
        raise ValueError(
            f"moe_dense_layers={config.moe_dense_layers} must be < num_layers="
            f"{config.num_layers} (num_experts=0 makes every MLP dense)"
        )
    if config.moe_shared_gate is not None and not config.shared_expert_dim:
        raise ValueError(f"moe_shared_gate={config.moe_shared_gate} needs shared_expert_dim")
    if not config.mlp:
        raise ValueError(f"num_experts={config.num_experts} needs mlp=True")
    if config.experts_per_token is None or config.experts_per_token > config.num_experts:
        raise ValueError(
            f"experts_per_token must be an int in [1, num_experts={config.num_experts}] with "
            f"num_experts > 0, got {config.experts_per_token!r}"
        )
    moe = config.moe_options  # (DEFAULT_ROUTER: the softmax router)
    check_moe_options(**moe, names=MOE_NAMES)
    if config.moe_aux_loss_coef and (
        moe["router"] != DEFAULT_ROUTER or moe["score_bias"] or moe["num_groups"] > 1
    ):
        raise ValueError(
            f"moe_aux_loss_coef={config.moe_aux_loss_coef!r} needs the softmax router without "
            f"score bias or groups (the loss transformers defines on softmax top-k choices), "
            f"got moe_router={config.moe_router!r}, moe_score_bias={config.moe_score_bias!r}, "
            f"moe_groups={config.moe_groups!r}"
        )


def moe_options(config) -> dict | None:
    """`layers.moe.MoE` keyword arguments of every block's MLP, or None (a SwiGLU)."""
    if not config.num_experts:
        return None
    width = config.mlp_dim or int(config.mlp_ratio * config.d_model)
    return dict(
        num_experts=config.num_experts,
        top_k=config.experts_per_token,
        hidden_dim=config.moe_dim or width,
        shared_dim=config.shared_expert_dim or 0,
        norm_topk=True if config.moe_norm_topk is None else config.moe_norm_topk,
        router=config.moe_router or DEFAULT_ROUTER,
        score_bias=bool(config.moe_score_bias),
        num_groups=config.moe_groups or 1,
        topk_groups=config.moe_topk_groups or 1,
        routed_scale=1.0 if config.moe_routed_scale is None else config.moe_routed_scale,
        shared_gate=True if config.moe_shared_gate is None else config.moe_shared_gate,
    )


def check_initializer(config) -> None:
    """`initializer_range` and `initializer` name architectures that have every layer's mixer."""
    mixers = dict.fromkeys(config.layer_mixers)
    others = [m for m in mixers if m not in INIT_MIXERS]
    if config.initializer_range is not None and others:
        raise ValueError(
            f"initializer_range={config.initializer_range!r} sets transformers' "
            f"initialisation, defined here for {', '.join(INIT_MIXERS)} layers only, not "
            f"{', '.join(others)}"
        )
    if config.initializer is None:
        return
    if config.initializer_range is None:
        raise ValueError(
            f"initializer={config.initializer!r} needs initializer_range (a positive float)"
        )
    others = [m for m in mixers if m not in INITIALIZERS[config.initializer]]
    if others:
        raise ValueError(
            f"initializer={config.initializer!r} initialises "
            f"{', '.join(INITIALIZERS[config.initializer])} layers, not {', '.join(others)}"
        )


def check_positions(config) -> None:
    if not config.reset_positions and config.position == "none":
        raise ValueError("reset_positions=False needs position 'learned' or 'rope'")


def check_used(config) -> None:
    """`redraw_interval`, `conv` and rotary positions are set only when some layer takes them
    (a common option some mixers refuse, rwkv7's conv and rope, applies to the others)."""
    mixers = dict.fromkeys(config.layer_mixers)
    names = ", ".join(sorted(mixers))
    redrawn = [name for name, cls in MIXERS.items() if cls.REDRAWS]
    if config.redraw_interval and not any(MIXERS[m].REDRAWS for m in mixers):
        raise ValueError(
            f"redraw_interval={config.redraw_interval} needs a {' or '.join(redrawn)} layer "
            f"(mixers: {names})"
        )
    for option, field, off, is_set in (
        ("conv", "conv", "0", bool(config.conv)),
        ("rope", "position", "none", config.position == "rope"),
    ):
        refusing = [m for m in mixers if option in MIXERS[m].NOT_TAKEN]
        if is_set and len(refusing) == len(mixers):
            why = MIXERS[refusing[0]].NOT_TAKEN[option]
            raise ValueError(
                f"{field}={getattr(config, field)!r} is not used by any layer: "
                f"{', '.join(refusing)} takes no {option} ({why}); set "
                f"--config.model.{field}={off}"
            )


def check_levels(config, configs) -> None:
    """A log-linear layer's `num_levels` covers `max_length` (positions below
    2^(num_levels − 1)): the kernel would refuse a full-length row only when traced."""
    for name, mixer in configs.items():
        levels = getattr(mixer, "num_levels", None)
        if levels is not None and config.max_length > capacity(levels):
            raise ValueError(
                f"num_levels={levels} of mixer {name!r} covers positions below "
                f"2^(num_levels-1) = {capacity(levels)}, but max_length={config.max_length} "
                f"needs num_levels >= {(config.max_length - 1).bit_length() + 1} "
                "(log2(max_length) + 1)"
            )
