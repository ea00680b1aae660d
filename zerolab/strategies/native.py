"""Reading a "native" checkpoint: a library's own files, which zerolab recorded, checksummed and
published beside its meta.json and rank*.safetensors. DeepSpeed runs wrote such checkpoints
before every strategy wrote zerolab's pieces (format version 5); a strategy that can still read
them mixes this in. Such a checkpoint loads only into its writing strategy (check_native_compatible
says when); export reads its weights (native_weights)."""
from __future__ import annotations

from typing import Callable, Optional

import torch


class NativeCheckpoint:
    checkpoint_globals: tuple = ()  # the pickle globals its torch.save files may name (zerolab/safeload.py)

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
