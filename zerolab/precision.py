"""Precision modes: compute dtype, FP32 master weights, dynamic loss scaling.

  fp32       weights, grads, optimizer all fp32
  bf16       bf16 weights and grads in the model; the optimizer updates an fp32 master copy
  fp16       as bf16 with fp16, plus dynamic loss scaling (fp16's range is too small for grads)
  bf16_pure  bf16 weights updated in place, no master copy: an opt-in demonstration of why
             master weights matter (small updates vanish in bf16's 8-bit mantissa)
Below the 16 bytes (zerolab/precision_modes.py says which apply where): precision.master holds the
bf16 run's master as the weight plus a 16-bit remainder (exact) or as the weight alone (lossy),
precision.optim_states keeps the optimizer's state in bf16; the update is computed in fp32.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from zerolab.master import MasterStorage, derive_weight_
from zerolab.schema import PrecisionConfig

log = logging.getLogger(__name__)

# The one precision-to-dtype map: each precision's compute dtype (the model's weights and
# gradients), and the short name of each dtype (the time model's rates and records use them).
COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "bf16_pure": torch.bfloat16}
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# Bytes per element of each mode's compute dtype (the model's weights and gradients): the one
# precision-to-bytes table, read by the memory ledger and the report.
COMPUTE_BYTES = {name: dtype.itemsize for name, dtype in COMPUTE_DTYPES.items()}
# The dtype the optimizer updates, and so keeps its state in: fp32 master weights (or the fp32
# weights themselves), except bf16_pure, whose point is to update the 16-bit weights in place.
UPDATE_DTYPES = {name: torch.bfloat16 if name == "bf16_pure" else torch.float32 for name in COMPUTE_DTYPES}
MIXED = ("bf16", "fp16")  # precisions that keep an fp32 master copy beside 16-bit weights


def state_bytes(precision: str) -> int:
    """Bytes per element of what the optimizer updates and keeps (UPDATE_DTYPES)."""
    return UPDATE_DTYPES[precision].itemsize


class LossScaleUnderflow(RuntimeError):
    pass


class LossScaler:
    """Dynamic loss scaling for fp16 (Micikevicius et al. 2017): start high, halve and skip the
    step on overflow, double after `growth_interval` clean steps. The overflow flag it receives
    must already agree across ranks (strategies all-reduce it), so every rank skips together.

    The scale and its counters are 0-dim tensors on the run's device, so a step can update them
    without the host knowing whether it overflowed (zerolab.numerics, on unlogged steps). The
    scale is fp64: powers of two, and the unscale multiplier coef/scale is then the same fp64
    division a Python float gives. A scale that would fall below min_scale is noted,
    not applied; raise_if_underflowed() raises LossScaleUnderflow for it (at once on a host-decided step)."""

    def __init__(self, cfg: PrecisionConfig, enabled: bool, device: torch.device = torch.device("cpu")):
        self.enabled = enabled
        self.growth_interval, self.min_scale = cfg.growth_interval, cfg.min_scale
        # torch.tensor (not torch.full): a dry run's fake tensors keep the value of a scalar made
        # this way through every operation on known values (FakeTensorMode's constants), so its
        # host reads of the scaler stay exact (zerolab.rehearsal).
        self.scale_tensor = torch.tensor(cfg.initial_scale if enabled else 1.0, dtype=torch.float64, device=device)
        self._clean = torch.tensor(0, dtype=torch.int64, device=device)
        self._skipped = torch.tensor(0, dtype=torch.int64, device=device)
        self._underflow_step = torch.tensor(-1, dtype=torch.int64, device=device)

    # ---- host views (each a read of the device: logged steps, checkpoints, messages) -----------
    @property
    def scale(self) -> float:
        return float(self.scale_tensor.item())

    @scale.setter
    def scale(self, value: float) -> None:  # a strategy with its own scaler mirrors it here
        self.scale_tensor.fill_(value)

    @property
    def clean_steps(self) -> int:
        return int(self._clean.item())

    @property
    def skipped_steps(self) -> int:
        return int(self._skipped.item())

    def update(self, found_inf, step: int) -> None:
        """found_inf: a bool, or a 0-dim bool tensor on the scaler's device (nothing read here)."""
        if not self.enabled:
            return
        found = torch.as_tensor(found_inf, device=self.scale_tensor.device)
        halved = self.scale_tensor / 2
        underflow = found & (halved < self.min_scale)
        self._underflow_step.masked_fill_(underflow & (self._underflow_step < 0), step)
        self._skipped.add_(found.long())
        self._clean.add_(1).masked_fill_(found, 0)
        grow = ~found & (self._clean % self.growth_interval == 0)
        # Exact in fp64: the scale stays a power of two (x/2 and x*2 round nothing).
        self.scale_tensor.copy_(torch.where(found & ~underflow, halved,
                                            torch.where(grow, self.scale_tensor * 2, self.scale_tensor)))
        if isinstance(found_inf, bool):
            self.raise_if_underflowed()  # a host-decided step raises at once

    def raise_if_underflowed(self) -> None:
        """Raise LossScaleUnderflow if an overflow would have taken the scale below min_scale."""
        if not self.enabled:
            return
        step = int(self._underflow_step.item())
        if step >= 0:
            self._underflow_step.fill_(-1)
            raise LossScaleUnderflow(
                f"step {step + 1}: fp16 loss scale would fall to {self.scale / 2:g}, below precision.min_scale="
                f"{self.min_scale:g}; the gradients overflow even unscaled. Lower the lr, enable "
                "clipping, or use precision=bf16")

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale_tensor.fill_(float(state["scale"]))
        self._clean.fill_(int(state["clean_steps"]))
        self._skipped.fill_(int(state["skipped_steps"]))


