"""The configuration boundary: the one field checker, the data-kind registry and what the
trainer asks of a source, the mixers' typed configs and what a mixer reports about itself."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from linear_attention import fields
from linear_attention.data import MQARData, TextData
from linear_attention.data.mad import MADData
from linear_attention.data.protocol import DataSource
from linear_attention.data.sources import GrainData
from linear_attention.data.state_tracking import StateTrackingData
from linear_attention.layers import MIXERS, MoE, get_mixer
from linear_attention.models import ModelConfig
from linear_attention.training import config as config_lib
from linear_attention.training.data_kinds import DATA_CONFIGS, DATA_KINDS

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "linear_attention"


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: fields.check_int("n", 0), "n must be an integer >= 1, got 0$"),
        (lambda: fields.check_int("n", "3"), r"n must be an integer >= 1, got '3' \(str\)$"),
        (lambda: fields.check_int("n", True, None), r"n must be an integer, got True \(bool\)$"),
        (lambda: fields.check_float("x", 0.0), "x must be a finite number > 0, got 0.0$"),
        (lambda: fields.check_float("x", math.nan), "x must be a finite number > 0, got nan$"),
        (lambda: fields.check_float("x", 2.0, 0.0, 1.0, low_open=False), r"in \[0.0, 1.0\]"),
        (lambda: fields.check_bool("b", 1), r"b must be a bool, got 1 \(int\)$"),
        (lambda: fields.check_choice("m", "x", ("a", "b"), "mixer 'y'"), "unknown m 'x' for mi"),
        (lambda: fields.check_int_tuple("t", (1, 2.0)), "t must be a tuple of integers"),
    ],
)
def test_one_message_format_per_kind_of_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_checker_converts_numpy_scalars_and_refuses_bools_as_numbers():
    assert type(fields.check_int("n", np.int64(3))) is int
    assert type(fields.check_float("x", np.float32(0.5))) is float
    assert fields.check_float("x", 2) == 2.0
    assert type(fields.check_bool("b", np.bool_(True))) is bool
    with pytest.raises(ValueError, match="x must be a finite number > 0, got True"):
        fields.check_float("x", True)


def test_the_integer_requirement_is_written_once():
    """Every "must be an integer >= n" comes from `fields.check_int` (an integer within a range
    set by another field is a rule of its own)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for line, text in _code_strings(path):
            if path.name != "fields.py" and re.search(r"must be an int(eger)?( >=|$)", text):
                found.append(f"{path.relative_to(PACKAGE)}:{line}: {text!r}")
    assert not found
    with pytest.raises(ValueError, match="top_k must be an integer >= 1, got 0$"):
        MoE(8, num_experts=2, top_k=0, hidden_dim=4, rngs=nnx.Rngs(0))


def test_build_names_unknown_and_missing_fields():
    with pytest.raises(ValueError, match=r"config.train.nope is not a field: config.train does"):
        config_lib._build(config_lib.TrainConfig, {"num_steps": 1, "nope": 2}, "train")
    with pytest.raises(ValueError, match="config.train.batch_size is required"):
        config_lib._build(config_lib.TrainConfig, {"num_steps": 1}, "train")
    train = config_lib.TrainConfig(num_steps=np.int32(3), batch_size=2, stop_at=1)
    assert type(train.num_steps) is int and train.stop_at == 1.0  # stored as Python values


def test_every_data_kind_is_registered_exported_and_listed():
    import linear_attention.training as training

    assert set(DATA_KINDS) == {"mqar", "text", "tokens", "mad", "state_tracking", "needles"}
    assert config_lib.SECTION_CLASSES["data"] == DATA_CONFIGS
    for kind, entry in DATA_KINDS.items():
        assert entry.config.KIND == kind
        assert getattr(training, entry.config.__name__) is entry.config
        assert entry.config.__name__ in training.__all__
    with pytest.raises(ValueError, match="unknown config.data.kind 'csv'; allowed: mqar, text"):
        config_lib.experiment_config(
            dict(seed=0, model={}, data={"kind": "csv"}, optimizer={}, train={}, mesh={})
        )


def test_every_source_answers_the_protocol():
    for cls in (MQARData, TextData, GrainData, MADData, StateTrackingData):
        assert issubclass(cls, DataSource), cls
    data = MQARData(vocab_size=16, seq_len=16, num_kv_pairs=2, num_train_examples=4,
                    num_test_examples=3)  # fmt: skip
    assert data.score == "micro" and data.token_bytes is None
    assert not data.process_local and not data.stateful
    assert data.iterator_state() is None
    groups = data.eval_groups(2)
    assert list(groups) == [""] and sum(b["inputs"].shape[0] for b in groups[""]) == 4
    assert StateTrackingData.score == "micro" and MADData.score == "class_macro"
    assert GrainData.stateful and GrainData.process_local


