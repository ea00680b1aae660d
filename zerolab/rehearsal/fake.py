"""The fake world a dry run steps in: tensors without data, a process group that moves nothing.

- Tensors are fake (torch._subclasses.FakeTensorMode): shapes, dtypes and storage sizes, no data,
  so a 7B model allocates nothing. Every storage is counted by size (accounting.storage_key).
- The process group is torch's fake one (FakeProcessGroup, registered here): each collective
  returns a correctly shaped output and moves nothing, so the strategies' own communication
  code runs unchanged at any rank of any world size.
- A value read back to the host (`.item()`) has no data behind it, except where it never
  depended on data: the loss scale, its counters and the optimizer's step counters are scalars
  that fake tensors keep as constants (they are made with torch.tensor for this), and read
  exactly. Everything else (a loss, a gradient norm, a trust ratio) is answered in one place
  (RehearsalMode): 1.0 for a float, 1 for an integer, False for a flag (no step skipped, nobody
  asked to stop).
- What ranks exchange as objects (the figures gathered for the record) is this rank's own
  (RehearsalContext).
- transformers asks one question of the data itself: whether a batch packs several sequences
  (then it builds a B x T x T mask). On fake tensors it cannot tell and builds the mask; zerolab's
  batches are whole windows and never pack, which is what a real run finds, so the rehearsal
  answers that (whole_windows).
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from zerolab import dist as zdist
from zerolab.errors import ZerolabError
from zerolab.topology import topology_for


def register_fake_backend() -> None:
    """torch's C++ FakeProcessGroup as the `fake` backend, unless something registered it already
    (importing torch.testing's fake_pg, as FSDP2's tests do, registers the same)."""
    if "FAKE" in dist.Backend._plugins:
        return
    from torch._C._distributed_c10d import FakeProcessGroup

    def create(common, options):
        return FakeProcessGroup._create_internal(common.group_rank, common.group_size, options)

    dist.Backend.register_backend("fake", create, extended_api=True, devices=["cpu", "cuda"])


class RehearsalMode(FakeTensorMode):
    """Fake tensors whose host reads are answered (the module docstring says with what)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            if getattr(t, "constant", None) is not None:  # a value fake tensors still know (a counter)
                return t.constant.item()
            return False if t.dtype == torch.bool else 1.0 if t.dtype.is_floating_point else 1
        return super().__torch_dispatch__(func, types, args, kwargs)


@contextlib.contextmanager
def whole_windows():
    """transformers' packed-sequence check, answered "not packed" (module docstring)."""
    masking = None
    if "transformers" in sys.modules:  # (a model=hf job has imported it by now: its config was read)
        import importlib

        masking = importlib.import_module("transformers.masking_utils")
    if masking is None or not hasattr(masking, "find_packed_sequence_indices"):
        yield
        return
    found = masking.find_packed_sequence_indices
    masking.find_packed_sequence_indices = lambda _position_ids: None
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = found


@dataclass
class RehearsalContext(zdist.DistContext):
    """Rank `rank` of `world_size` on the fake group: object exchanges return this rank's own."""

    rehearsal: bool = True

    def broadcast_object(self, obj, src: int = 0):
        return obj  # (the fake group would hand back whatever bytes its buffer held)

    def gather_objects(self, obj) -> list:
        return [obj] * self.world_size

    def all_reduce_mean(self, value: float) -> float:
        return value

    def barrier(self) -> None:
        pass

    def device_mesh(self):
        # A DeviceMesh computes this rank's coordinates from a real tensor of ranks.
        with unset_fake_temporarily():
            return super().device_mesh()

    def node_mesh(self):
        with unset_fake_temporarily():  # (as device_mesh)
            return super().node_mesh()


def join_fake_world(world: int, rank: int, ranks_per_node: int = 0) -> RehearsalContext:
    """The fake process group; its nodes are dist.ranks_per_node's when set (else one node), so the
    comm counter and the predictor's record see which groups cross nodes."""
    if dist.is_initialized():
        raise ZerolabError("a dry run needs a process without a process group (it makes a fake one)")
    register_fake_backend()
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world)
    host = dist.new_group(backend="fake") if world > 1 else None
    return RehearsalContext(rank=rank, local_rank=0, world_size=world, device=torch.device("cpu"), backend="fake",
                            store=None, host_group=host,
                            topology=topology_for(ranks_per_node, world) if ranks_per_node > 0 else None)
