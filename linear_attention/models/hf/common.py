"""What the Hugging Face mappings share: the config fields that leave the numbers alone, the
error a mapping raises, the initializer fields, and a converter declared as data.

A declared converter (`Weight` tables) names each transformers tensor once, with its shape in
named sizes, the parameter it is here and how its layout differs (`LAYOUTS`); the shapes, the
import and the export are all read from that one table (`weight_shapes`, `weights_to_params`,
`params_to_weights`), so two architectures differ by their tables, not by code.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# Config fields with no effect on the numbers of a causal LM's forward pass (generation ids,
# bookkeeping, the initialiser's scale: `initializer_range` is still read, as
# `ModelConfig.initializer_range`, by the mappings of the text models).
INERT = (
    "architectures",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "dtype",
    "torch_dtype",
    "transformers_version",
    "use_cache",
    "initializer_range",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "tie_encoder_decoder",
    "base_config_key",
)


class Unsupported(ValueError):
    """A checkpoint (or a config, on export) that this mapping cannot represent exactly."""


def require(hf: dict, name: str, wanted) -> None:
    """`Unsupported` unless field `name` of `hf` (when present) is `wanted`."""
    if hf.get(name, wanted) != wanted:
        raise Unsupported(f"{name}={hf[name]!r} is not supported (only {wanted!r})")


def check_fields(hf: dict, model_type: str, mapped, left_alone=()) -> None:
    """`Unsupported` naming the first field of `hf` that is neither `mapped`, `INERT` nor
    `left_alone`, or the first `mapped` field missing from it."""
    unknown = sorted(set(hf) - set(mapped) - set(INERT) - set(left_alone))
    if unknown:
        raise Unsupported(
            f"config field {unknown[0]!r} is not understood by the {model_type} importer"
        )
    missing = [f for f in mapped if f not in hf]
    if missing:
        raise Unsupported(f"config field {missing[0]!r} is missing")


def number(value) -> float:
    """A float of config.json, as transformers writes it (`{"__float__": "Infinity"}` for the
    values JSON lacks) or plain."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        return float(value["__float__"])
    return float(value)


def initializer_range(hf: dict) -> float | None:
    """`ModelConfig.initializer_range` of `hf`: its `initializer_range` (None when absent)."""
    value = hf.get("initializer_range")
    return None if value is None else float(value)


def initializer_options(hf: dict, initializer: str) -> dict:
    """`ModelConfig` keyword arguments for `hf`'s `initializer_range`: it and the architecture
    `initializer` (a key of `models.init.INITIALIZERS`), or nothing when absent."""
    r = initializer_range(hf)
    return {} if r is None else dict(initializer_range=r, initializer=initializer)


def initializer_field(config, initializer: str) -> dict:
    """The inverse of `initializer_range`: `{"initializer_range": r}`, or nothing when unset
    (transformers' default then); `Unsupported` when `config.initializer` names another
    architecture than `initializer`, whose initialisation transformers would not give."""
    if config.initializer not in (None, initializer):
        raise Unsupported(
            f"initializer={config.initializer!r}: a {initializer} checkpoint is initialised as "
            f"{initializer} (initializer None or {initializer!r})"
        )
    r = config.initializer_range
    return {} if r is None else {"initializer_range": r}


def left_alone(hf: dict, defaults: dict[str, tuple[object, str]]) -> list[str]:
    """The fields of `hf` named in `defaults` (`{field: (transformers' default, why it leaves
    the imported numbers alone)}`) whose value is not the default: one line each, for
    `hf.not_imported`."""
    return [
        f"config field {name}={hf[name]!r}: {why}"
        for name, (default, why) in defaults.items()
        if name in hf and hf[name] != default
    ]


# ------------------------------------------------------------------ converters as data
# How a transformers tensor's layout differs from the parameter's: the same array; an
# `nn.Linear` weight [out, in], the transpose of an `nnx.Linear` kernel [in, out]; a depthwise
# `nn.Conv1d` weight [C, 1, K], a `ShortConv` kernel [K, C].
LAYOUTS = {
    "as_is": (lambda w: w, lambda p: p),
    "transposed": (lambda w: w.T, lambda p: p.T),
    "depthwise": (lambda w: w[:, 0, :].T, lambda p: p.T[:, None, :]),
}


@dataclasses.dataclass(frozen=True)
class Weight:
    """One transformers tensor: its `name` (`{i}`: the layer index), its `shape` in named sizes
    (keys of the converter's `sizes(hf)`), the parameter `path` here (`"{i}"`: the layer
    index, as an int key), its `layout` (a key of `LAYOUTS`), and `when`: the boolean config
    field without which it does not exist (`"!field"`: that field false), or None."""

    name: str
    shape: tuple[str, ...]
    path: tuple[str, ...]
    layout: str = "as_is"
    when: str | None = None

    def present(self, hf: dict) -> bool:
        if self.when is None:
            return True
        field = self.when.lstrip("!")
        return bool(hf[field]) != self.when.startswith("!")


def _layers(table: tuple[Weight, ...], hf: dict, num_layers: int):
    """`(weight, its name, its parameter path)` for every tensor of `table` present in `hf`,
    once per layer for those whose name holds `{i}`."""
    for w in table:
        if not w.present(hf):
            continue
        for i in range(num_layers) if "{i}" in w.name else [None]:
            path = tuple(i if p == "{i}" else p for p in w.path)
            yield w, w.name.format(i=i), path


def weight_shapes(table, hf: dict, sizes: dict, num_layers: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of `table` with its shape (`sizes`: the named sizes)."""
    return {name: tuple(sizes[s] for s in w.shape) for w, name, _ in _layers(table, hf, num_layers)}


def weights_to_params(table, hf: dict, get, num_layers: int) -> dict:
    """The parameters (a nested dict as `nnx.to_pure_dict` gives) of the tensors
    `get(name) -> np.ndarray` of `table`."""
    params: dict = {}
    for w, name, path in _layers(table, hf, num_layers):
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = LAYOUTS[w.layout][0](get(name))
    return params


def params_to_weights(table, hf: dict, params: dict, num_layers: int) -> dict[str, np.ndarray]:
    """The tensors of `table` (float32, contiguous) from `params`, the inverse of
    `weights_to_params`."""
    out = {}
    for w, name, path in _layers(table, hf, num_layers):
        node = params
        for key in path:
            node = node[key]
        out[name] = np.ascontiguousarray(LAYOUTS[w.layout][1](np.asarray(node)), np.float32)
    return out


__all__ = [
    "INERT",
    "LAYOUTS",
    "Unsupported",
    "Weight",
    "check_fields",
    "initializer_field",
    "initializer_options",
    "initializer_range",
    "left_alone",
    "number",
    "params_to_weights",
    "require",
    "weight_shapes",
    "weights_to_params",
]