def test_model_config_is_static_and_holds_no_mixer_option():
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    for cls in MIXERS.values():  # (a mixer's own options are `options` keys, not fields)
        assert not set(cls.Config.own_options()) & names, cls.NAME
    assert ModelConfig.__module__ == "linear_attention.models.config"
    source = (PACKAGE / "models" / "config.py").read_text()
    assert "make_dataclass" not in source


def test_mixer_config_is_made_once_and_passed_to_the_layer():
    config = ModelConfig(vocab_size=32, d_model=16, num_layers=2, num_heads=2,
                         mixer=("swa", "gated_deltanet"),
                         options=dict(window=np.int64(8), num_value_heads=4))  # fmt: skip
    swa = config.mixer_config("swa")
    assert type(swa) is MIXERS["swa"].Config and swa.window == 8 and type(swa.window) is int
    assert config.options.get("window") == 8 and type(config.options.get("window")) is int
    delta = config.mixer_config("gated_deltanet")
    assert (delta.conv, delta.out_norm, delta.num_value_heads) == (True, True, 4)  # its defaults
    with pytest.raises(dataclasses.FrozenInstanceError):
        swa.window = 4
    # a mixer made from the config and one made from keyword options: the same parameters
    cls = get_mixer("gated_deltanet")
    a = cls(16, 2, config=delta, rngs=nnx.Rngs(0))
    b = cls(16, 2, num_value_heads=4, rngs=nnx.Rngs(0))
    assert a.options == b.options
    leaves = jax.tree.leaves(nnx.state(a, nnx.Param)), jax.tree.leaves(nnx.state(b, nnx.Param))
    assert all(np.array_equal(x, y) for x, y in zip(*leaves, strict=True))
    with pytest.raises(ValueError, match="takes a GatedDeltaNetMixerConfig or keyword options"):
        cls(16, 2, config=delta, window=3, rngs=nnx.Rngs(0))


def test_mixer_messages_name_the_mixer():
    with pytest.raises(
        ValueError, match="unknown method 'fft' for mixer 'kda'; allowed: chunk, scan, pallas$"
    ):
        MIXERS["kda"].Config(method="fft")
    with pytest.raises(ValueError, match="window is not a field: mixer 'kda' does not use option"):
        MIXERS["kda"].make_config(16, 2, window=3)


def _code_strings(path: pathlib.Path):
    """``(line, text)`` of every string constant of a module that is not a docstring."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) not in docstrings:
                yield node.lineno, node.value


# Strings that are a mixer's name and also a plain word where they appear: a corpus record's
# "path" (PaTH's mixer is "path"), the "linear" learning-rate schedule, a "softmax" router,
# transformers' "mamba" architecture (Mamba-1's initialisation, its model_type), the "comba"
# kernel (its family's name and export, as FLA's op).
_HOMONYMS = {
    "kernels/__init__.py": {"comba"},
    "kernels/comba/comba.py": {"comba"},
    "models/init.py": {"mamba"},
    "models/hf/mamba.py": {"mamba"},
    "data/sources.py": {"path"},
    "layers/moe.py": {"softmax"},
    "data/text.py": {"path"},
    "training/run_data.py": {"path"},
    "training/sweep/results.py": {"path"},
    "training/config.py": {"linear"},
    "training/optim.py": {"linear"},
}


def test_a_mixer_name_is_written_only_in_its_layer_module_and_the_registry():
    """flops, the presets and the sweep engine ask the mixers; no module outside a mixer's own
    and the registry holds its name (docstrings aside)."""
    own = {name: pathlib.Path(inspect.getsourcefile(cls)).resolve() for name, cls in MIXERS.items()}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "layers" / "registry.py":
            continue
        allowed = _HOMONYMS.get(path.relative_to(PACKAGE).as_posix(), set())
        for line, text in _code_strings(path):
            if text in MIXERS and own[text] != path and text not in allowed:
                found.append(f"{path.relative_to(PACKAGE)}:{line}: {text!r}")
    assert not found


def _imports(path: pathlib.Path, module: str, modules: set[str]) -> set[str]:
    """The package's modules that ``module`` (at ``path``) imports, at the top or inside a
    function (a deferred import that dodges a cycle is still a cycle)."""
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = base[: len(base) - node.level + 1] if node.level else []
            source = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                name = f"{source}.{alias.name}"
                found.add(name if name in modules else source)
    return {name for name in found if name in modules and name != module}


def test_no_import_cycle_in_the_package():
    paths = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {m: _imports(p, m, set(paths)) for m, p in paths.items()}
    # a module is on a cycle when it reaches itself
    on_cycle = []
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            module = todo.pop()
            if module not in seen:
                seen.add(module)
                todo.extend(graph[module])
        if start in seen:
            on_cycle.append(start)
    assert not on_cycle


# The functions of the package over 60 lines (docstring aside); the list only shrinks. Each is
# a kernel whose docstring says why it stays whole (the chunked backward's scan step).
_LONG_FUNCTIONS = {
    "kernels/linear/chunked.py:_chunked_bwd",
}


def _code_lines(node: ast.FunctionDef) -> int:
    """A function's lines, its docstring aside."""
    lines = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        lines -= first.end_lineno - first.lineno + 1
    return lines


