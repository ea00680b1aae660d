"""Nodes: which ranks share a machine, and so which collectives cross the network.

Ranks are laid out node-major, as torchrun and Slurm number them: node n holds ranks
[n·per_node, (n+1)·per_node). A collective over a group whose ranks all sit in one node moves its
bytes over the node's own links (NVLink, PCIe, shared memory); one over a group spanning nodes is
bounded by the network, so in the ring model every byte it sends counts as crossing nodes (the
accounting of the ZeRO++ paper, Wang et al. 2023, section 3, whose cross-node volumes zerolab's
counter is checked against). zerolab.dist builds the matching 2-D DeviceMesh (node x local).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable

from zerolab.errors import ConfigError

INSIDE, ACROSS = "inside", "across"  # the two kinds of link a collective's bytes travel on


@dataclass(frozen=True)
class Topology:
    world: int
    per_node: int  # ranks per node; divides world

    def __post_init__(self):
        if self.per_node < 1 or self.world % self.per_node:
            raise ConfigError(f"dist.ranks_per_node={self.per_node} does not divide the world size {self.world}: "
                              f"pick a divisor of {self.world} (e.g. {_divisor_near(self.world, self.per_node)}), or 0 "
                              "to take the launcher's ranks per node")

    @property
    def nodes(self) -> int:
        return self.world // self.per_node

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def local_of(self, rank: int) -> int:
        return rank % self.per_node

    def node_ranks(self, node: int) -> list[int]:
        return list(range(node * self.per_node, (node + 1) * self.per_node))

    def cross_ranks(self, local: int) -> list[int]:
        """The ranks with local index `local` on every node: a group that spans all the nodes."""
        return list(range(local, self.world, self.per_node))

    def link(self, ranks: Iterable[int]) -> str:
        """INSIDE when every rank of the group is on one node, else ACROSS."""
        return INSIDE if len({self.node_of(r) for r in ranks}) <= 1 else ACROSS


def _divisor_near(world: int, want: int) -> int:
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    return min(divisors, key=lambda d: (abs(d - want), d))


def launcher_ranks_per_node(world: int, environ=os.environ) -> int:
    """Ranks per node as the launcher says: torchrun's LOCAL_WORLD_SIZE, Slurm's
    SLURM_NTASKS_PER_NODE (or the first figure of SLURM_TASKS_PER_NODE, e.g. "4(x2)"); else the
    whole world is one node."""
    for var in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        text = environ.get(var, "").split("(")[0].split(",")[0]
        if text.isdigit() and int(text) > 0:
            return int(text)
    return world


def topology_for(configured: int, world: int, environ=os.environ) -> Topology:
    """dist.ranks_per_node when set (> 0), else the launcher's (launcher_ranks_per_node)."""
    return Topology(world, configured if configured > 0 else min(world, launcher_ranks_per_node(world, environ)))
