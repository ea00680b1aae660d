"""Communication accounting: bytes each rank sends per collective, per optimizer step, by link;
the one table of what each collective sends (VOLUMES), which the time model prices too
(zerolab/predict/topology.py); and the asynchronous collectives still running (InFlight).

Counts use the bandwidth-optimal (ring) cost of each collective, the model the ZeRO paper's
volume argument rests on (Rajbhandari et al. 2019, §7): for a buffer of S bytes over a group of
n ranks, all-reduce sends 2·S·(n−1)/n per rank, reduce-scatter and all-gather S·(n−1)/n each. So
DDP, a correct ZeRO-1 and a correct ZeRO-2 all send 2Ψ(N−1)/N elements per rank per step.

Every collective's bytes are also counted by the link it travels on (zerolab.topology): inside a
node when its group's ranks share one, across nodes otherwise.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from zerolab.topology import ACROSS, INSIDE, Topology


@dataclass(frozen=True)
class Volume:
    """Bytes per rank of one collective of an S-byte buffer (the whole buffer: a reduce-scatter's
    input, an all-gather's output) over n ranks, in the ring algorithms NCCL runs for large
    messages and the ZeRO paper's volumes assume; two figures:
      sent     what a rank sends, averaged over the group's ranks: the traffic on the wire over n.
               The counter records it, so a step's figures add up to the step's traffic.
      busiest  what the busiest rank's link carries: the bytes that set the collective's time,
               which the time model prices; NCCL's bus-bandwidth factor (nccl-tests'
               PERFORMANCE.md: busBw = algBw x busiest / S).
    They differ for the rooted collectives only. A ring broadcast is a pipelined chain from the
    root: every rank but the last forwards the whole buffer, so n - 1 links carry S each (NCCL:
    busBw = algBw), while the n ranks send (n - 1)·S in all, S·(n - 1)/n each on average (which is
    why broadcasts from every rank in turn, as torch's ZeroRedundancyOptimizer issues them, send
    an all-gather's volume). A ring reduce is the same chain towards the root."""
    passes: float  # times S·(n - 1)/n a rank sends: 2 for all-reduce (reduce-scatter, then all-gather), else 1
    rooted: bool = False  # a chain from or to one root: its busiest link carries all of S

    def sent(self, nbytes: float, n: int) -> float:
        return self.passes * nbytes * (n - 1) / n if n > 1 else 0.0

    def busiest(self, nbytes: float, n: int) -> float:
        return float(nbytes) if self.rooted and n > 1 else self.sent(nbytes, n)


VOLUMES = {"all_reduce": Volume(2.0), "reduce_scatter": Volume(1.0), "all_gather": Volume(1.0),
           "all_to_all": Volume(1.0),  # pairwise: S/n to each other rank
           "broadcast": Volume(1.0, rooted=True), "reduce": Volume(1.0, rooted=True)}


class CommCounter:
    def __init__(self, topology: Topology):
        self.topology = topology
        self.step_bytes: dict[str, float] = defaultdict(float)
        self.link_bytes: dict[str, float] = defaultdict(float)

    def record(self, op: str, full: torch.Tensor | int, element_size: int | None = None, group: Optional[object] = None,
               ranks: Optional[list[int]] = None) -> None:
        """Record a collective over a buffer of `full` (tensor, or element count) — the whole
        buffer, not the shard: for reduce-scatter the input, for all-gather the output — issued on
        `group` (None: every rank) or over the explicit `ranks`."""
        if isinstance(full, torch.Tensor):
            nbytes = full.numel() * full.element_size()
        else:
            nbytes = full * (element_size or 4)
        if ranks is None:
            ranks = dist.get_process_group_ranks(group) if group is not None else range(self.topology.world)
        ranks = list(ranks)
        n = len(ranks)
        sent = VOLUMES[op].sent(nbytes, n)
        self.step_bytes[op] += sent
        self.link_bytes[self.topology.link(ranks)] += sent

    def pop_step(self) -> dict[str, float]:
        """Bytes sent since the last call, by collective, plus 'total'; and, when the job spans
        nodes, by link ('link/inside', 'link/across', which add up to 'total')."""
        out = dict(self.step_bytes)
        out["total"] = sum(self.step_bytes.values())
        if self.topology.nodes > 1:
            out.update({f"link/{link}": self.link_bytes.get(link, 0.0) for link in (INSIDE, ACROSS)})
        self.step_bytes.clear()
        self.link_bytes.clear()
        return out


def theory_bytes_per_step(n_params: int, element_size: int, world_size: int) -> float:
    """2Ψ(N−1)/N elements per rank per step, in bytes: DDP's all-reduce and ZeRO-1/2's RS+AG."""
    return VOLUMES["all_reduce"].sent(n_params * element_size, world_size)


class InFlight:
    """Asynchronous collectives still running, by key (zerolab's ZeRO: a bucket's all-gather): each
    one's work, the tensors it reads or writes in the background (kept alive until it completes),
    the transient bytes it holds until then, and what finishes it after the wait (None, or a
    function: qwZ dequantizes what arrived)."""

    def __init__(self):
        self.running: dict = {}

    def add(self, key, work, keep, nbytes: int = 0, finish=None) -> None:
        self.running[key] = (work, keep, nbytes, finish)

    def wait(self, keys=None) -> int:
        """Wait for the collectives of `keys` (every one by default, in the order they started),
        finish each, and return the transient bytes they held."""
        freed = 0
        for key in (list(self.running) if keys is None else keys):
            entry = self.running.pop(key, None)
            if entry is not None:
                work, _, nbytes, finish = entry
                work.wait()
                if finish is not None:
                    finish()
                freed += nbytes
        return freed
