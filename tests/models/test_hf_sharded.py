"""A sharded checkpoint (`model.safetensors.index.json` and its shards) imports as the
single-file one; a shard the index names but the folder lacks is refused by name."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from linear_attention.models import hf

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf", "qwen3_5")


def _shard(folder: str) -> None:
    """Rewrite `folder`'s model.safetensors as two shards and an index, as transformers does."""
    with safe_open(os.path.join(folder, "model.safetensors"), "np") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    os.remove(os.path.join(folder, "model.safetensors"))
    names = sorted(tensors)
    halves = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for file, part in halves.items():
        save_file(
            {n: tensors[n] for n in part}, os.path.join(folder, file), metadata={"format": "pt"}
        )
        weight_map.update(dict.fromkeys(part, file))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def _flat(tree) -> dict[str, np.ndarray]:
    return {
        jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)
    }


def test_sharded_checkpoint_imports_as_the_single_file(tmp_path):
    folder = str(tmp_path / "sharded")
    shutil.copytree(FIXTURE, folder)
    _shard(folder)
    sharded, config = hf.from_pretrained(folder)
    single, single_config = hf.from_pretrained(FIXTURE)
    assert config == single_config
    ours = nnx.to_pure_dict(nnx.state(sharded, nnx.Param))
    theirs = nnx.to_pure_dict(nnx.state(single, nnx.Param))
    a, b = _flat(ours), _flat(theirs)
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    os.remove(os.path.join(folder, "model-00002-of-00002.safetensors"))
    with pytest.raises(ValueError, match="shard .*model-00002-of-00002.safetensors.* is missing"):
        hf.from_pretrained(folder)
