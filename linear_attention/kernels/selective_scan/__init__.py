"""Mamba-1's selective scan: a diagonal state per channel with input-dependent Δ, B and C."""
