"""The evaluation figures' one way to draw and save: matplotlib without a display, a PNG
written whole or not at all."""

from __future__ import annotations

from linear_attention.data.files import atomic_file


def new_figure(figsize: tuple[float, float]):
    """``(fig, ax)`` on matplotlib's Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=figsize)


def save_png(fig, path: str) -> None:
    """Write ``fig`` to ``path`` as a PNG (atomically) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    with atomic_file(path) as f:
        fig.savefig(f, format="png")
    plt.close(fig)
