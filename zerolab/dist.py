"""Process-group setup from the launcher's environment.

Supported launchers: torchrun (RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT), srun
starting one task per rank without torchrun (SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS), and a
plain `python train.py` (world size 1). The context is passed around explicitly; zerolab keeps
no module-global process group of its own.
"""
from __future__ import annotations

import datetime
import gc
import os
import subprocess
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from zerolab.schema import DistConfig
from zerolab.errors import ConfigError, ZerolabError
from zerolab.topology import Topology, topology_for


@dataclass
class DistContext:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str
    store: Optional[dist.Store] = None  # the job's key-value store (this restart round's namespace)
    # A gloo group over the same ranks, for per-step control messages on CPU tensors (the stop
    # agreement): on NCCL a device tensor read back on the host would wait for the whole step.
    # Created for every multi-rank run, so the CPU tests run the code CUDA runs.
    host_group: Optional[Any] = None
    # A dry run (zerolab.rehearsal): the group is torch's fake one, whose collectives move nothing,
    # and tensors are fake. The few places that read data across ranks ask this.
    rehearsal: bool = False
    # Which ranks share a node (zerolab.topology): dist.ranks_per_node, else the launcher's.
    topology: Optional[Topology] = None
    # The device type whose kernels run the step (what they save for backward differs between CPU
    # and CUDA kernels: zerolab.activations): this rank's device's, or a dry run's target.
    kernels: str = ""
    _mesh: Optional[Any] = None
    _node_mesh: Optional[Any] = None

    def __post_init__(self):
        if self.topology is None:
            self.topology = Topology(self.world_size, self.world_size)
        self.kernels = self.kernels or self.device.type

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device_mesh(self):
        """The 1-D DeviceMesh over every rank (FSDP2's), built once."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(self.device.type, (self.world_size,))
        return self._mesh

    def node_mesh(self):
        """The 2-D DeviceMesh (node x local) of the topology, built once, every subgroup made in
        the same order on every rank: `mesh.get_group("local")` is this rank's node, `"node"` the
        ranks with its local index on every node (FSDP2's HSDP takes the mesh as it is)."""
        if self._node_mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            t = self.topology
            self._node_mesh = init_device_mesh(self.device.type, (t.nodes, t.per_node),
                                               mesh_dim_names=("node", "local"))
        return self._node_mesh

    def barrier(self) -> None:
        dist.barrier()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def gather_objects(self, obj: Any) -> list:
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def all_reduce_mean(self, value: float) -> float:
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.item() / self.world_size

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _first_slurm_host() -> str:
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST", "")
    if not nodelist:
        return "127.0.0.1"
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
        return out.stdout.split()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return nodelist.split(",")[0]


def env_ranks() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's or Slurm's variables; (0, 0, 1) otherwise."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ["WORLD_SIZE"])
    if "SLURM_PROCID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        # srun started every rank itself (no torchrun): translate for init_process_group's env://.
        rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
        os.environ.setdefault("MASTER_ADDR", _first_slurm_host())
        os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000))
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
        os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
        return rank, int(os.environ["LOCAL_RANK"]), world
    return 0, 0, 1


def init(cfg: DistConfig) -> DistContext:
    rank, local_rank, world = env_ranks()
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise RuntimeError("dist.device=cuda but no CUDA device is visible; use dist.device=cpu or auto")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if use_cuda else "gloo")
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    if "MASTER_ADDR" in os.environ:
        store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world, timeout=timeout))
        # torchrun can keep one store across restart rounds; keys of a dead round (its gloo
        # addresses) must not be read by the next one, so every round gets its own namespace.
        store = dist.PrefixStore(f"zerolab/round{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)
    else:
        # Single process without a launcher: an in-memory store keeps every code path identical.
        store = dist.HashStore()
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout,
                            device_id=device if backend == "nccl" else None)
    # The same timeout as the default group (new_group's own default is 30 minutes): a dead or
    # frozen rank must fail the stop agreement as soon as it fails any other collective.
    host_group = dist.new_group(backend="gloo", timeout=timeout) if world > 1 else None
    return DistContext(rank=rank, local_rank=local_rank, world_size=world, device=device, backend=backend,
                       store=store, host_group=host_group, topology=topology_for(cfg.ranks_per_node, world))


def shutdown(ctx: Optional[DistContext]) -> None:
    """Tear down in a fixed order. The store and any strategy still referencing the group go
    before the group itself: if they were left for interpreter shutdown to destroy, the store
    client's destructor could run after the runtime it needs and abort the process (seen as
    'terminate called without an active exception' once the job had already finished)."""
    if ctx is not None:
        ctx.store = None
    gc.collect()  # strategies live in reference cycles (hooks on the model point back at them)
    if dist.is_initialized():
        dist.destroy_process_group()


def agree(ctx: DistContext, check) -> None:
    """Run `check` on every rank; if it raised on any, every rank raises the same error (a
    ConfigError as such, anything else as a ZerolabError naming it), so no rank goes on to wait
    in a collective for one that left; rank 0 alone says it (same_on_every_rank)."""
    mine, cause = None, None
    try:
        check()
    except ConfigError as err:
        mine, cause = ("config", str(err)), err
    except Exception as err:  # e.g. the embedded corpus could not be written: keep the ranks together
        mine, cause = ("error", f"{type(err).__name__}: {err}"), err
    found = [(r, m) for r, m in enumerate(ctx.gather_objects(mine)) if m]
    if found:
        rank, (kind, msg) = found[0]
        msg = msg if len(found) == ctx.world_size else f"on rank {rank}: {msg}"
        err = ConfigError(msg) if kind == "config" else ZerolabError(msg)
        err.same_on_every_rank = True
        raise err from cause
