"""The step's record: what a rehearsed step does, in the order it does it, as the time model needs it.

`Recorder(strategy, model)` is installed around a dry run's steps (zerolab.rehearsal). While it is,
every op dispatched under the rehearsal's fake tensors becomes an `Op` (FLOPs and bytes,
zerolab.predict.ops), every collective a ProcessGroup starts becomes a `Collective` (its kind, the
bytes of its full buffer, the global ranks of its group), every wait for one a `Wait`, and every
stream operation a `Sync`. Nothing about the strategy is assumed: whoever calls the process group
(zerolab's sharders, DDP's comm hook, FSDP2, torch's ZeroRedundancyOptimizer) is seen the same way,
as torch's fake process group sees it.

Where it hooks, and why there:
- ops: a TorchDispatchMode entered inside the rehearsal's FakeTensorMode, so it sees each op as the
  program issues it (after autograd, before the fake kernels), once. An op on DTensors (FSDP2's
  parameters and gradients, and so its optimizer step) is handed to DTensor first: what it runs is
  recorded, the local ops on each rank's shard and the collectives its redistributions issue (a
  gradient norm's all-reduce of a Partial sum), which a real step waits for at once;
- collectives: the methods of torch's ProcessGroup (zerolab.profile.commwatch's list), so each
  carries its group; functional collectives (DTensor's) at the dispatch level, by group name;
- waits: FakeWork.wait / Work.wait, and `_c10d_functional.wait_tensor`. A Work whose future is
  handed to another consumer (DDP's reducer waits for its buckets in C++) is waited for at the end
  of the strategy's backward, where that consumer waits. The fake group's works never report
  completion, so a strategy that polls (`is_completed`) before it waits records its blocking wait,
  the latest point at which the step needs the result;
- streams: torch.cpu's Stream and Event (what a device-agnostic strategy such as FSDP2 calls on a
  CPU, where they do nothing): which stream each op, collective and wait is issued on, and the
  events and stream waits between them, so a GPU's streams can be replayed (zerolab.predict.timeline);
- phases: a forward pre-hook on the model and wrappers on the strategy's backward and step (as
  zerolab.profile's Phases): forward, backward, optimizer, and other (the rest of train_step);
- the strategy's own Python: its hooks, step and backward, and the trainer's between the phases,
  timed as host sections (zerolab.predict.sections), each an op without kernels.

Collectives still in flight at the end of a step (zero1/2's all-gathers, waited for in the next
forward) are waited for in the next step's record as `Wait(carried=True)`, by their index among
the previous step's collectives; the time model replays the step periodically, so a step's
carried waits meet the previous repetition's collectives.
"""
from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from zerolab.models import find_blocks
from zerolab.predict.ops import cost, gemm_dims, memory_bound, tensor_bytes
from zerolab.predict.sections import HostSections
from zerolab.predict.streams import patch_streams
from zerolab.profile.commwatch import COLLECTIVES

PHASES = ("forward", "backward", "optimizer", "other")
HOST = "host:"  # the name of a host section's op (zerolab.predict.sections)
# ProcessGroup method -> the collective's kind (the names the time model prices)
KINDS = {"allreduce": "all_reduce", "allreduce_coalesced": "all_reduce", "allgather": "all_gather",
         "allgather_coalesced": "all_gather", "allgather_into_tensor_coalesced": "all_gather",
         "_allgather_base": "all_gather", "all_gather_single": "all_gather",
         "all_gather_single_coalesced": "all_gather",
         "reduce_scatter": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
         "reduce_scatter_single_coalesced": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
         "_reduce_scatter_base": "reduce_scatter", "broadcast": "broadcast", "reduce": "reduce",
         "alltoall": "all_to_all", "alltoall_base": "all_to_all", "all_to_all_single": "all_to_all",
         "barrier": "barrier", "gather": "gather", "scatter": "scatter", "send": "send", "recv": "recv"}
FUNCTIONAL = {"all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_gather_into_tensor": "all_gather",
              "reduce_scatter_tensor": "reduce_scatter", "all_to_all_single": "all_to_all", "broadcast": "broadcast",
              "broadcast_": "broadcast"}
_SKIP_NAMESPACES = ("prim", "profiler", "c10d")  # metadata; collectives are recorded at the process group


