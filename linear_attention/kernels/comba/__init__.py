"""Comba (FLA `ops/comba`): the delta rule with closed-loop control, on the DPLR kernels."""
