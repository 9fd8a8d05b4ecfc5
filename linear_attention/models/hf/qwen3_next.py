"""Qwen3-Next (transformers' `qwen3_next`, `Qwen3NextForCausalLM`): Qwen3.5's text model (the
`qwen3_5` mapping) with two differences, mapped here:

- the Gated DeltaNet layer's projections are fused per key head: `in_proj_qkvz` holds, for each
  of the Hk key heads, [q (dk), k (dk), v (r·dv), z (r·dv)] (r = Hv / Hk value heads per key
  head), and `in_proj_ba` [b (r), a (r)]; they are re-sliced into Qwen3.5's `in_proj_qkv`,
  `in_proj_z`, `in_proj_b`, `in_proj_a` (value head h·r + i is the i-th of key head h's group,
  which reads key head h, as the grouped value heads here);
- the MLP of every layer is a mixture of experts (`layers.moe.MoE`): `mlp.gate` [E, D] is the
  router, `mlp.experts.{e}.gate_proj / up_proj / down_proj` the experts, `mlp.shared_expert.*`
  and `mlp.shared_expert_gate` [1, D] the sigmoid-gated shared expert.

| transformers                        | `ModelConfig`                               |
| ----------------------------------- | ------------------------------------------- |
| `num_experts` (0: dense MLPs)       | `num_experts`                               |
| `num_experts_per_tok`               | `experts_per_token`                         |
| `moe_intermediate_size`             | `moe_dim`                                   |
| `shared_expert_intermediate_size`   | `shared_expert_dim`                         |
| `norm_topk_prob`                    | `moe_norm_topk`                             |
| `decoder_sparse_step`, `mlp_only_layers` | must be 1 and [] (every layer's MLP is MoE) |
| `router_aux_loss_coef` if `output_router_logits` (else 0) | `moe_aux_loss_coef` |
"""

from __future__ import annotations

import numpy as np

from linear_attention.models.hf import qwen3_5
from linear_attention.models.hf.qwen3_5 import MIXERS, Unsupported

__all__ = ["MIXERS", "MODEL_TYPE", "from_params", "hf_config", "model_options", "to_params"]

MODEL_TYPE = "qwen3_next"
ARCHITECTURE = "Qwen3NextForCausalLM"
MOE_FIELDS = (
    "decoder_sparse_step",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "num_experts_per_tok",
    "num_experts",
    "norm_topk_prob",
    "output_router_logits",
    "router_aux_loss_coef",
    "mlp_only_layers",
)


def _moe(hf: dict) -> bool:
    return hf.get("num_experts", 0) > 0


