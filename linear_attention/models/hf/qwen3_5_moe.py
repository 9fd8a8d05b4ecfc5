"""Qwen3.5-MoE's text model (transformers' `qwen3_5_moe_text`, `Qwen3_5MoeForCausalLM`): Qwen3.5's
layers (the `qwen3_5` mapping) with every MLP a mixture of experts, as Qwen3-Next's
(`layers.moe.MoE`: softmax router, top k renormalised, a sigmoid-gated shared expert).

| transformers                        | `ModelConfig`                                 |
| ----------------------------------- | --------------------------------------------- |
| `num_experts`                       | `num_experts` (> 0: every MLP is MoE)         |
| `num_experts_per_tok`               | `experts_per_token`                           |
| `moe_intermediate_size`             | `moe_dim` (and `mlp_dim`)                     |
| `shared_expert_intermediate_size`   | `shared_expert_dim` (> 0)                     |
| (always renormalised)               | `moe_norm_topk=True`                          |
| `router_aux_loss_coef` if `output_router_logits` (else 0) | `moe_aux_loss_coef` |

The experts are read in either stored layout: one tensor per expert and projection
(`mlp.experts.{e}.gate_proj.weight`, ..., what transformers' `save_pretrained` writes) or fused
per layer (`mlp.experts.gate_up_proj` [E, 2·I, D], each expert's gate rows then its up rows,
and `mlp.experts.down_proj` [E, D, I], as the released checkpoints store them; `unfuse_experts`).
Export writes the first.
"""

from __future__ import annotations

from linear_attention.models.hf import qwen3_5
from linear_attention.models.hf.qwen3_5 import MIXERS, Unsupported

__all__ = [
    "MIXERS",
    "MODEL_TYPE",
    "from_params",
    "hf_config",
    "model_options",
    "tensor_shapes",
    "to_params",
    "unfuse_experts",
]

MODEL_TYPE = "qwen3_5_moe_text"
ARCHITECTURE = "Qwen3_5MoeForCausalLM"
MOE_FIELDS = (
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "num_experts_per_tok",
    "num_experts",
    "output_router_logits",
    "router_aux_loss_coef",
)
FUSED_GATE_UP, FUSED_DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"


def model_options(hf: dict) -> dict:
    """`ModelConfig` keyword arguments for the transformers config `hf`."""
    if "intermediate_size" in hf:  # (a dense width this model has no layer for)
        raise Unsupported("config field 'intermediate_size' is not understood (every MLP is MoE)")
    for name in MOE_FIELDS[:4]:
        if name not in hf:
            raise Unsupported(f"config field {name!r} is missing")
    if hf["num_experts"] < 1 or hf["shared_expert_intermediate_size"] < 1:
        raise Unsupported(
            f"num_experts={hf['num_experts']}, shared_expert_intermediate_size="
            f"{hf['shared_expert_intermediate_size']}: both must be >= 1 (every {MODEL_TYPE} "
            "MLP is a mixture of experts with a shared expert)"
        )
    text = {k: v for k, v in hf.items() if k not in MOE_FIELDS}
    options = qwen3_5.model_options(dict(text, intermediate_size=hf["moe_intermediate_size"]))
    return dict(
        options,
        num_experts=hf["num_experts"],
        experts_per_token=hf["num_experts_per_tok"],
        moe_dim=hf["moe_intermediate_size"],
        shared_expert_dim=hf["shared_expert_intermediate_size"],
        moe_norm_topk=True,
        moe_aux_loss_coef=qwen3_5.moe_aux_loss_coef(hf),
    )


def hf_config(config) -> dict:
    """The transformers config of a `ModelConfig` in qwen3_5_moe_text's shape."""
    moe = config.moe_options or dict(num_experts=0, top_k=1, hidden_dim=1, shared_dim=0)
    text = qwen3_5.hf_config(config)
    del text["intermediate_size"]
    return dict(
        text,
        architectures=[ARCHITECTURE],
        model_type=MODEL_TYPE,
        num_experts=moe["num_experts"],
        num_experts_per_tok=moe["top_k"],
        moe_intermediate_size=moe["hidden_dim"],
        shared_expert_intermediate_size=moe["shared_dim"],
        **qwen3_5.aux_loss_fields(config),
    )


def tensor_shapes(hf: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor a `Qwen3_5MoeForCausalLM` of config `hf` holds (one per expert)."""
    return qwen3_5.tensor_shapes(hf, mlp_shapes=qwen3_5.moe_mlp_shapes)


def to_params(hf: dict, get) -> dict:
    """This library's parameters from the tensors `get(name)` of a checkpoint of config `hf`."""
    return qwen3_5.to_params(hf, get, mlp_params=qwen3_5.moe_mlp_params(hf))


def from_params(hf: dict, params: dict):
    """The checkpoint tensors of `params` (one per expert), the inverse of `to_params`."""
    return qwen3_5.from_params(hf, params, mlp_tensors=qwen3_5.moe_mlp_tensors)


def unfuse_experts(shapes: dict) -> tuple[dict, object]:
    """A stored form: the fused expert tensors of `shapes` (name -> shape) as one per expert.
    Returns `(shapes by per-expert name, wrap)`, where `wrap(get)` reads a per-expert tensor
    out of its fused one; ValueError naming a fused tensor whose shape is not `[E, 2·I, D]` /
    `[E, D, I]`. A checkpoint without fused tensors passes through unchanged."""
    out, sources = {}, {}
    for name, shape in shapes.items():
        prefix = name[: name.rfind(".") + 1]  # "...mlp.experts."
        if name.endswith(FUSED_GATE_UP):
            if len(shape) != 3 or shape[1] % 2:
                raise ValueError(f"tensor {name!r} has shape {tuple(shape)}, expected [E, 2·I, D]")
            num, width = shape[0], shape[1] // 2
            for e in range(num):
                for j, part in enumerate(("gate_proj", "up_proj")):
                    out[f"{prefix}{e}.{part}.weight"] = (width, shape[2])
                    sources[f"{prefix}{e}.{part}.weight"] = (
                        name,
                        e,
                        slice(j * width, (j + 1) * width),
                    )
        elif name.endswith(FUSED_DOWN):
            if len(shape) != 3:
                raise ValueError(f"tensor {name!r} has shape {tuple(shape)}, expected [E, D, I]")
            for e in range(shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = tuple(shape[1:])
                sources[f"{prefix}{e}.down_proj.weight"] = (name, e, slice(None))
        else:
            out[name] = tuple(shape)

    def wrap(get):
        last = {}  # the fused tensor read last (each is read once for all its experts)

        def unfused(name):
            if name not in sources:
                return get(name)
            stored, e, rows = sources[name]
            if stored not in last:
                last.clear()
                last[stored] = get(stored)
            return last[stored][e, rows]

        return unfused

    return out, wrap


STORED_FORMS = (unfuse_experts,)
