"""`LMEvalModel` and ``la-eval --tasks`` (lm-evaluation-harness, the ``eval`` extra; skipped
without it) on the qwen3_5 fixture imported with ``la-convert``:

- rolling log-likelihoods and greedy generation against the model's plain forward pass;
- the local tasks through ``simple_evaluate(model="linear_attention")`` against lm-eval's own
  ``hf`` backend: its per-request log-likelihoods recorded in
  docs/results/lm_eval_peer_cpu.json (default run, no torch), and live under ``-m hf``;
- the command line's errors before any work, and its output written whole or not at all."""

import json
import os

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness: pip install -e '.[eval]'")

from linear_attention.evals import LMEvalModel  # noqa: E402
from linear_attention.evals import cli as eval_cli  # noqa: E402
from linear_attention.evals.generation import power_of_two_pieces  # noqa: E402
from tests.evals.conftest import MAX_LENGTH, TASK_DIR, reference_logp  # noqa: E402
from tests.scripts import ROOT, load_module  # noqa: E402

RECORDED = os.path.join(ROOT, "docs", "results", "lm_eval_peer_cpu.json")


class Req:
    def __init__(self, *args):
        self.args = args


@pytest.fixture(scope="module")
def adapter(converted):
    return LMEvalModel(converted, batch_tokens=128)


@pytest.fixture(scope="module")
def peer():
    return load_module("experiments/lm_eval_peer.py", "lm_eval_peer")


def test_rolling_loglikelihood_is_the_sum_over_disjoint_windows(adapter):
    """Each text is scored whole: its first 64 tokens after the prefix token, then each next
    64 (fewer at the end) after the 64 tokens before their last, in the plain forward pass."""
    texts = [
        "short text.",
        "A river is a natural stream of water that flows in a channel to the sea, a lake or "
        "another river. Rivers carry sediment and shape the land over many years.",
        "x" * 64,
        "y" * 65,
    ]
    got = adapter.loglikelihood_rolling([Req(t) for t in texts])
    model, L = adapter.run.model, MAX_LENGTH
    for text, ll in zip(texts, got, strict=True):
        t = adapter.tok_encode(text)
        u = [adapter.prefix_token_id] + t  # u[j + 1] is t[j]
        want, a = 0.0, 0
        while a < len(t):
            b = min(len(t), a + L)  # this window predicts t[a:b]
            inputs = u[max(0, b - L) : b]
            logp = reference_logp(model, inputs)[-(b - a) :]
            want += logp[np.arange(b - a), t[a:b]].sum()
            a = b
        assert abs(ll - want) <= 1e-5 * abs(want), (text[:10], ll, want)
    assert adapter.prefix_token_id == 0  # the fixture's tokenizer names no end-of-text token


def _greedy_reference(model, prompt, n):
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(reference_logp(model, tokens)[-1].argmax()))
    return tokens[len(prompt) :]


def test_generate_until_is_greedy_and_stops(adapter):
    model, tok = adapter.run.model, adapter.run.tokenizer
    prompts = ["The color of grass is", "Count: 1 2 3", "z" * 70]  # the last one cut to 64 - 6
    drawn = {p: _greedy_reference(model, adapter.tok_encode(p)[-(MAX_LENGTH - 6) :], 6)
             for p in prompts}  # fmt: skip
    full = {p: tok.decode(d) for p, d in drawn.items()}
    # a stop string that occurs: the text before it; one that never does: all six tokens
    stop = {p: full[p][2:4] for p in prompts}
    requests = [Req(p, {"until": [stop[p]], "max_gen_toks": 6}) for p in prompts]
    requests += [Req(p, {"until": ["\u00a7"], "max_gen_toks": 6, "do_sample": False})
                 for p in prompts]  # fmt: skip
    got = adapter.generate_until(requests)
    assert got[:3] == [full[p][: full[p].index(stop[p])] for p in prompts]
    assert got[3:] == [full[p] for p in prompts]
    with pytest.raises(ValueError, match="generation_kwargs do_sample=True: LMEvalModel gen"):
        adapter.generate_until([Req("a", {"until": ["."], "do_sample": True, "max_gen_toks": 2})])
    with pytest.raises(ValueError, match="max_gen_toks 64 leaves no room for a context"):
        adapter.generate_until([Req("a", {"max_gen_toks": 64})])
    assert power_of_two_pieces(13) == [8, 4, 1] and power_of_two_pieces(64) == [64]
    assert adapter.max_gen_toks == 32  # half the fixture's 64 when not given


def test_adapter_arguments_are_checked(converted, adapter):
    with pytest.raises(ValueError, match="batch_size=8: LMEvalModel batches by batch_tokens"):
        LMEvalModel(run=adapter.run, batch_size=8)
    with pytest.raises(ValueError, match="max_batch_size=64: LMEvalModel batches by batch_tok"):
        LMEvalModel(run=adapter.run, max_batch_size=64)
    with pytest.warns(
        UserWarning, match="runs on JAX's default device \\(cpu\\); device='cuda:0' is"
    ):
        LMEvalModel(run=adapter.run, device="cuda:0")
    with pytest.raises(ValueError, match=r"max_length must be in \[1, 64\]"):
        LMEvalModel(run=adapter.run, max_length=65)
    with pytest.raises(ValueError, match=r"prefix_token_id must be in \[0, 96\), got 96"):
        LMEvalModel(run=adapter.run, prefix_token_id=96)
    with pytest.raises(ValueError, match="takes one of workdir"):
        LMEvalModel(converted, run=adapter.run)


