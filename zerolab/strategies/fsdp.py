"""FSDP2 (`torch.distributed.fsdp.fully_shard`): parameters, gradients and optimizer state
sharded — ZeRO-3.

Each of the model's repeated blocks (zerolab.models.find_blocks: `blocks`, `model.layers`,
`transformer.h`, ... or model.blocks) is its own FSDP unit, and the root (embeddings, final norm,
head) another,
so only one block's full parameters exist at a time. The sharded parameters are fp32 DTensors:
under bf16/fp16 they *are* the master weights, and MixedPrecisionPolicy all-gathers them in the
compute dtype and reduce-scatters gradients in fp32. In fp32 there is no policy.

Communication is derived from FSDP2's schedule, not intercepted: each forward of a unit all-gathers
its parameters, each backward of a unit that resharded after forward all-gathers them again, and
each synchronised backward reduce-scatters its gradients.

Checkpoints are zerolab's pieces: a sharded parameter is a DTensor placed Shard(0), so this rank's
local shard is a run of whole rows, one contiguous element range of the flattened tensor (uneven
splits follow torch.chunk: the trailing ranks hold fewer rows, or none). torch's own API reaches
the shards and their offsets (torch.distributed.checkpoint.state_dict's get/set functions with
full_state_dict=False, compute_local_shape_and_global_offset); the master (the fp32 shard under
mixed precision) and every optimizer state tensor are written alike, and read back in whatever
rows this rank holds now, so a checkpoint of any strategy at any world size loads here.
"""
from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from typing import Optional

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from zerolab.accounting import (CATEGORIES, MIXED, MODEL_STATES, StorageCounter, ceil_div, dtype_name, element_states,
                                fmt_n, placed, state_bytes)
from zerolab.models import find_blocks, place
from zerolab.precision import COMPUTE_BYTES
from zerolab.numerics import Measure, StepInfo
from zerolab.errors import CheckpointError, ConfigError
from zerolab.schema import FSDPSettings
from zerolab.strategies.base import (OptimizerFactory, ShardPiece, Strategy, Traits, kinds_to_load, larger_of,
                                     set_lr)


_log = logging.getLogger("zerolab")


