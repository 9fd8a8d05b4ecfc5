"""The files of a transformers checkpoint folder, read with every malformation named:
`config.json` and the shard index (`read_json`, `check_fields`), the header of each safetensors
file (`read_header`, `tensor_entries`) and each tensor (`read_tensor`).

A safetensors file is an 8-byte little-endian header length n, n bytes of JSON (tensor name ->
``{"dtype", "shape", "data_offsets": [begin, end]}``, offsets into the data after the header),
then the data. Every length and offset is checked against the file's size, and each tensor's
byte count against its dtype and shape, before a byte of data is read, so a truncated, empty or
altered file gives a `ValueError` naming the file and the tensor, never the safetensors
library's own exception. A tensor is read as float32; a NaN or Inf in it is refused unless
asked for (`allow_nonfinite`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import ml_dtypes
import numpy as np

INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_NAME = "model.safetensors"
# The float dtypes a weight may have (little-endian, as safetensors stores them).
FLOAT_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
# Every safetensors dtype's size in bytes (a header naming another dtype is damaged).
ITEM_SIZES = {
    **{name: dtype.itemsize for name, dtype in FLOAT_DTYPES.items()},
    **dict(I64=8, U64=8, I32=4, U32=4, I16=2, U16=2, I8=1, U8=1, BOOL=1),
    **dict(F8_E4M3=1, F8_E5M2=1, F8_E8M0=1, F6_E2M3=1, F6_E3M2=1, F4=1),
}
# Config fields that transformers writes as a JSON boolean, and as a positive integer (where a
# checkpoint's config has them; a missing one is the mapping's to name).
BOOLEAN_FIELDS = (
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "use_bias",
    "use_conv_bias",
    "mamba_conv_bias",
    "mamba_proj_bias",
    "linear_allow_neg_eigval",
    "moe_renormalize",
    "norm_topk_prob",
)
COUNT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "num_heads",
    "n_groups",
    "state_size",
    "conv_kernel",
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_head_dim",
    "linear_num_heads",
    "mamba_n_heads",
    "mamba_d_head",
    "mamba_d_state",
    "mamba_n_groups",
    "mamba_d_conv",
    "moe_intermediate_size",
    "num_experts",
    "num_experts_per_tok",
    "num_experts_per_token",
    "num_expert_group",
    "topk_group",
    "kv_lora_rank",
    "qk_head_dim",
    "v_head_dim",
)


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """Where a tensor's bytes are: `file`, from byte `start`, of safetensors `dtype` and
    `shape` (checked against the file by `read_header`)."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEM_SIZES[self.dtype]


