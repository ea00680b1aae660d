"""What a run measures about its memory on logged steps, beside what the ledger predicted.

The trainer asks three things of it: a step begins (reset the per-step peaks), a forward runs
(measure the bytes it saves for backward, on logged steps only: outside them no hook exists),
and a logged step's figures: per rank the strategy's model states by category
(Strategy.memory()), the measured activations, the step's peak by zerolab's own accounting
(zerolab.memory.peak) and the process figures; for the record, the predictions beside them and,
at the first real update, the comparison (zerolab.memory.ledger) that goes into summary.json.
"""
from __future__ import annotations

import torch

from zerolab.accounting import ActivationMeter, device_part, process_memory
from zerolab.activations import predict_activations
from zerolab.memory import check_against, check_peak, ledger_for_run, peak_for_run, peak_keys, peak_of, \
    process_summary, recompute_bytes
from zerolab.memory.peak import LOGIT_BUFFER_BYTES
from zerolab.models import MODELS


class MemoryMonitor:
    def __init__(self, cfg, ctx, model: torch.nn.Module):
        """`model`: the module about to be trained, before the strategy wraps or shards it."""
        self.ctx, world = ctx, ctx.world_size
        self.predicted = ledger_for_run(cfg, world, model, ctx.topology.per_node)  # model states per rank, or None
        # The activations are predicted for zerolab's own models only (zerolab.activations).
        act = predict_activations(cfg.model, cfg.data.micro_batch, precision=cfg.precision.name,
                                  device=ctx.kernels) if isinstance(model, tuple(MODELS.values())) else None
        self.activations_predicted = act.bytes if act else None
        self.peak_predicted = peak_for_run(self.predicted, act, cfg.model, cfg.data.micro_batch, cfg.model.block_size)
        # One recomputed checkpointed block, from the formula: the meter sees the forward only.
        self.recompute = recompute_bytes(act) if act else 0
        self.activations, self.logits_numel = 0, 0  # measured by the last metered forward (this rank)
        self.states_check, self.peak_check = {}, {}  # filled at the first real update
        self.strategy = None

    def attach(self, strategy) -> None:
        self.strategy = strategy

    def begin_step(self, logged: bool) -> None:
        self.strategy.transient.reset()
        if logged and self.ctx.device.type == "cuda":  # CUDA: the allocator's peak of this step (untested here)
            torch.cuda.reset_peak_memory_stats(self.ctx.device)

    def meter(self, model, enabled: bool) -> ActivationMeter:
        """Counts the bytes a forward saves for backward; costs nothing when not enabled."""
        return ActivationMeter(model, enabled=enabled)

    def measured(self, meter: ActivationMeter, logits_numel: int) -> None:
        if meter.enabled:
            self.activations, self.logits_numel = meter.bytes, logits_numel

    def rank_figures(self, comm: dict) -> dict:
        """This rank's memory and communication figures, to be gathered on rank 0."""
        # every category, its host part (mem/host/<category>_bytes) and the totals by place
        # (mem/device_bytes, mem/host_bytes: each strategy's memory() counts its tensors in their place,
        # zerolab.accounting.StorageCounter)
        out = {f"mem/{k}_bytes": v for k, v in self.strategy.memory().items()}
        out["mem/activations_bytes"] = self.activations  # zerolab.accounting.ActivationMeter
        out.update(self._peak(out))
        out.update(process_memory(self.ctx.device))
        out["comm_bytes"] = comm.get("total", 0.0)
        for link in ("inside", "across"):  # a job that spans nodes (zerolab.comm)
            if f"link/{link}" in comm:
                out[f"comm_{link}_bytes"] = comm[f"link/{link}"]
        return out

    def _peak(self, figures: dict) -> dict:
        """This step's peak by zerolab's accounting: the model states memory() measured, the
        activations the meter measured, and the transients: the loss's logits buffers (8 bytes ×
        the logits' measured numel), one recomputed block with checkpointing (formula) and what the
        strategy recorded (Strategy.transient)."""
        tp = self.strategy.transient.peak()
        # the device's peak: what lives on the host (offload) is not in it
        states = device_part({k[len("mem/"):-len("_bytes")]: v for k, v in figures.items() if k.startswith("mem/")})
        backward = LOGIT_BUFFER_BYTES * self.logits_numel + self.recompute + tp.get("backward", 0)
        pk = peak_of(states, self.activations, backward, tp.get("step", 0))
        out = {"mem/peak_bytes": pk.bytes, "mem/peak_phase": pk.phase,
               **{f"mem/peak_{k}_bytes": v for k, v in pk.parts.items()}}
        if self.ctx.device.type == "cuda":  # CUDA: the allocator's own peak of this step (untested here)
            out["mem/peak_cuda_allocated_bytes"] = torch.cuda.max_memory_allocated(self.ctx.device)
        return out

    def record_keys(self, per_rank: list[dict], skipped: bool) -> dict:
        """The logged record's predictions (rank{r}/mem_pred/...) and, at the first real update
        (optimizer state exists then), the comparisons with what was measured."""
        keys = {}
        if self.activations_predicted is not None:
            keys.update({f"rank{r}/mem_pred/activations_bytes": self.activations_predicted
                         for r in range(len(per_rank))})
        keys.update(peak_keys(self.peak_predicted))
        if skipped:
            return keys
        warn = self.ctx.is_main
        if not self.peak_check:
            acts = [self.activations_predicted] * len(per_rank) if self.activations_predicted else None
            self.peak_check = check_peak(self.peak_predicted, acts, per_rank, warn=warn)
        if not self.states_check:
            pred_keys, self.states_check = check_against(self.predicted, per_rank, warn=warn)
            keys.update(pred_keys)
        return keys

    def summary(self, per_rank: list[dict]) -> dict:
        """summary.json's memory sections."""
        return {
            "peak_memory_per_rank": [{k: v for k, v in r.items() if "peak" in k or "max" in k} for r in per_rank],
            "memory_per_rank": [{k: v for k, v in r.items() if k.startswith("mem/")} for r in per_rank],
            "memory_ledger": {**self.states_check, "process_per_rank": process_summary(per_rank),
                              "activations_predicted_bytes": self.activations_predicted, "peak": self.peak_check},
        }
