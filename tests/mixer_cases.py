"""The per-mixer test cases, one row per registered mixer (`tests/test_mixer_cases.py` fails
when a registered mixer has no row here, or none in the mixer table of docs/guides/models.md).

Each row: `options`, small options that switch on the mixer's own parts at d_model 16, 2 heads
and 12 tokens (the Linen bridge's cases); `tol`, how closely its paths (whole sequence, prefill,
step) agree in float32; whether it decodes (prefill and step), splits time over a mesh axis
(`Mixer.SEQUENCE_PARALLEL`) and takes `segment_ids`; `linen_fast`, whether the Linen bridge's
check runs by default (the rest under `-m slow`); `cpu_grids`, whether the state-tracking and
MAD CPU grids cover it (the mixers that came after those grids were run study elsewhere).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class MixerCase:
    options: dict
    tol: float = 1e-4
    decodes: bool = True
    splits_time: bool = False
    segment_ids: bool = True
    linen_fast: bool = False
    cpu_grids: bool = True


# (fox, lstm, mesanet, the log-linear mixers and path came after the CPU grids were run: their
# studies are issue 53's MQAR rows and 54's own presets; mla is issue 52's, for released
# checkpoints; favor and hedgehog are the random-feature and learned maps the grids leave out)
MIXER_CASES: dict[str, MixerCase] = {
    "softmax": MixerCase(dict(rope=True), splits_time=True, linen_fast=True),
    "mla": MixerCase(dict(q_rank=8, rope=True, rope_dim=4, kv_rank=12), cpu_grids=False),
    "linear": MixerCase(dict(conv=True), splits_time=True),
    "favor": MixerCase(dict(feature_dim=8), splits_time=True, linen_fast=True, cpu_grids=False),
    "taylor": MixerCase(dict(feature_dim=4), splits_time=True),
    "hedgehog": MixerCase(dict(), splits_time=True, linen_fast=True, cpu_grids=False),
    "retnet": MixerCase(dict(conv=True), splits_time=True),
    "gated": MixerCase(dict(), splits_time=True),
    "deltanet": MixerCase(dict(), splits_time=True),
    "gated_deltanet": MixerCase(
        dict(allow_neg_eigval=True, chunk_size=4), splits_time=True, linen_fast=True
    ),
    "gla": MixerCase(dict(conv=True), splits_time=True),
    "swa": MixerCase(dict(window=3, rope=True), splits_time=True, linen_fast=True),
    "kda": MixerCase(dict(num_value_heads=4, chunk_size=4), splits_time=True, linen_fast=True),
    "gated_deltaproduct": MixerCase(dict(num_householder=2, chunk_size=4), splits_time=True),
    "rwkv7": MixerCase(dict(chunk_size=4), splits_time=True, linen_fast=True),
    "fox": MixerCase(dict(conv=True), cpu_grids=False),
    "path": MixerCase(dict(forget_gate=True), cpu_grids=False),
    "lstm": MixerCase(dict(), cpu_grids=False),
    "mesanet": MixerCase(dict(chunk_size=4, cg_steps=16), splits_time=True, cpu_grids=False),
    "log_linear_mamba2": MixerCase(
        dict(chunk_size=4, num_levels=5), splits_time=True, cpu_grids=False
    ),
    "log_linear_gated_deltanet": MixerCase(dict(chunk_size=4, num_levels=5), cpu_grids=False),
    "mamba": MixerCase(dict(state_dim=4, dt_rank=3), tol=1e-5, splits_time=True, cpu_grids=False),
    "rglru": MixerCase(dict(lru_width=24), tol=1e-5, splits_time=True, cpu_grids=False),
    # issue 69's families over existing kernels (after the CPU grids: MQAR rows only)
    "rwkv6": MixerCase(dict(chunk_size=4), splits_time=True, cpu_grids=False),
    "hgrn2": MixerCase(dict(conv=True), splits_time=True, cpu_grids=False),
    "lightning": MixerCase(dict(chunk_size=4), splits_time=True, cpu_grids=False),
    "mlstm": MixerCase(dict(chunk_size=4), cpu_grids=False),
    "gdn2": MixerCase(dict(num_value_heads=4, chunk_size=4), splits_time=True, cpu_grids=False),
    # issue 71's Comba on the DPLR kernels (MQAR rows and the state-tracking parity slice)
    "comba": MixerCase(dict(num_value_heads=4, chunk_size=4), splits_time=True, cpu_grids=False),
}
