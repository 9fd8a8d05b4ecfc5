"""``config.mesh.target``: the accelerators ``la-train --dry_run`` compiles the train step for,
from any machine. ``""``: the visible devices (no target); ``tpu:...``: a TPU slice
(`tpu_target`, libtpu's XLA:TPU); ``gpu:...``: NVIDIA GPUs (`gpu_target`, the CUDA plugin's
XLA:GPU). Each is a `target_base.Target`; `parse_target` is the one reader."""

from __future__ import annotations

from linear_attention.training.gpu_target import GPU_FORMS, match_gpu
from linear_attention.training.target_base import Target
from linear_attention.training.tpu_target import TPU_FORMS, match_tpu

TARGET_FORMS = f"'' (the visible devices), {TPU_FORMS}, or {GPU_FORMS}"
_MATCHERS = {"tpu": match_tpu, "gpu": match_gpu}


def parse_target(target: str, path: str = "config.mesh.target") -> Target | None:
    """``None`` for ``""``; the `Target` of a TPU or GPU target; otherwise `ValueError`
    naming ``path`` and `TARGET_FORMS`. Syntax only: whether this machine can describe the
    target's devices is `Target.devices`'s to say."""
    if not isinstance(target, str):
        raise ValueError(f"{path} must be a string: {TARGET_FORMS}; got {target!r}")
    if target == "":
        return None
    match = _MATCHERS.get(target.split(":", 1)[0])
    found = None if match is None else match(target)
    if found is None:
        raise ValueError(f"{path} = {target!r} is not a compile target; accepted: {TARGET_FORMS}")
    return found
