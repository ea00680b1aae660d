"""An optimizer step whose values are stored in other dtypes than it computes in.

A param group may say how its values are kept (keys a strategy or zerolab.precision.MasterCopy
sets; absent, the step is zerolab's usual one):
  "master"       a zerolab.master.MasterStorage: where param i's fp32 master lives when it is not
                 the param itself (precision.master=remainder: the bf16 weight and an int16
                 remainder, exactly; bf16: the weight alone, lossy); read with its fp32(), written
                 back with its store()
  "state_dtype"  torch.bfloat16: the optimizer's per-element state (Adam's moments, a momentum
                 buffer) is stored in bf16 (lossy: rounded after every update)
Where the master is stored elsewhere the params are stand-ins: fp32 tensors of the right shape that
hold no memory (zerolab.master.stand_in), carrying the fp32 gradient and keying the state.

The math is the optimizer's own, in fp32, unchanged: each slice of the group is materialised as
fp32 tensors (a view where the storage already is fp32, a rebuilt or upcast copy otherwise), the
optimizer's _step_group runs on them as on any group, and what it wrote goes back into the
storage. So a remainder run computes bit for bit what an fp32-master run computes, and LAMB,
clipping and the fused kernels' device-side skip work as they do there.

A slice at a time: an elementwise update (Adam, AdamW, SGD, and LAMB/LARS groups without a trust
ratio) runs on slices of at most SLICE elements (aligned: ALIGN), whole tensors for unsharded groups; a layer-wise
update of a flat shard (LAMB/LARS with trust ratios: per-tensor norms completed by one all-reduce
of the whole shard) runs on the whole group at once. The largest set of fp32 copies alive at once
is `last_working_bytes` after the step, for the strategy's transient accounting.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from zerolab.master import MasterStorage, span
from zerolab.optim.segments import Segment, is_flat_group, per_tensor_sum_sq

SLICE = 1 << 22  # elements per materialised slice of an elementwise update (16 MB of fp32 per copy)
# Slices start and end on multiples of ALIGN elements from their tensor's start: torch's CPU kernels
# (the fused Adam's cache-line task units, the vectorised foreach ops) round the elements of a
# tensor's last partial vector differently (no FMA) from the others, so a slice that ended
# mid-vector would change which elements those are. At 64 they are the whole tensor's.
ALIGN = 64


def is_stored(group: dict) -> bool:
    """Whether the group keeps values in another dtype than its optimizer computes in."""
    return _master_mode(group) != "fp32" or group.get("state_dtype") not in (None, torch.float32)


def _master_mode(group: dict) -> str:
    return group["master"].mode if "master" in group else "fp32"


def _storage(group: dict) -> MasterStorage:
    """Where the group's masters live: its "master", or the params themselves."""
    return group["master"] if "master" in group else MasterStorage("fp32", group["params"])


def _slices(opt, group: dict, live: list[int]) -> list[list[tuple[int, int, int]]]:
    """The slices materialised together: lists of (param index, start, end)."""
    params = group["params"]
    if not is_flat_group(group):
        return [[(i, 0, params[i].numel())] for i in live]  # one whole tensor at a time
    if opt._layerwise(group):
        return [[(i, 0, params[i].numel()) for i in live]]
    size = group.get("stored_slice", SLICE)
    if size <= 0 or size % ALIGN:
        raise ValueError(f"stored_slice={size} must be a positive multiple of {ALIGN} elements")
    return [[(i, c, min(c + size, params[i].numel()))] for i in live for c in range(0, params[i].numel(), size)]


def _sub_segments(group: dict, slices: list[tuple[int, int, int]]) -> list[Segment]:
    """The group's segments as seen by a sub-group over `slices` (slab k of the sub-group is slices[k])."""
    out = []
    for k, (i, c0, c1) in enumerate(slices):
        for s in group["shard"].segments:
            lo, hi = max(s.start, c0), min(s.end, c1)
            if s.slab == i and lo < hi:
                out.append(Segment(s.tensor, lo - c0, hi - c0, s.offset + lo - s.start, slab=k))
    return out


class _Record:
    """‖Δw‖² and ‖w‖² per tensor of what landed in the storage, summed over the slices."""

    def __init__(self, group: dict, live: list[int]):
        flat = is_flat_group(group)
        self.group, self.flat = group, flat
        self.slot = {i: k for k, i in enumerate(live)}
        n = group["shard"].n_tensors if flat else len(live)
        self.names = list(group["names"]) if flat else [group["names"][i] for i in live] if group.get("names") \
            else [f"{id(group)}.{i}" for i in live]
        self.upd = torch.zeros(n, dtype=torch.float32)
        self.w = torch.zeros(n, dtype=torch.float32)

    def add(self, slices, befores, afters) -> None:
        diffs = [a - b for a, b in zip(afters, befores)]
        if self.flat:
            segs, n = _sub_segments(self.group, slices), len(self.names)
            self.upd += per_tensor_sum_sq(diffs, segs, n).cpu().float()
            self.w += per_tensor_sum_sq(befores, segs, n).cpu().float()
        else:
            for (i, _, _), d, b in zip(slices, diffs, befores):
                self.upd[self.slot[i]] += d.pow(2).sum().cpu().float()
                self.w[self.slot[i]] += b.pow(2).sum().cpu().float()

    def result(self) -> dict:
        return {"names": self.names, "partial": self.flat, "update_sq": self.upd, "weight_sq": self.w}


