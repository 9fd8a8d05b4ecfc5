"""Evaluation as the papers report it: an lm-evaluation-harness model over a run
(`LMEvalModel`, registered as ``linear_attention``; needs the ``eval`` extra), the loss by
position over long blocks (`document_blocks`, `position_losses`, `bucket_means`) and RULER-style
needle studies (the `needle_study` module). Behind ``la-eval --tasks``,
``la-eval --position_buckets`` and ``la-eval --needles``; `load_text_run` opens a run's model and
tokenizer for them.

Each name is imported on first use, so the rest works without lm-evaluation-harness; importing
`LMEvalModel` (or ``linear_attention.evals.harness``) registers the name with lm-eval."""

import importlib

_LAZY = {
    "LMEvalModel": "harness",
    "load_text_run": "runs",
    "document_blocks": "positions",
    "position_losses": "positions",
    "bucket_means": "positions",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = list(_LAZY)
