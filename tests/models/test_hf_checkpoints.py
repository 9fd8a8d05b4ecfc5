"""The Hugging Face fixtures of Qwen3-Next, Qwen3.5-MoE, Kimi Linear, OLMo Hybrid (with and
without rotary), Mamba and Falcon-Mamba imported and exported against transformers' logits,
greedy tokens and tensors; the other architectures and la-convert are in tests/models/test_hf.py,
the checks in tests/models/_hf_cases.py."""

from __future__ import annotations

import pytest

from tests.models import _hf_cases
from tests.models._hf_cases import IN_TEST_HF_CHECKPOINTS


@pytest.fixture(scope="module", params=IN_TEST_HF_CHECKPOINTS)
def imported(request):
    return _hf_cases.imported(request.param)


def test_import_matches_transformers(imported):
    _hf_cases.check_import(imported)


def test_export_gives_back_the_checkpoint(imported, tmp_path):
    _hf_cases.check_export(imported, tmp_path)


def test_export_refuses_a_model_without_an_equivalent(imported, tmp_path):
    _hf_cases.check_export_refusal(imported, tmp_path)
