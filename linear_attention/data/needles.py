"""RULER-style needle-in-a-haystack prompts at a chosen context length and needle depth, and
RULER's scoring (behind ``la-eval --needles``), and the same prompts as training data
(`NeedleData`, ``config.data.kind = "needles"``).

A prompt is a haystack of filler sentences with needles hidden at a depth, then a question and
the start of the answer; the model continues greedily and is scored on whether its text holds
the expected strings. The tasks (`NEEDLE_TASKS`), after RULER's:

- ``niah_single_1`` .. ``_3``: one needle "One of the special magic numbers for {key} is:
  {value}." in repeated noise (1), in text of a corpus (2), with a UUID as the value (3);
- ``niah_multikey``: the needle among 3 others with other keys (distractors);
- ``niah_multivalue``: 4 needles with the same key; all 4 values are asked for;
- ``niah_multiquery``: 4 needles with 4 keys; all 4 are asked for at once;
- ``vt`` (variable tracking): ``VAR A = 12345`` then a chain ``VAR B = VAR A`` ... of 4
  assignments; the answer is every name in the chain.

The haystack is sentences of synthetic noise ("The grass is green. ...") or of a corpus's
documents (the run's own text), added until the prompt holds ``context_len`` tokens less room
for the answer; the needles go in at sentence ``round(depth * n)`` of the ``n`` sentences
(``depth`` 0: the start, 1: the end), in order. Score (RULER's ``string_match_all``): the share
of the expected strings found, case aside, in the generated text, averaged over the prompts.
"""

from __future__ import annotations

import dataclasses
import re
import uuid

import numpy as np

from linear_attention.data.batches import IGNORE_INDEX, padded_batches
from linear_attention.data.protocol import DataSource

NOISE = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
).split(". ")
KEY_WORDS = (
    "apple river copper violet lantern meadow harbor falcon marble cedar velvet quartz "
    "thunder maple orchid saddle beacon canyon ember glacier"
).split()


@dataclasses.dataclass(frozen=True)
class NeedleTask:
    """One task of the family (module docstring)."""

    haystack: str  # "noise" or "corpus"
    value: str = "number"  # "number" (7 digits) or "uuid"
    keys: int = 1  # needles with distinct keys
    values: int = 1  # needles with the same (asked) key
    queries: int = 1  # keys asked at once
    chain: int = 0  # variable tracking: assignments in the chain (0: a needle task)


NEEDLE_TASKS = {
    "niah_single_1": NeedleTask("noise"),
    "niah_single_2": NeedleTask("corpus"),
    "niah_single_3": NeedleTask("corpus", value="uuid"),
    "niah_multikey": NeedleTask("corpus", keys=4),
    "niah_multivalue": NeedleTask("corpus", values=4),
    "niah_multiquery": NeedleTask("corpus", keys=4, queries=4),
    "vt": NeedleTask("noise", chain=4),
}


def corpus_sentences(documents, limit: int = 20000) -> list[str]:
    """Sentences of ``documents`` (split after ``.``, ``!`` or ``?`` and on blank lines; one
    line of whitespace each), at most ``limit``."""
    out = []
    for text in documents:
        for piece in re.split(r"(?<=[.!?])\s+|\n\s*\n", text):
            piece = " ".join(piece.split())
            if piece:
                out.append(piece)
                if len(out) == limit:
                    return out
    return out


def _value(kind: str, rng: np.random.Generator) -> str:
    if kind == "uuid":
        return str(uuid.UUID(bytes=rng.bytes(16), version=4))
    return str(rng.integers(1_000_000, 10_000_000))


def _needles(task: NeedleTask, rng) -> tuple[list[str], str, str, list[str]]:
    """``(needle sentences, question, answer prefix, expected strings)``."""
    if task.chain:
        names = [
            "".join(rng.choice(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ"), 5)) for _ in range(task.chain)
        ]
        value = _value("number", rng)
        needles = [f"VAR {names[0]} = {value}."]
        needles += [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:], strict=False)]
        question = f"Find all variables that are assigned the value {value} in the text above."
        return needles, question, f"Answer: the variables assigned {value} are:", names
    keys = list(rng.choice(KEY_WORDS, task.keys, replace=False))
    values = {k: [_value(task.value, rng) for _ in range(task.values)] for k in keys}
    needles = [
        f"One of the special magic numbers for {k} is: {v}." for k in keys for v in values[k]
    ]
    order = rng.permutation(len(needles))
    asked = keys[: task.queries]
    what = ", ".join(asked)
    noun = "numbers" if task.values > 1 or task.queries > 1 else "number"
    if task.value == "uuid":
        needles = [n.replace("magic numbers", "magic uuids") for n in needles]
        noun = noun.replace("number", "uuid")
    question = f"What are all the special magic {noun} for {what} mentioned in the provided text?"
    prefix = f"The special magic {noun} for {what} mentioned in the provided text are"
    expected = [v for k in asked for v in values[k]]
    return [needles[i] for i in order], question, prefix, expected


