"""`la-convert` checks what it reads before it writes: each damaged or unusual input (a copy of a
`tests/fixtures/hf` folder altered one way) is one `la-convert: error:` line naming the file, the
tensor or the field, exit status 2, and nothing written; a conversion is written into a staging
folder and renamed into place, so a refused, failed, concurrent or killed one leaves nothing and
its rerun works."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from linear_attention.models import hf
from linear_attention.training import convert
from linear_attention.training.workdir import LOCK_NAME, WorkdirLock

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")
NAME = "mamba2"  # the smallest fixture
WEIGHTS = "model.safetensors"
A_WEIGHT = "backbone.layers.0.mixer.out_proj.weight"
OTHER_SHARD = "model-00002-of-00002.safetensors"  # (`_shard` puts A_WEIGHT in the first)


# ----------------------------------------------------------------------------- damage
def _tensors(folder: str) -> dict[str, np.ndarray]:
    with safe_open(os.path.join(folder, WEIGHTS), "np") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def _save(folder: str, tensors: dict) -> None:
    save_file(tensors, os.path.join(folder, WEIGHTS), metadata={"format": "pt"})


def _retype(folder: str, dtype) -> None:
    tensors = _tensors(folder)
    tensors[A_WEIGHT] = tensors[A_WEIGHT].astype(dtype)
    _save(folder, tensors)


def _nan(folder: str) -> None:
    tensors = _tensors(folder)
    tensors[A_WEIGHT][1, 2] = np.nan
    _save(folder, tensors)


def _bytes(folder: str, name: str = WEIGHTS) -> bytes:
    with open(os.path.join(folder, name), "rb") as f:
        return f.read()


def _write(folder: str, name: str, data: bytes | str) -> None:
    mode = "wb" if isinstance(data, bytes) else "w"
    with open(os.path.join(folder, name), mode) as f:
        f.write(data)


def _header(folder: str) -> tuple[dict, bytes]:
    data = _bytes(folder)
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def _rewrite_header(folder: str, change) -> None:
    header, body = _header(folder)
    change(header)
    raw = json.dumps(header).encode()
    _write(folder, WEIGHTS, len(raw).to_bytes(8, "little") + raw + body)


def _nan_bytes(folder: str) -> None:
    """32 data bytes of one tensor overwritten with NaN patterns (0xFF: a NaN in every float)."""
    header, _ = _header(folder)
    data = bytearray(_bytes(folder))
    start = 8 + int.from_bytes(data[:8], "little") + header[A_WEIGHT]["data_offsets"][0]
    data[start : start + 32] = b"\xff" * 32
    _write(folder, WEIGHTS, bytes(data))


def _corrupt_header(folder: str) -> None:
    data = bytearray(_bytes(folder))
    data[8:12] = b"\x00\x93\xfe{"
    _write(folder, WEIGHTS, bytes(data))


def _edit_config(folder: str, change) -> None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        values = json.load(f)
    values = change(values) or values
    with open(path, "w") as f:
        json.dump(values, f)


def _shard(folder: str) -> dict[str, str]:
    """`folder`'s weights as two shards and an index (as transformers writes them); returns the
    index's weight_map."""
    tensors = _tensors(folder)
    os.remove(os.path.join(folder, WEIGHTS))
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, os.path.join(folder, file))
        weight_map.update(dict.fromkeys(part, file))
    return weight_map


def _index(folder: str, change) -> None:
    weight_map = _shard(folder)
    assert weight_map[A_WEIGHT] != OTHER_SHARD
    values = {"metadata": {}, "weight_map": weight_map}
    change(values)
    _write(folder, "model.safetensors.index.json", json.dumps(values))


def _grow_tokenizer(folder: str) -> None:
    path = os.path.join(folder, "tokenizer.json")
    with open(path) as f:
        values = json.load(f)
    vocab = values["model"]["vocab"]
    vocab.update({f"extra{i}": len(vocab) + i for i in range(10)})
    with open(path, "w") as f:
        json.dump(values, f)


def _sentencepiece_garbage(folder: str) -> None:
    os.remove(os.path.join(folder, "tokenizer.json"))
    _write(folder, "tokenizer.model", b"\x08\x01garbage, not a sentencepiece model")


