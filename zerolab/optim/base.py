"""What zerolab's optimizers share: kernel choice, flat-group plumbing, and the numbers the
trainer logs about each step (update-to-weight ratios, trust ratios: kept in update_stats.py).

Every zerolab optimizer computes the step of each tensor into one temporary per tensor (the
same as torch's foreach AdamW keeps for its denominator) and adds it to the weights; AdamW's
decoupled decay is applied first, as torch orders it. When the trainer asks (logged steps only),
the optimizer also records ‖Δw‖² and ‖w‖² per tensor, from sums and dot products, without
materialising Δw.

Kernels (`impl`):
  for_loop  one tensor at a time (a Python loop of small kernels)
  foreach   torch's multi-tensor `_foreach_*` ops over the whole group
  auto      Adam/AdamW and SGD: torch's fused kernel on fp32/fp64 tensors (see adamw.py,
            sgd.py and `_fusable`); otherwise foreach when every tensor of a group is dense and on one device
A flat group (one contiguous fp32 shard from the ZeRO sharder) is a single tensor, so foreach vs
for_loop does not matter there; the fused kernel does (one pass over memory instead of seven, no
shard-sized temporaries), and it treats a flat shard and whole tensors alike, so ddp and zero1/2
run the same kernel.

Skipping on a device flag (`step_unless`): the fused kernels take a found-inf flag and leave
weights and state untouched where it is set, so a strategy can skip an update (fp16 overflow,
trainer.nonfinite=skip) without reading the flag on the host; `skips_on_device()` says whether
every group of this step runs such a kernel. The composed paths (LAMB, LARS, 16-bit weights,
impl=foreach/for_loop) would each need a masked update, and read their step count on the host:
for them the strategy decides on the host.
"""
from __future__ import annotations

from typing import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor

from zerolab.optim import stored
from zerolab.optim.segments import LOW_PRECISION, is_flat_group, per_tensor_sum_sq, whole_tensor_sum_sq
from zerolab.optim.update_stats import UpdateStats

IMPLS = ("auto", "foreach", "for_loop")
# Tensor types the fused kernels take. A dry run's tensors are FakeTensors (zerolab.rehearsal) and
# stand for plain ones: without it a rehearsal would record the composed path that the real run
# does not take (seven passes over memory instead of one, and their temporaries).
PLAIN = (torch.Tensor, torch.nn.Parameter, FakeTensor)


class ZerolabOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer with optional per-step statistics.

    Set `track_updates = True` before `step()` to have the optimizer record, per tensor, ‖Δw‖²
    and ‖w‖² (w before the update); `pop_update_stats()` returns them. For flat groups the
    sums are this rank's partial sums over the segments it owns; the caller all-reduces them."""

    def __init__(self, params, defaults: dict, impl: str = "auto"):
        if impl not in IMPLS:
            raise ValueError(f"impl={impl!r} is not valid; use one of {', '.join(IMPLS)}")
        self.impl = impl
        super().__init__(params, defaults)
        self.track_updates = False
        self._found_inf: torch.Tensor | None = None  # step_unless's flag, fp32 0-dim, during step() only
        self.update_stats = UpdateStats()  # what the step records (update_stats.py): a fresh one every step()
        self.last_working_bytes = 0  # the last step's largest set of fp32 copies of stored groups (stored.py)

    # ---- helpers for subclasses ---------------------------------------------------------------
    def _live(self, group: dict) -> tuple[list[torch.Tensor], list[torch.Tensor], list[str]]:
        """The group's params that have a gradient, their grads, and their names."""
        params, grads, names = [], [], []
        group_names = group.get("names") or [f"{id(group)}.{i}" for i in range(len(group["params"]))]
        for p, name in zip(group["params"], group_names):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients ({name})")
            params.append(p)
            grads.append(p.grad)
            names.append(name)
        if is_flat_group(group) and len(params) != len(group["params"]):
            # Every rank must take part in the group's collectives, so a flat shard without a
            # gradient would leave the others waiting: refuse instead of hanging.
            raise RuntimeError("a flat (ZeRO) param group has a shard without .grad; the sharder must "
                               "set the gradient shard on every rank before optimizer.step()")
        return params, grads, names

    def _chunks(self, group: dict, *lists: list) -> Iterator[tuple[list, ...]]:
        """The whole lists at once (foreach), or one tensor at a time (for_loop)."""
        if self._foreach(lists[0]):
            yield lists
        else:
            for i in range(len(lists[0])):
                yield tuple([lst[i]] for lst in lists)

    def _foreach(self, tensors: list[torch.Tensor]) -> bool:
        if self.impl == "for_loop" or len(tensors) <= 1:
            return False
        if self.impl == "foreach":
            return True
        return len({(t.device, t.dtype) for t in tensors}) == 1

    def _state(self, p: torch.Tensor, *names: str) -> list[torch.Tensor]:
        """Optimizer state tensors of `p` (created as zeros, in p's dtype, on first use)."""
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)  # a constant to a dry run (precision.LossScaler)
        for n in names:
            if n not in state:
                state[n] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return [state[n] for n in names]

    def _advance_step(self, params: list[torch.Tensor]) -> int:
        """Increment the per-parameter step counters; returns the new step (1 on the first).
        A group steps together, so one count serves it (zerolab checkpoints store one value)."""
        steps = [self.state[p]["step"] for p in params]
        for s in steps:
            s += 1
        return int(steps[0].item()) if steps else 0

    def _device_steps(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """For a fused kernel: the step counters on their tensors' device (moved there once; torch's
        fused CUDA kernels read them on the device), advanced by one without a host read."""
        steps = []
        for p in params:
            state = self.state[p]
            if state["step"].device != p.device:
                state["step"] = state["step"].to(p.device)
            steps.append(state["step"])
        torch._foreach_add_(steps, 1)
        return steps

    def _adam_state(self, group: dict):
        """What Adam(W) and LAMB share before their updates differ: the live tensors and their m
        and v. Returns None when no tensor of the group has a gradient."""
        params, grads, names = self._live(group)
        if not params:
            return None
        states = [self._state(p, "exp_avg", "exp_avg_sq") for p in params]
        return params, grads, names, [m for m, _ in states], [v for _, v in states]

    def _bias_corrections(self, group: dict, params: list[torch.Tensor]) -> tuple[float, float]:
        """Advance the step; the bias corrections 1 − βᵗ (1 without bias correction)."""
        t = self._advance_step(params)
        b1, b2 = group["betas"]
        return (1 - b1 ** t, 1 - b2 ** t) if group["bias_correction"] else (1.0, 1.0)

    @staticmethod
    def _update_moments(ms: list, vs: list, gs: list, betas) -> None:
        """m ← β1·m + (1−β1)·g, v ← β2·v + (1−β2)·g², in place."""
        torch._foreach_lerp_(ms, gs, 1 - betas[0])
        torch._foreach_mul_(vs, betas[1])
        torch._foreach_addcmul_(vs, gs, gs, value=1 - betas[1])

    def _apply(self, group: dict, params: list[torch.Tensor], updates: list[torch.Tensor],
               names: list[str], decay: float = 0.0) -> None:
        """p ← p·(1 − decay) + s for every tensor, so Δw = s − decay·p. The decay is applied first
        and separately (as torch's AdamW does), which keeps the rounding identical to torch's.
        When asked, records ‖Δw‖² and ‖w‖² (w before the update) first."""
        if self.track_updates and params[0].dtype in LOW_PRECISION:
            # 16-bit weights updated in place (precision=bf16_pure, whole tensors or a ZeRO shard):
            # rounding can swallow the update, so record the change that actually landed.
            before = self.update_stats.snapshot(params)
            for p, u in zip(params, updates):
                p.mul_(1 - decay).add_(u)
            self.update_stats.record_landed(group, params, before, names)
            return
        if self.track_updates:
            self.update_stats.record(group, params, updates, names, decay)
        foreach = self._foreach(params)
        if decay:
            if foreach:
                torch._foreach_mul_(params, 1 - decay)
            else:
                for p in params:
                    p.mul_(1 - decay)
        if foreach:
            torch._foreach_add_(params, updates)
        else:
            for p, u in zip(params, updates):
                p.add_(u)

    def _fused(self, group: dict, params: list[torch.Tensor], names: list[str], kernel,
               steps: list[torch.Tensor] = ()) -> None:
        """Run `kernel(found_inf)`, which updates `params` in one fused pass, never materialises Δw,
        and changes nothing where found_inf is set (step_unless's flag, or None); `steps`, the
        counters _device_steps advanced, go back by the flag. On logged steps (track_updates)
        record what landed, from a snapshot taken before."""
        before = self.update_stats.snapshot(params) if self.track_updates else None
        kernel(self._found_inf)
        if self._found_inf is not None and steps:
            torch._foreach_sub_(list(steps), self._found_inf)
        if before is not None:
            self.update_stats.record_landed(group, params, before, names)

    def _fused_group(self, group: dict) -> bool:
        """Whether this group's update runs in a fused kernel that takes a found-inf flag
        (subclasses with one say when; the composed paths never do)."""
        return False

    def _fusable(self, *lists: list[torch.Tensor]) -> bool:
        """Whether torch's fused kernel can run over these tensors: impl auto, and every tensor a
        plain (not DTensor), dense, contiguous fp32/fp64 tensor of one dtype on one CPU or CUDA
        device (the CUDA kernel reads the step counters there: _device_steps moves them). 16-bit
        weights keep the composed path: the fused kernel computes them in fp32 and rounds once,
        which would change bf16_pure's results. A dry run's fake tensors count as plain (PLAIN)."""
        if self.impl != "auto":
            return False
        tensors = [t for lst in lists for t in lst]
        dtype, device = tensors[0].dtype, tensors[0].device
        return dtype in (torch.float32, torch.float64) and device.type in ("cpu", "cuda") and all(
            type(t) in PLAIN and t.device == device and t.dtype == dtype
            and t.layout == torch.strided and t.is_contiguous() for t in tensors)

    def _existing_state(self, params: list[torch.Tensor], *names: str) -> list[torch.Tensor]:
        """The named state tensors of `params` that exist already (none before the first step)."""
        return [self.state[p][n] for p in params for n in names if n in self.state[p]]

    # ---- the optimizer's side of the metrics ------------------------------------------------
    def step(self, closure=None):
        self.update_stats, self.last_working_bytes = UpdateStats(), 0
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            for group in self.param_groups:
                if stored.is_stored(group):  # values kept in other dtypes (stored.py): fp32 copies, slice by slice
                    stored.step_group(self, group)
                else:
                    self._step_group(group)
        return loss

    def _step_group(self, group: dict) -> None:
        raise NotImplementedError

    def _layerwise(self, group: dict) -> bool:
        """Whether the group's update needs norms of whole tensors (LAMB's and LARS's trust ratios)."""
        return False

    def skips_on_device(self) -> bool:
        """Whether step_unless can skip this step without the host: every group with a gradient
        runs a kernel that takes the flag."""
        return all(stored.fuses(self, g) if stored.is_stored(g) else self._fused_group(g)
                   for g in self.param_groups if any(p.grad is not None for p in g["params"]))

    def step_unless(self, found_inf: torch.Tensor) -> None:
        """step(), except that nothing changes (weights, state, step counters) where the 0-dim
        device flag `found_inf` is true; the flag is never read on the host. Only for a step
        skips_on_device() allows."""
        self._found_inf = found_inf.to(torch.float32)  # the fused kernels' flag type
        try:
            self.step()
        finally:
            self._found_inf = None

    def pop_update_stats(self) -> list[dict]:
        """Per group: names, update_sq and weight_sq per tensor, and whether they are partial
        (flat shard: the caller must sum them over ranks). Empty unless track_updates was set."""
        out, self.update_stats.updates = self.update_stats.updates, []
        return out

    def step_stats(self) -> dict[str, float]:
        """min/median/max of the last step's trust ratios over tensors (LAMB/LARS; {} otherwise).
        Under flat groups every rank holds the complete per-tensor vector after its all-reduce."""
        return self.update_stats.trust_summary()


def per_tensor_norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of each tensor (fp32 for 16-bit tensors, else their own dtype), as one vector."""
    if not tensors:
        return torch.zeros(0)
    return whole_tensor_sum_sq(tensors).sqrt()


def layer_norms(group: dict, a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor L2 norms of two lists (e.g. weights and updates), as fp32 vectors.

    Unsharded group: norms of whole tensors. Flat group: this rank's partial sums of squares
    over its segments, completed by ONE call to the shard's allreduce for both vectors, so every
    rank ends with the full per-tensor norms of tensors that straddle shard boundaries."""
    if is_flat_group(group):
        segs, n = group["shard"].segments, group["shard"].n_tensors
        both = torch.cat([per_tensor_sum_sq(a, segs, n), per_tensor_sum_sq(b, segs, n)])
        group["shard"].allreduce(both)
        return both[:n].sqrt(), both[n:].sqrt()
    return per_tensor_norms(a), per_tensor_norms(b)


def scale_per_tensor(group: dict, tensors: list[torch.Tensor], factors: torch.Tensor) -> None:
    """tensors[i] *= factors[i] (unsharded), or each segment by its tensor's factor (flat), in place:
    no shard-sized tensor of factors is built (the same products, so the same bits). Padding is left
    as it is: its update is 0 (zero gradient, zero weight)."""
    if is_flat_group(group):
        factors = factors.to(device=tensors[0].device, dtype=tensors[0].dtype)
        for seg in group["shard"].segments:
            tensors[seg.slab][seg.start:seg.end].mul_(factors[seg.tensor])
    else:
        for t, f in zip(tensors, factors.to(tensors[0].device).unbind()):
            t.mul_(f)


def trust_ratio(numer: torch.Tensor, denom: torch.Tensor, max_ratio) -> torch.Tensor:
    """numer/denom per tensor; 1 where either is 0 (a fresh zero tensor, or no signal); clamped."""
    ratio = torch.where((numer > 0) & (denom > 0), numer / denom.clamp_min(torch.finfo(denom.dtype).tiny),
                        torch.ones_like(numer))
    return ratio.clamp(max=max_ratio) if max_ratio is not None else ratio
