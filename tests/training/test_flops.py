"""FLOPs per token and the dry run for every registered mixer: each has a count (a new mixer
without one is refused by name), the delta-rule family's counts match a hand count from the
shapes, and ``la-train --dry_run`` sizes a model holding every mixer (slow: one compilation of
thirteen different layers)."""

import json

import jax
import pytest
from flax import nnx

from linear_attention.layers.registry import MIXERS, get_mixer
from linear_attention.training import cli, experiment_config
from linear_attention.training.flops import flops_per_token, mixing_flops
from linear_attention.training.sizing import abstract_model
from tests.training.conftest import ROOT, load_config

# configs/mqar.py:smoke: d 32, 2 heads of 16, vocabulary 64, T 32, conv 4, no MLP, tied head.
D, H, DH, V, T = 32, 2, 16, 64, 32
HEAD = V * D  # the tied output head's matmul


def _config(mixer: str):
    """The smoke preset with one layer of ``mixer``."""
    config = load_config("mqar", "smoke")
    config.model.mixer, config.model.num_layers = mixer, 1
    if "conv" in get_mixer(mixer).NOT_TAKEN:  # rwkv7 (token shift), lstm: refuse the conv
        config.model.conv = False
    return config


def _abstract_model(config):
    return abstract_model(experiment_config(config))


def test_every_registered_mixer_has_a_flops_count():
    for name in MIXERS:
        flops = flops_per_token(_abstract_model(_config(name)), T)
        assert set(flops) == {"matmul", f"mixer/{name}", "total"}, name
        # (q, k, v and o projections; Griffin's block has three: linear_x, linear_y, out_proj)
        projections = 3 if name == "rglru" else 4
        assert flops[f"mixer/{name}"] > 0
        assert flops["matmul"] >= 3 * 2 * (HEAD + projections * D * D), name
        assert flops["total"] == flops["matmul"] + flops[f"mixer/{name}"]


def test_delta_family_flops_match_a_hand_count():
    """kda and gated_deltaproduct, one layer each, counted here from their parameter shapes
    (d 32, 2 heads of 16 keys and values, conv 4 on q, k, v) and the delta rule's chunk form
    (WY/UT): 2·H·(3·C·dk + 2·C·dv + C²/3 + 3·dk·dv) per token and state head."""

    def delta_chunk(heads, c):
        return 2 * heads * (3 * c * DH + 2 * c * DH + c * c / 3 + 3 * DH * DH)

    # kda: qkv 32·96, conv 4·96, β 32·2, the decay's low rank (16) down and up 32·16 + 16·32,
    # the output gate's low rank down and up 32·16 + 16·32, the output 32·32; chunk min(64, 32)
    kda = 3 * D * D + 4 * 3 * D + D * H + 2 * D * DH + 2 * D * DH + D * D + HEAD
    got = flops_per_token(_abstract_model(_config("kda")), T)
    assert got["matmul"] == 3 * 2 * kda
    assert got["mixer/kda"] == pytest.approx(3 * delta_chunk(H, 32), rel=1e-12)
    # gated_deltaproduct (n = 2 keys and values per token): qkv 32·(32 + 2·32 + 2·32), conv
    # 4·160, β 32·4, the decay 32·2, the output gate 32·32, the output 32·32. Its chunk counts
    # sub-tokens: 64 of the 2·32, each state head runs n = 2 sub-tokens per token.
    width = D + 2 * D + 2 * D
    product = D * width + 4 * width + D * 2 * H + D * H + 2 * D * D + HEAD
    got = flops_per_token(_abstract_model(_config("gated_deltaproduct")), T)
    assert got["matmul"] == 3 * 2 * product
    assert got["mixer/gated_deltaproduct"] == pytest.approx(3 * delta_chunk(2 * H, 64), rel=1e-12)


def test_a_mixer_without_a_count_is_refused_by_name():
    mixer = _abstract_model(_config("kda")).blocks[0].mixer
    with pytest.raises(ValueError, match=r"no FLOPs count for mixer 'new_mixer' \(counted: "):
        mixing_flops(mixer, "new_mixer", T, method="chunk", chunk_size=64)


@pytest.mark.slow
def test_dry_run_sizes_a_model_of_every_mixer(capsys, monkeypatch, tmp_path):
    """``la-train --dry_run`` on one layer of each registered mixer prints its JSON; its FLOPs
    and parameters are the one-layer models' (less the shared head, embedding and norm)."""
    monkeypatch.chdir(ROOT)
    names = list(MIXERS)
    argv = [
        "la-train",
        "--config=configs/mqar.py:smoke",
        f"--workdir={tmp_path / 'never'}",
        f"--config.model.mixer={','.join(names)}",
        f"--config.model.num_layers={len(names)}",
        "--dry_run",
    ]
    assert cli.main(argv) == 0
    sizing = json.loads(capsys.readouterr().out.strip().split("\n")[-1])
    singles = [_abstract_model(_config(name)) for name in names]
    flops = sum(flops_per_token(m, T)["total"] for m in singles) - (len(names) - 1) * 6 * HEAD
    assert sizing["flops_per_token"] == pytest.approx(flops, rel=1e-12)
    params = [sum(x.size for x in jax.tree.leaves(nnx.state(m, nnx.Param))) for m in singles]
    # each one-layer model has its own embedding table (V·D) and final norm (D)
    assert sizing["parameters"] == sum(params) - (len(names) - 1) * (HEAD + D)
    assert sizing["train_step_bytes_per_device"] >= 3 * 4 * sizing["parameters"]
