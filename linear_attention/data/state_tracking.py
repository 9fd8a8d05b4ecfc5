"""State tracking: parity, modular arithmetic and group word problems, trained on short
sequences and evaluated on longer ones.

The tasks of Grazzi et al. (ICLR 2025, "Unlocking State-Tracking in Linear RNNs Through
Negative Eigenvalues", after Deletang et al. 2023 and Beck et al. 2024) and of Merrill et al.
(2024, "The Illusion of State") / Siems et al. (DeltaProduct), written from their definitions:

- ``parity``: tokens are bits ``{0, 1}``; the label at the last position of a sequence is the
  sum of its bits mod 2 (one label per sequence). Chance: 1/2.
- ``mod_arith``: an expression ``d op d op ... d =`` without brackets, digits ``0..4``, operators
  ``+ − *`` with ``*`` binding tighter than ``+ −`` (evaluated left to right otherwise); the label
  at the ``=`` (the last position) is the value mod 5. A sequence of ``n`` numbers has length
  ``2n`` (so lengths are even). Tokens: digits 0–4, ``+`` 5, ``−`` 6, ``*`` 7, ``=`` 8.
  Chance: 1/5.
- ``s3``, ``s5``, ``a5``: every token is an element of the group (permutations of ``{0..n-1}``,
  index in lexicographic order; A5: the 60 even permutations of 5 in that order) and the label at
  every position ``t`` is the running product ``p_t = p_{t−1} ∘ g_t`` (``p_1 = g_1``,
  ``(p ∘ g)(i) = p(g(i))``).
- ``s5_swaps``: as ``s5``, but the tokens are only the identity and the 10 transpositions (the
  products still range over all of S5; token ids are S5's indices).

Sequence lengths: training rows have a length drawn uniformly from ``[min_len, max_len]``
(for ``mod_arith``: the number of operands uniform, so lengths are the even numbers in range),
padded on the right to ``max_len`` with token 0 and ``IGNORE_INDEX`` labels (the models are
causal, so padding after a sequence never changes its predictions). Evaluation has
``num_eval_examples`` sequences of exactly each length in ``eval_lengths``; `eval_groups` yields
them per length so the trainer records ``eval/length_{L}/accuracy``. That accuracy is over the
scored positions: sequence-level for ``parity`` and ``mod_arith`` (one label per sequence, as
Grazzi et al.), token-level (every prefix's running product) for the group tasks.

Training batches are fresh draws keyed by ``(seed, step)``, so a resumed run sees the same data
(as in Grazzi et al., whose training data is sampled, not a fixed set).
"""

from __future__ import annotations

import itertools

import numpy as np

from linear_attention.data.batches import IGNORE_INDEX, padded_batches
from linear_attention.data.protocol import DataSource
from linear_attention.fields import did_you_mean

TASKS = ("parity", "mod_arith", "s3", "s5", "s5_swaps", "a5")
MODULUS = 5
PLUS, MINUS, TIMES, EQUALS = MODULUS, MODULUS + 1, MODULUS + 2, MODULUS + 3
_GROUP_DEGREE = {"s3": 3, "s5": 5, "s5_swaps": 5, "a5": 5}


def permutation_sign(perm) -> int:
    """+1 for an even permutation, −1 for an odd one (by counting inversions)."""
    inversions = sum(1 for i, j in itertools.combinations(range(len(perm)), 2) if perm[i] > perm[j])
    return -1 if inversions % 2 else 1


def group_elements(task: str) -> np.ndarray:
    """``int[|G|, n]``: the group's permutations in lexicographic order (token id = row)."""
    if task not in _GROUP_DEGREE:
        raise ValueError(
            f"task must be one of {tuple(_GROUP_DEGREE)}, got {task!r}"
            f"{did_you_mean(task, _GROUP_DEGREE)}"
        )
    perms = list(itertools.permutations(range(_GROUP_DEGREE[task])))
    if task == "a5":
        perms = [p for p in perms if permutation_sign(p) == 1]
    return np.array(perms, dtype=np.int64)


def multiplication_table(elements: np.ndarray) -> np.ndarray:
    """``table[i, j]`` = index of ``elements[i] ∘ elements[j]`` (``(p ∘ g)(x) = p(g(x))``)."""
    index = {tuple(p): i for i, p in enumerate(elements.tolist())}
    composed = elements[:, elements]  # [i, j, x] = p_i[g_j[x]]
    return np.array([[index[tuple(row)] for row in block] for block in composed.tolist()])