def make_prompt(task, rng, tokenizer, context_len: int, depth: float, sentences, answer_len: int):
    """``(prompt text, expected strings)`` of ``task`` (a `NeedleTask`): the haystack of
    ``sentences`` (cycled) grown until the prompt's tokens reach ``context_len - answer_len``,
    the needles at ``depth``."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    needles, question, prefix, expected = _needles(task, rng)
    head = "Some special magic values are hidden in the following text. Memorize them."
    tail = f"{question} {prefix}"
    budget = context_len - answer_len
    fixed = len(tokenizer.encode(" ".join([head, *needles, tail])))
    if fixed >= budget:
        raise ValueError(
            f"context length {context_len} leaves no room for a haystack ({fixed} tokens of "
            f"needles and question, {answer_len} for the answer)"
        )
    start = int(rng.integers(len(sentences)))
    hay, used = [], fixed
    while True:
        sentence = sentences[(start + len(hay)) % len(sentences)].rstrip(".") + "."
        cost = len(tokenizer.encode(" " + sentence))
        if used + cost > budget:
            break
        hay.append(sentence)
        used += cost
    at = round(depth * len(hay))
    text = " ".join([head, *hay[:at], *needles, *hay[at:], tail])
    while len(tokenizer.encode(text)) > budget and hay:  # (joins may cost a token more)
        if at < len(hay):
            hay.pop()
        else:
            hay.pop(0)
            at -= 1
        text = " ".join([head, *hay[:at], *needles, *hay[at:], tail])
    return text, expected


def string_match_all(prediction: str, expected: list[str]) -> float:
    """RULER's score of one answer: the share of ``expected`` found in ``prediction``, case
    aside."""
    found = sum(e.lower() in prediction.lower() for e in expected)
    return found / len(expected)


def answer_text(expected: list[str]) -> str:
    """What a trained model is taught to write after a prompt: the expected strings."""
    return " " + ", ".join(expected) + "."


def needle_row(task, rng, tokenizer, seq_len: int, answer_len: int, sentences):
    """``(inputs int32[seq_len], labels int32[seq_len])``: a prompt of ``task`` at a depth
    drawn uniformly in [0, 1], then its `answer_text`, padded with token 0; only the answer's
    tokens are labelled (each at the position before it)."""
    depth = float(rng.uniform())
    prompt, expected = make_prompt(task, rng, tokenizer, seq_len + 1, depth, sentences, answer_len)
    head, answer = tokenizer.encode(prompt), tokenizer.encode(answer_text(expected))
    if len(answer) > answer_len:
        raise ValueError(
            f"config.data.answer_len {answer_len} is shorter than an answer of {len(answer)} tokens"
        )
    tokens = np.zeros(seq_len + 1, np.int32)
    tokens[: len(head)] = head
    tokens[len(head) : len(head) + len(answer)] = answer
    labels = np.full(seq_len, IGNORE_INDEX, np.int32)
    labels[len(head) - 1 : len(head) - 1 + len(answer)] = answer
    return tokens[:-1], labels


class NeedleData(DataSource):
    """Needle prompts as data: each row one prompt of ``seq_len`` tokens of ``task`` (a name
    of `NEEDLE_TASKS`), its answer the only labelled part, so ``eval/accuracy`` is the share of
    answer tokens predicted. Training rows are drawn from ``(seed, step)``; the test set of
    ``num_test_examples`` rows is fixed. ``sentences``: the corpus haystack."""

    def __init__(self, *, task: str, seq_len: int, answer_len: int, tokenizer, sentences,
                 num_test_examples: int, seed: int = 0):  # fmt: skip
        self.task, self.spec = task, NEEDLE_TASKS[task]
        self.seq_len, self.answer_len, self.seed = seq_len, answer_len, seed
        self.tokenizer, self.vocab_size = tokenizer, tokenizer.vocab_size
        self.sentences = sentences if self.spec.haystack == "corpus" else NOISE
        rows = self._rows(np.random.default_rng([seed, 1]), num_test_examples)
        self.test_inputs, self.test_labels = rows

    @staticmethod
    def needs_corpus(task: str) -> bool:
        """Whether ``task``'s haystack is a corpus's sentences (else synthetic noise)."""
        return NEEDLE_TASKS[task].haystack == "corpus"

    def _rows(self, rng, n: int):
        made = [needle_row(self.spec, rng, self.tokenizer, self.seq_len, self.answer_len,
                           self.sentences) for _ in range(n)]  # fmt: skip
        return np.stack([m[0] for m in made]), np.stack([m[1] for m in made])

    def train_batch(self, step: int, batch_size: int) -> dict[str, np.ndarray]:
        inputs, labels = self._rows(np.random.default_rng([self.seed, 2, step]), batch_size)
        return {"inputs": inputs, "labels": labels}

    def eval_batches(self, batch_size: int):
        yield from padded_batches(self.test_inputs, self.test_labels, batch_size)
