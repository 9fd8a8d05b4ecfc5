"""Config files: every preset loads, validates and builds; command-line overrides; bad
configurations stop with a message naming the field."""

import dataclasses
import os
import subprocess
import sys

import jax
import pytest
from flax import nnx

from linear_attention.models import ModelConfig
from linear_attention.training import experiment_config, make_optimizer, trainer
from linear_attention.training.cli import UsageError, parse_args
from tests.scripts import DEADLINE_S
from tests.training.conftest import ROOT, load_config

PRESETS = [(name, arg) for name in ("mqar", "lm", "niah") for arg in (None, "cpu", "smoke")]


@pytest.mark.parametrize("name,arg", PRESETS)
def test_every_preset_loads_and_builds(name, arg):
    config = load_config(name, arg)
    # The model section is exactly ModelConfig's fields, so each can be overridden.
    assert set(config.model) == {f.name for f in dataclasses.fields(ModelConfig)}
    cfg = experiment_config(config)
    assert cfg.data.kind == {"mqar": "mqar", "lm": "text", "niah": "needles"}[name]
    tx, _ = make_optimizer(cfg.optimizer, cfg.train.num_steps)
    model, opt = nnx.eval_shape(lambda: trainer.build_model(cfg, tx))
    graphdef, state = nnx.split(model)
    tokens = jax.ShapeDtypeStruct((2, cfg.data.seq_len), "int32")
    logits = jax.eval_shape(lambda s, t: nnx.merge(graphdef, s)(t), state, tokens)
    assert logits.shape == (2, cfg.data.seq_len, cfg.model.vocab_size)
    assert logits.dtype == "float32"
    assert cfg.train.batch_size * cfg.data.seq_len == cfg.tokens_per_step


def test_docstrings_give_the_command():
    for name in ("mqar", "lm"):
        with open(ROOT / "configs" / f"{name}.py") as f:
            text = f.read()
        assert f"python experiments/train.py --config configs/{name}.py:cpu --workdir" in text


def test_presets_for_mqar_follow_zoology():
    default = experiment_config(load_config("mqar"))
    assert default.data.vocab_size == default.model.vocab_size == 8192
    assert default.model.num_layers == 2 and not default.model.mlp
    assert default.optimizer.weight_decay == 0.1 and default.optimizer.schedule == "cosine"
    # The short convolution is on (linear mixers need it to bind keys to values).
    assert default.model.conv == 4


def _args(*extra, config="configs/mqar.py:cpu"):
    return ["la-train", f"--config={config}", "--workdir=/tmp/unused", *extra]


def test_overrides_apply_and_tie_fields():
    config, workdir = parse_args(
        _args(
            "--config.model.mixer=linear",
            "--config.data.num_kv_pairs=16",
            "--config.data.vocab_size=1024",
            "--config.data.seq_len=128",
            "--config.model.options.feature_map=relu",
            "--config.train.num_steps=500",
        )
    )
    cfg = experiment_config(config)
    assert workdir == "/tmp/unused"
    assert (cfg.model.mixer, cfg.model.options.get("feature_map"), cfg.data.num_kv_pairs) == (
        "linear",
        "relu",
        16,
    )
    # vocab_size is shared between data and model.
    assert cfg.model.vocab_size == 1024 and cfg.data.seq_len == 128
    assert cfg.train.num_steps == 500
    hybrid, _ = parse_args(_args("--config.model.mixer=gated,softmax", config="configs/lm.py:cpu"))
    assert experiment_config(hybrid).model.mixer == ("gated", "softmax")
    delta, _ = parse_args(
        _args(
            "--config.model.mixer=gated_deltanet,softmax",
            "--config.model.options.allow_neg_eigval=True",
            config="configs/mqar.py:cpu",
        )
    )
    model = experiment_config(delta).model
    assert (
        model.mixer == ("gated_deltanet", "softmax")
        and model.options.get("allow_neg_eigval") is True
    )
    # Based: taylor + sliding window, written either way on the command line
    for mixer in ("taylor,swa", "('taylor','swa')", '("taylor", "swa")'):
        based, _ = parse_args(
            _args(
                f"--config.model.mixer={mixer}",
                "--config.model.options.feature_dim=16",
                "--config.model.options.window=32",
            )
        )
        model = experiment_config(based).model
        assert (model.mixer, model.options.get("feature_dim"), model.options.get("window")) == (
            ("taylor", "swa"),
            16,
            32,
        )
        assert model.mixer_options("swa")["window"] == 32
        assert "window" not in model.mixer_options("taylor")
    # a document separator given on a command line: backslash escapes are decoded
    packed, _ = parse_args(_args(r"--config.data.separator=\n\n", config="configs/lm.py:cpu"))
    data = experiment_config(packed).data
    assert data.pack and data.separator == "\\n\\n" and data.separator_bytes == b"\n\n"


