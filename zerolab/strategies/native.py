"""The "native" checkpoint format: a strategy that saves its own files (DeepSpeed's engine does)
mixes this in beside `checkpoint_format = "native"`. zerolab records, checksums and publishes
every file it writes, beside its own meta.json and rank*.safetensors (zerolab/checkpoint/); such a
checkpoint loads only into the same strategy (check_native_compatible says when)."""
from __future__ import annotations

from typing import Callable, Optional

import torch


class NativeCheckpoint:
    checkpoint_format = "native"
    checkpoint_globals: tuple = ()  # the pickle globals its torch.save files may name (zerolab/safeload.py)

    def save_native(self, directory: str) -> None:
        """Collective: write this strategy's own checkpoint files under `directory` (the save's
        temporary directory)."""
        raise NotImplementedError

    def native_meta(self) -> dict:
        """Rank 0, after save_native: what load_native and the classmethods below need, stored
        as meta.json's "native" record (JSON values)."""
        raise NotImplementedError

    def load_native(self, path: str, meta: dict) -> None:
        """Collective: restore weights, optimizer state and loss scaler from the checkpoint at
        `path` (meta: its verified meta.json, the record under meta["native"]). Open torch.save
        files only inside zerolab.safeload.safe_torch_load(self.checkpoint_globals)."""
        raise NotImplementedError

    @classmethod
    def native_meta_problem(cls, native) -> Optional[str]:
        """What a valid "native" record looks like, when `native` is not one; None when it is."""
        return None

    @classmethod
    def check_native_compatible(cls, meta: dict, path: str, cfg, world_size: int) -> None:
        """Raise zerolab.errors.CheckpointError (naming what to do instead) unless this run's
        config and world size can load the native checkpoint `meta` describes."""

    @classmethod
    def native_weights(cls, path: str, meta: dict) -> dict[str, Callable[[], torch.Tensor]]:
        """Export: parameter name -> a function returning its full weights (any float dtype, any
        shape with the right element count), called one at a time inside safe_torch_load."""
        raise NotImplementedError
