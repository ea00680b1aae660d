"""Plain data parallelism with torch's DistributedDataParallel: nothing is sharded.

Gradients are all-reduced in buckets during backward. Gradients are views into DDP's buckets
(gradient_as_bucket_view) so they are not stored twice. In bf16/fp16 the optimizer updates an
fp32 master copy of every weight — the (2 + 2 + 12)Ψ bytes of the ZeRO paper's baseline.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from zerolab.accounting import MIXED, StorageCounter, dtype_name, is_element_state, state_bytes
from zerolab.models import place
from zerolab.precision import COMPUTE_BYTES
from zerolab.precision import MasterCopy
from zerolab.precision_modes import Mode, master_term, working_bytes_per_element
from zerolab.numerics import Measure, StepInfo
from zerolab.schema import DDPSettings
from zerolab.strategies.base import (PRECISION_MODE_SETTINGS, ZEROLAB_STEP_SETTINGS, OptimizerFactory, ShardPiece,
                                     Strategy, Traits, kinds_to_load, materialise_state, precision_lossy, set_lr)


def _counting_allreduce(state, bucket):
    """What DDP's default hook does (average: divide by N, then sum in place), plus a record of the
    bucket's size for comm accounting. The future resolves to the bucket's own buffer rather than
    to the collective's result list, which is the same tensor on gloo and NCCL; a dry run's fake
    process group (zerolab.rehearsal) resolves its futures to nothing (the value is not used)."""
    counter, group = state
    buffer = bucket.buffer()
    counter.record("all_reduce", buffer)
    buffer.div_(dist.get_world_size(group))
    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(lambda fut: _bucket(fut, buffer))


def _bucket(fut, buffer):
    """The reduced bucket, once its all-reduce has succeeded. `fut.value()` re-raises the
    collective's error: a callback that ignored its future would complete the chain with the
    bucket as it was (this rank's gradients over N) when the all-reduce failed, and the step would
    go on with them; a rank frozen in backward was then named a step late."""
    fut.value()
    return buffer


class DDPStrategy(Strategy):
    name = "ddp"
    # nothing sharded: the baseline every other strategy is compared against
    traits = Traits(settings=DDPSettings, reference=True, also_reads=ZEROLAB_STEP_SETTINGS | PRECISION_MODE_SETTINGS)
    checkpoint_format = "pieces"

    def setup(self, model: nn.Module, param_groups: list[dict], make_optimizer: OptimizerFactory) -> nn.Module:
        place(model, self.ctx.device, self.precision.compute_dtype)
        self.model = model
        self.params = [p for g in param_groups for p in g["params"]]
        self.names = [n for g in param_groups for n in g["names"]]
        s = self.settings
        # DDP broadcasts rank 0's weights here, so the master copy is taken after it.
        self.ddp = DistributedDataParallel(
            model, device_ids=[self.ctx.device.index] if self.ctx.device.type == "cuda" else None,
            bucket_cap_mb=s.bucket_mb, gradient_as_bucket_view=True,
            # A dry run's fake tensors have no data, and two of DDP's exchanges read it: the check
            # that every rank has the same parameter shapes (init_sync), and the agreement on a
            # new bucket order after the first step, which DDP skips when it looks for unused
            # parameters. Neither changes the bytes a rank holds.
            find_unused_parameters=s.find_unused_parameters or self.ctx.rehearsal,
            init_sync=not self.ctx.rehearsal)
        self.ddp.register_comm_hook((self.comm, None), _counting_allreduce)
        self.master = MasterCopy(self.params, self.precision) if self.precision.master_weights else None
        if self.master:  # the optimizer updates the master (fp32 copies, or stand-ins: precision.master)
            param_groups = self.master.groups(param_groups)
        self.optimizer = make_optimizer(param_groups)
        return self.ddp

    def no_sync(self):
        return self.ddp.no_sync()

    def _optimizer_params(self) -> list[torch.Tensor]:
        return self.master.master if self.master else self.params

    def step(self, lr: float, measure: Measure = Measure.NOTHING) -> StepInfo:
        set_lr(self.optimizer, lr)
        if self.master:
            self.master.grads_to_master()
            # transient (peak accounting): the fp32 gradient copies live until the update is done.
            # DDP's reducer buckets are the gradients themselves (gradient_as_bucket_view): no more.
            copies = sum(m.grad.untyped_storage().nbytes() for m in self.master.master if m.grad is not None)
            self.transient.alloc(copies, "step")
        grads = [p.grad for p in self._optimizer_params() if p.grad is not None]
        info = self._update(grads, measure)
        if self.master:
            if not info.known_skipped:
                self.master.master_to_model()
            for m in self.master.master:
                m.grad = None  # the fp32 grad copy is transient
            self.transient.free(copies)
        # Zero in place (not set_to_none): the grads are views of DDP's buckets, which stay
        # allocated anyway, so keeping the views makes the ledger see them.
        for p in self.params:
            if p.grad is not None:
                p.grad.zero_()
        return info

    def _describe_nonfinite(self) -> str:
        for name, p in zip(self.names, self._optimizer_params()):
            if p.grad is not None and not torch.isfinite(p.grad).all():
                return f"first non-finite gradient: {name}"
        return "no single gradient is non-finite; their norm overflowed"

    def memory(self) -> dict[str, int]:
        c = StorageCounter()
        c.add("params", self.params).add("grads", (p.grad for p in self.params))
        if self.master:
            c.add("master", self.master.master).add("master", self.master.remainders)
        c.add_optimizer(self.optimizer).add("buffers", self.model.buffers())
        return c.result()

    @torch.no_grad()
    def consolidated_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        if not self.ctx.is_main:
            return None
        master = {id(p): i for i, p in enumerate(self.params)} if self.master else {}
        out = {}
        for name, t in self.model.state_dict(keep_vars=True).items():
            src = self.master.fp32(master[id(t)]) if id(t) in master else t
            out[name] = src.detach().float().cpu().clone()
        return out

    # ---- checkpoints: whole tensors; every rank holds the same full state, so rank 0 writes it --
    def _state_holder(self, p: torch.Tensor) -> Optional[dict]:
        """The optimizer state dict of optimizer-side parameter `p` on this rank (None where
        another rank keeps it: torch_zero)."""
        return self.optimizer.state[p]

    def _writes(self, p: torch.Tensor) -> bool:
        """Whether this rank writes `p`'s master and state: each tensor is written once."""
        return self.ctx.is_main

    def checkpoint_state(self) -> dict[str, ShardPiece]:
        out = {}
        for i, (name, p) in enumerate(zip(self.names, self._optimizer_params())):
            if not self._writes(p):
                continue
            shape, n = tuple(p.shape), p.numel()
            master = self.master.fp32(i) if self.master else p.detach()  # exact fp32 in every precision.master
            out[f"master/{name}"] = ShardPiece(master.reshape(-1), 0, n, shape)
            for kind, v in self._state_holder(p).items():
                if is_element_state(v):  # scalars (Adam's step) go to metadata
                    out[f"{kind}/{name}"] = ShardPiece(v.detach().reshape(-1), 0, n, shape)
        return out

    def _materialise_state(self) -> None:
        materialise_state(self.optimizer, self._optimizer_params())

    @torch.no_grad()
    def load_checkpoint_state(self, read) -> None:
        """Every rank reads the whole of every master, and the state of the tensors it keeps state
        for, into state its optimizer created first (materialise_state: of its own dtypes)."""
        self._materialise_state()
        for i, (name, p) in enumerate(zip(self.names, self._optimizer_params())):
            n = p.numel()
            if self.master:  # the master, and from it the model's weights (rounded, or split: precision.master)
                self.master.load_fp32(i, read(f"master/{name}", 0, n))
            else:
                p.copy_(read(f"master/{name}", 0, n).view(p.shape))
            state = self._state_holder(p)
            if state is None:
                continue
            held = [k for k, v in state.items() if is_element_state(v)]
            for kind in kinds_to_load(read, name, held, f"optim={self.cfg.optim.name} under strategy={self.name}"):
                state[kind].copy_(read(f"{kind}/{name}", 0, n).view(p.shape))

    @classmethod
    def lossy(cls, cfg: dict):
        return precision_lossy(cfg)  # precision.master=bf16, optim_states=bf16, ... (base.py)

    # ---- memory prediction (zerolab.memory asks it; Strategy.predict_memory says how) ----------
    @classmethod
    def predict_memory(cls, p, shape, *, precision, k, mode=Mode(), **_) -> None:
        n, c, dt = shape.n_params, COMPUTE_BYTES[precision], dtype_name(precision)
        p.add("params", n * c, f"{dt} weights: Ψ × {c}")
        p.add("grads", n * c, f"{dt} gradients, views into DDP's all-reduce buckets: Ψ × {c}")
        s = state_bytes(precision)  # the optimizer updates fp32 masters, or the bf16 weights
        if precision in MIXED:
            master_term(p, n, mode, "weights")
            p.add("transient", n * 4, "fp32 copies of the gradients while the optimizer steps: Ψ × 4", when="step")
        ss = 2 if mode.optim_states == "bf16" else s
        p.add("optim_state", n * k * ss, f"optimizer state: Ψ × {k:g} elements × {ss}")
        per = working_bytes_per_element(mode, k)
        if per:  # the step over a stored master or state works on one whole tensor at a time
            largest = max(math.prod(t) for _, t in shape.tensors)
            p.add("transient", largest * per, f"fp32 working copies of the largest tensor's stored master/state "
                                              f"during the update (zerolab/optim/stored.py): {largest:,} × {per:g}",
                  when="step")
        if shape.buffer_bytes:
            p.add("buffers", shape.buffer_bytes, "model buffers")