def test_no_function_over_60_lines_or_complexity_15():
    long = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _code_lines(node) > 60:
                long.add(f"{path.relative_to(PACKAGE).as_posix()}:{node.name}")
    assert long - _LONG_FUNCTIONS == set()  # a new long function
    assert _LONG_FUNCTIONS - long == set()  # taken apart: strike it from the list
    complexity = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--isolated", "--select", "C901"]
        + ["--config", "lint.mccabe.max-complexity=15", "--output-format", "concise", PACKAGE],
        capture_output=True,
        text=True,
    )
    assert complexity.returncode == 0, complexity.stdout


def test_data_kinds_say_whether_they_are_text_and_how_runs_are_judged():
    from linear_attention.training.sweep.results import METRICS

    mqar = DATA_KINDS["mqar"].config(kind="mqar", vocab_size=16, seq_len=16, num_kv_pairs=2)
    state = DATA_KINDS["state_tracking"].config(kind="state_tracking", task="parity", seq_len=8,
                                                eval_lengths=(8,))  # fmt: skip
    text = DATA_KINDS["text"].config(kind="text", seq_len=16)
    assert (mqar.has_text, state.has_text, text.has_text) == (False, False, True)
    assert not mqar.packed and not text.packed
    assert DATA_KINDS["text"].config(kind="text", seq_len=16, pack=True).packed
    assert set(METRICS) == set(DATA_KINDS)
    assert METRICS["text"] == ("eval/bits_per_byte", False) and METRICS["mqar"][1] is True


# A data kind's name that is also a plain word where it appears: a JSONL field ("text"), a
# sidecar's count ("tokens"), a sweep scored as MAD scores ("mad"); la-convert writes the text
# section of an imported model's run.
_KIND_HOMONYMS = {
    "training/tokenizer_cli.py": {"text", "tokens"},
    "training/convert.py": {"text"},
    "training/sweep/synthetic.py": {"mad"},
}


def test_the_training_room_asks_the_data_kind_and_names_none():
    """The trainer, the evaluation and the sweep reports ask a data config (its class
    attributes, `DataSource`) and never compare its kind's name."""
    from linear_attention.training.sweep.runner import SWEEP_REPORTS

    assert {entry.config.SWEEP_REPORT for entry in DATA_KINDS.values()} <= set(SWEEP_REPORTS)
    found = []
    for path in sorted((PACKAGE / "training").rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        for line, text in _code_strings(path):
            if text in DATA_KINDS and text not in _KIND_HOMONYMS.get(where, set()):
                found.append(f"{where}:{line}: {text!r}")
    assert not found


def test_a_data_config_holds_its_own_kind():
    with pytest.raises(ValueError, match="unknown config.data.kind 'text'; allowed: mqar$"):
        DATA_KINDS["mqar"].config(kind="text", vocab_size=16, seq_len=16, num_kv_pairs=2)


# What the evaluation package reads of the training floor beside it: a run's loading, the
# command lines' shared parts, the output check, and la-eval's own evaluation (its fallback).
_EVALS_READS_OF_TRAINING = {
    "linear_attention.training.load",
    "linear_attention.training.cli_args",
    "linear_attention.training.outputs",
    "linear_attention.training.eval_cli",
    "linear_attention.training.cuda_plugin",  # la-eval keeps jax's CUDA plugin out without a GPU
}


def test_evals_sits_on_top_and_reads_training_through_load():
    """`linear_attention.evals` (lm-eval adapter, loss by position) sits beside training: no
    other module of the package imports it, and of training it imports only the modules that
    load a run and share the command lines' parts."""
    paths = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    into, out_of = [], set()
    for module, path in paths.items():
        imported = _imports(path, module, set(paths))
        inside = module.startswith("linear_attention.evals")
        if not inside and any(m.startswith("linear_attention.evals") for m in imported):
            into.append(module)
        if inside:
            out_of |= {m for m in imported if m.startswith("linear_attention.training")}
    assert into == []
    assert out_of <= _EVALS_READS_OF_TRAINING, out_of - _EVALS_READS_OF_TRAINING
