"""What a zerolab optimizer records about one step for the trainer's logged numbers: ‖Δw‖² and
‖w‖² per tensor (w before the update) when asked (ZerolabOptimizer.track_updates), and LAMB's and
LARS's trust ratios. ZerolabOptimizer.step starts a fresh UpdateStats; pop_update_stats() and
step_stats() read it.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zerolab.optim.segments import is_flat_group, per_tensor_sum_sq, upcast, whole_tensor_sum_sq


@dataclass
class UpdateStats:
    """One step's records: per group, names, update_sq and weight_sq per tensor and whether they
    are partial (a flat shard's: this rank's sums over its segments, completed by the caller); and
    the trust ratios, kept without a device sync until trust_summary() reads them."""
    updates: list[dict] = field(default_factory=list)
    trust_ratios: list[torch.Tensor] = field(default_factory=list)

    @staticmethod
    def snapshot(params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The weights before an update (fp32 copies of 16-bit ones), for record_landed."""
        return [upcast(p.detach()).clone() for p in params]

    def record_landed(self, group: dict, params: list[torch.Tensor], before: list[torch.Tensor],
                      names: list[str]) -> None:
        """Record ‖Δw‖² and ‖w‖² from the weights before (`before`) and after the update: used where
        Δw is never materialised (a fused kernel) or rounding may swallow part of it (16-bit)."""
        diffs = [upcast(p.detach()) - b for p, b in zip(params, before)]
        if is_flat_group(group):
            segs, n = group["shard"].segments, group["shard"].n_tensors
            upd_sq, w_sq = per_tensor_sum_sq(diffs, segs, n), per_tensor_sum_sq(before, segs, n)
            names = list(group["names"])
        else:
            # per-tensor sums (not _foreach_norm): FSDP's bf16_pure weights are DTensors
            upd_sq = torch.stack([d.pow(2).sum() for d in diffs])
            w_sq = torch.stack([b.pow(2).sum() for b in before])
        self.updates.append({"names": names, "partial": is_flat_group(group), "update_sq": upd_sq,
                             "weight_sq": w_sq})

    def record(self, group: dict, params: list[torch.Tensor], updates: list[torch.Tensor],
               names: list[str], decay: float = 0.0) -> None:
        """Per tensor ‖s − decay·w‖² = ‖s‖² − 2·decay·⟨s, w⟩ + decay²·‖w‖², and ‖w‖², without
        materialising Δw (flat groups: this rank's partial sums over its segments)."""
        if is_flat_group(group):
            segs, n = group["shard"].segments, group["shard"].n_tensors
            s_sq, w_sq = per_tensor_sum_sq(updates, segs, n), per_tensor_sum_sq(params, segs, n)
            dot = torch.zeros(n, dtype=s_sq.dtype, device=params[0].device)
            if decay:
                for seg in segs:
                    u, w = updates[seg.slab][seg.start:seg.end], params[seg.slab][seg.start:seg.end]
                    dot[seg.tensor] += torch.dot(upcast(u), upcast(w))
            names = list(group["names"])
        elif params:
            s_sq, w_sq = whole_tensor_sum_sq(updates), whole_tensor_sum_sq(params)
            # (u * w).sum(), not dot of flattened views: FSDP2's unevenly sharded DTensors cannot flatten
            dot = torch.stack([(upcast(u) * upcast(w)).sum() for u, w in zip(updates, params)]) \
                if decay else torch.zeros_like(s_sq)
        else:
            return
        upd_sq = (s_sq - 2 * decay * dot + decay * decay * w_sq).clamp_min(0)
        self.updates.append({"names": names, "partial": is_flat_group(group), "update_sq": upd_sq,
                             "weight_sq": w_sq})

    def record_trust(self, ratios: torch.Tensor) -> None:
        """Keep this step's trust ratios (no device sync here; trust_summary() reads them)."""
        self.trust_ratios.append(ratios.detach())

    def trust_summary(self) -> dict[str, float]:
        """min/median/max of the step's trust ratios over tensors ({} when none was recorded)."""
        if not self.trust_ratios:
            return {}
        r = torch.cat([t.flatten().float() for t in self.trust_ratios]).cpu()
        return {"trust_ratio_min": r.min().item(), "trust_ratio_median": r.median().item(),
                "trust_ratio_max": r.max().item()}
