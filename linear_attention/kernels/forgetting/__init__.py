"""Forgetting attention (FoX): softmax attention with a cumulative log forget gate."""