def _local(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return t.to_local() if isinstance(t, DTensor) else t


class FSDPStrategy(Strategy):
    name = "fsdp"
    # fully_shard has no bucket size (a unit is one block) and reduces in fp32 under mixed precision;
    # its settings are offload's two. Ranks hold uneven shares: the last ranks' optimizer state is smaller.
    traits = Traits(settings=FSDPSettings, stage=3, sharded_grads=True, needs_blocks=True, uneven_memory=True)
    checkpoint_format = "pieces"  # the module docstring says how

    @classmethod
    def check_config(cls, cfg, world_size: int) -> None:
        super().check_config(cfg, world_size)
        s = cfg.strategy
        if bool(s.offload_optimizer) != bool(s.offload_params):
            asked = "offload_optimizer" if s.offload_optimizer else "offload_params"
            raise ConfigError(
                f"strategy=fsdp strategy.{asked}=true alone: FSDP2 has one offload, CPUOffloadPolicy, which keeps "
                "the sharded parameters, their gradients and the optimizer state on the host and runs the "
                "optimizer step there, all together; it cannot offload one without the other. Set both "
                "strategy.offload_optimizer=true and strategy.offload_params=true for CPUOffloadPolicy, or use "
                "strategy=zero3 (zerolab's own), which offloads the optimizer alone or the parameters too, or "
                "strategy=deepspeed (offload_optimizer, and offload_params under stage 3)")

    def offload_policy(self) -> OffloadPolicy:
        """CPUOffloadPolicy when both offload settings are on (check_config refuses one alone);
        pinned host memory only where CUDA is present (pinning needs an accelerator's driver)."""
        if self.settings.offload_optimizer and self.settings.offload_params:
            return CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        return OffloadPolicy()

    def setup(self, model: nn.Module, param_groups: list[dict], make_optimizer: OptimizerFactory) -> nn.Module:
        p = self.precision
        if p.name == "bf16_pure":
            place(model, self.ctx.device, torch.bfloat16)
            mp = MixedPrecisionPolicy()
        else:
            place(model, self.ctx.device)  # fp32 shards; the policy casts for compute
            mp = (MixedPrecisionPolicy(param_dtype=p.compute_dtype, reduce_dtype=torch.float32)
                  if p.compute_dtype != torch.float32 else MixedPrecisionPolicy())
        self.compute_bytes = p.compute_dtype.itemsize
        self.reduce_bytes = p.update_dtype.itemsize
        found = find_blocks(model, self.cfg.model.blocks)  # blocks, model.layers, transformer.h, ...
        self.units: list[nn.Module] = list(found.modules) if found is not None else []
        if not self.units and self.ctx.is_main:
            _log.warning("strategy=fsdp: the model (%s) has no .blocks (no nn.ModuleList of same-class modules), "
                         "so it is one FSDP unit: every parameter is gathered for the whole forward and backward, and "
                         "the memory per rank is not ZeRO-3's. Name its layers with model.blocks=PATH, or use "
                         "strategy=zero2",
                         type(model).__name__)
        mesh, offload = self.ctx.device_mesh(), self.offload_policy()
        for block in self.units:  # resharded after forward: re-gathered in backward
            fully_shard(block, mesh=mesh, mp_policy=mp, offload_policy=offload)
        # the root keeps its parameters between forward and backward
        fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
        self.model = model
        # fully_shard replaced the parameters with DTensors: rebuild the groups by name.
        by_name = dict(model.named_parameters())
        groups = [{**g, "params": [by_name[n] for n in g["names"]]} for g in param_groups]
        self.params = [q for g in groups for q in g["params"]]
        self.names = [n for g in groups for n in g["names"]]
        self.optimizer = make_optimizer(groups)
        self._count_schedule()
        self._sync = True
        self._step_mem: dict[str, int] = {}
        return model

    # ---- communication, from the schedule ----------------------------------------------------
    def _count_schedule(self) -> None:
        def numel(module: nn.Module, root: bool) -> int:
            inner = {id(q) for u in self.units for q in u.parameters()}
            return sum(q.numel() for q in module.parameters() if not root or id(q) not in inner)

        for unit, root in [(u, False) for u in self.units] + [(self.model, True)]:
            n = numel(unit, root)

            def on_forward(module, args, _n=n, _root=root):
                if torch.is_grad_enabled() and module.training:
                    self.comm.record("all_gather", _n, self.compute_bytes)
                    if not _root:  # resharded after forward: gathered again for backward
                        self.comm.record("all_gather", _n, self.compute_bytes)
                    if self._sync:
                        self.comm.record("reduce_scatter", _n, self.reduce_bytes)

            unit.register_forward_pre_hook(on_forward)

    @contextmanager
    def no_sync(self):
        # Accumulate unsharded gradients locally; the last micro-batch reduce-scatters the sum.
        self.model.set_requires_gradient_sync(False)
        self._sync = False
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)
            self._sync = True

    def step(self, lr: float, measure: Measure = Measure.NOTHING) -> StepInfo:
        set_lr(self.optimizer, lr)
        grads = [_local(q.grad) for q in self.params if q.grad is not None]
        if measure or not self._step_mem:  # (larger_of: why only then)
            self._step_mem = self._measure()
        info = self._update(grads, measure)
        self.optimizer.zero_grad(set_to_none=True)
        return info

    def _describe_nonfinite(self) -> str:
        for name, q in zip(self.names, self.params):
            g = _local(q.grad)
            if g is not None and not torch.isfinite(g).all():
                return f"first non-finite gradient shard on this rank: {name}"
        return "no single gradient shard is non-finite; their norm overflowed"

    # ---- memory --------------------------------------------------------------------------------
    def _measure(self) -> dict[str, int]:
        # CPUOffloadPolicy keeps every sharded state on the host (said, not read from the tensors:
        # on a CPU both places are the same memory)
        c = StorageCounter({k: "host" for k in ("params", "master", "grads", "optim_state")}
                           if self.settings.offload_params else None)
        shards = [_local(q) for q in self.params]
        # Under mixed precision the fp32 shards are the master weights; the compute-dtype copies
        # exist only while a unit is gathered.
        c.add("master" if self.precision.master_weights else "params", shards)
        c.add("grads", (_local(q.grad) for q in self.params))
        c.add("optim_state", (_local(v) for v in element_states(self.optimizer)))
        c.add("buffers", self.model.buffers())
        return c.result()

    def memory(self) -> dict[str, int]:
        """The larger of what existed just before the last update (gradients alive) and now, each
        category on its own; the totals and places summed again from them."""
        most = larger_of(self._step_mem, self._measure())
        before = self._step_mem  # (larger_of keeps the keys of now: host/grads is gone after the step)
        host = {c: max(most.get(f"host/{c}", 0), before.get(f"host/{c}", 0)) for c in CATEGORIES}
        out = {c: most[c] for c in CATEGORIES}
        out["model_states"] = sum(out[c] for c in MODEL_STATES)
        out["total"] = sum(out[c] for c in CATEGORIES)
        return placed(out, host)

    # ---- weights -------------------------------------------------------------------------------
    @torch.no_grad()
    def consolidated_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        out = {}
        for name, t in self.model.state_dict().items():  # collective: same order on every rank
            full = t.full_tensor() if isinstance(t, DTensor) else t
            if self.ctx.is_main:
                out[name] = full.detach().float().cpu().clone()
        return out if self.ctx.is_main else None

    # ---- checkpoints: each rank its rows of every sharded state (module docstring) -------------
    SHARDED = StateDictOptions(full_state_dict=False)  # DTensors as they are: no gather, no copy

    def checkpoint_state(self) -> dict[str, ShardPiece]:
        model = get_model_state_dict(self.model, options=self.SHARDED)
        optim = get_optimizer_state_dict(self.model, self.optimizer, options=self.SHARDED)["state"]
        out = {}
        for name in self.names:
            for kind, t in [("master", model[name])] + [(k, v) for k, v in optim.get(name, {}).items()
                                                          if isinstance(v, DTensor)]:
                start, end = _span(t, f"{kind}/{name}")
                if end > start:  # a trailing rank may hold no row of a small tensor
                    out[f"{kind}/{name}"] = ShardPiece(t.to_local().detach().reshape(-1), start, end, tuple(t.shape))
        return out

    @torch.no_grad()
    def load_checkpoint_state(self, read) -> None:
        """The rows this rank holds now, of the master and of every optimizer state, through
        torch's set_*_state_dict. get_optimizer_state_dict creates the optimizer's state first
        (one step with zero gradients at lr 0, which changes no weight); the counters (Adam's
        step) are zerolab.checkpoint's to restore after this."""
        model = get_model_state_dict(self.model, options=self.SHARDED)
        set_model_state_dict(self.model, {n: _read_like(read, f"master/{n}", model[n]) for n in self.names},
                             options=StateDictOptions(full_state_dict=False, strict=False))
        optim = get_optimizer_state_dict(self.model, self.optimizer, options=self.SHARDED)
        for name in self.names:
            state = optim["state"].get(name, {})
            held = [k for k, v in state.items() if isinstance(v, DTensor)]
            for kind in kinds_to_load(read, name, held, f"optim={self.cfg.optim.name} under strategy=fsdp"):
                state[kind] = _read_like(read, f"{kind}/{name}", state[kind])
        set_optimizer_state_dict(self.model, self.optimizer, optim, options=self.SHARDED)

    # ---- memory prediction (zerolab.memory asks it; Strategy.predict_memory says how) ----------
    @classmethod
    def predict_memory(cls, p, shape, *, world, precision, k, rank, settings=None, **_) -> None:
        """FSDP2 (fully_shard): every parameter is a DTensor sharded on dim 0 in chunks of
        ceil(rows/N) rows; rank r holds rows [r·chunk, (r+1)·chunk) of each, fewer (or none) on the
        last ranks. The sharded weights and gradients are stored padded to a whole chunk on every
        rank; the optimizer state, made like the local shard, holds only the rows the rank has.
        With MixedPrecisionPolicy the sharded parameters stay fp32 (they are the master weights)
        and the compute-dtype copy exists only while a module runs. With CPUOffloadPolicy (both
        offload settings) every sharded state is on the host; the device keeps the gathered units."""
        c, dt, N = COMPUTE_BYTES[precision], dtype_name(precision), world
        at = "host" if (settings or {}).get("offload_params") else "device"
        shard = sum(ceil_div(s[0], N) * math.prod(s[1:]) for s in shape.shapes)
        held = sum(max(0, min(ceil_div(s[0], N), s[0] - rank * ceil_div(s[0], N))) * math.prod(s[1:])
                   for s in shape.shapes)  # this rank's rows, unpadded
        s = state_bytes(precision)
        kind = "bf16" if s == 2 else "fp32"
        if precision in MIXED:
            p.add("master", shard * 4, f"fp32 sharded parameters (the optimizer's weights): {fmt_n(shard)} × 4",
                  place=at)
        else:
            p.add("params", shard * s, f"{kind} sharded parameters: {fmt_n(shard)} × {s}", place=at)
        p.add("grads", shard * s, f"{kind} sharded gradients: {fmt_n(shard)} × {s}", place=at)
        p.add("optim_state", held * k * s, f"optimizer state of rank {rank}'s rows: {fmt_n(held)} × {k:g} × {s}",
              place=at)
        if shape.buffer_bytes:  # fully_shard leaves buffers whole on every rank (RoPE's inv_freq, say)
            p.add("buffers", shape.buffer_bytes, "model buffers")
        biggest = max(math.prod(s_) for s_ in shape.shapes)
        p.add("transient", biggest * c, f"{dt} unsharded weights of the module being computed (largest tensor)")
        padded = shard * N > shape.n_params
        p.why = "; ".join(w for w in ("no 16-bit weight shard (the fp32 shard is the weights) and an fp32 "
                                      "gradient shard (4Ψ/N, not 2Ψ/N): the same total" if precision in MIXED else "",
                                      "each tensor's dim 0 padded to a multiple of N" if padded else "") if w)
        p.notes.append("vs the paper: no separate 16-bit weight shard; the gradient shard is fp32 (4Ψ/N, not 2Ψ/N)"
                       if precision in MIXED else "every model state is sharded on dim 0 of each tensor")


