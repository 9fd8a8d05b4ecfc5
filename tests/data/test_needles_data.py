"""Needle prompts as a data kind (`data.needles.NeedleData`, ``config.data.kind = "needles"``):
rows whose only labels are the answer's tokens (against the answer text by hand), batches keyed
by the step, the config's refusals, and a two-step training run evaluated by ``la-eval
--needles``."""

import json

import ml_collections
import numpy as np
import pytest

from linear_attention.data import IGNORE_INDEX
from linear_attention.data.needles import NEEDLE_TASKS, NeedleData, answer_text, needle_row
from linear_attention.data.tokenizers import ByteTokenizer
from linear_attention.training import experiment_config
from linear_attention.training.trainer import train
from tests.training.conftest import load_config

SENTENCES = [f"Sentence number {i} of the corpus is here" for i in range(50)]


def _text(ids) -> str:
    return bytes(np.asarray(ids, np.uint8).tolist()).decode()


@pytest.mark.parametrize("task", ["niah_single_1", "niah_multivalue", "vt"])
def test_a_row_labels_only_its_answer(task):
    rng = np.random.default_rng(3)
    inputs, labels = needle_row(NEEDLE_TASKS[task], rng, ByteTokenizer(), 700, 48, SENTENCES)
    assert inputs.shape == labels.shape == (700,)
    marked = np.flatnonzero(labels != IGNORE_INDEX)
    assert (np.diff(marked) == 1).all()  # one run: the answer
    answer = _text(labels[marked])
    assert answer.startswith(" ") and answer.endswith(".") and len(answer) <= 48
    # each label is the next input: the answer follows the prompt in the row
    inside = marked[marked + 1 < 700]
    assert (labels[inside] == inputs[inside + 1]).all()
    prompt = _text(inputs[: marked[0] + 1])
    expected = answer[1:-1].split(", ")
    assert answer == answer_text(expected) and all(e in prompt for e in expected)
    assert (inputs[marked[-1] + 2 :] == 0).all()  # padded after the answer


def test_batches_are_keyed_by_the_step_and_the_test_set_is_fixed():
    data = NeedleData(task="niah_multikey", seq_len=600, answer_len=32, tokenizer=ByteTokenizer(),
                      sentences=SENTENCES, num_test_examples=3, seed=1)  # fmt: skip
    a, b, c = data.train_batch(5, 2), data.train_batch(5, 2), data.train_batch(6, 2)
    assert np.array_equal(a["inputs"], b["inputs"]) and not np.array_equal(a["inputs"], c["inputs"])
    batches = list(data.eval_batches(2))
    assert [x["inputs"].shape for x in batches] == [(2, 600), (2, 600)]
    assert (batches[1]["labels"][1] == IGNORE_INDEX).all()  # the padding row
    assert data.vocab_size == 256


def _needles_config(workdir_data: str | None = None):
    config = load_config("mqar", "smoke")
    config.data = ml_collections.ConfigDict(
        dict(
            kind="needles", task="niah_single_1", seq_len=384, answer_len=16, num_test_examples=4
        )  # fmt: skip
    )
    config.model.vocab_size = 256
    config.model.max_length = 512
    config.train.num_steps = 2
    config.train.eval_every = 2
    config.train.batch_size = 2
    return config


def test_config_refuses_what_cannot_be_made():
    config = _needles_config()
    config.data.task = "niah_single_4"
    with pytest.raises(ValueError, match="unknown config.data.task 'niah_single_4'"):
        experiment_config(config)
    config = _needles_config()
    config.data.answer_len = 384
    with pytest.raises(ValueError, match="config.data.seq_len = 384 leaves no room past answer"):
        experiment_config(config)


def test_train_on_needles_then_la_eval_needles(tmp_path):
    from linear_attention.evals import cli as eval_cli

    workdir = str(tmp_path / "run")
    summary = train(_needles_config(), workdir)
    assert 0.0 <= summary["eval/accuracy"] <= 1.0
    out = tmp_path / "n.json"
    argv = ["la-eval", "--workdir", workdir, "--needles", "niah_single_1", "--lengths", "384",
            "--depths", "0.5", "--samples", "1", "--answer_len", "16"]  # fmt: skip
    argv += ["--output", str(out)]
    assert eval_cli.main(argv) == 0
    (cell,) = json.loads(out.read_text())["cells"]
    assert cell["context_len"] == 384 and 0.0 <= cell["score"] <= 1.0
