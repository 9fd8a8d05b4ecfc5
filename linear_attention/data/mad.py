"""MAD's six synthetic tasks (Poli et al. 2024, "Mechanistic Design and Scaling of Hybrid
Architectures"), written from the paper's task definitions.

Every task is a fixed training set and a fixed test set (MAD: 12,800 and 1,280 examples) of
``int32[N, seq_len]`` inputs with next-token labels, ``IGNORE_INDEX`` where nothing is scored.
MAD scores class-macro accuracy over the scored positions (`training.scores`). Token ids: the
task's ``vocab_size`` "content" tokens first, then the task's special tokens (``mad_num_tokens``).

- ``in_context_recall``: keys are tokens ``[0, V/2)``, values ``[V/2, V)``. Each sequence has its
  own random map key → value (each key's value uniform) and is ``seq_len / 2`` pairs ``k v``
  with keys drawn uniformly (so keys recur). ``multi_query``: every key that occurred earlier in
  the sequence is scored (the label at the key is its value); otherwise only the last pair is
  scored, its key drawn among the earlier ones.
- ``noisy_recall``: in-context recall with noise tokens (ids ``[V, V + noise_vocab_size)``,
  uniform) between the pairs: ``round(noise_fraction · seq_len)`` of the positions (rounded so the
  pairs fill the rest), at uniformly random places between pairs; noise is never scored.
- ``fuzzy_recall``: keys and values are tuples ("motifs") of ``1..max_key_len`` key tokens and
  ``1..max_value_len`` value tokens; a sequence's ``V / 2`` keys form a prefix-free set (so the
  end of a key is known when its value starts). Pairs are concatenated until the next one does
  not fit (the rest is the pad token ``V``); when a key recurs, every token of its value is
  scored (the label at the key's last token is the value's first token, and so on).
- ``selective_copying``: ``num_tokens_to_copy`` tokens (uniform in ``[0, V)``) at random ordered
  positions among blanks (token ``V``) in the first ``seq_len − num_tokens_to_copy`` positions,
  then a copy token (``V + 1``) and the tokens again; the label at the copy token and at each
  copied token is the next token to copy. ``selective=False``: the tokens are contiguous (plain
  copying, no blanks in between).
- ``compression``: MAD feeds a random sequence and a compress token, and reconstructs every
  token from the compress token's output (with a position embedding) through a separate MLP
  decoder. That decoder is a model part outside a language model's interface, so here it is
  replaced by position queries: ``n = (seq_len − 1) // 2`` random tokens, the compress token
  ``V``, then position tokens ``V + 1 .. V + n``; the label at position token ``i`` is token ``i``.
  A recurrent model must hold the ``n`` tokens in its state at the compress token, what MAD's
  compression probes; unlike MAD's decoder, attention may still look back at the tokens.
- ``memorization``: one fixed random map key → value (keys ``[0, V/2)``, values ``[V/2, V)``,
  drawn from ``seed`` alone, so the training and test sets share it); sequences are
  ``seq_len / 2`` pairs with uniform keys and every key is scored: the map is learned in the
  weights, across the training set.

Settings (``MAD_SETTINGS``): MAD's baseline as the paper describes it — vocabulary 16 and length
128 for the recall tasks, 256 with 16 tokens to copy for selective copying, 32 for compression,
vocabulary 256 and length 32 for memorization. Options that belong to another task must stay at
their defaults (`check_mad_settings` raises otherwise): nothing is silently ignored.
"""

from __future__ import annotations

import numpy as np

from linear_attention.data.batches import IGNORE_INDEX, padded_batches
from linear_attention.data.protocol import DataSource
from linear_attention.data.recall_sampling import sample_distinct
from linear_attention.fields import did_you_mean

