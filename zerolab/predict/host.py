"""The host's side of a step under offload: what the planner's offload rows hold in a node's CPU
memory, and what their step costs on the host and its links (a prediction, not a measurement).

Offload moves the optimizer's side of ZeRO to the host (ZeRO-Offload, Ren et al., USENIX ATC 2021)
and, under stage 3, the parameter shards too (ZeRO-Infinity, Rajbhandari et al., SC 2021). Its step
is the device's step without the optimizer's kernels, plus what the host and the PCIe link add:

  gradients down   each rank's gradient shard (its reduce dtype) over the rank's PCIe link, issued
                   as each reduce-scatter completes: hidden behind the rest of backward, exposed
                   where it outlasts it (zerolab's zero1/2/3, DeepSpeed's stages, FSDP2's
                   post-reduce copy all issue it so)
  host step        Adam over the shard in host memory: memory-bound, ADAM_BYTES per element (the
                   gradient read, the fp32 master, m and v read and written, the 16-bit weights
                   written), at the node's memory bandwidth x HOST_ACHIEVABLE shared by the node's
                   ranks, or at most CORE_BANDWIDTH per core of the rank's share of the cores;
                   after backward and the gradient norm, so never hidden
  weights up       the updated 16-bit shard back over PCIe, after the host step (exposed)
  parameters up    parameter offload: each all-gather of a unit first copies the rank's shard to
                   the device, once for the forward and once for the backward's re-gather, per
                   micro-batch; prefetched, so hidden behind the forward's and backward's compute
                   where the compute is longer

A copy's rate is the rank's PCIe link (the device's achievable factor applies, as on every link)
or its share of the host's memory bandwidth, the lower. The host figures are the DGX systems'
data sheets; a memory bandwidth is its CPUs' channels x transfer rate x 8 bytes.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from zerolab.memory import NotPredicted, predict
from zerolab.predict.hardware import LINKS, Device
from zerolab.predict.model import op_seconds
from zerolab.predict.record import Op, StepRecord


@dataclass(frozen=True)
class Host:
    name: str
    label: str
    cores: int  # the node's CPU cores, all sockets
    memory_bandwidth: float  # bytes/s, all sockets: channels x MT/s x 8 bytes
    memory: int  # bytes of host memory in the node
    pcie: str  # the link from each GPU to the host (hardware.LINKS)
    source: str


HOSTS = {h.name: h for h in (
    Host("dgx-a100", "NVIDIA DGX A100 640GB: 2 x AMD EPYC 7742", 128, 2 * 8 * 3200e6 * 8, 2 * 10**12, "pcie4",
         "NVIDIA DGX A100 data sheet (2020): dual AMD Rome 7742, 128 cores in all, 2.25 GHz base, 2 TB of system "
         "memory in the 640GB system, PCIe Gen4; AMD EPYC 7742: 8 channels of DDR4-3200 per socket (204.8 GB/s)"),
    Host("dgx-h100", "NVIDIA DGX H100: 2 x Intel Xeon Platinum 8480C", 112, 2 * 8 * 4800e6 * 8, 2 * 10**12, "pcie5",
         "NVIDIA DGX H100 data sheet (2023): dual Intel Xeon Platinum 8480C, 112 cores in all, 2.0 GHz base, 2 TB of "
         "system memory, PCIe Gen5; Xeon Platinum 8480+: 8 channels of DDR5-4800 per socket (307.2 GB/s)"),
)}
# the DGX each GPU kind comes in (a DGX H200 has the DGX H100's CPUs and memory: its data sheet)
HOST_OF = {"a100": "dgx-a100", "h100": "dgx-h100", "h200": "dgx-h100"}
# Assumptions, said with every figure: the share of the DRAM peak a vectorized Adam streams at (it
# reads four arrays and writes four across both sockets), and what one core can stream at most
HOST_ACHIEVABLE = 0.5
CORE_BANDWIDTH = 10e9

# offload rows: the label's suffix -> the strategy settings it sets
OFFLOAD_ROWS = {"+offload": {"offload_optimizer": True},
                "+offload+p": {"offload_optimizer": True, "offload_params": True}}


def host_of(dev: Device) -> Host | None:
    """The host a GPU kind is sold in (None for a kind without one here, and for this CPU)."""
    return HOSTS.get(HOST_OF.get(dev.name, ""))


def offload_suffixes(label: str, optim: str) -> list[str]:
    """The offload rows a plan row (a memory identity: zero2, deepspeed-3, fsdp) has, as the
    strategies accept them: optimizer offload for every ZeRO stage, parameter offload with it under
    stage 3 only; FSDP2's CPUOffloadPolicy moves both together; DeepSpeed steps an offloaded
    optimizer with its own CPU Adam only (adam, adamw)."""
    name, _, stage = label.partition("-")
    if name == "deepspeed" and optim not in ("adam", "adamw"):
        return []
    if name in ("zero1", "zero2") or (name == "deepspeed" and stage in ("1", "2")):
        return ["+offload"]
    if name == "zero3" or label == "deepspeed-3":
        return ["+offload", "+offload+p"]
    return ["+offload+p"] if name == "fsdp" else []


def with_offload_rows(states: dict, shape, world: int, precision: str, optim: str, bucket_mb: float) -> dict:
    """The planner's rows (label -> zerolab.memory Prediction), each followed by its offload rows."""
    out = {}
    for label, pred in states.items():
        out[label] = pred
        name, _, stage = label.partition("-")
        for suffix in offload_suffixes(label, optim):
            try:
                out[label + suffix] = predict(shape, name, world, precision, optim, stage=int(stage or 0),
                                              bucket_mb=bucket_mb, settings=OFFLOAD_ROWS[suffix])
            except (NotPredicted, ValueError):  # a combination the ledger has no model of
                continue
    return out


