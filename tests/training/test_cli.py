"""The command lines: la-train's help, dry run and error messages; Ctrl-C in a real process;
la-eval and la-generate (and `load_run` behind them) on a finished text run."""

import io
import json
import math
import os
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention.data import IGNORE_INDEX
from linear_attention.models import generate
from linear_attention.training import (
    build_data,
    cli,
    cli_args,
    eval_cli,
    experiment_config,
    generate_cli,
    load_run,
    train,
)
from linear_attention.training import trainer as trainer_module
from linear_attention.training.metrics import Reporter, read_jsonl
from tests.scripts import DEADLINE_S, wait_until
from tests.training.conftest import ROOT, full_pass, load_config

SMOKE = "--config=configs/mqar.py:smoke"


def test_help_lists_presets_and_sections(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert cli.main(["la-train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "configs/mqar.py: default, cpu, smoke" in out
    assert "configs/lm.py: default, cpu, smoke" in out
    for section in ("model: vocab_size, d_model", "data: kind", "optimizer:", "train:", "mesh:"):
        assert section in out
    assert "--dry_run" in out
    # each mixer's own options with its defaults, from the mixer's table
    assert "  swa: window=64\n" in out
    assert (
        "  softmax: num_kv_heads=None, qk_norm=False, qk_norm_all_heads=False, rotary_dim=None,\n"
        "      gate_activation=silu\n" in out
    )
    assert "  lstm: conv=False\n" in out
    assert "retnet: feature_map=identity, method=chunk, chunk_size=64, out_norm=True" in out


def test_dry_run_prints_the_resolved_config_and_runs_nothing(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    workdir = tmp_path / "never"
    argv = ["la-train", SMOKE, f"--workdir={workdir}", "--config.model.mixer=gated,softmax"]
    assert cli.main([*argv, "--config.train.num_steps=9", "--dry_run"]) == 0
    *config_lines, last = capsys.readouterr().out.strip().split("\n")
    printed = json.loads("\n".join(config_lines))
    expected = load_config("mqar", "smoke")
    expected.model.mixer = "gated,softmax"
    expected.train.num_steps = 9
    assert printed == json.loads(json.dumps(experiment_config(expected).to_dict()))
    assert printed["model"]["mixer"] == ["gated", "softmax"]
    assert not workdir.exists()
    # The last line sizes the run; parameters and FLOPs counted here by hand for this model
    # (d 32, 2 heads of 16, vocab 64, T 32, conv 4, no MLP, tied head; layer 0 gated with its
    # decay (d·h + 2h) and output gate (d·d) and per-head out norm, layer 1 softmax).
    sizing = json.loads(last)
    assert set(sizing) == {"parameters", "flops_per_token", "train_step_bytes_per_device"}
    d, h, dh, v, t, c = 32, 2, 16, 64, 32, 32  # c: the chunk, min(64, T)
    layer = 4 * d * d + 4 * 3 * d  # q, k, v, o projections; the depthwise conv on q, k, v
    weights = 2 * layer + d * h + d * d + v * d  # + the decay and gate projections; the head
    others = 2 * 3 * d + 2 * h + h * dh + 2 * d + d  # conv biases, decay, out norm, norms
    assert sizing["parameters"] == weights + others  # (the tied head is the embedding table)
    gated = 2 * h * (c * 2 * dh + 2 * dh * dh)  # intra-chunk + reading/updating the state
    softmax = 2 * h * t * 2 * dh
    assert sizing["flops_per_token"] == pytest.approx(3 * (2 * weights + gated + softmax))
    assert sizing["train_step_bytes_per_device"] >= 3 * 4 * sizing["parameters"]


def test_resume_with_another_config_is_a_usage_error(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    workdir = tmp_path / "run"
    workdir.mkdir()
    previous = experiment_config(load_config("mqar", "smoke")).to_dict()
    (workdir / "config.json").write_text(json.dumps(previous))
    status = cli.main(["la-train", SMOKE, f"--workdir={workdir}", "--config.model.d_model=16"])
    err = capsys.readouterr().err
    assert status == 2
    assert err.startswith("la-train: error: ") and "Traceback" not in err
    assert "config.model.d_model = 32, but this config has 16" in err


def test_ctrl_c_saves_a_checkpoint_and_the_rerun_resumes_from_it(tmp_path):
    """SIGINT to a real la-train process long before its first scheduled checkpoint."""
    workdir = tmp_path / "run"
    common = [SMOKE, f"--workdir={workdir}", "--config.train.checkpoint_every=100000"]
    common += ["--config.train.eval_every=100000", "--config.train.log_every=1"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "experiments/train.py", *common, "--config.train.num_steps=100000"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        metrics = str(workdir / "metrics.jsonl")
        wait_until(lambda: len(read_jsonl(metrics)) >= 2, proc, "two logged steps")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=DEADLINE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    step = int(err.split("SIGINT at step ")[1].split(":")[0])
    assert "checkpoint saved; rerun the same command to resume" in err
    assert "SIGINT received: saving a checkpoint" in out
    assert os.listdir(workdir / "checkpoints") == [str(step)]
    assert step >= 2

    rerun = subprocess.run(
        [sys.executable, "experiments/train.py", *common, f"--config.train.num_steps={step + 1}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert rerun.returncode == 0, rerun.stderr
    assert f"resuming from step {step} " in rerun.stdout
    assert [r["step"] for r in read_jsonl(str(workdir / "metrics.jsonl"))][-1] == step + 1


def test_a_second_sigint_stops_at_once_without_a_traceback(tmp_path, monkeypatch, capsys):
    """The first SIGINT only sets a flag (the handler does no I/O); a second one before the
    step ends stops at once: exit 130, one line, no traceback, no checkpoint, and the previous
    SIGINT handler is back (here in-process: two signals inside step 2's batch)."""
    real_build = trainer_module.build_data

    def signalling_build(cfg, **kwargs):
        data = real_build(cfg, **kwargs)
        real_batch = data.train_batch

        def train_batch(step, batch_size):
            if step == 2:
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGINT)  # the handler raises out of this call
            return real_batch(step, batch_size)

        data.train_batch = train_batch
        return data

    monkeypatch.setattr(trainer_module, "build_data", signalling_build)
    monkeypatch.chdir(ROOT)
    workdir = tmp_path / "run"
    previous = signal.getsignal(signal.SIGINT)
    args = [SMOKE, f"--workdir={workdir}", "--config.train.checkpoint_every=100000"]
    status = cli.main(["la-train", *args])
    out, err = capsys.readouterr()
    assert status == 130, (out, err)
    assert "Traceback" not in out + err
    assert f"la-train: interrupted; rerun the same command to resume in {workdir}" in out
    assert "SIGINT received" not in out  # stopped before the loop could announce the first
    assert not [p for p in (workdir / "checkpoints").glob("*") if p.name.isdigit()]
    assert signal.getsignal(signal.SIGINT) is previous


def test_ctrl_c_before_the_loop_stops_a_run_started_with_sigint_ignored(
    tmp_path, monkeypatch, capsys
):
    """A background job of a shell script starts with SIGINT ignored; la-train honours Ctrl-C
    from its start anyway (before, one that came before the loop was lost and the run trained
    to its end, exit 0): here SIGINT while the data are built, exit 130, nothing trained."""
    real_build = trainer_module.build_data

    def interrupted_build(cfg, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # (kept: the run stops once it is built)
        return real_build(cfg, **kwargs)

    monkeypatch.setattr(trainer_module, "build_data", interrupted_build)
    monkeypatch.chdir(ROOT)
    workdir = tmp_path / "run"
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        status = cli.main(["la-train", SMOKE, f"--workdir={workdir}"])
    finally:
        signal.signal(signal.SIGINT, previous)
    out, err = capsys.readouterr()
    assert status == 130, (out, err)
    assert f"la-train: interrupted; rerun the same command to resume in {workdir}" in out
    metrics = workdir / "metrics.jsonl"  # (opened before the loop)
    assert metrics.read_text() == "" and not (workdir / "summary.json").exists()
    assert not [p for p in (workdir / "checkpoints").glob("*") if p.name.isdigit()]


def test_ctrl_c_while_la_train_loads_jax_is_honoured():
    """SIGINT ignored from the start, and sent as JAX starts to load (the first seconds of
    la-train): kept, and main stops at once, one line, exit 130 (before, it was lost)."""
    script = (
        "import os, signal, sys\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "class Hook:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'jax':\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "sys.meta_path.insert(0, Hook())\n"
        "from linear_attention.training.cli import main\n"
        "sys.exit(main(['la-train', '--help']))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 130, (done.stdout, done.stderr)
    assert done.stdout == "la-train: interrupted before it started\n"
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "spec, path, preset",
    [
        ("configs/mqar.py", "configs/mqar.py", None),
        ("configs/mqar.py:cpu", "configs/mqar.py", "cpu"),
        ("/a:b/configs/lm.py:smoke", "/a:b/configs/lm.py", "smoke"),
    ],
)
def test_config_spec_split(spec, path, preset):
    assert cli_args.split_spec(spec) == (path, preset)


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """A finished 4-step text run (gated + softmax hybrid, so both decoding states are used)."""
    workdir = str(tmp_path_factory.mktemp("lm") / "run")
    config = load_config("lm", "smoke")
    config.model.mixer = "gated,softmax"
    config.model.num_layers = 2
    config.model.max_length = 64
    config.train.num_steps = 4
    config.train.sample_tokens = 0
    train(config, workdir, reporter=Reporter(4, stream=io.StringIO()))
    return workdir, config


def _summary(workdir):
    with open(os.path.join(workdir, "summary.json")) as f:
        return json.load(f)


def test_load_run_restores_the_final_parameters(text_run):
    workdir, config = text_run
    model, cfg = load_run(workdir)
    assert cfg == experiment_config(config)
    data = build_data(cfg)
    # The reloaded model's bits per byte on the validation windows, in float64 here.
    inputs, labels = data.val_inputs, data.val_labels
    logits = np.asarray(full_pass(model, jnp.asarray(inputs)), np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    picked = np.take_along_axis(logits, labels[..., None], -1)[..., 0]
    np.testing.assert_allclose(
        (logz - picked).mean() / math.log(2), _summary(workdir)["eval/bits_per_byte"], rtol=1e-5
    )
    earlier, _ = load_run(workdir, step=2)
    assert not np.allclose(earlier.embed.embedding[...], model.embed.embedding[...])
    with pytest.raises(ValueError, match=r"step must be one of the saved checkpoints \[2, 4\]"):
        load_run(workdir, step=3)
    with pytest.raises(ValueError, match="holds no run"):
        load_run(os.path.dirname(workdir))


def test_la_eval_reports_summary_metrics_and_accepts_data_overrides(text_run, capsys):
    workdir, _ = text_run
    before = _summary(workdir)
    assert eval_cli.eval_main(["la-eval", f"--workdir={workdir}"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("step 4: eval/accuracy ")
    with open(os.path.join(workdir, "eval_step4.json")) as f:
        record = json.load(f)
    for key in ("eval/loss", "eval/accuracy", "eval/bits_per_byte"):
        assert record[key] == pytest.approx(before[key], rel=1e-6)
    assert record["overrides"] == {} and record["step"] == 4
    # Other data: shorter windows, fewer of them; the output file names the overrides.
    argv = ["la-eval", f"--workdir={workdir}", "--config.data.seq_len=16", "--step=2"]
    assert eval_cli.eval_main([*argv, "--config.data.num_val_windows=5"]) == 0
    path = capsys.readouterr().out.split("written to ")[1].strip()
    with open(path) as f:
        short = json.load(f)
    assert short["step"] == 2 and short["overrides"]["config.data.seq_len"] == "16"
    model, cfg = load_run(workdir, step=2)
    data = build_data(
        experiment_config(
            {
                **cfg.to_dict(),
                "data": {**cfg.to_dict()["data"], "seq_len": 16, "num_val_windows": 5},
            }
        )
    )
    assert data.val_inputs.shape == (5, 16)
    # the smoke preset packs documents: the model gets the segment ids, boundary labels are ignored
    segments = None if data.val_segment_ids is None else jnp.asarray(data.val_segment_ids)
    logits = np.asarray(full_pass(model, jnp.asarray(data.val_inputs), segments), np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    labelled = data.val_labels != IGNORE_INDEX
    picked = np.take_along_axis(logits, np.where(labelled, data.val_labels, 0)[..., None], -1)
    want = (logz - picked[..., 0])[labelled].mean()
    assert short["eval/loss"] == pytest.approx(want, rel=1e-5)
    assert _summary(workdir) == before  # summary.json untouched


def test_la_eval_of_a_state_tracking_run_at_other_lengths(tmp_path, capsys):
    """``data.eval_lengths`` comes back from config.json as a tuple: la-eval reproduces the
    run's per-length figures and takes ``--config.data.eval_lengths=(...)`` as la-train does."""
    workdir = str(tmp_path / "parity")
    config = load_config("state_tracking", "smoke")
    config.train.num_steps = 2
    train(config, workdir, reporter=Reporter(2, stream=io.StringIO()))
    before = _summary(workdir)
    assert (
        eval_cli.eval_main(["la-eval", f"--workdir={workdir}", f"--output={tmp_path}/a.json"]) == 0
    )
    with open(tmp_path / "a.json") as f:
        same = json.load(f)
    for length in config.data.eval_lengths:
        key = f"eval/length_{length}/accuracy"
        assert same[key] == pytest.approx(before[key], abs=1e-6)
    argv = ["la-eval", f"--workdir={workdir}", "--config.data.eval_lengths=(4,6)"]
    assert eval_cli.eval_main([*argv, f"--output={tmp_path}/b.json"]) == 0, capsys.readouterr().err
    with open(tmp_path / "b.json") as f:
        other = json.load(f)
    per_length = sorted(k for k in other if k.startswith("eval/length_"))
    assert per_length == ["eval/length_4/accuracy", "eval/length_6/accuracy"]
    mean = (other["eval/length_4/accuracy"] + other["eval/length_6/accuracy"]) / 2
    assert other["eval/accuracy"] == pytest.approx(mean)


def test_la_eval_errors(text_run, capsys):
    workdir, _ = text_run
    for argv, message in (
        ([], "--workdir is required"),
        (
            [f"--workdir={workdir}", "--config.data.seq_lem=8"],
            "did you mean --config.data.seq_len?",
        ),
        ([f"--workdir={workdir}", "--config.data.seq_len=100"], "config.model.max_length = 64"),
        (
            [f"--workdir={workdir}", "--config.model.d_model=16"],
            "does not fit this config's parameters",
        ),
        ([f"--workdir={workdir}/nope"], "holds no run"),
    ):
        assert eval_cli.eval_main(["la-eval", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("la-eval: error: ") and message in err, err


def test_la_generate_streams_the_sample_of_generate(text_run, capsys):
    workdir, _ = text_run
    argv = ["la-generate", f"--workdir={workdir}", "--prompt=def f(", "--num_tokens=12"]
    assert generate_cli.generate_main([*argv, "--temperature=0.7", "--top_k=20", "--seed=3"]) == 0
    out = capsys.readouterr().out
    model, _ = load_run(workdir)
    prompt = np.frombuffer(b"def f(", np.uint8).astype(np.int32)[None]
    tokens = generate(model, prompt, 12, rng=jax.random.key(3), temperature=0.7, top_k=20)
    expected = b"def f(" + np.asarray(tokens)[0].astype(np.uint8).tobytes()
    assert out == expected.decode("utf-8", errors="replace") + "\n"
    for extra, message in (
        (["--num_tokens=100"], "exceeds max_length=64"),
        (["--top_k=-1"], "--top_k must be >= 0"),
        (["--temperature=-1"], "temperature must be a number >= 0"),
    ):
        assert generate_cli.generate_main([*argv, *extra]) == 2
        assert message in capsys.readouterr().err


def test_la_eval_output_never_replaces_a_run_file_and_is_checked_first(text_run, capsys):
    workdir, _ = text_run
    own = {name: open(os.path.join(workdir, name), "rb").read()
           for name in ("config.json", "summary.json", "metrics.jsonl")}  # fmt: skip
    base = ["la-eval", f"--workdir={workdir}"]
    for extra, message in (
        (["--output", f"{workdir}/config.json", "--overwrite"], "is the run's config.json"),
        ([f"--output={workdir}/summary.json"], "is the run's summary.json"),
        ([f"--output={workdir}/metrics.jsonl"], "is the run's metrics.jsonl"),
        ([f"--output={workdir}/checkpoints/4/x.json"], "part of the run's checkpoints/"),
        ([f"--output={workdir}/nope/a.json"], "does not exist"),
        ([f"--output={workdir}"], "is a folder"),
    ):
        assert eval_cli.eval_main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("la-eval: error: --output ") and message in err, err
    for name, content in own.items():
        assert open(os.path.join(workdir, name), "rb").read() == content
    out = os.path.join(os.path.dirname(workdir), "metrics_a.json")
    assert eval_cli.eval_main([*base, f"--output={out}"]) == 0
    first = capsys.readouterr().out
    assert eval_cli.eval_main([*base, f"--output={out}"]) == 2
    assert "exists; pass --overwrite to replace it" in capsys.readouterr().err
    assert eval_cli.eval_main([*base, f"--output={out}", "--overwrite"]) == 0
    assert capsys.readouterr().out == first


def test_la_eval_says_and_records_an_override_that_changes_the_model(text_run, capsys):
    workdir, _ = text_run
    out = os.path.join(os.path.dirname(workdir), "as_swa.json")
    argv = ["la-eval", f"--workdir={workdir}", "--config.model.mixer=gated,swa", f"--output={out}"]
    assert eval_cli.eval_main(argv) == 0, capsys.readouterr().err
    first = capsys.readouterr().out.splitlines()[0]
    assert first == (
        "la-eval: warning: the checkpoint evaluated as another model or tokenizer: "
        "config.model.mixer = ('gated', 'swa') (the run has ('gated', 'softmax'))"
    )
    with open(out) as f:
        record = json.load(f)
    assert record["changed"] == {
        "config.model.mixer": {"run": ["gated", "softmax"], "now": ["gated", "swa"]}
    }
    # data overrides keep the model's meaning: nothing said, nothing recorded
    argv = ["la-eval", f"--workdir={workdir}", "--config.data.num_val_windows=3"]
    assert eval_cli.eval_main([*argv, f"--output={out}", "--overwrite"]) == 0
    assert capsys.readouterr().out.startswith("step 4: ")
    with open(out) as f:
        assert "changed" not in json.load(f)


def test_la_generate_refuses_a_negative_seed_and_a_prompt_that_is_not_utf8(text_run, capsys):
    workdir, _ = text_run
    argv = ["la-generate", f"--workdir={workdir}", "--num_tokens=4"]
    assert generate_cli.generate_main([*argv, "--prompt=x", "--seed=-1"]) == 2
    assert capsys.readouterr().err == "la-generate: error: --seed must be >= 0, got -1\n"
    prompt = b"ab\xffc".decode("utf-8", "surrogateescape")  # as Python decodes such an argv
    assert generate_cli.generate_main([*argv, f"--prompt={prompt}"]) == 2
    err = capsys.readouterr().err
    assert err == "la-generate: error: --prompt is not UTF-8 text (byte 0xff at offset 2)\n"


def test_a_trailing_comma_in_the_mixer_list_is_an_error(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    for mixer in ("kda,", "gated,,softmax"):
        assert cli.main(["la-train", SMOKE, "--workdir=x", f"--config.model.mixer={mixer}"]) == 2
        err = capsys.readouterr().err
        assert err == (
            f"la-train: error: config.model.mixer has an empty name in {mixer!r}; give NAME or "
            "NAME,NAME,...\n"
        )
    assert not os.path.exists(ROOT / "x")


def test_pallas_method_off_a_tpu_is_a_usage_error_before_anything_runs(
    text_run, capsys, monkeypatch
):
    """On the CPU, method="pallas" stops la-train (before the workdir), la-eval and la-generate
    with the usage error; inside `pallas_interpret()` (how the tests run the kernels) it passes."""
    from linear_attention.kernels import pallas_interpret

    message = (
        "config.model.options.method = 'pallas' runs the Pallas kernels, which need a TPU or GPU, "
        "and this machine's backend is 'cpu': run it there, or pass "
        "--config.model.options.method=chunk"
    )
    workdir, config = text_run
    fresh = os.path.join(os.path.dirname(workdir), "pallas")
    train_argv = ["la-train", "--config=configs/lm.py:smoke", f"--workdir={fresh}"]
    calls = [
        ("la-train", lambda a: cli.main([*train_argv, *a])),
        ("la-eval", lambda a: eval_cli.eval_main(["la-eval", f"--workdir={workdir}", *a])),
        (
            "la-generate",
            lambda a: generate_cli.generate_main(
                ["la-generate", f"--workdir={workdir}", "--prompt=x", "--num_tokens=2", *a]
            ),
        ),
    ]
    monkeypatch.chdir(ROOT)
    for prog, call in calls:
        assert call(["--config.model.options.method=pallas"]) == 2, prog
        err = capsys.readouterr().err
        assert err.startswith(f"{prog}: error: {message}"), err
    assert not os.path.exists(fresh)
    # one layer type's method, through layer_options
    hybrid = ["--config.model.mixer=gated,linear", "--config.model.num_layers=2"]
    hybrid.append("--config.model.layer_options={'gated': {'method': 'pallas'}}")
    assert cli.main([*train_argv, *hybrid]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "la-train: error: config.model.layer_options.gated.method = 'pallas' runs the Pallas"
    ), err
    assert "or set it to 'chunk' (the same recurrence in XLA)" in err
    assert not os.path.exists(fresh)
    pallas = config.copy_and_resolve_references()
    pallas.model.options.method = "pallas"
    with pallas_interpret():
        assert cli_args.check_backend(pallas) is None
    assert config.model.options.method != "pallas" and cli_args.check_backend(config) is None
    # the model's method is 'pallas' but its one layer type with a method (gated; softmax has
    # none) is set back to 'chunk': no layer runs a Mosaic kernel, so the CPU runs it
    overridden = config.copy_and_resolve_references()
    assert overridden.model.mixer == "gated,softmax"
    overridden.model.options.method = "pallas"
    overridden.model.layer_options = {"gated": {"method": "chunk"}}
    assert cli_args.check_backend(overridden) is None