TASKS = (
    "in_context_recall",
    "noisy_recall",
    "fuzzy_recall",
    "selective_copying",
    "compression",
    "memorization",
)
# The task options and their defaults; each task's options are the ones it reads.
OPTION_DEFAULTS = dict(
    multi_query=True,
    noise_vocab_size=16,
    noise_fraction=0.2,
    max_key_len=3,
    max_value_len=3,
    num_tokens_to_copy=16,
    selective=True,
)
TASK_OPTIONS = {
    "in_context_recall": ("multi_query",),
    "noisy_recall": ("multi_query", "noise_vocab_size", "noise_fraction"),
    "fuzzy_recall": ("max_key_len", "max_value_len"),
    "selective_copying": ("num_tokens_to_copy", "selective"),
    "compression": (),
    "memorization": (),
}
# MAD's baseline (vocab_size, seq_len) per task.
MAD_SETTINGS = {
    "in_context_recall": (16, 128),
    "noisy_recall": (16, 128),
    "fuzzy_recall": (16, 128),
    "selective_copying": (16, 256),
    "compression": (16, 32),
    "memorization": (256, 32),
}
NUM_TRAIN_EXAMPLES, NUM_TEST_EXAMPLES = 12_800, 1_280
# MAD's training-set size at each task's baseline (its configs/tasks/<task>.yml): memorization
# learns one fixed map from 256 examples.
MAD_TRAIN_EXAMPLES = {**dict.fromkeys(TASKS, NUM_TRAIN_EXAMPLES), "memorization": 256}
# MAD's harder settings (the same files' "changes"): each varies one field of the baseline,
# the others kept. Vocabulary sizes count content tokens, as `MAD_SETTINGS` does (MAD's noisy
# recall sizes 48, 80, 144 hold its 16 noise tokens: 32, 64, 128 here).
_RECALL_CHANGES = dict(
    vocab_size=(32, 64, 128),
    seq_len=(256, 512, 1024),
    num_train_examples=(6_400, 3_200, 1_600, 800),
)
MAD_CHANGES = {
    "in_context_recall": _RECALL_CHANGES,
    "noisy_recall": {**_RECALL_CHANGES, "noise_fraction": (0.4, 0.6, 0.8)},
    "fuzzy_recall": _RECALL_CHANGES,
    "selective_copying": dict(
        vocab_size=(32, 64, 128),
        seq_len=(512, 1024),
        num_train_examples=(6_400, 3_200, 1_600, 800),
        num_tokens_to_copy=(32, 64, 96),
    ),
    "compression": dict(
        vocab_size=(32, 64, 128),
        seq_len=(64, 128, 256),
        num_train_examples=(6_400, 3_200, 1_600, 800),
    ),
    "memorization": dict(vocab_size=(512, 1_024, 2_048, 4_096, 8_192)),
}