@dataclass(slots=True)
class Op:
    name: str
    phase: str
    stream: int
    flops: float
    bytes: int
    kernels: int  # a foreach op over n tensors: n
    priced: bool  # has a FLOP formula, or is memory-bound by nature (zerolab.predict.ops)
    dtype: str  # the compute dtype of an op with FLOPs ("" for the rest)
    block: int  # the repeated block (zerolab.models.find_blocks) whose module issued it, -1 outside one
    dims: tuple = ()  # a matmul's (batch, m, n, k) (ops.gemm_dims): a GPU's rate depends on its shape
    host_s: float = 0.0  # a host section (name HOST + what): the Python it ran, timed in the dry run (no kernel)


@dataclass(slots=True)
class Collective:
    index: int  # among this step's collectives
    kind: str
    bytes: int  # the full buffer: all-reduce's tensor, all-gather's output, reduce-scatter's input
    ranks: tuple  # global ranks of the group, in group order
    phase: str
    stream: int


@dataclass(slots=True)
class Wait:
    index: int  # the collective's index in this step, or in the previous one when carried
    carried: bool
    phase: str
    stream: int


@dataclass(slots=True)
class Sync:
    what: str  # "record" (an event on `stream`), "wait_event", "wait_stream"
    stream: int
    target: int  # the event's number in its step, or the stream waited for
    carried: bool = False  # wait_event: the event was recorded in the previous step


@dataclass
class StepRecord:
    events: list = field(default_factory=list)  # Op | Collective | Wait | Sync, in issue order
    collectives: list = field(default_factory=list)
    unpriced: Counter = field(default_factory=Counter)  # op name -> count: no formula, not memory-bound
    streams: int = 1
    events_recorded: int = 0  # stream events recorded in this step (Sync.target numbers them)

    def ops(self):
        return [e for e in self.events if isinstance(e, Op)]


class _OpMode(TorchDispatchMode):
    def __init__(self, recorder: "Recorder"):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        rec = self.recorder
        rec.dispatches += 1
        t0 = rec.enter()
        try:
            kwargs = kwargs or {}
            if any(issubclass(t, DTensor) for t in types):  # (types: the tensor subclasses among the arguments)
                # DTensor's own dispatch goes first: its local ops and the collectives it issues to
                # redistribute (a Partial sum's all-reduce) come back here, each recorded as it runs.
                return NotImplemented
            out = func(*args, **kwargs)
            if rec.step is not None:
                ns = func.namespace
                if ns == "_c10d_functional":
                    rec.functional(func, args, out)
                elif ns not in _SKIP_NAMESPACES:
                    rec.op(func, args, kwargs, out)
            return out
        finally:
            rec.leave(t0)