def test_local_tasks_equal_lm_evals_hf_backend_as_recorded(converted, peer):
    """``simple_evaluate(model="linear_attention", ...)`` (the registered name) on the local
    tasks: every request's log-likelihood within 1e-4 relative of the hf backend's and the
    same is-greedy, as recorded by experiments/lm_eval_peer.py; the metrics too."""
    with open(RECORDED) as f:
        recorded = json.load(f)["hf"]
    ours = peer.evaluate("linear_attention", model_args=f"workdir={converted},batch_tokens=256")
    for task, rows in recorded["requests"].items():
        assert len(ours["requests"][task]) == len(rows) > 0
    result = peer.compare(ours, recorded)
    assert result["max_relative_difference"] <= 1e-4
    assert result["is_greedy_equal"] and result["max_metric_relative_difference"] <= 1e-4


@pytest.mark.hf
def test_local_tasks_equal_lm_evals_hf_backend_live(converted, adapter, peer):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    theirs = peer.hf_model()
    result = peer.compare(peer.evaluate(adapter), peer.evaluate(theirs))
    assert result["max_relative_difference"] <= 1e-4
    assert result["is_greedy_equal"] and result["max_metric_relative_difference"] <= 1e-4
    for _, _, (ll_a, greedy_a), (ll_b, greedy_b) in peer.compare_greedy(adapter, theirs):
        assert greedy_a and greedy_b and abs(ll_a - ll_b) <= 1e-4 * abs(ll_b)


# ------------------------------------------------------------------ la-eval --tasks
def _la_eval(*args):
    return eval_cli.main(["la-eval", *args])


@pytest.fixture
def in_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the local tasks' data files are relative to the checkout


def test_la_eval_tasks_writes_the_result_dict(converted, tmp_path, in_root, capsys):
    out = tmp_path / "r.json"
    argv = ["--workdir", converted, "--tasks", "local_cloze", "--include_path", TASK_DIR,
            "--batch_tokens", "128", "--limit", "3", "--log_samples"]  # fmt: skip
    argv += ["--output", str(out)]
    assert _la_eval(*argv) == 0
    record = json.loads(out.read_text())
    assert record["la_eval"]["step"] == 0 and record["la_eval"]["max_length"] == MAX_LENGTH
    samples = record["samples"]["local_cloze"]
    assert len(samples) == 3 and record["results"]["local_cloze"]["acc,none"] == 0.0
    # perplexity = exp(-mean log-likelihood) of the samples written
    lls = [s["resps"][0][0][0] for s in samples]
    want = np.exp(-np.mean(lls))
    assert abs(record["results"]["local_cloze"]["perplexity,none"] - want) <= 1e-6 * want
    assert _la_eval(*argv) == 2 and "exists; pass --overwrite" in capsys.readouterr().err


def _mqar_workdir(tmp_path):
    from linear_attention.training import experiment_config
    from tests.training.conftest import tiny_mqar

    workdir = tmp_path / "mqar"
    workdir.mkdir()
    (workdir / "config.json").write_text(json.dumps(experiment_config(tiny_mqar()).to_dict()))
    return str(workdir)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tasks", "local_clozee"], "unknown task 'local_clozee'; close names: local_cloze"),
        (["--tasks", "local_remote"], "from the Hugging Face Hub, and la-eval downloads nothing"),
        (["--tasks", "lambada_openai"], "write the task with `dataset_path: json`"),
        (["--tasks", "local_cloze", "--block_len", "8"], "--block_len goes with --position_b"),
        (
            ["--tasks", "local_cloze", "--position_buckets", "8"],
            "give one of --tasks, --position_buckets or --needles",
        ),
        (["--tasks", "local_cloze", "--limit", "0"], "--limit must be >= 1, got 0"),
        (["--tasks", ","], "--tasks needs at least one task name"),
        (["--tasks", "local_cloze", "--include_path", "/nonexistent"], "is not a folder"),
        ("MQAR", "is a 'mqar' run with no tokenizer for text"),
    ],
)
def test_la_eval_tasks_refuses_bad_input_before_any_work(
    argv, message, converted, tmp_path, in_root, capsys, monkeypatch
):
    out = tmp_path / "r.json"
    loaded = []
    monkeypatch.setattr(eval_cli, "load_text_run", lambda *a, **k: loaded.append(a))
    if argv == "MQAR":
        argv = ["--tasks", "local_cloze", "--workdir", _mqar_workdir(tmp_path)]
    else:
        argv = [*argv, "--workdir", converted]
        if "--include_path" not in argv:
            argv += ["--include_path", TASK_DIR]
    assert _la_eval(*argv, "--output", str(out)) == 2
    err = capsys.readouterr().err
    assert err.startswith("la-eval: error: ") and message in err, err
    assert not out.exists() and not loaded


def test_la_eval_leaves_no_file_when_evaluation_fails(converted, tmp_path, in_root, monkeypatch):
    def fail(**kwargs):
        raise ValueError("a continuation of 70 tokens is longer than the model's maximum")

    monkeypatch.setattr(lm_eval, "simple_evaluate", fail)
    out = tmp_path / "r.json"
    argv = ["--workdir", converted, "--tasks", "local_cloze", "--include_path", TASK_DIR]
    assert _la_eval(*argv, "--output", str(out)) == 2
    assert list(tmp_path.iterdir()) == []


def test_la_eval_without_tasks_is_the_runs_own_evaluation(tmp_path, capsys):
    assert _la_eval("--workdir", str(tmp_path / "none")) == 2
    assert "holds no run (no config.json)" in capsys.readouterr().err