def mad_changes(task: str) -> tuple[tuple[str, dict], ...]:
    """MAD's changes of ``task`` in its file's order: ``("<field>-<value>", {field: value})``."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}{did_you_mean(task, TASKS)}")
    return tuple(
        (f"{name}-{value}", {name: value})
        for name, values in MAD_CHANGES[task].items()
        for value in values
    )


def mad_num_tokens(task: str, vocab_size: int, seq_len: int, **options) -> int:
    """Token ids the task uses: the ``vocab_size`` content tokens plus its special tokens."""
    options = {**OPTION_DEFAULTS, **options}
    extra = {
        "noisy_recall": options["noise_vocab_size"],
        "fuzzy_recall": 1,  # pad
        "selective_copying": 2,  # blank, copy
        "compression": 1 + (seq_len - 1) // 2,  # compress, position tokens
    }.get(task, 0)
    return vocab_size + extra


def check_mad_settings(*, task: str, vocab_size: int, seq_len: int, **options) -> None:
    """Raise ``ValueError`` naming the numbers if a MAD setting cannot be generated."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}{did_you_mean(task, TASKS)}")
    unknown = sorted(set(options) - set(OPTION_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown option {unknown[0]!r}; options: {tuple(OPTION_DEFAULTS)}")
    for name, value in options.items():
        if name not in TASK_OPTIONS[task] and value != OPTION_DEFAULTS[name]:
            raise ValueError(
                f"{name}={value!r} is not an option of {task!r} (its options: "
                f"{TASK_OPTIONS[task] or 'none'}); leave it at {OPTION_DEFAULTS[name]!r}"
            )
    if task in ("in_context_recall", "noisy_recall", "fuzzy_recall", "memorization"):
        if vocab_size < 4 or vocab_size % 2:
            raise ValueError(
                f"vocab_size must be even and >= 4 (keys and values split it), got {vocab_size}"
            )
    elif vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    if task in ("in_context_recall", "memorization") and (seq_len < 4 or seq_len % 2):
        raise ValueError(f"seq_len must be even and >= 4 for {task!r} (pairs), got {seq_len}")
    if task in _TASK_CHECKS:
        _TASK_CHECKS[task](seq_len, {**OPTION_DEFAULTS, **options})


def _check_noisy_recall(seq_len: int, o: dict) -> None:
    if not 0.0 <= o["noise_fraction"] < 1.0:
        raise ValueError(f"noise_fraction must be in [0, 1), got {o['noise_fraction']}")
    if o["noise_vocab_size"] < 1:
        raise ValueError(f"noise_vocab_size must be >= 1, got {o['noise_vocab_size']}")
    pairs, _ = noisy_layout(seq_len, o["noise_fraction"])
    if pairs < 2:
        raise ValueError(
            f"seq_len={seq_len} with noise_fraction={o['noise_fraction']} leaves {pairs} "
            "pair(s); need >= 2"
        )


def _check_fuzzy_recall(seq_len: int, o: dict) -> None:
    for name in ("max_key_len", "max_value_len"):
        if o[name] < 1:
            raise ValueError(f"{name} must be >= 1, got {o[name]}")
    longest = o["max_key_len"] + o["max_value_len"]
    if seq_len < 2 * longest:
        raise ValueError(
            f"seq_len={seq_len} must hold two of the longest pairs "
            f"(2 * (max_key_len + max_value_len) = {2 * longest})"
        )
    # A prefix-free set of V/2 keys of length <= max_key_len over V/2 symbols exists when
    # the keys of exactly max_key_len tokens are enough: (V/2)^max_key_len >= V/2.


def _check_selective_copying(seq_len: int, o: dict) -> None:
    n = o["num_tokens_to_copy"]
    if n < 1:
        raise ValueError(f"num_tokens_to_copy must be >= 1, got {n}")
    if seq_len < 2 * n + (1 if o["selective"] else 0):
        raise ValueError(
            f"seq_len={seq_len} must be >= 2 * num_tokens_to_copy = {2 * n} (the tokens "
            f"among blanks, then their copy){' plus a blank' if o['selective'] else ''}"
        )


def _check_compression(seq_len: int, o: dict) -> None:
    if seq_len < 3:
        raise ValueError(f"seq_len must be >= 3 for compression, got {seq_len}")


# The checks of one task's own options and lengths.
_TASK_CHECKS = {
    "noisy_recall": _check_noisy_recall,
    "fuzzy_recall": _check_fuzzy_recall,
    "selective_copying": _check_selective_copying,
    "compression": _check_compression,
}


def noisy_layout(seq_len: int, noise_fraction: float) -> tuple[int, int]:
    """``(pairs, noise tokens)`` with ``2 · pairs + noise = seq_len`` and the noise the nearest
    to ``noise_fraction · seq_len`` that keeps the parity right."""
    noise = int(round(noise_fraction * seq_len))
    if (seq_len - noise) % 2:
        noise += 1
    return (seq_len - noise) // 2, noise


def _first_seen_before(keys_NP: np.ndarray, num_keys: int) -> np.ndarray:
    """``[N, P]`` bool: key ``p`` of the row occurred at an earlier pair."""
    onehot = np.zeros((*keys_NP.shape, num_keys), np.int32)
    np.put_along_axis(onehot, keys_NP[..., None], 1, axis=-1)
    seen = np.cumsum(onehot, axis=1) - onehot  # occurrences strictly before
    return np.take_along_axis(seen, keys_NP[..., None], axis=-1)[..., 0] > 0


def _recall_pairs(rng, n, num_pairs, vocab_size, multi_query):
    """Keys, values and scored mask ``[n, num_pairs]`` of in-context recall."""
    half = vocab_size // 2
    keys = rng.integers(0, half, size=(n, num_pairs))
    table = rng.integers(half, vocab_size, size=(n, half))
    if not multi_query:  # the last key repeats one of the earlier ones
        pick = rng.integers(0, num_pairs - 1, size=n)
        keys[:, -1] = keys[np.arange(n), pick]
    values = np.take_along_axis(table, keys, axis=1)
    if multi_query:
        scored = _first_seen_before(keys, half)
    else:
        scored = np.zeros(keys.shape, bool)
        scored[:, -1] = True
    return keys, values, scored


def in_context_recall(rng, n, vocab_size, seq_len, multi_query=True):
    keys, values, scored = _recall_pairs(rng, n, seq_len // 2, vocab_size, multi_query)
    inputs = np.empty((n, seq_len), np.int64)
    inputs[:, 0::2], inputs[:, 1::2] = keys, values
    labels = np.full((n, seq_len), IGNORE_INDEX, np.int64)
    labels[:, 0::2] = np.where(scored, values, IGNORE_INDEX)
    return inputs, labels


def noisy_recall(
    rng, n, vocab_size, seq_len, multi_query=True, noise_vocab_size=16, noise_fraction=0.2
):
    num_pairs, num_noise = noisy_layout(seq_len, noise_fraction)
    keys, values, scored = _recall_pairs(rng, n, num_pairs, vocab_size, multi_query)
    # Units: num_pairs pairs (2 tokens, in order) and num_noise noise tokens, in a uniformly
    # random arrangement; a unit starts after every token of the units before it.
    units = num_pairs + num_noise
    is_noise = np.zeros((n, units), bool)
    noise_units = sample_distinct(rng, n, 0, units, num_noise) if num_noise else None
    if num_noise:
        np.put_along_axis(is_noise, noise_units, True, axis=1)
    width = np.where(is_noise, 1, 2)
    start = np.cumsum(width, axis=1) - width
    inputs = np.empty((n, seq_len), np.int64)
    labels = np.full((n, seq_len), IGNORE_INDEX, np.int64)
    rows = np.arange(n)[:, None]
    pair_start = start[~is_noise].reshape(n, num_pairs)
    inputs[rows, pair_start] = keys
    inputs[rows, pair_start + 1] = values
    labels[rows, pair_start] = np.where(scored, values, IGNORE_INDEX)
    if num_noise:
        noise_start = start[is_noise].reshape(n, num_noise)
        noise = rng.integers(vocab_size, vocab_size + noise_vocab_size, size=(n, num_noise))
        inputs[rows, noise_start] = noise
    return inputs, labels


def _prefix_free_motifs(rng, count, low, high, max_len):
    """``count`` distinct tuples of ``1..max_len`` tokens in ``[low, high)``, none a prefix of
    another (redrawn until they fit; lengths uniform)."""
    motifs = []
    while len(motifs) < count:
        m = tuple(rng.integers(low, high, size=rng.integers(1, max_len + 1)).tolist())
        if all(m[: len(o)] != o and o[: len(m)] != m for o in motifs):
            motifs.append(m)
    return motifs


def fuzzy_recall(rng, n, vocab_size, seq_len, max_key_len=3, max_value_len=3):
    half = vocab_size // 2
    pad = vocab_size
    inputs = np.full((n, seq_len), pad, np.int64)
    labels = np.full((n, seq_len), IGNORE_INDEX, np.int64)
    for b in range(n):
        keys = _prefix_free_motifs(rng, half, 0, half, max_key_len)
        values = [
            tuple(rng.integers(half, vocab_size, size=rng.integers(1, max_value_len + 1)).tolist())
            for _ in keys
        ]
        seen, t = set(), 0
        while True:
            i = int(rng.integers(0, half))
            k, v = keys[i], values[i]
            if t + len(k) + len(v) > seq_len:
                break
            inputs[b, t : t + len(k)] = k
            inputs[b, t + len(k) : t + len(k) + len(v)] = v
            if i in seen:  # each value token is the label one position earlier
                labels[b, t + len(k) - 1 : t + len(k) + len(v) - 1] = v
            seen.add(i)
            t += len(k) + len(v)
    return inputs, labels


def selective_copying(rng, n, vocab_size, seq_len, num_tokens_to_copy=16, selective=True):
    k = num_tokens_to_copy
    context = seq_len - k  # tokens among blanks, then the copy token and k - 1 copied tokens
    blank, copy = vocab_size, vocab_size + 1
    tokens = rng.integers(0, vocab_size, size=(n, k))
    if selective:
        positions = np.sort(sample_distinct(rng, n, 0, context, k), axis=1)
    else:
        positions = np.broadcast_to(np.arange(context - k, context), (n, k))
    inputs = np.full((n, seq_len), blank, np.int64)
    np.put_along_axis(inputs, positions, tokens, axis=1)
    inputs[:, context] = copy
    inputs[:, context + 1 :] = tokens[:, :-1]
    labels = np.full((n, seq_len), IGNORE_INDEX, np.int64)
    labels[:, context:] = tokens
    return inputs, labels


def compression(rng, n, vocab_size, seq_len):
    m = (seq_len - 1) // 2
    tokens = rng.integers(0, vocab_size, size=(n, m))
    inputs = np.full((n, seq_len), vocab_size, np.int64)  # the tail (odd seq_len) repeats it
    inputs[:, :m] = tokens
    inputs[:, m] = vocab_size  # compress
    inputs[:, m + 1 : 2 * m + 1] = vocab_size + 1 + np.arange(m)
    labels = np.full((n, seq_len), IGNORE_INDEX, np.int64)
    labels[:, m + 1 : 2 * m + 1] = tokens
    return inputs, labels


def memorization_map(seed, vocab_size: int) -> np.ndarray:
    """The task's fixed map: ``value[key]`` for the keys ``[0, V/2)``, from ``seed`` alone."""
    half = vocab_size // 2
    return np.random.default_rng([seed, 7]).integers(half, vocab_size, size=half)


def memorization(rng, n, vocab_size, seq_len, table):
    keys = rng.integers(0, vocab_size // 2, size=(n, seq_len // 2))
    values = table[keys]
    inputs = np.empty((n, seq_len), np.int64)
    inputs[:, 0::2], inputs[:, 1::2] = keys, values
    labels = np.full((n, seq_len), IGNORE_INDEX, np.int64)
    labels[:, 0::2] = values
    return inputs, labels


def mad_examples(
    *, task: str, vocab_size: int, seq_len: int, num_examples: int, seed, map_seed=0, **options
) -> tuple[np.ndarray, np.ndarray]:
    """``(inputs, labels)`` ``int32[num_examples, seq_len]`` of ``task``, deterministic in
    ``seed`` (memorization's map in ``map_seed``)."""
    check_mad_settings(task=task, vocab_size=vocab_size, seq_len=seq_len, **options)
    if num_examples < 1:
        raise ValueError(f"num_examples must be >= 1, got {num_examples}")
    rng = np.random.default_rng(seed)
    used = {name: options.get(name, OPTION_DEFAULTS[name]) for name in TASK_OPTIONS[task]}
    if task == "memorization":
        used["table"] = memorization_map(map_seed, vocab_size)
    generate = {
        "in_context_recall": in_context_recall,
        "noisy_recall": noisy_recall,
        "fuzzy_recall": fuzzy_recall,
        "selective_copying": selective_copying,
        "compression": compression,
        "memorization": memorization,
    }[task]
    inputs, labels = generate(rng, num_examples, vocab_size, seq_len, **used)
    return inputs.astype(np.int32), labels.astype(np.int32)


class MADData(DataSource):
    """A MAD task's fixed training and test sets (different seeds), step-keyed training batches,
    scored by class-macro accuracy (``score = "class_macro"``)."""

    score = "class_macro"

    def __init__(
        self,
        *,
        task: str,
        vocab_size: int,
        seq_len: int,
        num_train_examples: int = NUM_TRAIN_EXAMPLES,
        num_test_examples: int = NUM_TEST_EXAMPLES,
        seed: int = 0,
        **options,
    ):
        self.task, self.seq_len, self.seed = task, seq_len, seed
        self.vocab_size = mad_num_tokens(task, vocab_size, seq_len, **options)
        common = dict(task=task, vocab_size=vocab_size, seq_len=seq_len, map_seed=seed, **options)
        self.train_inputs, self.train_labels = mad_examples(
            num_examples=num_train_examples, seed=np.random.SeedSequence([seed, 0]), **common
        )
        self.test_inputs, self.test_labels = mad_examples(
            num_examples=num_test_examples, seed=np.random.SeedSequence([seed, 1]), **common
        )

    def train_batch(self, step: int, batch_size: int) -> dict[str, np.ndarray]:
        """Distinct training examples drawn by a generator keyed by ``(seed, step)``."""
        n = self.train_inputs.shape[0]
        if batch_size > n:
            raise ValueError(f"batch_size={batch_size} exceeds num_train_examples={n}")
        idx = np.random.default_rng([self.seed, 2, step]).choice(n, size=batch_size, replace=False)
        return {"inputs": self.train_inputs[idx], "labels": self.train_labels[idx]}

    def eval_batches(self, batch_size: int):
        """The whole test set in order, the last batch padded with ignored rows."""
        yield from padded_batches(self.test_inputs, self.test_labels, batch_size)
