"""Evaluation as the papers report it: an lm-evaluation-harness model over a run
(`LMEvalModel`, registered as ``linear_attention``; needs the ``eval`` extra) and the loss by
position over long blocks (`positions`). Behind ``la-eval --tasks`` and ``la-eval
--position_buckets``.

`LMEvalModel` is imported on first use, so the rest works without lm-evaluation-harness;
importing it (or ``linear_attention.evals.harness``) registers the name with lm-eval."""

import importlib


def __getattr__(name: str):
    if name == "LMEvalModel":
        value = importlib.import_module(f"{__name__}.harness").LMEvalModel
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["LMEvalModel"]