def model_options(hf: dict) -> dict:
    """`ModelConfig` keyword arguments for the transformers config `hf`."""
    moe = {k: hf[k] for k in MOE_FIELDS if k in hf}
    options = qwen3_5.model_options({k: v for k, v in hf.items() if k not in MOE_FIELDS})
    if not _moe(hf):
        return options
    for name in ("num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if name not in moe:
            raise Unsupported(f"config field {name!r} is missing")
    if moe.get("decoder_sparse_step", 1) != 1 or moe.get("mlp_only_layers") not in (None, []):
        raise Unsupported(
            f"decoder_sparse_step={moe.get('decoder_sparse_step')!r} and mlp_only_layers="
            f"{moe.get('mlp_only_layers')!r}: only every layer's MLP a mixture of experts "
            "(1 and []) is supported"
        )
    if moe["shared_expert_intermediate_size"] < 1:
        raise Unsupported("shared_expert_intermediate_size=0 (no shared expert) is not supported")
    return dict(
        options,
        num_experts=moe["num_experts"],
        experts_per_token=moe["num_experts_per_tok"],
        moe_dim=moe["moe_intermediate_size"],
        shared_expert_dim=moe["shared_expert_intermediate_size"],
        moe_norm_topk=bool(moe.get("norm_topk_prob", True)),
        moe_aux_loss_coef=qwen3_5.moe_aux_loss_coef(moe),
    )


def hf_config(config) -> dict:
    """The transformers config of a `ModelConfig` in qwen3_next's shape."""
    moe = config.moe_options
    return dict(
        qwen3_5.hf_config(config),
        architectures=[ARCHITECTURE],
        model_type=MODEL_TYPE,
        num_experts=0 if moe is None else moe["num_experts"],
        num_experts_per_tok=2 if moe is None else moe["top_k"],
        moe_intermediate_size=1 if moe is None else moe["hidden_dim"],
        shared_expert_intermediate_size=1 if moe is None else moe["shared_dim"],
        norm_topk_prob=True if moe is None else moe["norm_topk"],
        decoder_sparse_step=1,
        mlp_only_layers=[],
        **qwen3_5.aux_loss_fields(config),
    )


def _mlp(hf: dict):
    if _moe(hf):
        return (
            dict(mlp_shapes=qwen3_5.moe_mlp_shapes),
            dict(mlp_params=qwen3_5.moe_mlp_params(hf)),
            dict(mlp_tensors=qwen3_5.moe_mlp_tensors),
        )
    return {}, {}, {}


# ------------------------------------------------------------------ the fused projections
def _sizes(hf: dict):
    hk, hv = hf["linear_num_key_heads"], hf["linear_num_value_heads"]
    return hk, hf["linear_key_head_dim"], hv // hk * hf["linear_value_head_dim"], hv // hk


def tensor_shapes(hf: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor a `Qwen3NextForCausalLM` of config `hf` holds, with its shape."""
    shapes = qwen3_5.tensor_shapes(hf, **_mlp(hf)[0])
    hk, dk, gv, r = _sizes(hf)
    for name in [n for n in shapes if n.endswith("linear_attn.in_proj_qkv.weight")]:
        a, d = name[: -len("in_proj_qkv.weight")], shapes[name][1]
        for old in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
            del shapes[a + old + ".weight"]
        shapes[a + "in_proj_qkvz.weight"] = (hk * (2 * dk + 2 * gv), d)
        shapes[a + "in_proj_ba.weight"] = (hk * 2 * r, d)
    return shapes


def to_params(hf: dict, get) -> dict:
    """This library's parameters from the tensors `get(name)` of a checkpoint of config `hf`."""
    hk, dk, gv, r = _sizes(hf)

    def get_unfused(name: str) -> np.ndarray:
        head, _, part = name.rpartition("linear_attn.")
        if part not in (
            "in_proj_qkv.weight",
            "in_proj_z.weight",
            "in_proj_b.weight",
            "in_proj_a.weight",
        ):
            return get(name)
        if part in ("in_proj_b.weight", "in_proj_a.weight"):
            ba = get(head + "linear_attn.in_proj_ba.weight")
            ba = ba.reshape(hk, 2 * r, -1)
            return (ba[:, :r] if part == "in_proj_b.weight" else ba[:, r:]).reshape(hk * r, -1)
        qkvz = get(head + "linear_attn.in_proj_qkvz.weight").reshape(hk, 2 * dk + 2 * gv, -1)
        q, k, v, z = np.split(qkvz, [dk, 2 * dk, 2 * dk + gv], axis=1)
        if part == "in_proj_z.weight":
            return z.reshape(hk * gv, -1)
        return np.concatenate([x.reshape(-1, x.shape[-1]) for x in (q, k, v)])

    return qwen3_5.to_params(hf, get_unfused, **_mlp(hf)[1])


def from_params(hf: dict, params: dict) -> dict[str, np.ndarray]:
    """The checkpoint tensors of `params`, the inverse of `to_params`."""
    out = qwen3_5.from_params(hf, params, **_mlp(hf)[2])
    hk, dk, gv, r = _sizes(hf)
    for name in [n for n in out if n.endswith("linear_attn.in_proj_qkv.weight")]:
        a = name[: -len("in_proj_qkv.weight")]
        qkv = out.pop(a + "in_proj_qkv.weight")
        q, k, v = np.split(qkv, [hk * dk, 2 * hk * dk])
        z = out.pop(a + "in_proj_z.weight")
        parts = [x.reshape(hk, -1, x.shape[-1]) for x in (q, k, v, z)]
        out[a + "in_proj_qkvz.weight"] = np.concatenate(parts, axis=1).reshape(-1, qkv.shape[-1])
        b, a_ = (out.pop(a + f"in_proj_{x}.weight").reshape(hk, r, -1) for x in ("b", "a"))
        out[a + "in_proj_ba.weight"] = np.concatenate([b, a_], axis=1).reshape(hk * 2 * r, -1)
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}
