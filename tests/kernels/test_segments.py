"""The packed-sequence helpers: segment starts, reset log decays, the same-segment mask, checks."""

import jax.numpy as jnp
import numpy as np
import pytest

from linear_attention.kernels.segments import (
    check_segment_ids,
    same_segment,
    segment_log_decay,
    segment_starts,
)

IDS = np.array([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, 5, 5], [3, 4, 4, 3, 3, 3]])


def test_starts_are_id_changes_never_the_first_token():
    want = [
        [False, False, True, False, False, True],
        [False] * 6,
        [False, True, False, True, False, False],
    ]
    np.testing.assert_array_equal(segment_starts(jnp.asarray(IDS)), want)


@pytest.mark.parametrize("shape", [None, (3, 6, 2), (3, 6, 2, 4)])
def test_log_decay_is_minus_inf_at_starts_and_unchanged_elsewhere(shape):
    ids = jnp.asarray(IDS)
    a = None if shape is None else jnp.full(shape, -0.25, jnp.float32)
    out = np.asarray(segment_log_decay(ids, a, num_heads=2))
    assert out.shape == (shape or (3, 6, 2))
    starts = np.asarray(segment_starts(ids))
    starts = starts.reshape(starts.shape + (1,) * (out.ndim - 2))
    np.testing.assert_array_equal(np.isneginf(out), np.broadcast_to(starts, out.shape))
    np.testing.assert_array_equal(out[~np.isneginf(out)], 0.0 if shape is None else -0.25)


def test_same_segment_mask():
    ids = jnp.asarray(IDS[:1])
    np.testing.assert_array_equal(same_segment(ids, ids)[0], IDS[0][:, None] == IDS[0][None, :])


@pytest.mark.parametrize(
    "ids, match",
    [
        (np.zeros((3, 6), np.float32), "must be integers"),
        (np.zeros((3, 6), bool), "must be integers"),
        (np.zeros((3, 5), np.int32), r"\[B, T\] = \(3, 6\), got shape \(3, 5\) dtype int32"),
        (np.zeros((3, 6, 1), np.int32), r"got shape \(3, 6, 1\)"),
        (IDS.tolist(), r"got shape \(3, 6\) dtype None"),  # a list: no dtype to trust
    ],
)
def test_bad_segment_ids(ids, match):
    with pytest.raises(ValueError, match=match):
        check_segment_ids(ids, 3, 6)
    assert check_segment_ids(None, 3, 6) is None


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8])
def test_good_segment_ids_pass_through(dtype):
    out = check_segment_ids(IDS.astype(dtype), 3, 6)
    np.testing.assert_array_equal(np.asarray(out), IDS)
