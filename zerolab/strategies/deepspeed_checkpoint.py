"""DeepSpeed's native checkpoint format, behind the strategy protocol's "native" hooks
(zerolab/strategies/native.py).

DeepSpeed saves and loads its partitioned state itself (engine.save_checkpoint /
engine.load_checkpoint, torch.save files under the tag directory DS_TAG inside zerolab's
checkpoint directory), which makes resume bitwise exact at the same world size and stage and
impossible anywhere else; export goes through DeepSpeed's own consolidation (zero_to_fp32).
zerolab checksums the files and never lets DeepSpeed unpickle anything beyond tensors, plain
containers and the classes in DEEPSPEED_GLOBALS (zerolab/safeload.py: safe_torch_load).
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch

from zerolab.errors import CheckpointError
from zerolab.safeload import safe_torch_load
from zerolab.strategies.native import NativeCheckpoint

DS_TAG = "deepspeed"  # the tag (sub-directory) DeepSpeed's own files go into
# The globals torch does not allow by default that DeepSpeed 0.19.8's ZeRO checkpoints hold, as
# torch.serialization.get_unsafe_globals_in_checkpoint reports them on saved stage-1 and stage-2
# checkpoints (CPU, fp32 and bf16), plus DynamicLossScaler, the class fp16's dynamic loss scaling
# saves in LossScaler's place (fp16 cannot run on the CPU accelerator here).
DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


class DeepSpeedCheckpointing(NativeCheckpoint):
    """Mixed into DeepSpeedStrategy: checkpoint_format "native" (strategies/native.py)."""

    checkpoint_globals = DEEPSPEED_GLOBALS

    def save_native(self, directory: str) -> None:
        self.engine.save_checkpoint(directory, tag=DS_TAG, save_latest=False)
        # DeepSpeed's global rank 0 also copies its recovery scripts (zero_to_fp32.py,
        # zero_to_torch.py) beside the tag, before save_checkpoint returns there. A checkpoint is
        # data, never code (export runs the installed DeepSpeed's consolidation): they go. Only the
        # rank that wrote them removes them: another rank listing the directory could see a script
        # that rank 0 removes before it does, and fail on its missing file. Only *.py:
        # other ranks may be writing their rank files already.
        if self.engine.global_rank != 0:
            return
        for name in os.listdir(directory):
            if name.endswith(".py") and os.path.isfile(os.path.join(directory, name)):
                os.remove(os.path.join(directory, name))

    def native_meta(self) -> dict:
        import deepspeed

        return {"tag": DS_TAG, "stage": self.cfg.strategy.stage, "version": deepspeed.__version__}

    def load_native(self, path: str, meta: dict) -> None:
        tag = meta["native"]["tag"]
        with safe_torch_load(self.checkpoint_globals):
            loaded, _ = self.engine.load_checkpoint(path, tag=tag, load_optimizer_states=True,
                                                    load_lr_scheduler_states=False)
        if loaded is None:
            raise CheckpointError(f"{path}: DeepSpeed found no checkpoint under tag {tag!r}")

    @classmethod
    def native_meta_problem(cls, native) -> Optional[str]:
        ok = (isinstance(native, dict) and native.get("tag") == DS_TAG and isinstance(native.get("stage"), int)
              and not isinstance(native["stage"], bool) and 0 <= native["stage"] <= 3)
        return None if ok else f"{{'tag': {DS_TAG!r}, 'stage': 0..3, ...}}"

    @classmethod
    def check_native_compatible(cls, meta: dict, path: str, cfg, world_size: int) -> None:
        saved, stage = meta["native"]["stage"], cfg.strategy.stage
        # the run in the words that set it: strategy.stage is a setting of this strategy alone
        same = cfg.strategy.name == cls.name
        this_run = f"strategy={cfg.strategy.name}" + (f" strategy.stage={stage}" if same else "")
        if not same or saved != stage or meta["world_size"] != world_size:
            raise CheckpointError(
                f"{os.path.join(path, 'meta.json')}: a DeepSpeed stage-{saved} checkpoint of {meta['world_size']} "
                f"ranks loads "
                f"only into strategy={cls.name} strategy.stage={saved} with {meta['world_size']} ranks (this run: "
                f"{this_run}, {world_size} ranks). To continue elsewhere, "
                f"convert its weights: python -m zerolab export {path} --as-checkpoint --out DIR "
                f"(the optimizer state does not carry over)")

    @classmethod
    def native_weights(cls, path: str, meta: dict) -> dict[str, Callable[[], torch.Tensor]]:
        # zero_to_fp32 in lazy mode: one tensor at a time from memory-mapped partitions
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        lazy = get_fp32_state_dict_from_zero_checkpoint(path, tag=meta["native"]["tag"], lazy_mode=True)
        return {n: (lambda n=n: lazy[n].contiguous()) for n in lazy}
