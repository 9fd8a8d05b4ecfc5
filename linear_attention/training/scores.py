"""Evaluation scores of the synthetic tasks: class-macro accuracy (MAD) and accuracy per
evaluation length (state tracking).

- Class-macro accuracy (MAD, Poli et al. 2024): over the scored positions, the accuracy of each
  label class that occurs (``correct_c / count_c``), averaged over those classes. A model that
  always predicts the most frequent class scores ``1 / #classes``, not that class's frequency.
- Per length (state tracking, Grazzi et al. 2025): the accuracy of each evaluation length's
  scored positions, ``eval/length_{L}/accuracy``; ``eval/accuracy`` is their mean over the
  lengths (each length weighs the same, as Grazzi et al. average over test lengths) and
  ``eval/scaled_accuracy`` is ``(accuracy − chance) / (1 − chance)``, their published score.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from linear_attention.data import IGNORE_INDEX


def class_token_stats(logits_BTV: jax.Array, labels_BT: jax.Array):
    """``(sum of cross-entropy, correct per label class [V], labelled per class [V])`` over the
    labelled positions (``labels != IGNORE_INDEX``), float32."""
    num_classes = logits_BTV.shape[-1]
    mask_BT = labels_BT != IGNORE_INDEX
    safe_BT = jnp.where(mask_BT, labels_BT, 0)
    ce_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV.astype(jnp.float32), safe_BT)
    correct_BT = (jnp.argmax(logits_BTV, axis=-1) == labels_BT) & mask_BT
    # Positions that carry no label go to an extra bin that is dropped.
    bins_N = jnp.where(mask_BT, safe_BT, num_classes).reshape(-1)
    correct_V = (
        jnp.zeros(num_classes + 1, jnp.float32)
        .at[bins_N]
        .add(correct_BT.reshape(-1).astype(jnp.float32))
    )
    count_V = jnp.zeros(num_classes + 1, jnp.float32).at[bins_N].add(1.0)
    return jnp.sum(jnp.where(mask_BT, ce_BT, 0.0)), correct_V[:-1], count_V[:-1]


def class_macro_accuracy(correct_V, count_V) -> float:
    """Mean over the classes that occur (``count > 0``) of ``correct / count``."""
    correct_V, count_V = np.asarray(correct_V, np.float64), np.asarray(count_V, np.float64)
    present = count_V > 0
    if not present.any():
        return 0.0
    return float(np.mean(correct_V[present] / count_V[present]))


def length_metrics(totals: dict[str, tuple[float, float, float]], chance: float) -> dict:
    """``eval/<group>/accuracy`` per group (``{"length_40": (loss_sum, correct, count)}``),
    their mean as ``eval/accuracy``, its scaled form and the loss over every scored position."""
    out = {}
    accuracies = []
    for name, (_, correct, count) in totals.items():
        accuracy = correct / max(count, 1.0)
        out[f"eval/{name}/accuracy"] = accuracy
        accuracies.append(accuracy)
    loss_sum = sum(t[0] for t in totals.values())
    count = sum(t[2] for t in totals.values())
    accuracy = float(np.mean(accuracies))
    return {
        "eval/loss": loss_sum / max(count, 1.0),
        "eval/accuracy": accuracy,
        "eval/scaled_accuracy": (accuracy - chance) / (1.0 - chance),
        **out,
    }