def read_json(file: str, what: str):
    """The JSON value of `file` (`what` it should be, for the message); ValueError naming the
    file when it is empty, truncated or not JSON."""
    try:
        with open(file, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ValueError(f"{file} cannot be read: {e.strerror or e}") from None
    if not raw.strip():
        raise ValueError(f"{file} is empty; expected {what}")
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(
            f"{file} is not valid JSON ({e}): truncated or damaged; expected {what}"
        ) from None


def check_fields(values: dict, file: str, prefix: str = "") -> None:
    """ValueError naming the first field of `values` (read from `file`; `text_config`'s too) of
    another kind than transformers writes: `BOOLEAN_FIELDS`, `COUNT_FIELDS`."""
    for name in BOOLEAN_FIELDS:
        if name in values and not isinstance(values[name], bool):
            raise ValueError(
                f"{file}: config field {prefix}{name} = {values[name]!r} must be true or false "
                "(a JSON boolean)"
            )
    for name in COUNT_FIELDS:
        value = values.get(name)
        if name in values and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(
                f"{file}: config field {prefix}{name} = {value!r} must be a positive integer"
            )
    if isinstance(values.get("text_config"), dict):
        check_fields(values["text_config"], file, "text_config.")


def read_header(file: str) -> dict[str, TensorEntry]:
    """Each tensor of the safetensors `file` -> its `TensorEntry`; ValueError naming the file
    (and the tensor) when the header is short, not JSON, or disagrees with the file's size or
    with itself (a dtype and shape that do not fill the tensor's offsets, overlapping tensors)."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(
                f"{file} is {size} bytes: too short for a safetensors file (an 8-byte header "
                "length, the header, the data); truncated or not a safetensors file"
            )
        length = int.from_bytes(head, "little")
        if length > size - 8:
            raise ValueError(
                f"{file}: its header length {length} runs past the end of the file ({size} "
                "bytes); truncated or not a safetensors file"
            )
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(
            f"{file}: its header is not valid JSON ({e}); the file is damaged"
        ) from None
    if not isinstance(header, dict):
        raise ValueError(f"{file}: its header is a JSON {type(header).__name__}, not an object")
    data_size, entries = size - 8 - length, {}
    for name, info in header.items():
        if name != "__metadata__":
            entries[name] = _entry(file, name, info, data_size, 8 + length)
    spans = sorted((e.start, e.start + e.nbytes, name) for name, e in entries.items())
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:], strict=False):
        if begin < end:
            raise ValueError(f"{file}: the bytes of tensors {first!r} and {second!r} overlap")
    return entries


def _entry(file: str, name: str, info, data_size: int, data_start: int) -> TensorEntry:
    """Tensor `name`'s `TensorEntry` from its header record `info`, checked against the size of
    the data (`data_size` bytes from byte `data_start` of `file`)."""
    where = f"{file}: tensor {name!r}"
    info = info if isinstance(info, dict) else {}
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in ITEM_SIZES:
        raise ValueError(f"{where} has dtype {dtype!r}, not one of safetensors' dtypes")
    if not isinstance(shape, list) or not all(_whole(d) for d in shape):
        raise ValueError(f"{where} has shape {shape!r}, expected a list of sizes >= 0")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_whole(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise ValueError(f"{where} has data_offsets {offsets!r}, expected [begin, end]")
    begin, end = offsets
    if end > data_size:
        raise ValueError(
            f"{where}: its bytes [{begin}, {end}) run past the end of the data ({data_size} "
            "bytes); the file is truncated"
        )
    expected = math.prod(shape) * ITEM_SIZES[dtype]
    if end - begin != expected:
        raise ValueError(
            f"{where}: the header says {dtype} {tuple(shape)}, {expected} bytes, but its "
            f"offsets hold {end - begin} bytes"
        )
    return TensorEntry(file, dtype, tuple(shape), data_start + begin)


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def tensor_entries(folder: str) -> dict[str, TensorEntry]:
    """Each tensor of the checkpoint `folder` (its `model.safetensors`, or the shards its
    `model.safetensors.index.json` names) -> its `TensorEntry`; ValueError when the index is
    damaged, names a shard that is missing or that lacks the tensor, or leaves out a tensor a
    shard holds."""
    index = os.path.join(folder, INDEX_NAME)
    if not os.path.isfile(index):
        single = os.path.join(folder, WEIGHTS_NAME)
        if not os.path.isfile(single):
            raise ValueError(f"{folder!r} holds neither {WEIGHTS_NAME} nor {INDEX_NAME}")
        return read_header(single)
    values = read_json(index, 'an object with "weight_map": tensor name -> shard file')
    weight_map = values.get("weight_map") if isinstance(values, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError(
            f'{index} has no "weight_map" (an object of tensor name -> shard file name)'
        )
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard or os.path.basename(shard) != shard:
            raise ValueError(
                f"{index}: weight_map gives tensor {name!r} the shard {shard!r}, expected the "
                "name of a file in the folder"
            )
    headers = {}
    for shard in sorted(set(weight_map.values())):
        file = os.path.join(folder, shard)
        if not os.path.isfile(file):
            raise ValueError(f"shard {file!r} named by the index is missing")
        headers[shard] = read_header(file)
    for name, shard in weight_map.items():
        if name not in headers[shard]:
            holders = [s for s, header in headers.items() if name in header]
            found = f"it is in {holders[0]}" if holders else "no shard holds it"
            raise ValueError(
                f"{index}: weight_map names {shard} for tensor {name!r}, which that shard does "
                f"not hold ({found})"
            )
    for shard, header in headers.items():
        for name in header:
            if weight_map.get(name) != shard:
                named = weight_map.get(name)
                said = "leaves it out" if named is None else f"names {named} for it"
                raise ValueError(
                    f"{index}: shard {shard} holds tensor {name!r}, but the weight_map {said}"
                )
    return {name: headers[shard][name] for name, shard in weight_map.items()}


def check_float(name: str, entry: TensorEntry) -> None:
    """ValueError naming tensor `name` when its dtype is not a float (an integer or boolean
    tensor is no weight)."""
    if entry.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"{entry.file}: tensor {name!r} is {entry.dtype}, expected a float weight "
            f"({', '.join(FLOAT_DTYPES)})"
        )


def read_tensor(name: str, entry: TensorEntry, *, allow_nonfinite: bool = False) -> np.ndarray:
    """Tensor `name` (at `entry`) as float32; ValueError when its dtype is not a float, or
    when it holds NaN or Inf and not `allow_nonfinite`."""
    check_float(name, entry)
    dtype = FLOAT_DTYPES[entry.dtype]
    count = math.prod(entry.shape)
    with open(entry.file, "rb") as f:
        f.seek(entry.start)
        data = np.frombuffer(f.read(count * dtype.itemsize), dtype, count)
    values = data.astype(np.float32).reshape(entry.shape)
    check_finite(f"{entry.file}: tensor {name!r}", values, allow_nonfinite)
    return values


def check_finite(what: str, values: np.ndarray, allow_nonfinite: bool = False) -> None:
    """ValueError saying that `what` (`values`) holds NaN or Inf, unless `allow_nonfinite`."""
    bad = int(values.size - np.count_nonzero(np.isfinite(values)))
    if bad and not allow_nonfinite:
        raise ValueError(
            f"{what} holds {bad} NaN or Inf value(s) of {values.size}: a damaged or diverged "
            "model (allow_nonfinite takes it as it is)"
        )
