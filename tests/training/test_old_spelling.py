"""Mixer options moved into `model.options`: the old flat spelling still works for a release,
each use warned once with the new spelling, and gives the same model. The config.json fixture
was written by main before the move (a gated + softmax hybrid with options on both), with its
mixers' Configs beside it."""

import dataclasses
import json
import warnings

import ml_collections
import pytest

from linear_attention.models import ModelConfig
from linear_attention.training import cli, cli_args, experiment_config
from linear_attention.training.config import config_difference, model_section
from linear_attention.training.sweep.grid import grid_axis, parse_axes
from tests.training.conftest import ROOT

FIXTURE = ROOT / "tests" / "fixtures" / "old_run"
SIZES = dict(vocab_size=16, d_model=16, num_layers=2, num_heads=2, mixer=("gated", "softmax"))


def _one_warning(record, *needles):
    assert len(record) == 1, [str(w.message) for w in record]
    message = str(record[0].message)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


def test_old_config_json_loads_as_the_new_spelling():
    with pytest.warns(DeprecationWarning) as record:
        config = cli_args.load_config_file(str(FIXTURE / "main_hybrid_config.json"))
    _one_warning(record, "config.model.chunk_size, config.model.method", "config.model.options.")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        cfg = experiment_config(config)
    new = dict(method="chunk", chunk_size=32, state_dim=16, num_kv_heads=1, qk_norm=True)
    assert cfg.model.options == new
    written = json.loads((FIXTURE / "main_hybrid_mixers.json").read_text())  # (main's Configs)
    spelled = ModelConfig(
        **{**SIZES, "vocab_size": 512, "d_model": 64}, conv=4, mlp=False, options=new,
        layer_options={"softmax": {"num_heads": 2, "rope": True}},
    )  # fmt: skip
    assert cfg.model == spelled
    for name in ("gated", "softmax"):
        assert cfg.model.mixer_config(name) == spelled.mixer_config(name)
        assert dataclasses.asdict(cfg.model.mixer_config(name)) == written[name]
    # resuming the old run: its saved config is no different from this one
    saved = json.loads((FIXTURE / "main_hybrid_config.json").read_text())
    current = json.loads(json.dumps(cfg.to_dict()))
    with pytest.warns(DeprecationWarning):
        assert config_difference(saved, current, cfg) is None
        changed = {**saved, "model": {**saved["model"], "chunk_size": 64}}
        assert config_difference(changed, current, cfg) == ("model.options.chunk_size", 64, 32)


def test_flat_keywords_and_reads_warn_once_and_give_the_same_config():
    new = ModelConfig(**SIZES, options=dict(state_dim=8, chunk_size=8, qk_norm=True))
    with pytest.warns(DeprecationWarning) as record:
        old = ModelConfig(**SIZES, state_dim=8, chunk_size=8, qk_norm=True)
    _one_warning(record, "model.state_dim, model.chunk_size, model.qk_norm is now spelled")
    assert old == new and hash(old) == hash(new)
    with pytest.warns(DeprecationWarning, match=r"options\['chunk_size'\]"):
        assert old.chunk_size == 8
    with pytest.warns(DeprecationWarning):  # dataclasses.replace passes the flat keyword on
        assert dataclasses.replace(new, chunk_size=16).options["chunk_size"] == 16
    with pytest.warns(DeprecationWarning) as record:
        section = model_section(vocab_size=16, mixer="gated", state_dim=8)
    _one_warning(record, "config.model.state_dim is now spelled config.model.options.state_dim")
    assert section.options.state_dim == 8 and "state_dim" not in section
    # a config file's old field beside a different new one (a command-line override): refused
    config = cli_args.load_config_file(str(ROOT / "configs" / "mqar.py") + ":smoke")
    config.model.mixer, config.model.state_dim, config.model.options.state_dim = "gated", 4, 8
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="both set; keep"):
        experiment_config(config)
    with pytest.raises(AttributeError):
        new.not_an_option  # noqa: B018


def test_options_are_checked_against_the_models_mixers():
    with pytest.raises(ValueError, match=r"options.windw=3: no mixer takes it \(did you mean "):
        ModelConfig(**SIZES, options=dict(windw=3))
    message = r"options.window=3: no mixer of this model takes it \(mixers: gated, softmax; "
    with pytest.raises(ValueError, match=message + r".*take: chunk_size, conv_bias"):
        ModelConfig(**SIZES, options=dict(window=3))
    with pytest.raises(ValueError, match="state_dim must be an integer >= 1, got 'x'"):
        ModelConfig(**SIZES, options=dict(state_dim="x"))
    with pytest.raises(ValueError, match="options.conv=3: conv is a model field"):
        ModelConfig(**SIZES, options=dict(conv=3))
    # an option both mixers take is set once; layer_options overrides it for one of them
    both = ModelConfig(
        **{**SIZES, "mixer": ("gated", "gla")}, options=dict(chunk_size=16),
        layer_options={"gla": {"chunk_size": 32}},
    )  # fmt: skip
    assert both.mixer_config("gated").chunk_size == 16
    assert both.mixer_config("gla").chunk_size == 32
    assert both.options == {"chunk_size": 16}


def test_command_line_old_spelling_and_bad_options(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    base = ["la-train", "--config=configs/mqar.py:smoke", "--workdir=/nonexistent/never"]
    hybrid = [*base, "--config.model.mixer=gated,softmax"]
    with pytest.warns(DeprecationWarning) as record:
        fv = cli_args.parse_overrides(
            ["la-train", "--config.model.mixer=gated,softmax", "--config.model.state_dim=8"],
            cli_args.load_config_file("configs/mqar.py:smoke"),
            lambda fv: None,
        )
    _one_warning(record, "model.state_dim is now spelled model.options.state_dim")
    assert fv.config.model.options.state_dim == 8
    assert cli.main([*hybrid, "--config.model.options.windw=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "la-train: error: unknown config field --config.model.options.windw; did you mean "
        "--config.model.options.window?"
    ), err
    assert cli.main([*hybrid, "--config.model.options.window=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("la-train: error: config.model: options.window=3: no mixer"), err
    assert cli.main(["la-train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--config.model.options.OPTION=VALUE" in out and "  model.options: " in out


def test_sweep_axis_old_spelling():
    base = cli_args.load_config_file(str(ROOT / "configs" / "mqar.py") + ":smoke")
    sweep = ml_collections.ConfigDict(dict(base=base, grid={}))
    sweep.grid.window = grid_axis("model.window", (8, 16))
    with pytest.warns(DeprecationWarning, match="model.window is now spelled model.options.window"):
        (axis,) = parse_axes(sweep)
    assert axis.fields == ("model.options.window",)