def split_label(label: str) -> tuple[str, dict]:
    """'zero3+offload+p' -> ('zero3', its offload settings); a plain label -> (label, {})."""
    for suffix in sorted(OFFLOAD_ROWS, key=len, reverse=True):
        if label.endswith(suffix):
            return label[:-len(suffix)], dict(OFFLOAD_ROWS[suffix])
    return label, {}


def host_bytes(pred) -> int:
    """One rank's host peak (zerolab.memory's Prediction): its states there and its host staging
    at the larger of its two moments (backward's chunks in flight, or the step's copies)."""
    staged = [t for t in pred.terms if t.category == "transient" and t.place == "host"]
    return pred.bytes("host")["total"] + max(sum(t.bytes for t in staged if t.when == w) for w in ("backward", "step"))


# ---- time --------------------------------------------------------------------------------------
ADAM_BYTES = 24  # fp32 master, m and v, each read and written; + the gradient read and the 16-bit weights written


@dataclass
class HostTime:
    step_s: float
    parts: dict  # device, grads_down_exposed, host_step, weights_up, params_up_exposed -> seconds
    assumptions: list


@dataclass(frozen=True)
class Shard:
    """What one rank moves and updates: `elements` of the shard, `grad_bytes` per gradient element as
    reduced, `weight_bytes` per 16-bit weight, `micro_batches` per step, `params`: parameter offload."""
    elements: int
    grad_bytes: int
    weight_bytes: int
    micro_batches: int = 1
    params: bool = False


def phase_seconds(record: StepRecord, dev: Device) -> dict:
    """Each phase's op time on the device, one after another (the compute the copies hide behind)."""
    out: dict = defaultdict(float)
    for e in record.events:
        if isinstance(e, Op):
            out[e.phase] += op_seconds(e, dev)
    return out


def rates(h: Host, dev: Device, ranks_on_node: int) -> tuple[float, float]:
    """(bytes/s of one rank's copies, bytes/s of one rank's host Adam) with `ranks_on_node` ranks sharing h."""
    share = h.memory_bandwidth * HOST_ACHIEVABLE / ranks_on_node
    copy = min(LINKS[h.pcie].bandwidth * dev.achievable, share)
    step = min(share, h.cores / ranks_on_node * CORE_BANDWIDTH)
    return copy, step


def price_offload(record: StepRecord, step_s: float, dev: Device, h: Host, shard: Shard,
                  ranks_on_node: int) -> HostTime:
    """The offloaded step from the priced step of the same job without offload (`step_s` on `dev`,
    its record `record`): the optimizer's device kernels taken out, the host's side put in."""
    phases = phase_seconds(record, dev)
    copy, step = rates(h, dev, ranks_on_node)
    device = max(0.0, step_s - phases["optimizer"])
    down = shard.elements * shard.grad_bytes / copy
    parts = {"device": device, "grads_down_exposed": max(0.0, down - phases["backward"]),
             "host_step": shard.elements * (ADAM_BYTES + shard.grad_bytes + shard.weight_bytes) / step,
             "weights_up": shard.elements * shard.weight_bytes / copy, "params_up_exposed": 0.0}
    if shard.params:
        up = 2 * shard.micro_batches * shard.elements * shard.weight_bytes / copy
        parts["params_up_exposed"] = max(0.0, up - phases["forward"] - phases["backward"])
    return HostTime(sum(parts.values()), parts, host_assumptions(h, dev, ranks_on_node, copy, step))


def host_assumptions(h: Host, dev: Device, ranks_on_node: int, copy: float, step: float) -> list[str]:
    link = LINKS[h.pcie]
    return [f"host: {h.label}: {h.cores} cores, {h.memory_bandwidth / 1e9:g} GB/s memory, "
            f"{h.memory / 1e12:g} TB ({h.source})",
            f"host shared by {ranks_on_node} rank(s) of the node: each copies at {copy / 1e9:.1f} GB/s (the lower of "
            f"{link.label} {link.bandwidth / 1e9:g} GB/s x{dev.achievable:g} and its share of x{HOST_ACHIEVABLE:g} "
            f"of the memory bandwidth) and steps Adam at {step / 1e9:.1f} GB/s ({ADAM_BYTES} bytes + the gradient "
            f"and the 16-bit weight per element; at most {CORE_BANDWIDTH / 1e9:g} GB/s per core)",
            "offload overlap: gradients go down behind backward as each reduce-scatter completes; the host step "
            "and the weights' way up are exposed; parameter shards go up behind the forward's and backward's "
            "compute (prefetched); the delayed parameter update (ZeRO-Offload §4.4) is not modelled"]


def offloaded(record: StepRecord, step_s: float, topo, settings: dict, *, n_params: int, weight_bytes: int,
              grad_bytes: int) -> HostTime | None:
    """The offloaded step of a priced job without offload on `topo` (a zerolab.predict.topology
    Network): one rank's shard is n_params / world; None where the device has no host here."""
    h = host_of(topo.device)
    if h is None:
        return None
    shard = Shard(-(-n_params // topo.world), grad_bytes, weight_bytes, params=bool(settings.get("offload_params")))
    return price_offload(record, step_s, topo.device, h, shard, min(topo.world, topo.gpus_per_node))