def input_elements(task: str, elements: np.ndarray) -> np.ndarray:
    """Token ids a sequence of ``task`` draws from: all of the group, or for ``s5_swaps`` the
    identity and the transpositions (permutations moving exactly 2 points, or none)."""
    if task != "s5_swaps":
        return np.arange(len(elements))
    moved = (elements != np.arange(elements.shape[1])).sum(axis=1)
    return np.flatnonzero((moved == 0) | (moved == 2))


def task_vocab_size(task: str) -> int:
    """Tokens (= label classes at most) of ``task``."""
    check_task(task)
    if task == "parity":
        return 2
    if task == "mod_arith":
        return EQUALS + 1
    return len(group_elements(task))


def task_chance(task: str) -> float:
    """Accuracy of a uniform guess among the task's label classes (Grazzi et al.'s scaled
    accuracy is ``(acc − chance) / (1 − chance)``)."""
    check_task(task)
    if task == "parity":
        return 0.5
    if task == "mod_arith":
        return 1.0 / MODULUS
    return 1.0 / len(group_elements(task))


def check_task(task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}{did_you_mean(task, TASKS)}")


def check_state_tracking_settings(
    *, task: str, min_len: int, max_len: int, eval_lengths, num_eval_examples: int = 1
) -> None:
    """Raise ``ValueError`` naming the numbers if a setting cannot be generated."""
    check_task(task)
    shortest = 2 if task == "mod_arith" else 1
    if min_len < shortest:
        raise ValueError(f"min_len must be >= {shortest} for {task!r}, got {min_len}")
    if max_len < min_len:
        raise ValueError(f"max_len must be >= min_len, got max_len={max_len}, min_len={min_len}")
    if task == "mod_arith" and 2 * ((min_len + 1) // 2) > max_len:
        raise ValueError(
            f"mod_arith lengths are even (2 per operand): [min_len, max_len] = "
            f"[{min_len}, {max_len}] holds none"
        )
    lengths = tuple(eval_lengths)
    if not lengths:
        raise ValueError("eval_lengths must hold at least one length, got ()")
    for length in lengths:
        if not isinstance(length, (int, np.integer)) or length < shortest:
            raise ValueError(f"eval_lengths must be integers >= {shortest}, got {lengths}")
        if task == "mod_arith" and length % 2:
            raise ValueError(
                f"mod_arith lengths are even (2 tokens per operand), got eval_lengths={lengths}"
            )
    if len(set(lengths)) != len(lengths):
        raise ValueError(f"eval_lengths must be distinct, got {lengths}")
    if num_eval_examples < 1:
        raise ValueError(f"num_eval_examples must be >= 1, got {num_eval_examples}")


def parity_labels(bits_BT: np.ndarray, lengths_B: np.ndarray) -> np.ndarray:
    """Sum of the first ``lengths[b]`` bits of row ``b``, mod 2."""
    t = np.arange(bits_BT.shape[1])
    return (np.where(t < lengths_B[:, None], bits_BT, 0).sum(axis=1) % 2).astype(np.int64)


def evaluate_mod_arith(digits_BN: np.ndarray, ops_BN: np.ndarray, n_B: np.ndarray) -> np.ndarray:
    """Value mod 5 of ``d_0 op_1 d_1 ... op_{n−1} d_{n−1}`` with ``*`` before ``+ −``.

    Left to right with a pending product ``term`` and its ``sign``: ``*`` multiplies the term,
    ``+``/``−`` adds ``sign · term`` to the total and starts a new term. (``ops[:, 0]`` unused.)"""
    total = np.zeros(len(n_B), np.int64)
    sign = np.ones(len(n_B), np.int64)
    term = digits_BN[:, 0].astype(np.int64)
    for i in range(1, digits_BN.shape[1]):
        live = i < n_B
        d = digits_BN[:, i].astype(np.int64)
        times = live & (ops_BN[:, i] == TIMES)
        new_term = live & ~times
        total = np.where(new_term, (total + sign * term) % MODULUS, total)
        sign = np.where(new_term, np.where(ops_BN[:, i] == MINUS, -1, 1), sign)
        term = np.where(times, term * d % MODULUS, np.where(new_term, d, term))
    return (total + sign * term) % MODULUS


def running_products(tokens_BT: np.ndarray, table: np.ndarray) -> np.ndarray:
    """``p[:, t] = tokens[:, 0] ∘ ... ∘ tokens[:, t]`` via the multiplication table."""
    out = np.empty_like(tokens_BT, dtype=np.int64)
    p = tokens_BT[:, 0].astype(np.int64)
    out[:, 0] = p
    for t in range(1, tokens_BT.shape[1]):
        p = table[p, tokens_BT[:, t]]
        out[:, t] = p
    return out


def state_tracking_examples(
    *, task: str, lengths, width: int, seed
) -> tuple[np.ndarray, np.ndarray]:
    """``(inputs, labels)`` ``int32[len(lengths), width]``: row ``b`` is a sequence of length
    ``lengths[b]`` (<= width) followed by padding (token 0, label ``IGNORE_INDEX``)."""
    check_task(task)
    lengths_B = np.asarray(lengths, np.int64)
    if lengths_B.ndim != 1 or (lengths_B > width).any() or (lengths_B < 1).any():
        raise ValueError(f"lengths must be in [1, width={width}], got {lengths_B.tolist()}")
    rng = np.random.default_rng(seed)
    b = len(lengths_B)
    t_BT = np.broadcast_to(np.arange(width), (b, width))
    live_BT = t_BT < lengths_B[:, None]
    labels = np.full((b, width), IGNORE_INDEX, np.int64)
    rows = np.arange(b)
    if task == "parity":
        inputs = rng.integers(0, 2, size=(b, width))
        labels[rows, lengths_B - 1] = parity_labels(inputs, lengths_B)
    elif task == "mod_arith":
        if (lengths_B % 2).any():
            raise ValueError(f"mod_arith lengths must be even, got {lengths_B.tolist()}")
        n_B = lengths_B // 2
        n_max = max(1, width // 2)
        digits = rng.integers(0, MODULUS, size=(b, n_max))
        ops = rng.integers(PLUS, TIMES + 1, size=(b, n_max))
        inputs = np.zeros((b, width), np.int64)
        inputs[:, 0 : 2 * n_max : 2] = digits
        inputs[:, 1 : 2 * n_max - 1 : 2] = ops[:, 1:]
        inputs[rows, lengths_B - 1] = EQUALS
        labels[rows, lengths_B - 1] = evaluate_mod_arith(digits, ops, n_B)
    else:
        elements = group_elements(task)
        allowed = input_elements(task, elements)
        inputs = allowed[rng.integers(0, len(allowed), size=(b, width))]
        labels = np.where(
            live_BT, running_products(inputs, multiplication_table(elements)), IGNORE_INDEX
        )
    inputs = np.where(live_BT, inputs, 0)
    return inputs.astype(np.int32), labels.astype(np.int32)


class StateTrackingData(DataSource):
    """Step-keyed training batches of lengths in ``[min_len, max_len]`` and a fixed evaluation
    set per length in ``eval_lengths`` (see the module docstring)."""

    def __init__(
        self,
        *,
        task: str,
        min_len: int,
        max_len: int,
        eval_lengths,
        num_eval_examples: int,
        seed: int = 0,
    ):
        eval_lengths = tuple(int(length) for length in eval_lengths)
        check_state_tracking_settings(
            task=task,
            min_len=min_len,
            max_len=max_len,
            eval_lengths=eval_lengths,
            num_eval_examples=num_eval_examples,
        )
        self.task, self.seed = task, seed
        self.min_len, self.max_len, self.eval_lengths = min_len, max_len, eval_lengths
        self.seq_len = max_len
        self.vocab_size = task_vocab_size(task)
        self.chance = task_chance(task)
        self.eval_sets = {
            length: state_tracking_examples(
                task=task,
                lengths=np.full(num_eval_examples, length),
                width=length,
                seed=np.random.SeedSequence([seed, 1, length]),
            )
            for length in eval_lengths
        }

    def train_lengths(self, rng: np.random.Generator, batch_size: int) -> np.ndarray:
        if self.task == "mod_arith":  # operands uniform: lengths are the even ones in range
            low, high = (self.min_len + 1) // 2, self.max_len // 2
            return 2 * rng.integers(low, high + 1, size=batch_size)
        return rng.integers(self.min_len, self.max_len + 1, size=batch_size)

    def train_batch(self, step: int, batch_size: int) -> dict[str, np.ndarray]:
        """The batch of ``step``, drawn from a generator keyed by ``(seed, step)``."""
        rng = np.random.default_rng([self.seed, 2, step])
        lengths = self.train_lengths(rng, batch_size)
        inputs, labels = state_tracking_examples(
            task=self.task, lengths=lengths, width=self.max_len, seed=rng
        )
        return {"inputs": inputs, "labels": labels}

    def eval_groups(self, batch_size: int):
        """``{"length_L": batches}`` for every evaluation length, shortest first."""
        return {
            f"length_{length}": padded_batches(*self.eval_sets[length], batch_size)
            for length in self.eval_lengths
        }

    def eval_batches(self, batch_size: int):
        """Every evaluation length's batches in turn (widths differ between lengths)."""
        for batches in self.eval_groups(batch_size).values():
            yield from batches