class Recorder:
    """Records the steps run inside `with recorder.step_record() as record:` (module docstring)."""

    def __init__(self, strategy, model):
        self.strategy, self.model = strategy, model
        self.step: StepRecord | None = None
        self.previous: StepRecord | None = None  # the last step recorded, and the one before it
        self.before: StepRecord | None = None
        self.phase, self.in_backward = "other", False
        self.blocks: list[int] = []  # the blocks whose modules are running (innermost last)
        self.live: dict[int, tuple] = {}  # id(work) -> (work, record, index)
        self.handed: list[tuple] = []  # (work, record, index) whose future went to another consumer
        self.tensors: dict[int, tuple] = {}  # functional collectives: id(output) -> (output, record, index)
        self.stream_ids: dict[int, int] = {}
        self.event_ids: dict[int, tuple] = {}  # id(event) -> (event, the step record, its number there)
        self.saved: list = []
        self.seconds = 0.0  # time spent recording (what it adds to the dry run)
        # host sections (HostSections): time inside the dispatcher's handler and the process group's
        # wrappers, and how many dispatches, so a section's own Python is its wall time less them
        self.inside_s, self.dispatches, self.depth = 0.0, 0, 0
        self.host = HostSections(self)

    # ---- installing ----------------------------------------------------------------------------
    def __enter__(self):
        from torch._C._distributed_c10d import FakeWork, ProcessGroup, Work

        for name in COLLECTIVES:
            if name in vars(ProcessGroup) and name in KINDS:
                self._patch(ProcessGroup, name, self._launcher(name))
        for cls in (Work, FakeWork):
            if "wait" in vars(cls):
                self._patch(cls, "wait", self._waiter)
        self._patch(Work, "get_future", self._future)
        patch_streams(self)
        self.host.wrap_hooks(self.model)  # before the recorder's own hooks below: those are not the program's
        self.hooks = [self.model.register_forward_pre_hook(self._forward, prepend=True), *self._block_hooks()]
        self._wrap_strategy()
        self._patch(torch.autograd, "backward", self.host.engine)
        self.mode = _OpMode(self)
        self.mode.__enter__()
        self.host.measure_dispatch()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        self.host.unwrap_hooks()
        for h in self.hooks:
            h.remove()
        for cls, name, raw in reversed(self.saved):
            if raw is None:
                delattr(cls, name)
            else:
                setattr(cls, name, raw)
        self.saved.clear()

    def _patch(self, cls, name: str, make) -> None:
        raw = vars(cls).get(name)
        self.saved.append((cls, name, raw))
        setattr(cls, name, make(getattr(cls, name)))

    def _wrap_strategy(self) -> None:
        s, rec = self.strategy, self
        backward, step = s.backward, s.step

        def recorded_backward(loss, *args, **kwargs):
            rec.phase, rec.in_backward = "backward", True
            try:
                with rec.host.section("strategy.backward"):  # less the autograd engine's run (HostSections.engine)
                    return backward(loss, *args, **kwargs)
            finally:
                rec._consumer_waits()
                rec.phase, rec.in_backward = "other", False
                rec.host.open_other()

        def recorded_step(*args, **kwargs):
            rec.host.close_other()
            rec.phase = "optimizer"
            try:
                with rec.host.section("strategy.step"):
                    return step(*args, **kwargs)
            finally:
                rec.phase = "other"
                rec.host.open_other()

        self.saved.append((s, "backward", vars(s).get("backward")))
        self.saved.append((s, "step", vars(s).get("step")))
        s.backward, s.step = recorded_backward, recorded_step

    def _block_hooks(self) -> list:
        """Every module inside a repeated block marks the ops it issues with the block's index. On
        every module, not the block alone: a checkpointed block's recomputation calls its forward
        without its hooks, but its submodules' hooks still run (so a recomputed block's matmuls are
        marked, in backward)."""
        found = find_blocks(getattr(self.model, "module", self.model))
        hooks = []

        def leave(_module, _args, _out) -> None:
            self.blocks.pop()

        for i, block in enumerate(found.modules if found is not None else ()):
            for m in block.modules():
                hooks.append(m.register_forward_pre_hook(lambda _mod, _args, i=i: self.blocks.append(i)))
                hooks.append(m.register_forward_hook(leave, always_call=True))
        return hooks

    def _forward(self, module, args) -> None:
        if not self.in_backward:  # (a checkpointed block's recomputation runs inside backward)
            self.host.close_other()
            self.phase = "forward"

    def host_op(self, what: str, phase: str, seconds: float) -> None:
        """A host section's time as an op without kernels (zerolab.predict.sections)."""
        if self.step is not None:
            self.step.events.append(Op(f"{HOST}{what}", phase, 0, 0.0, 0, 0, True, "", -1, (), seconds))

    def enter(self) -> float:
        """The dispatcher's handler or a process group's wrapper starts: time not the program's own."""
        self.depth += 1
        return time.perf_counter()

    def leave(self, t0: float) -> None:
        self.depth -= 1
        if self.depth == 0:  # (a collective may dispatch ops inside its wrapper: counted once)
            self.inside_s += time.perf_counter() - t0

    # ---- one step ------------------------------------------------------------------------------
    @contextmanager
    def step_record(self):
        self.step = StepRecord()
        t0 = time.perf_counter()
        self.host.open_other()
        try:
            yield self.step
        finally:
            self.host.close_other()
            rec, self.step = self.step, None
            rec.streams = max(len(self.stream_ids) + 1, 1)
            self.before, self.previous = self.previous, rec
            self.seconds += time.perf_counter() - t0

    def _stream(self) -> int:
        s = torch.cpu.current_stream()
        if s is torch.cpu._default_cpu_stream:
            return 0
        return self.stream_ids.setdefault(id(s), len(self.stream_ids) + 1)

    def op(self, func, args, kwargs, out) -> None:
        flops, moved, kernels, formula, dtype = cost(func, args, kwargs, out)
        if kernels:
            name = str(func._overloadpacket.__name__)
            priced = formula or memory_bound(func)
            if not priced:
                self.step.unpriced[name] += 1
            self.step.events.append(Op(name, self.phase, self._stream(), flops, moved, kernels, priced, dtype,
                                        self.blocks[-1] if self.blocks else -1, gemm_dims(func, args)))

    def collective(self, kind: str, nbytes: int, ranks: tuple) -> int:
        rec = self.step
        c = Collective(len(rec.collectives), kind, nbytes, tuple(ranks), self.phase, self._stream())
        rec.collectives.append(c)
        rec.events.append(c)
        return c.index

    def waited(self, entry) -> None:
        _, rec, index = entry
        if self.step is None:
            return
        carried = rec is not self.step
        if carried and rec is not self.previous:
            return  # issued before the step before this one: not part of the periodic step
        self.step.events.append(Wait(index, carried, self.phase, self._stream()))

    def _consumer_waits(self) -> None:
        """The end of backward: a consumer holding a collective's future (DDP's reducer) waits here."""
        for work, rec, index in self.handed:
            if self.live.pop(id(work), None) is not None:
                self.waited((work, rec, index))
        self.handed.clear()

    def functional(self, func, args, out) -> None:
        name = func._overloadpacket.__name__.split(".")[-1]
        if name == "wait_tensor":
            entry = self.tensors.pop(id(args[0]), None)
            if entry is not None:
                self.waited(entry)
            return
        kind = FUNCTIONAL.get(name)
        if kind is None:
            return
        from torch.distributed.distributed_c10d import _resolve_process_group

        group = _resolve_process_group(args[-1])
        nbytes = max(tensor_bytes(args[0]), tensor_bytes(out))
        index = self.collective(kind, nbytes, dist.get_process_group_ranks(group))
        self.tensors[id(out)] = (out, self.step, index)

    # ---- the process group's methods -----------------------------------------------------------
    def _launcher(self, method: str):
        rec, kind = self, KINDS[method]

        def make(original):
            def collective(pg, *args, **kwargs):
                t0 = rec.enter()
                try:
                    return launch(original, pg, *args, **kwargs)
                finally:
                    rec.leave(t0)

            def launch(original, pg, *args, **kwargs):
                work = original(pg, *args, **kwargs)
                if rec.step is not None and kind != "barrier":
                    nbytes = max(_bytes_of(args[0]) if args else 0, _bytes_of(args[1]) if len(args) > 1 else 0)
                    index = rec.collective(kind, nbytes, dist.get_process_group_ranks(pg))
                    if work is not None:
                        rec.live[id(work)] = (work, rec.step, index)
                    else:
                        rec.waited((None, rec.step, index))
                return work
            return collective
        return make

    def _waiter(self, original):
        rec = self

        def wait(work, *args, **kwargs):
            t0 = rec.enter()
            try:
                entry = rec.live.pop(id(work), None)
                if entry is not None:
                    rec.waited(entry)
                return original(work, *args, **kwargs)
            finally:
                rec.leave(t0)
        return wait

    def _future(self, original):
        rec = self

        def get_future(work):
            entry = rec.live.get(id(work))
            if entry is not None and rec.step is not None:
                rec.handed.append(entry)
            return original(work)
        return get_future

    # ---- streams (torch.cpu's stand-ins for a device's: zerolab.predict.streams) -------------------
    def sync(self, what: str, stream: int, target: int, carried: bool = False) -> None:
        if self.step is not None:
            self.step.events.append(Sync(what, stream, target, carried))


def record_steps(trainer, first: int) -> tuple[StepRecord, StepRecord]:
    """Two more steps of a dry run's trainer (zerolab.rehearsal), from step index `first`, as a long
    run's steps between two logged ones: nothing reads the memory after them, so what a strategy
    leaves in flight at the end of a step (zero1/2's all-gathers) is waited for where the next step
    needs it (a logged step's memory figures would wait for it first). Returns the second (the
    record) and the first (its predecessor, whose collectives its carried waits name)."""
    cfg = trainer.cfg
    cfg.trainer.log_every = cfg.trainer.max_steps = 1 << 30  # neither is logged (no eval, no last step)
    with Recorder(trainer.strategy, trainer.model) as recorder:
        for step in range(first, first + 2):
            with recorder.step_record():
                trainer.train_step(step)
    return recorder.previous, recorder.before


def _bytes_of(x) -> int:
    """Bytes of a tensor, or of the tensors in a (nested) list of them."""
    if isinstance(x, torch.Tensor):
        return tensor_bytes(x)
    if isinstance(x, (list, tuple)):
        return sum(_bytes_of(v) for v in x)
    return 0
