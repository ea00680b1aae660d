"""The time model: a recorded step priced on named hardware (a prediction, not a measurement).

On a GPU each op costs its roofline at the rates its kind of kernel reaches there (matmuls by
shape, attention, memory-bound ops: zerolab.predict.gpu). On the CPU, and on a device without
such rates, max(FLOPs / (achievable x peak FLOP/s of its dtype), bytes / (achievable x memory
bandwidth)), plus the device's per-kernel overhead (calibrated on a CPU). Each collective costs
its algorithm's time on the links of its group (zerolab.predict.topology). The timeline
(zerolab.predict.timeline) overlaps them as the strategy scheduled them. Out come the four parts
a profiled step reports, tokens/s per device, MFU (model FLOPs per token, zerolab.profile's
convention, over the device's data-sheet peak), and the bytes and time of each collective kind
on each link.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field

from zerolab.predict.gpu import KERNELS, kernel_seconds
from zerolab.predict.hardware import Device
from zerolab.predict.kernels import STEP_PHASES, table_seconds
from zerolab.predict.record import HOST, Op, StepRecord
from zerolab.predict.timeline import replay
from zerolab.predict.topology import Network

NOT_MODELLED = ("not modelled: the host's own time on a GPU (it is assumed to run ahead of the device; what the "
                "launch gaps of small kernels cost is inside the fitted memory share), on a GPU, compute slowed by "
                "communication running beside it, kernels fused or tuned differently from what the dry run "
                "dispatched (CUDA's attention, dropout and layer norm on a GPU; the CPU's other kernels), a software "
                "stack older or newer than the measurements behind the rates, data loading, on a CPU the "
                "Python that runs inside the autograd engine outside the strategy's hooks (FSDP2's "
                "post-backward: zerolab.predict.sections)")


@dataclass
class Prediction:
    hardware: str
    topology: str
    world: int
    dtype: str
    step_s: float
    parts: dict  # PARTS -> seconds
    tokens_per_s_per_device: float
    mfu: float
    comm_s: float  # collectives' running time in the step (per group, one after another)
    collectives: list = field(default_factory=list)  # per kind: count, bytes, per-link bytes and seconds, exposed
    assumptions: list = field(default_factory=list)
    unpriced: list = field(default_factory=list)  # (op, count, share of the step's predicted time)

    def to_dict(self) -> dict:
        return asdict(self)


def op_seconds(op: Op, dev: Device) -> float:
    if op.name.startswith(HOST):  # a host section of the strategy's Python (zerolab.predict.sections)
        return op.host_s if dev.host_sync else 0.0  # on a GPU the host runs ahead of the device
    kinds = None if dev.host_sync else KERNELS.get(dev.name)
    if kinds is not None:
        return kernel_seconds(op, dev, kinds)
    measured = table_seconds(op.name, op.flops, op.bytes, op.kernels, op.dims, dev.kernel_table) \
        if dev.kernel_table else None
    if measured is not None:  # this CPU's own kernels of that name, nearest in shape (zerolab.predict.kernels)
        host = dev.host_s_per_kernel_step if op.phase in STEP_PHASES else dev.host_s_per_kernel
        return measured + host * op.kernels
    a = dev.achievable
    compute = op.flops / (dev.kernel_flops.get(op.name) or dev.peak(op.dtype) * a) if op.flops else 0.0
    bandwidth = dev.kernel_bandwidth.get(op.name) or dev.memory_bandwidth * a
    return max(compute, op.bytes / bandwidth) + dev.op_overhead_s * op.kernels


def predict(record: StepRecord, topo: Network, tokens_per_rank: int, flops_per_token: float,
            dtype: str) -> Prediction:
    """The step of `record` (one rank's) on `topo`'s device and links."""
    dev = topo.device
    priced = {c.index: topo.price(c.kind, c.bytes, c.ranks) for c in record.collectives}
    r = replay(record, lambda op: op_seconds(op, dev), lambda c: priced[c.index].seconds, streams=not dev.host_sync,
               meeting_s=dev.meeting_s, overlap_rate=dev.overlap_rate, queued_s=dev.queued_s)
    per_device = tokens_per_rank / r.step_s if r.step_s > 0 else 0.0
    mfu = per_device * flops_per_token / dev.peak(dtype) if dev.peak(dtype) else 0.0
    return Prediction(dev.name, topo.describe(), topo.world, dtype, r.step_s, r.parts, per_device, mfu, r.comm_s,
                      _collectives(record, priced, topo, r.exposed_by_kind), assumptions(dev, topo, dtype),
                      _unpriced(record, dev, r.step_s))


def _collectives(record: StepRecord, priced: dict, topo: Network, exposed: dict) -> list[dict]:
    rows: dict = defaultdict(lambda: {"count": 0, "bytes": 0, "intra_bytes": 0.0, "inter_bytes": 0.0,
                                      "seconds": 0.0, "intra_s": 0.0, "inter_s": 0.0, "algorithms": set()})
    for c in record.collectives:
        p, row = priced[c.index], rows[c.kind]
        row["count"] += 1
        row["bytes"] += c.bytes
        row["intra_bytes"] += p.intra_bytes
        row["inter_bytes"] += p.inter_bytes
        row["seconds"] += p.seconds
        if not topo.device.host_sync:
            row["intra_s"] += topo.data_seconds(p.intra_bytes, 0.0)
            row["inter_s"] += topo.data_seconds(0.0, p.inter_bytes)
        row["algorithms"].add(p.algorithm)
    return [{"kind": k, **v, "algorithms": sorted(v["algorithms"]), "exposed_s": exposed.get(k, 0.0)}
            for k, v in rows.items()]


def _unpriced(record: StepRecord, dev: Device, step_s: float) -> list:
    """Ops without a FLOP formula that are not memory-bound by nature: priced by their bytes (named)."""
    time_of: dict = defaultdict(float)
    for e in record.events:
        if isinstance(e, Op) and not e.priced:
            time_of[e.name] += op_seconds(e, dev)
    return [(name, n, time_of[name] / step_s if step_s else 0.0) for name, n in record.unpriced.most_common()]


def assumptions(dev: Device, topo: Network, dtype: str) -> list[str]:
    a = dev.achievable
    kinds = None if dev.host_sync else KERNELS.get(dev.name)
    rates = (f"kernels: {kinds.describe()}; links at x{a:g} of their bandwidth" if kinds else
             f"achievable: x{a:g} of every peak" + (" (a GPU without kernel rates: docs/predict.md)"
                                                     if not dev.host_sync else " (measured figures)"))
    out = [f"device: {dev.label}: {dev.peak(dtype) / 1e12:g} TFLOP/s {dtype} peak, "
           f"{dev.memory_bandwidth / 1e9:g} GB/s memory ({dev.source})",
           rates,
           (f"each op at the rate of this CPU's measured ops of its name nearest in shape ({len(dev.kernel_table)} "
            f"kinds, from reference training steps: zerolab/predict/kernels.py) + "
            f"{dev.host_s_per_kernel * 1e6:.1f} us of host per kernel ({dev.host_s_per_kernel_step * 1e6:.1f} us "
            f"in the optimizer step); any other op: " if dev.kernel_table else
            "each op: ")
           + "max(FLOPs / its kind's FLOP/s, bytes / bandwidth)"
           + (f" + {dev.op_overhead_s * 1e6:.1f} us per kernel" if dev.op_overhead_s else "")
           + (f"; the fused AdamW kernel at {dev.kernel_bandwidth['_fused_adamw_'] / 1e9:.1f} GB/s (measured)"
              if "_fused_adamw_" in dev.kernel_bandwidth else ""),
           f"links: {topo.describe()}" + (f"; each collective + {dev.meeting_s * 1e3:.2f} ms for the ranks to meet "
                                          f"(measured: ranks sharing cores arrive apart)" if dev.meeting_s else "")
           + (f"; + {dev.queued_s * 1e3:.2f} ms where it is issued behind others in flight (measured)"
              if dev.queued_s else ""),
           (("overlap: one timeline on the host; a collective runs on gloo's threads from its issue to its wait, "
             + ("beside the compute at no cost" if dev.overlap_rate >= 1 else
                f"sharing the cores with the compute: both at x{dev.overlap_rate:g} of their speed while both run"))
            if dev.host_sync else "overlap: the strategy's streams (compute; each process group's collectives one "
                                  "after another); a collective is hidden by compute issued after it and before its "
                                  "wait"),
           NOT_MODELLED]
    return out