# (each case: how the copy is damaged -> what the one error line must say)
DAMAGED = {
    "empty weights": (lambda d: _write(d, WEIGHTS, b""), "model.safetensors is 0 bytes: too short"),
    "4-byte weights": (lambda d: _write(d, WEIGHTS, b"\x10\x00\x00\x00"), "is 4 bytes: too short"),
    "truncated weights": (
        lambda d: _write(d, WEIGHTS, _bytes(d)[: len(_bytes(d)) // 2]),
        "run past the end of the data",
    ),
    "header corrupt": (_corrupt_header, "its header is not valid JSON"),
    "offsets past the end": (
        lambda d: _rewrite_header(d, lambda h: h[A_WEIGHT]["data_offsets"].__setitem__(1, 10**9)),
        f"tensor '{A_WEIGHT}': its bytes",
    ),
    "header dtype not the bytes'": (
        lambda d: _rewrite_header(d, lambda h: h[A_WEIGHT].update(dtype="F16")),
        f"tensor '{A_WEIGHT}': the header says F16 (32, 64), 4096 bytes, but its offsets hold 8192",
    ),
    "int32 weight": (
        lambda d: _retype(d, np.int32),
        f"tensor '{A_WEIGHT}' is I32, expected a float",
    ),
    "bool weight": (
        lambda d: _retype(d, np.bool_),
        f"tensor '{A_WEIGHT}' is BOOL, expected a float",
    ),
    "NaN weight": (_nan, f"tensor '{A_WEIGHT}' holds 1 NaN or Inf value(s) of 2048"),
    "NaN bytes": (_nan_bytes, f"tensor '{A_WEIGHT}' holds 8 NaN or Inf value(s)"),
    "config a list": (lambda d: _write(d, "config.json", "[1, 2]"), "config.json is a JSON list"),
    "config a string": (
        lambda d: _write(d, "config.json", '"mamba2"'),
        "config.json is a JSON str",
    ),
    "config empty": (lambda d: _write(d, "config.json", ""), "config.json is empty; expected"),
    "config truncated": (
        lambda d: _write(d, "config.json", _bytes(d, "config.json")[:50]),
        "config.json is not valid JSON",
    ),
    "model_type a list": (
        lambda d: _edit_config(d, lambda c: c.update(model_type=["mamba2"])),
        "unsupported model_type ['mamba2']",
    ),
    "n_groups 0": (
        lambda d: _edit_config(d, lambda c: c.update(n_groups=0)),
        "config field n_groups = 0 must be a positive integer",
    ),
    "tie_word_embeddings a string": (
        lambda d: _edit_config(d, lambda c: c.update(tie_word_embeddings="false")),
        "config field tie_word_embeddings = 'false' must be true or false",
    ),
    "index names the wrong shard": (
        lambda d: _index(d, lambda v: v["weight_map"].update({A_WEIGHT: OTHER_SHARD})),
        f"weight_map names {OTHER_SHARD} for tensor '{A_WEIGHT}', which that shard does not hold "
        "(it is in model-00001-of-00002.safetensors)",
    ),
    "index omits a tensor": (
        lambda d: _index(d, lambda v: v["weight_map"].pop(A_WEIGHT)),
        f"holds tensor '{A_WEIGHT}', but the weight_map leaves it out",
    ),
    "index without weight_map": (
        lambda d: _index(d, lambda v: v.pop("weight_map")),
        'no "weight_map"',
    ),
    "index names a tensor no shard holds": (
        lambda d: _index(
            d,
            lambda v: v["weight_map"].update(
                {"lm_head.weight": "model-00001-of-00002.safetensors"}
            ),
        ),
        "tensor 'lm_head.weight', which that shard does not hold (no shard holds it)",
    ),
    "tokenizer.json truncated": (
        lambda d: _write(d, "tokenizer.json", _bytes(d, "tokenizer.json")[:300]),
        "is not a valid tokenizer.json",
    ),
    "tokenizer larger than the vocabulary": (_grow_tokenizer, "106"),
    "tokenizer.model garbage": (_sentencepiece_garbage, "is not a sentencepiece model"),
}


def _from_hf(damage):
    """A case that damages the checkpoint copy and converts it into a new workdir."""

    def case(folder, tmp_path, monkeypatch):
        damage(folder)
        return ["--from-hf", folder, "--workdir", str(tmp_path / "runs" / "w")]

    return case


def _under_a_file(tmp_path, flag: str) -> str:
    (tmp_path / "a_file").write_text("")
    return str(tmp_path / "a_file" / flag)


def _read_only(tmp_path, monkeypatch) -> str:
    """A new folder in a read-only one."""
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o555)
    if os.geteuid() == 0:  # (root writes anyway: the refusal the kernel gives anyone else)
        makedirs = os.makedirs

        def refused(path, *args, **kwargs):
            if str(path).startswith(str(folder)):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
            return makedirs(path, *args, **kwargs)

        monkeypatch.setattr(os, "makedirs", refused)
    return str(folder / "w")


def _full_disk(monkeypatch) -> None:
    """safetensors' writer on a full disk: part of the file, then ENOSPC."""
    import safetensors.numpy

    def full(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\0" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)

    monkeypatch.setattr(safetensors.numpy, "save_file", full)


def _other_run(tmp_path) -> str:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text("{}")
    return str(tmp_path / "run")


def _in_a_busy_folder(folder, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return ["--from-hf", folder, "--workdir", "."]


def _in_an_empty_folder(folder, tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path / "empty")
    return ["--from-hf", folder, "--workdir", "."]


TARGETS = {
    "--workdir empty": (
        lambda folder, tmp, mp: ["--from-hf", folder, "--workdir", ""],
        "--workdir is empty",
    ),
    "--workdir under a file": (
        lambda folder, tmp, mp: ["--from-hf", folder, "--workdir", _under_a_file(tmp, "w")],
        "w' cannot be created: Not a directory",
    ),
    "--workdir read-only": (
        lambda folder, tmp, mp: ["--from-hf", folder, "--workdir", _read_only(tmp, mp)],
        "w' cannot be created: Permission denied",
    ),
    "--workdir holding another run": (
        lambda folder, tmp, mp: ["--from-hf", folder, "--workdir", _other_run(tmp)],
        "run' exists and is not an empty folder",
    ),
    "--workdir the current folder": (_in_a_busy_folder, "'.' exists and is not an empty folder"),
    "--workdir the empty current folder": (_in_an_empty_folder, "'.' is the current folder"),
    "--to-hf of a transformers folder": (
        lambda folder, tmp, mp: ["--to-hf", folder, str(tmp / "out")],
        "is a transformers checkpoint (config.json with model_type 'mamba2'), not a run: import "
        "it with la-convert --from-hf",
    ),
    "--to-hf OUT empty": (lambda folder, tmp, mp: ["--to-hf", folder, ""], "--to-hf OUT is empty"),
}
# (cases that need a converted run, `run_workdir`: its path replaces "W")
RUN_TARGETS = {
    "--to-hf OUT under a file": (
        lambda folder, tmp, mp: ["--to-hf", "W", _under_a_file(tmp, "out")],
        "out' cannot be created: Not a directory",
    ),
    "--to-hf OUT onto a full disk": (
        lambda folder, tmp, mp: _full_disk(mp) or ["--to-hf", "W", str(tmp / "out")],
        "out' not written (No space left on device); nothing of it is left",
    ),
}
CASES = {**{k: (_from_hf(d), m) for k, (d, m) in DAMAGED.items()}, **TARGETS, **RUN_TARGETS}


def _tree(folder) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, n), folder)
        for d, dirs, files in os.walk(folder)
        for n in dirs + files
    )