@pytest.mark.parametrize(
    "extra,config,message",
    [
        ((), "configs/nope.py:cpu", "configs/nope.py"),
        ((), "configs/mqar.py:gpu", "unknown preset 'gpu'"),
        (
            ("--config.model.foo=1",),
            "configs/mqar.py:cpu",
            "unknown config field --config.model.foo; config.model has: ",
        ),
        (
            ("--config.model.d_modle=8",),
            "configs/mqar.py:cpu",
            "^unknown config field --config.model.d_modle; did you mean --config.model.d_model\\?$",
        ),
        (
            ("--config.modle.d_model=8",),
            "configs/mqar.py:cpu",
            "^unknown config field --config.modle.d_model; did you mean --config.model.d_model\\?$",
        ),
        (("--config.train.num_steps=abc",), "configs/mqar.py:cpu", "config.train.num_steps=abc"),
        (
            ("--config.train.num_steps=0",),
            "configs/mqar.py:cpu",
            "config.train.num_steps must be an integer >= 1, got 0",
        ),
        (
            ("--config.model.mixer=swa", "--config.model.options.window=0"),
            "configs/mqar.py:cpu",
            "config.model: window must be an integer >= 1, got 0",
        ),
        (
            ("--config.model.mixer=nope",),
            "configs/mqar.py:cpu",
            "config.model: unknown mixer 'nope'",
        ),
        (
            ("--config.data.num_kv_pairs=40",),
            "configs/mqar.py:cpu",
            "seq_len must be >= 4 \\* num_kv_pairs = 160",
        ),
        (
            ("--config.optimizer.schedule=step",),
            "configs/mqar.py:cpu",
            "unknown config.optimizer.schedule .step.; allowed: cosine, linear, constant",
        ),
        (
            ("--config.model.vocab_size=100",),
            "configs/lm.py:cpu",
            "config.model.vocab_size = 100 is smaller than the data's vocabulary \\(256\\)",
        ),
        (
            ("--config.data.path=/no/such/file",),
            "configs/lm.py:cpu",
            "config.data.path '/no/such/file' does not exist",
        ),
        (
            ("--config.data.pack=False", "--config.data.separator=;"),
            "configs/lm.py:cpu",
            "config.data.separator = ';' needs config.data.pack = True",
        ),
        (
            ("--config.data.separator=a\\",),
            "configs/lm.py:cpu",
            "config.data.separator = 'a\\\\\\\\' has a bad escape",
        ),
        (
            ("--config.train.grad_accum_steps=3",),
            "configs/lm.py:cpu",
            "config.train.grad_accum_steps = 3 must divide config.train.batch_size = 32",
        ),
        (
            ("--config.train.sample_tokens=5000",),
            "configs/lm.py:cpu",
            "config.train.sample_tokens = 5000",
        ),
        (
            ("--config.train.batch_size=30000",),
            "configs/mqar.py:cpu",
            "config.train.batch_size = 30000 exceeds config.data.num_train_examples = 20000",
        ),
    ],
)
def test_bad_config_stops_with_a_message_naming_it(extra, config, message):
    with pytest.raises(UsageError, match=message):
        parse_args(_args(*extra, config=config))


def test_experiment_config_checks_types_and_sections():
    config = load_config("mqar", "smoke")
    bad = config.to_dict()
    bad["train"]["num_steps"] = "10"
    with pytest.raises(
        ValueError, match="config.train.num_steps must be an integer >= 1, got '10'"
    ):
        experiment_config(bad)
    bad = config.to_dict()
    bad["extra"] = {}
    with pytest.raises(ValueError, match="config.extra is not a section"):
        experiment_config(bad)
    bad = config.to_dict()
    del bad["train"]["batch_size"]
    with pytest.raises(ValueError, match="config.train.batch_size is required"):
        experiment_config(bad)
    bad = config.to_dict()
    bad["data"]["path"] = "x"
    with pytest.raises(ValueError, match="config.data.path is not a field"):
        experiment_config(bad)
    bad = config.to_dict()
    bad["model"]["vocab_size"] = 32
    with pytest.raises(ValueError, match="config.model.vocab_size = 32 is smaller than the data"):
        experiment_config(bad)


def test_command_line_exit_status_and_message():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [
            sys.executable,
            "experiments/train.py",
            "--config=configs/mqar.py:smoke",
            "--workdir=/tmp/never_created_by_la_train",
            "--config.model.num_heads=0",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert proc.returncode == 2
    assert "la-train: error: config.model: num_heads must be an integer >= 1, got 0" in proc.stderr
    assert not os.path.exists("/tmp/never_created_by_la_train")