def _load_state(stored: dict, step0, c0: int, c1: int, like: torch.Tensor) -> dict:
    """The stored state of one slice as fp32: views of fp32 state, copies of bf16 state; the step
    counter as it was before this step (every slice of a tensor advances it from there)."""
    state = {} if step0 is None else {"step": step0.clone()}
    for k, v in stored.items():
        if k != "step" and isinstance(v, torch.Tensor) and v.ndim > 0:
            s = span(v, c0, c1)
            state[k] = s if s.dtype == like.dtype else s.to(like.dtype)
    return state


def _store_state(stored: dict, state: dict, c0: int, c1: int, p: torch.Tensor, dtype: torch.dtype) -> None:
    for k, v in state.items():
        if k == "step":
            stored["step"] = v
            continue
        if k not in stored:  # first step: the optimizer created it for this slice only
            stored[k] = torch.zeros(p.shape, dtype=dtype, device=v.device)
        target = span(stored[k], c0, c1)
        if target.untyped_storage()._cdata != v.untyped_storage()._cdata:  # not a view of it: a copy to write back
            target.copy_(v)


def _working_bytes(group: dict, sub_params: list, states: list[dict], dtype: torch.dtype, tracked: bool) -> int:
    """Bytes of the fp32 copies a list of slices holds at once: rebuilt or upcast masters, upcast states, the
    snapshot a logged step compares against, and the remainder split's int16 and flag temporaries."""
    n = sum(t.numel() for t in sub_params)
    copies = 4 * n if _master_mode(group) != "fp32" else 0
    if dtype != torch.float32:
        copies += sum(4 * v.numel() for st in states for k, v in st.items() if k != "step")
    split = 3 * max(t.numel() for t in sub_params) if _master_mode(group) == "remainder" else 0
    return copies + split + (4 * n if tracked else 0)


def step_group(opt, group: dict) -> None:
    """The optimizer's update of a stored group (module docstring)."""
    live_params, _, _ = opt._live(group)  # the usual checks (a flat shard without a gradient)
    if not live_params:
        return
    ids = {id(p) for p in live_params}
    live = [i for i, p in enumerate(group["params"]) if id(p) in ids]
    dtype = group.get("state_dtype") or torch.float32
    steps0 = {i: opt.state[group["params"][i]].get("step") for i in live}
    steps0 = {i: None if s is None else s.clone() for i, s in steps0.items()}
    record = _Record(group, live) if opt.track_updates else None
    tracking, opt.track_updates = opt.track_updates, False
    try:
        for slices in _slices(opt, group, live):
            _run_slices(opt, group, slices, steps0, dtype, record)
    finally:
        opt.track_updates = tracking
    if record is not None:
        opt.update_stats.updates.append(record.result())


def _run_slices(opt, group: dict, slices, steps0: dict, dtype: torch.dtype, record) -> None:
    params, sub_params, master = group["params"], [], _storage(group)
    for i, c0, c1 in slices:
        if params[i].dtype != torch.float32:
            raise ValueError(f"a stored param group computes in fp32; its params (or stand-ins) must be fp32, "
                             f"got {params[i].dtype}")
        t = master.fp32(i, c0, c1)
        t.grad = span(params[i].grad, c0, c1)
        opt.state[t] = _load_state(opt.state[params[i]], steps0[i], c0, c1, t)
        sub_params.append(t)
    before = [t.detach().clone() for t in sub_params] if record is not None else None
    sub = {**group, "params": sub_params}
    if is_flat_group(group):
        sub["shard"] = replace(group["shard"], segments=_sub_segments(group, slices))
    else:
        sub["names"] = [group["names"][i] for i, _, _ in slices] if group.get("names") else None
    opt._step_group(sub)
    opt.last_working_bytes = max(opt.last_working_bytes, _working_bytes(
        group, sub_params, [opt.state[t] for t in sub_params], dtype, record is not None))
    afters = []
    for (i, c0, c1), t in zip(slices, sub_params):
        master.store(i, t, c0, c1)
        _store_state(opt.state[params[i]], opt.state.pop(t), c0, c1, params[i], dtype)
        if record is not None:  # (the bf16 master is what the store rounded t to)
            afters.append(master.fp32(i, c0, c1) if master.mode == "bf16" else t)
    if record is not None:
        record.add(slices, before, afters)


def fuses(opt, group: dict) -> bool:
    """Whether the group's update runs in a fused kernel that takes a found-inf flag, as its fp32
    slices would (a probe of one element: the slices are plain contiguous fp32 tensors)."""
    live, _, _ = opt._live(group)
    if not live:
        return True
    probe = torch.zeros(1, dtype=torch.float32, device=live[0].grad.device)
    probe.grad = torch.zeros_like(probe)
    sub = {k: v for k, v in group.items() if k != "shard"}
    sub["params"] = [probe]
    try:
        return opt._fused_group(sub)
    finally:
        opt.state.pop(probe, None)