@pytest.fixture(scope="module")
def run_workdir(tmp_path_factory):
    """The fixture converted into a run workdir (for `--to-hf`)."""
    workdir = str(tmp_path_factory.mktemp("converted") / "run")
    assert convert.main(["--from-hf", os.path.join(FIXTURES, NAME), "--workdir", workdir]) == 0
    return workdir


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_error_line_and_nothing_written(
    case, tmp_path, monkeypatch, capsys, request
):
    prepare, message = CASES[case]
    folder = str(tmp_path / NAME)
    shutil.copytree(os.path.join(FIXTURES, NAME), folder)
    argv = prepare(folder, tmp_path, monkeypatch)
    if case in RUN_TARGETS:
        argv = [request.getfixturevalue("run_workdir") if a == "W" else a for a in argv]
    before = _tree(tmp_path)
    capsys.readouterr()
    assert convert.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("la-convert: error: ") and err.count("\n") == 1, err
    assert message in err
    assert _tree(tmp_path) == before  # nothing written, not even a parent folder


def test_allow_nonfinite_imports_and_exports_a_nan_weight(tmp_path, capsys):
    """A NaN weight is refused both ways unless --allow_nonfinite, which keeps it where it was
    (transformers' out_proj.weight [d, inner] is the kernel transposed)."""
    folder = str(tmp_path / NAME)
    shutil.copytree(os.path.join(FIXTURES, NAME), folder)
    _nan(folder)
    model, _ = hf.from_pretrained(folder, allow_nonfinite=True)
    kernel = np.asarray(model.blocks[0].mixer.output.out_proj.kernel[...])
    assert np.argwhere(np.isnan(kernel)).tolist() == [[2, 1]]
    workdir, out = str(tmp_path / "w"), str(tmp_path / "out")
    assert convert.main(["--from-hf", folder, "--workdir", workdir, "--allow_nonfinite"]) == 0
    assert convert.main(["--to-hf", workdir, out]) == 2
    assert f"tensor '{A_WEIGHT}' holds 1 NaN or Inf value(s)" in capsys.readouterr().err
    assert not os.path.exists(out)
    assert convert.main(["--to-hf", workdir, out, "--allow_nonfinite"]) == 0
    assert np.argwhere(np.isnan(_tensors(out)[A_WEIGHT])).tolist() == [[1, 2]]