@dataclass
class Precision:
    name: str
    compute_dtype: torch.dtype
    master_weights: bool
    scaler: LossScaler
    master: str = "fp32"  # precision.master: fp32 | remainder | bf16
    optim_states: str = "fp32"  # precision.optim_states: fp32 | bf16
    grad_shard: str = "fp32"  # precision.grad_shard: fp32 | bf16
    weight_rounding: str = "nearest_even"  # resolved from precision.weight_rounding (auto)

    @classmethod
    def from_config(cls, cfg: PrecisionConfig, device: torch.device = torch.device("cpu")) -> "Precision":
        if cfg.name == "bf16_pure":
            log.warning("precision=bf16_pure: the optimizer updates bf16 weights directly, with no fp32 "
                        "master copy. Updates smaller than ~0.4% of a weight are lost. This mode exists "
                        "to show why master weights matter; use precision=bf16 to train.")
        rounding = cfg.weight_rounding
        if rounding == "auto":
            rounding = "nearest_away" if cfg.master == "remainder" else "nearest_even"
        return cls(cfg.name, COMPUTE_DTYPES[cfg.name], cfg.name in MIXED,
                   LossScaler(cfg, enabled=cfg.name == "fp16", device=device),
                   cfg.master, cfg.optim_states, cfg.grad_shard, rounding)

    def state_keys(self) -> dict:
        """The optimizer group key that says how this precision stores the optimizer's state
        (zerolab/optim/stored.py); {} for the usual fp32 state. Where the master is stored is the
        strategy's MasterStorage (zerolab/master.py), under the group's "master" key."""
        return {"state_dtype": torch.bfloat16} if self.optim_states == "bf16" else {}

    @property
    def update_dtype(self) -> torch.dtype:
        """The dtype the optimizer updates (UPDATE_DTYPES)."""
        return UPDATE_DTYPES[self.name]


class MasterCopy:
    """FP32 master weights for unsharded strategies: the optimizer updates these, the model's
    16-bit weights are refreshed from them after every step. With precision.master=remainder or
    bf16 the master is not a copy: the optimizer updates fp32 stand-ins (zerolab.master.stand_in) and writes the model's
    bf16 weights (and the int16 remainders) itself, through the MasterStorage groups() hands it."""

    def __init__(self, params: list[torch.nn.Parameter], precision: "Precision | None" = None):
        self.model_params = params
        self.precision = precision
        self.mode = precision.master if precision is not None else "fp32"
        if self.mode == "fp32":
            self.storage = MasterStorage("fp32", [torch.nn.Parameter(p.detach().float().clone()) for p in params])
        else:  # the master starts as the weight itself: remainder 0
            self.storage = MasterStorage.held_in(self.mode, params)
        self.master = self.storage.masters

    @property
    def remainders(self) -> list[torch.Tensor]:
        return self.storage.remainders

    def groups(self, param_groups: list[dict]) -> list[dict]:
        """The optimizer's param groups over the master (and how it is stored: "master")."""
        index = {id(p): i for i, p in enumerate(self.model_params)}
        keys = self.precision.state_keys() if self.precision is not None else {}
        out = []
        for g in param_groups:
            ids = [index[id(p)] for p in g["params"]]
            group = {**g, "params": [self.master[i] for i in ids], **keys}
            if self.mode != "fp32":
                s = self.storage
                group["master"] = MasterStorage(self.mode, group["params"], [s.weights[i] for i in ids],
                                                [s.remainders[i] for i in ids] if s.remainders else [])
            out.append(group)
        return out

    def grads_to_master(self) -> None:
        for p, m in zip(self.model_params, self.master):
            m.grad = None if p.grad is None else p.grad.float()

    @torch.no_grad()
    def master_to_model(self) -> None:
        if self.mode != "fp32":
            return  # the optimizer wrote the weights
        for p, m in zip(self.model_params, self.master):
            derive_weight_(m, p, self._rounding())

    def _rounding(self) -> str:
        return self.precision.weight_rounding if self.precision is not None else "nearest_even"

    def fp32(self, i: int) -> torch.Tensor:
        """Parameter i's fp32 master, exactly (a copy where it is stored as a pair)."""
        return self.storage.fp32(i)

    @torch.no_grad()
    def load_fp32(self, i: int, value: torch.Tensor) -> None:
        """Set parameter i's master (and so its weight) from fp32 `value`."""
        value = value.to(device=self.model_params[i].device, dtype=torch.float32).reshape(self.model_params[i].shape)
        self.storage.load(i, value)
        if self.mode == "fp32":
            derive_weight_(self.master[i], self.model_params[i], self._rounding())


def grad_norm_sq(grads: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of all gradients (a 0-dim tensor), accumulated in fp32, or in fp64 when a
    gradient is fp64 (16-bit gradients are upcast, fp64 ones never downcast)."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    return torch.stack([g.to(dtype).pow(2).sum() for g in grads]).sum()


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s rule: scale by max_norm/(norm+1e-6) when that is < 1."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
