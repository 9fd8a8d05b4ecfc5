"""`check_layouts`, the kernels' shared shape check: ranks first, then one size per axis letter."""

import numpy as np
import pytest

from linear_attention.kernels.checks import check_layouts


def test_layouts_return_the_sizes_by_letter():
    q, k, v = np.zeros((2, 5, 3, 4)), np.zeros((2, 7, 3, 4)), np.zeros((2, 7, 3, 6))
    sizes = check_layouts(q=(q, "[B, Tq, H, D]"), k=(k, "[B, Tk, H, D]"), v=(v, "[B, Tk, H, Dv]"))
    assert sizes == dict(B=2, Tq=5, H=3, D=4, Tk=7, Dv=6)


@pytest.mark.parametrize(
    "shapes, match",
    [
        # a wrong rank is named before any disagreement (here also on B)
        (
            [(2, 5, 3, 4), (1, 5, 3), (1, 5, 3, 6)],
            r"^k must have rank 4 \[B, T, H, K\], got shape \(1, 5, 3\) \(rank 3\)$",
        ),
        (
            [(2, 5, 3, 4), (2, 5, 3, 4), (2, 4, 3, 6)],
            r"^q / k / v disagree on T \(time\) \(q: \(2, 5, 3, 4\), k: \(2, 5, 3, 4\), "
            r"v: \(2, 4, 3, 6\)\)$",
        ),
        ([(2, 5, 3, 4), (2, 5, 3, 8), (2, 5, 3, 6)], r"^q / k disagree on K \(key width\)"),
    ],
)
def test_layout_errors_name_the_arrays_and_shapes(shapes, match):
    q, k, v = (np.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        check_layouts(q=(q, "[B, T, H, K]"), k=(k, "[B, T, H, K]"), v=(v, "[B, T, H, Dv]"))