def test_a_conversion_in_progress_is_not_joined(tmp_path, capsys):
    """Another live conversion holds the staging folder's lock: refused, its files untouched."""
    staging = tmp_path / ".w.partial"
    staging.mkdir()
    (staging / "config.json").write_text("{}")
    with WorkdirLock(str(staging)):
        argv = ["--from-hf", os.path.join(FIXTURES, NAME), "--workdir", str(tmp_path / "w")]
        assert convert.main(argv) == 2
    assert "is in use by another run" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == [".w.partial"]
    assert sorted(os.listdir(staging)) == ["config.json"]


def test_a_killed_conversion_leaves_nothing_and_its_rerun_works(tmp_path, capsys):
    """kill -9 while the checkpoint is written: no workdir; the rerun clears the staging folder
    the killed process left and writes the workdir whole."""
    folder, workdir = os.path.join(FIXTURES, NAME), str(tmp_path / "w")
    script = (
        "import sys, time; from linear_attention.training import convert, checkpoint; "
        "checkpoint.Checkpoints.save = lambda *a, **k: (print('saving', flush=True), "
        "time.sleep(120)); "
        f"convert.main(['--from-hf', {folder!r}, '--workdir', {workdir!r}])"
    )
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    process = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env
    )
    try:
        assert process.stdout.readline() == b"saving\n"
        assert sorted(os.listdir(tmp_path / ".w.partial")) == [
            LOCK_NAME,
            "checkpoints",
            "generation_config.json",
            "tokenizer.json",
        ]
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert sorted(os.listdir(tmp_path)) == [".w.partial"]  # no workdir
    capsys.readouterr()
    assert convert.main(["--from-hf", folder, "--workdir", workdir]) == 0
    out = capsys.readouterr().out
    assert f"removed a stale lock of process {process.pid}" in out
    assert "left by an unfinished writer" in out
    assert sorted(os.listdir(tmp_path)) == ["w"]
    assert sorted(os.listdir(workdir)) == [
        "checkpoints",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
    ]
    with open(os.path.join(workdir, "config.json")) as f:
        assert json.load(f)["data"]["tokenizer"] == os.path.join(workdir, "tokenizer.json")