def _span(t: DTensor, key: str) -> tuple[int, int]:
    """Elements [start, end) of the flattened global tensor that this rank's local shard of `t`
    holds, from torch's own offset computation. Shard(0) on one mesh dimension gives whole rows:
    one contiguous range; any other placement (a 2-D mesh, Shard(1)) is refused, not guessed."""
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    whole_rows = tuple(shape[1:]) == tuple(t.shape[1:]) and not any(offset[1:])
    if not whole_rows:
        raise CheckpointError(f"{key}: a shard of shape {tuple(shape)} at offset {tuple(offset)} of {tuple(t.shape)} "
                              f"(placements {t.placements}) is not a run of whole rows; zerolab's pieces need "
                              "FSDP2's Shard(0) on one mesh dimension")
    row = math.prod(t.shape[1:])
    start = offset[0] * row if shape[0] else 0
    return start, start + math.prod(shape)


def _read_like(read, key: str, like: DTensor) -> DTensor:
    """The saved elements of `key` that `like`'s local shard covers, as a DTensor placed like it."""
    start, end = _span(like, key)
    local = like.to_local()
    values = read(key, start, end).to(device=local.device, dtype=local.dtype).view(local.shape)
    return DTensor.from_local(values, like.device_mesh, like.placements, shape=like.shape, stride=like.stride())
