"""What a collective costs on the links it crosses: the Network of a priced run.

Where the ranks are is zerolab.topology's Topology, the layout the comm counter and the sharders
use (node-major: rank r on node r // ranks per node); a Network adds the links, one inside a node
(NVLink or PCIe, per GPU) and one across nodes (a NIC per GPU), and the device. A collective is
priced on its own group's ranks, so a group inside one node (a node group of hierarchical
sharding) is priced on the intra-node link alone, a group with one rank per node (the cross-node
group) on the network alone, and the world group on both.

Ring (NCCL's default for large messages, and the algorithm the ZeRO paper's volumes assume). A
group of n ranks on k nodes, m per node, puts f x S bytes on its busiest rank's links (S: the full
buffer; f = 2(n-1)/n for all-reduce, (n-1)/n for all-gather and reduce-scatter, 1 for broadcast
and reduce: zerolab.comm.VOLUMES, the table the comm counter reads, whose `busiest` column this is).
NCCL runs m rings (channels), each leaving a node through a different GPU's NIC, so of a rank's
f x S, 1/m crosses nodes on its own NIC (the rings' k inter-node hops among their n) and the rest
goes over its intra-node link. Both links carry their share at once; the slower sets the time,
plus the latency of each ring step (intra or network) and one base latency per collective:
NCCL's own model (tuning.cc: ncclTopoTuneModel) with the topology written out.

Tree (all-reduce only, across nodes): NCCL's double binary tree, 2 x S / bandwidth for the data
(a reduce up and a broadcast down, pipelined) and 2 x (m - 1 intra + log2 k network) steps of
latency: cheaper than the ring's 2(n-1) steps for small buffers on many nodes. The cheaper of the
two is taken, as NCCL's tuner does.

All-to-all: each rank sends (n-1)/n x S, of which (n-m)/n crosses nodes on its own NIC.

On a CPU (gloo) the figures are this machine's, measured per kind and group size
(zerolab.predict.calibrate), and everything stays inside the one host.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from zerolab.comm import VOLUMES
from zerolab.errors import ConfigError
from zerolab.predict.hardware import BASE_LATENCY_S, Device, Link
from zerolab.topology import Topology

# f of the module docstring: the busiest link's bytes per byte of the buffer
FACTOR = {kind: (lambda n, v=v: v.busiest(1, n)) for kind, v in VOLUMES.items()}
STEPS = {"all_reduce": lambda n: 2 * (n - 1), "all_to_all": lambda n: n - 1}  # others: n - 1


@dataclass(frozen=True)
class Priced:
    seconds: float
    algorithm: str
    intra_bytes: float  # sent by each rank, inside its node
    inter_bytes: float  # sent by each rank, across nodes


@dataclass(frozen=True)
class Network:
    world: int
    gpus_per_node: int  # a node's GPUs; a world smaller than a node fills part of one
    intra: Link
    inter: Link
    device: Device
    layout: Topology = field(init=False)  # the ranks in nodes, as the comm counter lays them out

    def __post_init__(self):
        g, w = self.gpus_per_node, self.world
        if g < 1:
            raise ConfigError(f"--gpus-per-node {g} must be at least 1")
        if w > g and w % g:
            raise ConfigError(f"--gpus-per-node {g} does not divide --world {w}: nodes hold the same number of "
                              f"ranks; use a world that is a multiple of {g}, or the GPUs per node of the cluster")
        object.__setattr__(self, "layout", Topology(max(w, 1), max(1, min(w, g))))

    @property
    def nodes(self) -> int:
        return self.layout.nodes

    def placement(self, ranks: tuple) -> tuple[int, int, int]:
        """(n, k nodes spanned, m ranks per node at most) of a group."""
        per_node: dict[int, int] = {}
        for r in ranks:
            node = self.layout.node_of(r)
            per_node[node] = per_node.get(node, 0) + 1
        return len(ranks), len(per_node), max(per_node.values())

    def price(self, kind: str, nbytes: int, ranks: tuple) -> Priced:
        n, k, m = self.placement(ranks)
        if n <= 1 or nbytes <= 0 or kind not in FACTOR:
            return Priced(0.0, "none", 0.0, 0.0)
        if self.device.host_sync:
            return _gloo(self.device, kind, nbytes, n)
        if kind == "all_to_all":
            return self._all_to_all(nbytes, n, k, m)
        f = FACTOR[kind](n) * nbytes
        steps = STEPS.get(kind, lambda n: n - 1)(n)
        inter_steps = 0 if k == 1 else (2 if kind == "all_reduce" else 1) * (k - 1)  # NCCL's nInterSteps
        latency = BASE_LATENCY_S + (steps - inter_steps) * self.intra.latency_s + inter_steps * self.inter.latency_s
        intra, inter = (f, 0.0) if k == 1 else (f * (m - 1) / m, f / m)
        ring = Priced(latency + self.data_seconds(intra, inter), "ring", intra, inter)
        if kind != "all_reduce" or k == 1:
            return ring
        tree_latency = BASE_LATENCY_S + 2 * ((m - 1) * self.intra.latency_s + math.log2(k) * self.inter.latency_s)
        t_intra, t_inter = 2 * nbytes * (m - 1) / m, 2 * nbytes / m
        tree = Priced(tree_latency + self.data_seconds(t_intra, t_inter), "tree", t_intra, t_inter)
        return min(ring, tree, key=lambda p: p.seconds)

    def data_seconds(self, intra: float, inter: float) -> float:
        """The bytes' time: each link carries its share at the same time; the slower one sets it."""
        a = self.device.achievable
        return max(intra / (self.intra.bandwidth * a) if intra else 0.0,
                   inter / (self.inter.bandwidth * a) if inter else 0.0)

    def _all_to_all(self, nbytes: int, n: int, k: int, m: int) -> Priced:
        intra, inter = nbytes * (m - 1) / n, nbytes * (n - m) / n
        lat = BASE_LATENCY_S + (m - 1) * self.intra.latency_s + (n - m) * self.inter.latency_s
        return Priced(lat + self.data_seconds(intra, inter), "pairwise", intra, inter)

    def describe(self) -> str:
        if self.device.host_sync:
            return f"{self.world} rank(s) on one host, collectives on gloo (calibrated here)"
        a = self.device.achievable
        return (f"{self.nodes} node(s) x {min(self.world, self.gpus_per_node)} GPUs; inside a node {self.intra.label}, "
                f"{self.intra.bandwidth / 1e9:g} GB/s per GPU each way (x{a:g} achievable), "
                f"{self.intra.latency_s * 1e6:g} us per ring step; across nodes {self.inter.label}, "
                f"{self.inter.bandwidth / 1e9:g} GB/s per GPU (x{a:g}), {self.inter.latency_s * 1e6:g} us per step; "
                f"{BASE_LATENCY_S * 1e6:g} us per collective; ring, or tree for an all-reduce across nodes "
                f"when cheaper")


def _gloo(dev: Device, kind: str, nbytes: int, n: int) -> Priced:
    """gloo on this host: the calibrated latency + bytes / bandwidth of `kind` at the nearest group
    size measured (every byte stays inside the host)."""
    table = dev.gloo.get(kind) or dev.gloo.get("all_reduce")
    if not table:
        raise ConfigError("the cpu calibration has no gloo figures: rerun python -m zerolab.predict calibrate")
    sizes = sorted(int(s) for s in table)
    fit = table[str(min(sizes, key=lambda s: (abs(s - n), s)))]
    sent = FACTOR[kind](n) * nbytes
    return Priced(fit["latency_s"] + nbytes / fit["bandwidth"], "gloo", sent, 0.0)
