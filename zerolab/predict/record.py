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
  zerolab.profile's Phases): forward, backward, optimizer, and other (the rest of train_step).

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
from zerolab.profile.commwatch import COLLECTIVES

PHASES = ("forward", "backward", "optimizer", "other")
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
    host_s: float = 0.0  # a host section (name "host:..."): the Python it ran, timed in the dry run (no kernel)


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
        self._patch_streams()
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

    # ---- streams (torch.cpu's stand-ins for a device's) -----------------------------------------
    def _patch_streams(self) -> None:
        rec = self
        stream_cls, event_cls = torch.cpu.Stream, torch.cpu.Event

        def sync(what: str, stream: int, target: int, carried: bool = False) -> None:
            if rec.step is not None:
                rec.step.events.append(Sync(what, stream, target, carried))

        def waited_event(stream, event) -> None:
            entry = rec.event_ids.get(id(event))
            if entry is not None and rec.step is not None and entry[1] in (rec.step, rec.previous):
                sync("wait_event", stream, entry[2], entry[1] is not rec.step)

        def stream_id(s) -> int:
            if s is None or s is torch.cpu._default_cpu_stream:
                return 0
            return rec.stream_ids.setdefault(id(s), len(rec.stream_ids) + 1)

        def event_record(original):
            def record(event, stream=None):
                # each record is a new point in time, numbered in its step; the object is kept (its id is not reused)
                if rec.step is not None:
                    rec.step.events_recorded += 1
                    rec.event_ids[id(event)] = (event, rec.step, rec.step.events_recorded)
                    sync("record", stream_id(stream) if stream is not None else rec._stream(), rec.step.events_recorded)
                return original(event, stream)
            return record

        def record_event(original):
            def make_event(stream):
                event = event_cls()
                event.record(stream)
                return event
            return make_event

        def wait_event(original):
            def wait(stream, event):
                waited_event(stream_id(stream), event)
                return original(stream, event)
            return wait

        def event_wait(original):
            def wait(event, stream=None):
                waited_event(stream_id(stream) if stream is not None else rec._stream(), event)
                return original(event, stream)
            return wait

        def wait_stream(original):
            def wait(stream, other):
                sync("wait_stream", stream_id(stream), stream_id(other))
                return original(stream, other)
            return wait

        self._patch(event_cls, "record", event_record)
        self._patch(event_cls, "wait", event_wait)
        self._patch(stream_cls, "record_event", record_event)
        self._patch(stream_cls, "wait_event", wait_event)
        self._patch(stream_cls, "wait_stream", wait_stream)


class HostSections:
    """The host's own Python in the strategy's code, timed in the dry run: a step's ops are priced
    by their kernels (and a calibrated host time per kernel), but a strategy also runs Python that
    dispatches little: a hook per gradient that finds its bucket and launches a collective, a step
    that loops over buckets and parameters, a module pre-hook that gathers and frees a unit. The
    dry run runs that same Python on this host, so each section's own time is measured there: its
    wall time less the time inside the recorder's dispatch handler and process-group wrappers (the
    fake kernels and the recording), less `per_dispatch_s` for each dispatch (what reaching the
    Python handler costs, measured at install), less the sections inside it. Each becomes an Op
    "host:<what>" with that time (no kernel) where the section ends. The sections:

    - every hook on the model's parameters and modules when the recorder is installed (the
      strategy's: zero1/2's post-accumulate-grad hooks, zero3's and FSDP2's pre-forward hooks);
    - the strategy's backward, less the autograd engine's run (its ops and hooks are their own);
    - the strategy's step (its Python, the optimizer's, numerics');
    - "other": the trainer's Python between the phases (the batch, the instruments).

    What no section holds: Python inside the autograd engine other than those hooks (FSDP2's
    post-backward autograd functions and final callbacks, DDP's comm hook, checkpointing's
    recomputation), and C++ bookkeeping (DDP's reducer). On a GPU the host is assumed to run ahead
    of the device: these sections cost nothing there (zerolab.predict.model)."""

    def __init__(self, rec: "Recorder"):
        self.rec = rec
        self.stack: list[list] = []  # [what, phase, t0, inside_s, dispatches, seconds of sections inside, emit]
        self.per_dispatch_s = 0.0
        self.wrapped: list[tuple] = []  # (hook dict, key, original)
        self.other = False

    def measure_dispatch(self, n: int = 400) -> None:
        """What one dispatch costs the host under the dry run's modes outside the handler, beyond what
        the same call costs a real run (a view of a real tensor, no mode): the dry run's own cost."""
        from torch.utils._python_dispatch import _disable_current_modes

        rec, x = self.rec, torch.empty(16)
        t0, inside, count = time.perf_counter(), rec.inside_s, rec.dispatches
        for _ in range(n):
            x.view(-1)
        wall = time.perf_counter() - t0 - (rec.inside_s - inside)
        with _disable_current_modes():
            real = torch.empty(16)
            t0 = time.perf_counter()
            for _ in range(n):
                real.view(-1)
            plain = time.perf_counter() - t0
        self.per_dispatch_s = max(0.0, (wall - plain) / max(rec.dispatches - count, 1))

    @contextmanager
    def section(self, what: str, emit: bool = True):
        self.open(what, emit)
        try:
            yield
        finally:
            self.close()

    def open(self, what: str, emit: bool = True) -> None:
        rec = self.rec
        self.stack.append([what, rec.phase, time.perf_counter(), rec.inside_s, rec.dispatches, 0.0, emit])

    def close(self) -> None:
        rec = self.rec
        what, phase, t0, inside, count, nested, emit = self.stack.pop()
        wall = time.perf_counter() - t0
        if self.stack:
            self.stack[-1][5] += wall
        own = wall - (rec.inside_s - inside) - self.per_dispatch_s * (rec.dispatches - count) - nested
        if emit and own > 0 and rec.step is not None:
            rec.step.events.append(Op(f"host:{what}", phase, 0, 0.0, 0, 0, True,
                                      "", -1, (), own))

    def open_other(self) -> None:
        if not self.other and not self.stack:
            self.open("other")
            self.other = True

    def close_other(self) -> None:
        if self.other and self.stack and self.stack[-1][0] == "other":
            self.close()
        self.other = False

    def engine(self, original):
        """torch.autograd.backward: the engine's run is not the strategy's (its hooks are timed on their own)."""
        def backward(*args, **kwargs):
            with self.section("autograd", emit=False):
                return original(*args, **kwargs)
        return backward

    def wrap_hooks(self, model) -> None:
        hooks = [(p, "_post_accumulate_grad_hooks") for p in model.parameters()]
        hooks += [(p, "_backward_hooks") for p in model.parameters()]
        hooks += [(m, name) for m in model.modules() for name in ("_forward_pre_hooks", "_forward_hooks",
                                                                   "_backward_pre_hooks", "_backward_hooks")]
        for owner, name in hooks:
            table = getattr(owner, name, None)
            for key, fn in list((table or {}).items()):
                self.wrapped.append((table, key, fn))
                table[key] = self._timed(fn)

    def unwrap_hooks(self) -> None:
        for table, key, fn in reversed(self.wrapped):
            if key in table:
                table[key] = fn
        self.wrapped.clear()

    def _timed(self, fn):
        what = getattr(fn, "__qualname__", type(fn).__name__)

        def hook(*args, **kwargs):
            with self.section(what):
                return fn(*args, **kwargs)
        return hook


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
