"""`LMEvalModel`: a run (``la-train`` workdir or ``la-convert``-ed checkpoint) as an
lm-evaluation-harness model, registered as ``linear_attention``::

    import lm_eval
    import linear_attention.evals.harness  # registers the name

    lm_eval.simple_evaluate(model="linear_attention", model_args="workdir=runs/x", tasks=[...])

or ``lm_eval.simple_evaluate(model=LMEvalModel("runs/x"), ...)``.

Requests are encoded as lm-eval's own `TemplateLM` encodes them (trailing spaces of a context
move to the continuation; the continuation's tokens are those of the whole text after the
context's), so the tokens scored are the Hugging Face backend's. Log-likelihoods are scored in
packed rows (`packing`): a batch holds ``batch_tokens`` tokens of many requests, each its own
document through ``segment_ids``, and each continuation in one pass. Rolling log-likelihoods
(perplexity of whole texts) split a text into lm-eval's disjoint windows of the model's
maximum length, the first after ``prefix_token_id``, and pack the windows the same way.
`generate_until` is greedy: prefill and the O(1) step (`generation`).

``prefix_token_id``, the token before a text with no context (an empty context, the first
window of a rolling text): the tokenizer's end-of-text token, or 0 when it has none (a byte
run's NUL), unless given.
"""

from __future__ import annotations

import warnings

import jax
import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from linear_attention.evals.generation import greedy_until
from linear_attention.evals.packing import causal_request, score_requests
from linear_attention.evals.runs import TextRun, load_text_run
from linear_attention.fields import check_int

# What a task's generation_kwargs may hold: generation here is greedy.
_GREEDY = {"do_sample": (False,), "temperature": (0, 0.0)}


@register_model("linear_attention")
class LMEvalModel(TemplateLM):
    """An lm-evaluation-harness model over a run of this library.

    Args:
      workdir: a run's folder (``la-train``, or ``la-convert --from-hf``); or ``run``, a
        `runs.TextRun` already loaded.
      step: the checkpoint (default: the latest).
      batch_tokens: tokens per scored batch (rows of packed requests).
      max_length: the longest input (default and upper bound: the model's ``max_length``);
        longer contexts are cut on the left.
      prefix_token_id: see the module docstring.
      max_gen_toks: new tokens of `generate_until` when a task does not say (default: 256,
        at most half of ``max_length``).
      batch_size, max_batch_size: what ``simple_evaluate`` passes every model; this one batches
        by ``batch_tokens``, so they must be left unset (or batch_size 1, lm-eval's default).
      device: JAX places the model; a device given (lm-eval's command line passes ``cuda:0``
        by default) is not used, and a warning says so.
    """

    def __init__(
        self,
        workdir: str | None = None,
        *,
        run: TextRun | None = None,
        step: int | None = None,
        batch_tokens: int = 4096,
        max_length: int | None = None,
        prefix_token_id: int | None = None,
        max_gen_toks: int | None = None,
        batch_size=None,
        max_batch_size=None,
        device=None,
    ):
        super().__init__()
        for name, value in dict(batch_size=batch_size, max_batch_size=max_batch_size).items():
            if value not in (None, 1, "1"):
                raise ValueError(
                    f"{name}={value!r}: LMEvalModel batches by batch_tokens; leave {name} unset"
                )
        if device is not None:
            warnings.warn(
                f"LMEvalModel runs on JAX's default device ({jax.devices()[0].platform}); "
                f"device={device!r} is not used",
                stacklevel=2,
            )
        if (workdir is None) == (run is None):
            raise ValueError("LMEvalModel takes one of workdir (a run's folder) or run")
        self.run = run if run is not None else load_text_run(workdir, step=step)
        self.batch_tokens = check_int("batch_tokens", int(batch_tokens))
        limit = self.run.max_length
        self._max_length = limit if max_length is None else int(max_length)
        if not 1 <= self._max_length <= limit:
            raise ValueError(f"max_length must be in [1, {limit}] (the model's), got {max_length}")
        if max_gen_toks is None:
            max_gen_toks = min(256, max(1, self._max_length // 2))
        self.max_gen_toks = check_int("max_gen_toks", int(max_gen_toks))
        vocab = self.run.model.config.vocab_size
        prefix = prefix_token_id
        if prefix is None:
            prefix = 0 if self.run.eot_token_id is None else self.run.eot_token_id
        prefix = check_int("prefix_token_id", int(prefix), minimum=0)
        if prefix >= vocab:
            raise ValueError(f"prefix_token_id must be in [0, {vocab}), got {prefix}")
        self._prefix = prefix

    # ------------------------------------------------------------------ TemplateLM
    @property
    def eot_token_id(self) -> int:
        return self._prefix if self.run.eot_token_id is None else self.run.eot_token_id

    @property
    def prefix_token_id(self) -> int:
        return self._prefix

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return self.run.tokenizer.encode(string).tolist()

    def tok_decode(self, tokens) -> str:
        return self.run.tokenizer.decode(tokens)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        scored = score_requests(
            self.run.model,
            [causal_request(ctx, cont, self.max_length) for _, ctx, cont in requests],
            self.max_length,
            self.batch_tokens,
        )
        for (key, _, _), result in zip(requests, scored, strict=True):
            self.cache_hook.add_partial("loglikelihood", key, result)
        return scored

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole text, its tokens scored in lm-eval's disjoint
        windows of ``max_length`` (all the windows of all the texts packed together)."""
        windows, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            pieces = get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for context, continuation in map(make_disjoint_window, pieces):
                windows.append(causal_request(context, continuation, self.max_length))
                owner.append(i)
        scored = score_requests(self.run.model, windows, self.max_length, self.batch_tokens)
        totals = np.zeros(len(requests), np.float64)
        for i, (logp, _) in zip(owner, scored, strict=True):
            totals[i] += logp
        out = [float(t) for t in totals]
        for req, total in zip(requests, out, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, each cut before the first of its ``until`` strings (and
        ending at the end-of-text token when the tokenizer has one); the context is cut on the
        left to leave room for ``max_gen_toks`` new tokens."""
        settings = [self._generation_settings(req.args[1]) for req in requests]
        out = []
        for req, (until, max_new) in zip(requests, settings, strict=True):
            room = self.max_length - max_new
            prompt = self.tok_encode(req.args[0])[-room:]
            text = greedy_until(
                self.run.model,
                self.run.tokenizer,
                np.asarray(prompt, np.int32),
                until=until,
                max_new_tokens=max_new,
                stop_token=self.run.eot_token_id,
            )
            self.cache_hook.add_partial("generate_until", req.args, text)
            out.append(text)
        return out

    def _generation_settings(self, kwargs: dict) -> tuple[list[str], int]:
        """``(until, max_gen_toks)`` of a request's generation kwargs; ValueError for sampling
        or an option this greedy generation does not have."""
        kwargs = dict(kwargs or {})
        until = kwargs.pop("until", [])
        until = [until] if isinstance(until, str) else list(until)
        max_new = check_int("max_gen_toks", int(kwargs.pop("max_gen_toks", self.max_gen_toks)))
        if max_new >= self.max_length:
            raise ValueError(
                f"max_gen_toks {max_new} leaves no room for a context in max_length "
                f"{self.max_length}"
            )
        for name, value in kwargs.items():
            if name not in _GREEDY or value not in _GREEDY[name]:
                raise ValueError(
                    f"generation_kwargs {name}={value!r}: LMEvalModel generates greedily "
                    "(until, max_gen_toks, do_sample: false, temperature: 0)"
                )
        return until, max_new
