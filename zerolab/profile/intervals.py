"""A step's parts from intervals of time: the arithmetic (merge, clip, subtract) and the two ways of
getting the intervals' parts, from the host's clock (CPU/gloo) or from the device timeline (CUDA)."""
from __future__ import annotations

from contextlib import nullcontext

import torch

NULL = nullcontext()  # what a step that is not profiled gets: nothing is created per step
STEP, COMPUTE, OPTIMIZER, WAIT = "zerolab:step", "zerolab:compute", "zerolab:optimizer", "zerolab:wait"
PARTS = ("time/compute_s", "time/optimizer_s", "time/comm_exposed_s", "time/other_s")  # disjoint; sum = step_s


def merged(iv) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted((a, b) for a, b in iv if b > a):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def total(iv) -> float:
    return sum(b - a for a, b in merged(iv))


def clipped(iv, lo: float, hi: float) -> list[tuple[float, float]]:
    return merged((max(a, lo), min(b, hi)) for a, b in iv)


def subtract(a, b) -> list[tuple[float, float]]:
    """The parts of intervals `a` outside intervals `b`."""
    out, cut = [], merged(b)
    for lo, hi in merged(a):
        for c0, c1 in cut:
            if c1 <= lo or c0 >= hi:
                continue
            if c0 > lo:
                out.append((lo, c0))
            lo = max(lo, c1)
            if lo >= hi:
                break
        if lo < hi:
            out.append((lo, hi))
    return out


def step_parts(window: tuple[float, float], compute, optimizer, exposed, comm) -> dict:
    """The parts of one step on one rank, from its window and intervals: exposed communication
    first, then compute and optimizer less it (and less each other), other the rest of the window.
    Disjoint by construction, so the four add up to time/step_s exactly; `comm` (in flight) holds
    `exposed` too, so 0 <= comm_exposed_s <= comm_s."""
    lo, hi = window
    e = clipped(exposed, lo, hi)
    c = subtract(clipped(compute, lo, hi), e)
    o = subtract(subtract(clipped(optimizer, lo, hi), e), c)
    parts = {"time/compute_s": total(c), "time/optimizer_s": total(o), "time/comm_exposed_s": total(e)}
    parts["time/other_s"] = max(0.0, (hi - lo) - sum(parts.values()))
    parts["time/comm_s"] = total(clipped(list(comm) + e, lo, hi))
    parts["time/step_s"] = hi - lo
    return parts


def is_comm_kernel(name: str) -> bool:
    return "nccl" in name.lower()


def device_parts(events) -> dict:
    """CUDA: the parts from the device timeline. `events`: (name, kind, start_s, end_s) of the
    step's device activity, kind "kernel" or "annotation" (the device span of a record_function
    range: STEP, COMPUTE, OPTIMIZER). Exposed = communication kernels' time not covered by any
    other kernel (on any stream); the step's window is its STEP span, else its kernels' extent;
    without COMPUTE spans the other kernels' own time stands for compute."""
    spans: dict[str, list] = {}
    comm, busy = [], []
    for name, kind, a, b in events:
        if kind == "annotation":
            spans.setdefault(name, []).append((a, b))
        elif kind == "kernel":
            (comm if is_comm_kernel(name) else busy).append((a, b))
    ends = spans.get(STEP) or comm + busy or [(0.0, 0.0)]
    window = (min(a for a, _ in ends), max(b for _, b in ends))
    return step_parts(window, spans.get(COMPUTE) or busy, spans.get(OPTIMIZER, []), subtract(comm, busy), comm)


def kineto_device_events(prof) -> list[tuple[str, str, float, float]]:
    """The CUDA activity of a stopped torch.profiler session as device_parts' events."""
    out = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() != torch.autograd.DeviceType.CUDA:
            continue
        kind = e.activity_type() if hasattr(e, "activity_type") else ""
        if e.is_user_annotation() or kind == "gpu_user_annotation":
            kind = "annotation"
        elif kind in ("kernel", "") and not e.name().startswith(("Memcpy", "Memset")):
            kind = "kernel"
        out.append((e.name(), kind, e.start_ns() / 1e9, e.end_ns() / 1e9))
    return out

