"""DeepSpeed's state in zerolab's pieces, and DeepSpeed's own (native) checkpoints of before.

Pieces (every DeepSpeed checkpoint zerolab writes): the fp32 master and every per-element
optimizer state tensor of each parameter, by name and element range, through DeepSpeed's public
per-parameter API (deepspeed.utils), so a DeepSpeed run at any stage and world size resumes any
strategy's checkpoint, and any strategy resumes DeepSpeed's. Nothing here re-derives DeepSpeed's
flattening, alignment or padding, and nothing is unpickled:

  stage 3     each rank reads and writes its own partition of each parameter with the local API
              (safe_get/set_local_fp32_param, safe_get/set_local_optimizer_state). A partition is
              partition_numel() elements at partition_numel() x the rank in the parameter's
              partition group, the tail past the tensor's end being DeepSpeed's padding (how its
              own safe_get_full_* puts partitions together). The full setters are not used: at
              stage 3 they cut the last rank's partition out of an unpadded value, which fails
              wherever a tensor does not divide by the ranks (DeepSpeed 0.19.8).
  stages 1-2  the full API (safe_get/set_full_fp32_param, safe_get/set_full_optimizer_state,
  (and its    collective: an all-reduce per tensor on save): each rank writes 1/N of every tensor;
  bf16 opt.)  on load each rank hands the whole tensor to the setter, which keeps its fragment.
  stage 0     the model's own weights and its optimizer's state, whole on every rank: rank 0
              writes them, every rank loads them.

After a load the 16-bit weights follow the fp32 masters as DeepSpeed's own step makes them follow
(its update_lp_params at stages 1-2, the partitions re-flattened at stage 3). The counters (the
optimizer's `step`, the engine's step counts) and the fp16 loss scaler are translated to and from
zerolab's terms (zerolab/checkpoint restores them after load_checkpoint_state).

Native (read only): DeepSpeed's engine.save_checkpoint files under step_.../deepspeed/, which
zerolab wrote before format version 5. They resume as they always did, under strategy=deepspeed
with the same stage and world size (DeepSpeed's engine.load_checkpoint, exact), after zerolab has
checksummed them and checked every pickled global against DEEPSPEED_GLOBALS (zerolab/safeload.py);
export goes through DeepSpeed's consolidation (zero_to_fp32).
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch
import torch.distributed as dist

from zerolab.errors import CheckpointError
from zerolab.safeload import safe_torch_load
from zerolab.strategies.base import ShardPiece, kinds_to_load, materialise_state
from zerolab.strategies.native import NativeCheckpoint

DS_TAG = "deepspeed"  # the tag (sub-directory) DeepSpeed's own files were written into
# The globals torch does not allow by default that DeepSpeed 0.19.8's ZeRO checkpoints hold, as
# torch.serialization.get_unsafe_globals_in_checkpoint reports them on saved stage-1 and stage-2
# checkpoints (CPU, fp32 and bf16), plus DynamicLossScaler, the class fp16's dynamic loss scaling
# saves in LossScaler's place.
DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


class DeepSpeedCheckpointing(NativeCheckpoint):
    """Mixed into DeepSpeedStrategy (its engine, optimizer and inner optimizer): pieces written
    and read, native checkpoints read (module docstring)."""

    checkpoint_format = "pieces"
    checkpoint_globals = DEEPSPEED_GLOBALS  # what a native checkpoint's pickles may name

    # ---- pieces ----------------------------------------------------------------------------------
    def _trained(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

    def _state_kinds(self) -> list[str]:
        """The per-element state DeepSpeed's optimizer keeps (Adam's exp_avg and exp_avg_sq)."""
        return sorted({k for state in self.inner.state.values() for k, v in state.items()
                       if isinstance(v, torch.Tensor) and v.ndim > 0})

    def _partition(self, p: torch.nn.Parameter) -> tuple[int, int, int]:
        """ZeRO-3: (start, end, size) of this rank's partition of p in its flattened elements
        (module docstring); end - start < size on the rank whose partition holds the padding."""
        size = p.partition_numel()
        start = min(dist.get_rank(group=p.ds_process_group) * size, p.ds_numel)
        return start, min(start + size, p.ds_numel), size

    def optimizer_states(self):
        return self.inner.state.values()  # DeepSpeed's optimizer, inside its ZeRO wrapper

    @torch.no_grad()
    def checkpoint_state(self) -> dict[str, ShardPiece]:
        from deepspeed.utils import (safe_get_full_fp32_param, safe_get_full_optimizer_state,
                                     safe_get_local_fp32_param, safe_get_local_optimizer_state)

        self._link_fragments()
        self.mirror_scaler()  # meta.json's loss scaler: DeepSpeed's own, even before its first step here
        kinds, rank, world = self._state_kinds(), self.ctx.rank, self.ctx.world_size
        out = {}
        for name, p in self._trained():  # every rank, in one order: the stage 1-2 getters all-reduce
            if hasattr(p, "ds_id"):  # stage 3: this rank's own partition
                shape = tuple(p.ds_shape)
                start, end, _ = self._partition(p)
                got = {"master": safe_get_local_fp32_param(p),
                       **{k: safe_get_local_optimizer_state(p, k) for k in kinds}}
                cut = lambda t: t.reshape(-1)[:end - start]
            elif hasattr(p, "_hp_mapping"):  # stages 1-2 (None where p lies in another rank's partition)
                shape, n = tuple(p.shape), p.numel()
                start, end = n * rank // world, n * (rank + 1) // world
                got = {"master": safe_get_full_fp32_param(p),
                       **{k: safe_get_full_optimizer_state(p, k) for k in kinds}}
                cut = lambda t: t.reshape(-1)[start:end]
            else:  # stage 0: the weights are the master, whole on every rank
                shape, n = tuple(p.shape), p.numel()
                start, end = 0, (n if rank == 0 else 0)
                got = {"master": p, **{k: self.inner.state[p][k] for k in kinds}}
                cut = lambda t: t.reshape(-1)
            if end > start:
                for kind, t in got.items():
                    out[f"{kind}/{name}"] = ShardPiece(cut(t).detach().float().cpu().clone(), start, end, shape)
        return out

    @torch.no_grad()
    def load_checkpoint_state(self, read) -> None:
        from deepspeed.utils import (safe_get_local_fp32_param, safe_set_full_fp32_param,
                                     safe_set_full_optimizer_state, safe_set_local_fp32_param,
                                     safe_set_local_optimizer_state)

        self._materialise_state()
        held, who = self._state_kinds(), f"DeepSpeed's optimizer (optim={self.cfg.optim.name})"
        for name, p in self._trained():
            kinds = kinds_to_load(read, name, held, who)
            if hasattr(p, "ds_id"):  # stage 3: this rank's partition, padded with zeros as DeepSpeed pads it
                start, end, size = self._partition(p)
                like = safe_get_local_fp32_param(p)

                def local(key, start=start, end=end, size=size, like=like):
                    value = torch.zeros(size, dtype=like.dtype, device=like.device)
                    value[:end - start] = read(key, start, end)
                    return value
                safe_set_local_fp32_param(p, local(f"master/{name}"))
                for k in kinds:
                    safe_set_local_optimizer_state(p, local(f"{k}/{name}"), k)
            elif hasattr(p, "_hp_mapping"):  # stages 1-2: the whole tensor; the setter keeps this rank's fragment
                whole = lambda key, p=p: read(key, 0, p.numel()).view(p.shape).to(p.device)
                safe_set_full_fp32_param(p, whole(f"master/{name}"))
                for k in kinds:
                    safe_set_full_optimizer_state(p, whole(f"{k}/{name}"), k)
            else:  # stage 0
                p.copy_(read(f"master/{name}", 0, p.numel()).view(p.shape))
                for k in kinds:
                    self.inner.state[p][k].copy_(read(f"{k}/{name}", 0, p.numel()).view(p.shape))
        self._weights_follow_masters()

    def _materialise_state(self) -> None:
        """DeepSpeed 0.19's optimizers create their state at the first step (materialise_state
        makes it now, before a load). Its ZeRO-3 steps one sub-group's flat partition at a time,
        with that partition alone in its param group: so here too."""
        opt, inner = self.optimizer, self.inner
        if hasattr(opt, "fp32_partitioned_groups_flat"):
            for i, flat in enumerate(opt.fp32_partitioned_groups_flat):
                group = inner.param_groups[opt.sub_group_to_group_id[i]]
                group["params"] = [flat]
                try:
                    materialise_state(inner, [flat])
                finally:
                    group["params"] = []
        else:
            materialise_state(inner, [q for g in inner.param_groups for q in g["params"]])
        self._link_fragments()

    def _link_fragments(self) -> None:
        """At stages 1-2 (and in its bf16 optimizer) DeepSpeed reaches a parameter's optimizer state
        through fragments it links once, after its first step. DeepSpeed 0.19.8's ZeRO-1/2 steps one
        param group at a time and links after the first group's step, when the other groups have no
        state yet, and never again: the full-state API then fails for every parameter outside the
        first group. Running its own linking again, once every group has state, mends that."""
        opt = self.optimizer
        if hasattr(opt, "_lazy_init_hp_params_optimizer_state") and self.inner.state:
            opt._hp_optimizer_states_linked = False
            opt._lazy_init_hp_params_optimizer_state()

    def _weights_follow_masters(self) -> None:
        """The 16-bit (or fp32) weights the model computes with, from the loaded fp32 masters, as
        DeepSpeed's step leaves them: update_lp_params at stages 1-2 (and in its bf16 optimizer),
        the flat partitions copied and re-viewed per sub-group at stage 3 (what its step and its
        own universal-checkpoint load do), persistent parameters re-gathered."""
        opt = self.optimizer
        if hasattr(opt, "update_lp_params"):
            opt.update_lp_params()
        elif hasattr(opt, "fp32_partitioned_groups_flat"):
            for i in range(len(opt.fp32_partitioned_groups_flat)):
                opt._reassign_or_swap_out_partitioned_parameters(i)
            persistent = getattr(opt, "persistent_parameters", None)
            if persistent:
                persistent[0].all_gather(persistent)

    def restore_step(self, step: int) -> None:
        """The engine counts the steps too (its own schedulers and logs read them), and DeepSpeed's
        fp16 loss scaler takes the state zerolab.checkpoint loaded into zerolab's (mirror_scaler)."""
        super().restore_step(step)
        self.engine.global_steps = step
        self.engine.global_samples = step * self.engine.train_batch_size()
        scaler = self._ds_scaler()
        if scaler is not None:
            state = self.precision.scaler.state_dict()
            scaler.cur_scale = float(state["scale"])
            scaler.last_overflow_iter = scaler.cur_iter - 1 - int(state["clean_steps"])
            self.engine.skipped_steps = int(state["skipped_steps"])

    # ---- the fp16 loss scaler, in zerolab's terms ----------------------------------------------------
    # zerolab counts the clean steps since the last overflow; DeepSpeed's DynamicLossScaler keeps
    # cur_iter (updates seen) and last_overflow_iter, whose difference less one is that same count.
    # The scale carries over exactly; when it next grows follows the reader's own rule.
    def _ds_scaler(self):
        scaler = getattr(self.optimizer, "loss_scaler", None)
        return scaler if self.precision.scaler.enabled and hasattr(scaler, "last_overflow_iter") else None

    def mirror_scaler(self) -> None:
        """After each step: DeepSpeed's loss scaler into zerolab's (the log's loss_scale, and what a
        checkpoint records)."""
        scaler = self._ds_scaler()
        if scaler is not None:
            self.precision.scaler.load_state_dict({
                "scale": float(scaler.cur_scale), "clean_steps": int(scaler.cur_iter - scaler.last_overflow_iter - 1),
                "skipped_steps": int(self.engine.skipped_steps)})

    # ---- native checkpoints, written before format version 5 (read only) --------------------------
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
                f"ranks in DeepSpeed's own format (written by zerolab before format version 5) loads only into "
                f"strategy={cls.name} strategy.stage={saved} with {meta['world_size']} ranks (this run: {this_run}, "
                f"{world_size} ranks). Resume it there once and let that run save again (every checkpoint zerolab "
                f"writes now is in its pieces format, which any strategy resumes at any world size), or convert "
                f"its weights: python -m zerolab export {path} --as-checkpoint --out DIR (the optimizer state "
                f"does not carry over)")

    @classmethod
    def native_weights(cls, path: str, meta: dict) -> dict[str, Callable[[], torch.Tensor]]:
        # zero_to_fp32 in lazy mode: one tensor at a time from memory-mapped partitions
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        lazy = get_fp32_state_dict_from_zero_checkpoint(path, tag=meta["native"]["tag"], lazy_mode=True)
        return {n: (lambda n=n: lazy[n].contiguous()) for n in lazy}
