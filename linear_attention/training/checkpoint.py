"""Checkpoints of the whole training state (parameters, optimizer state, step) with an orbax
`CheckpointManager`: one numbered folder per saved step under ``<workdir>/checkpoints``,
the newest ``keep`` kept. Saving is synchronous, so a checkpoint is complete on disk before
training goes on (and before its device buffers are donated to the next step)."""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp
from flax import nnx


class Checkpoints:
    def __init__(self, directory: str, *, keep: int):
        self.directory = os.path.abspath(directory)
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, create=True, enable_async_checkpointing=False
            ),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: nnx.State) -> None:
        """Save ``state`` as step ``step`` (a no-op if that step is already saved)."""
        if step in self.manager.all_steps():
            return
        self.manager.save(step, args=ocp.args.StandardSave(nnx.to_pure_dict(state)), force=True)
        self.manager.wait_until_finished()

    def restore(self, step: int, abstract_state: nnx.State) -> nnx.State:
        """Restore step ``step`` into the structure, dtypes and shardings of ``abstract_state``
        (a State of `jax.ShapeDtypeStruct` with ``sharding`` set)."""
        target = nnx.to_pure_dict(abstract_state)
        restored = self.manager.restore(step, args=ocp.args.StandardRestore(target))
        state = jax.tree.map(lambda x: x, abstract_state)
        nnx.replace_by_pure_dict(state, restored)
        return state

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
