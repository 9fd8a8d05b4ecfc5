"""Requests packed into rows (`evals.packing`): each request's log-likelihood and is-greedy
equal those of the model's plain forward pass on that request alone (float64 NumPy), with
contexts cut on the left to the model's length, several requests a row and several batches."""

import numpy as np
import pytest

from linear_attention.evals.packing import (
    Request,
    batches,
    causal_request,
    pack_rows,
    row_width,
    score_requests,
)
from linear_attention.evals.runs import load_text_run
from tests.evals.conftest import MAX_LENGTH, reference_logp


def test_causal_request_cuts_the_context_on_the_left():
    r = causal_request([1, 2, 3, 4, 5], [6, 7], max_length=4)
    assert r.inputs.tolist() == [3, 4, 5, 6] and r.targets.tolist() == [4, 5, 6, 7]
    assert r.num_scored == 2
    r = causal_request([1], [2, 3], max_length=8)
    assert r.inputs.tolist() == [1, 2] and r.targets.tolist() == [2, 3]
    with pytest.raises(ValueError, match="longer than the model's maximum length 2"):
        causal_request([1], [2, 3, 4], max_length=2)
    with pytest.raises(ValueError, match="at least one token, got 0 and 1"):
        causal_request([], [2], max_length=2)


def test_rows_are_packed_best_fit_longest_first():
    lengths = [5, 3, 8, 2, 4, 1]
    assert row_width(lengths, 64) == 8 and row_width([9], 64) == 16 and row_width([60], 32) == 32
    rows = pack_rows(lengths, 8)
    # 8 alone; 5 then 3 fills a row; 4, then 2 and 1 join it (the fullest row with room)
    assert rows == [[2], [0, 1], [4, 3, 5]]
    assert sorted(i for row in rows for i in row) == list(range(6))
    requests = [Request(np.arange(n, dtype=np.int32), np.arange(n, dtype=np.int32) + 1, 1)
                for n in lengths]  # fmt: skip
    shapes = [(a["tokens"].shape, len(p)) for a, p in batches(requests, 64, batch_tokens=16)]
    assert shapes == [((2, 8), 3), ((2, 8), 3)]  # two rows a batch, the last one filled
    arrays, placed = next(batches(requests, 64, batch_tokens=16))
    assert arrays["segment_ids"][1].tolist() == [0] * 5 + [1] * 3
    assert placed[1] == (1, 7, 8)  # the last input of request 1 is scored
    with pytest.raises(ValueError, match="batch_tokens must be an integer >= 1, got 0"):
        next(batches(requests, 64, batch_tokens=0))


def test_packed_scores_equal_each_request_alone(converted):
    run = load_text_run(converted)
    rng = np.random.default_rng(0)
    vocab = run.model.config.vocab_size
    requests = []
    for n_ctx, n_cont in [(3, 1), (10, 4), (40, 2), (70, 3), (1, 1), (20, 20), (62, 1), (5, 64)]:
        ctx, cont = rng.integers(1, vocab, n_ctx), rng.integers(1, vocab, n_cont)
        requests.append(causal_request(ctx.tolist(), cont.tolist(), MAX_LENGTH))
    # a continuation that is the model's own greedy token: is-greedy must hold
    ctx = rng.integers(1, vocab, 12)
    greedy = int(reference_logp(run.model, ctx)[-1].argmax())
    requests.append(causal_request(ctx.tolist(), [greedy], MAX_LENGTH))
    scored = score_requests(run.model, requests, MAX_LENGTH, batch_tokens=128)
    for r, (ll, is_greedy) in zip(requests, scored, strict=True):
        logp = reference_logp(run.model, r.inputs)[-r.num_scored :]
        targets = r.targets[-r.num_scored :]
        want = logp[np.arange(len(targets)), targets].sum()
        assert abs(ll - want) <= 1e-5 * abs(want), (len(r.inputs), ll, want)
        assert is_greedy == bool((logp.argmax(-1) == targets).all())
    assert scored[-1][1] is True
    assert len(requests[3].inputs) == MAX_LENGTH  # 73 tokens cut to the model's 64
