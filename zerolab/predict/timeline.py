"""The recorded step replayed on a timeline: what overlaps, what is exposed.

The rules (one compute timeline, one communication timeline per process group):
- ops run one after another on the stream they were issued on, each for its priced time;
- a collective starts when its group's previous collective has finished and, on a GPU, when
  everything issued before it on its stream has (NCCL orders a collective after the work already
  on the issuing stream); it runs beside the compute;
- a wait holds its stream until the collective has finished; on a GPU an event wait or a stream
  wait holds a stream until that event or stream has caught up (FSDP2's all-gather and
  reduce-scatter streams); on a CPU there are no streams: every wait holds the host, and stream
  operations mean nothing;
- a collective is hidden by the compute issued after it and before its wait; the rest of its time,
  the gap it leaves on the compute stream, is exposed communication.

Collectives on one group are serialized: two that shared its links at once would take as long
together. On gloo a collective issued while others are still in flight also costs `queued_s`
more (calibrated: each of many small collectives issued at once takes longer than it does alone,
as gloo's threads hand each one over between the ranks).

A collective ends when the last rank has joined it. Where ranks share cores (more ranks than cores
on a CPU), they reach it apart: `meeting_s` (calibrated) after its issue, on average. It does not
take the cores (the ranks that wait sleep); it delays the collective's end, so a collective waited
for soon after its issue (FSDP2's on a CPU) exposes it, and one with compute enough behind it hides
it. Zero on a GPU, where the ranks do not share a device.

On a CPU whose cores the ranks' compute threads and gloo's threads share (fewer cores than twice
the ranks: hardware.overlap_rate), overlap is not free: while a collective is in flight, it and
the compute each run at `overlap_rate` of their speed alone (processor sharing). The collectives
then form one queue of work beside the host's: an op of d seconds that runs while x seconds of
collective work remain takes x / rate + (d - x) and leaves x less of it; a wait runs what is left
up to the collective it waits for, at full speed, and that is exposed. So a hidden collective
still lengthens the compute it hides behind, as a profiled CPU step shows.

The step is replayed three times in a row (a step waits for what the previous one left in
flight: zero1/2's all-gathers); the middle one is the prediction: its length is the time between
its first op and the next step's, and its parts are the compute stream's time in each phase
(forward and backward: compute; optimizer; other) plus the gaps (exposed communication), which
add up to it exactly, as a profiled step's parts do (zerolab.profile).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from zerolab.predict.record import Collective, Op, StepRecord, Sync, Wait

PARTS = ("compute", "optimizer", "comm_exposed", "other")
PART_OF_PHASE = {"forward": "compute", "backward": "compute", "optimizer": "optimizer", "other": "other"}
REPEATS, MEASURED = 3, 1


@dataclass
class Replay:
    step_s: float
    parts: dict  # PARTS -> seconds of the measured step
    comm_s: float  # seconds some collective of the measured step was running (their durations, per group)
    exposed_by_kind: dict = field(default_factory=dict)  # collective kind -> exposed seconds


def replay(record: StepRecord, op_seconds, coll_seconds, streams: bool, overlap_rate: float = 1.0,
           meeting_s: float = 0.0, queued_s: float = 0.0) -> Replay:
    """`op_seconds(op)`, `coll_seconds(collective)`: their priced times. `streams`: a GPU's
    streams (False: a CPU, where everything runs on the host's one timeline). `overlap_rate` < 1:
    a CPU's shared cores (the module docstring). `meeting_s`: how long after its issue the last
    rank joins a collective (ranks sharing cores: the module docstring). `queued_s`: what a
    collective adds when it is issued while others are still in flight (gloo: the module docstring)."""
    durations = [op_seconds(e) if isinstance(e, Op) else coll_seconds(e) if isinstance(e, Collective) else 0.0
                 for e in record.events]
    sim = _Sim(streams, meeting_s, queued_s) if streams or overlap_rate >= 1 else \
        _SharedCores(overlap_rate, meeting_s, queued_s)
    starts = []
    for tile in range(REPEATS):
        starts.append(sim.ready[0])
        sim.tile(record, durations, tile, measured=tile == MEASURED)
    starts.append(sim.ready[0])
    parts = {p: sim.parts.get(p, 0.0) for p in PARTS}
    comm = sum(d for e, d in zip(record.events, durations) if isinstance(e, Collective))
    return Replay(starts[MEASURED + 1] - starts[MEASURED], parts, comm, dict(sim.exposed))


class _Sim:
    def __init__(self, streams: bool, meeting_s: float = 0.0, queued_s: float = 0.0):
        self.streams, self.meeting_s, self.queued_s = streams, meeting_s, queued_s
        self.ready = defaultdict(float)  # stream -> when the work issued on it so far is done
        self.why = {}  # stream -> the collective kind its ready time waits for, if a wait set it
        self.group_free = defaultdict(float)  # group's ranks -> when its last collective ends
        self.ends = {}  # (tile, index) -> (end, kind)
        self.events = {}  # (tile, event number) -> (time, why)
        self.parts = defaultdict(float)
        self.exposed = defaultdict(float)

    def tile(self, record: StepRecord, durations: list, tile: int, measured: bool) -> None:
        for e, d in zip(record.events, durations):
            s = e.stream if self.streams else 0
            if isinstance(e, Op):
                self.ready[s] += d
                self.why.pop(s, None)
                if measured and s == 0:
                    self.parts[PART_OF_PHASE[e.phase]] += d
            elif isinstance(e, Collective):
                if self.group_free[e.ranks] > self.ready[s]:  # behind another of its group
                    d += self.queued_s
                start = max(self.ready[s] + self.meeting_s, self.group_free[e.ranks])
                self.group_free[e.ranks] = start + d
                self.ends[tile, e.index] = (start + d, e.kind)
            elif isinstance(e, Wait):
                end, kind = self.ends.get((tile - e.carried, e.index), (0.0, ""))
                self._hold(s, end, kind, measured)
            elif isinstance(e, Sync) and self.streams:
                self._sync(e, tile, measured)

    def _sync(self, e: Sync, tile: int, measured: bool) -> None:
        if e.what == "record":
            self.events[tile, e.target] = (self.ready[e.stream], self.why.get(e.stream, ""))
        elif e.what == "wait_event":
            t, kind = self.events.get((tile - e.carried, e.target), (0.0, ""))
            self._hold(e.stream, t, kind, measured)
        elif e.what == "wait_stream":
            self._hold(e.stream, self.ready[e.target], self.why.get(e.target, ""), measured)

    def _hold(self, stream: int, until: float, kind: str, measured: bool) -> None:
        gap = until - self.ready[stream]
        if gap <= 0:
            return
        self.ready[stream] = until
        if kind:
            self.why[stream] = kind
        if measured and stream == 0:
            self.parts["comm_exposed"] += gap
            self.exposed[kind or "stream wait"] += gap


class _SharedCores(_Sim):
    """One host whose cores the compute and gloo's threads share (the module docstring)."""

    def __init__(self, rate: float, meeting_s: float = 0.0, queued_s: float = 0.0):
        super().__init__(streams=False, meeting_s=meeting_s, queued_s=queued_s)
        self.rate = rate
        self.queue: dict = {}  # (tile, index) -> [collective seconds left, kind], in issue order
        self.earliest: dict = {}  # (tile, index) -> (its issue + the meeting + its own time, kind)

    def tile(self, record: StepRecord, durations: list, tile: int, measured: bool) -> None:
        for e, d in zip(record.events, durations):
            if isinstance(e, Op):
                x = self._run_queue(d)
                self.ready[0] += x / self.rate + (d - x)
                if measured:
                    self.parts[PART_OF_PHASE[e.phase]] += x / self.rate + (d - x)
            elif isinstance(e, Collective):
                d += self.queued_s if self.queue else 0.0  # behind collectives still in flight
                self.queue[tile, e.index] = [d, e.kind]
                self.earliest[tile, e.index] = (self.ready[0] + self.meeting_s + d, e.kind)
            elif isinstance(e, Wait):
                key = (tile - e.carried, e.index)
                self._drain_to(key, measured)
                end, kind = self.earliest.pop(key, (0.0, ""))
                self._hold(0, end, kind, measured)  # the last rank joined it late: that wait is exposed too

    def _run_queue(self, budget: float) -> float:
        """Advance the queued collectives by up to `budget` seconds of their work; what was done."""
        done = 0.0
        for key in list(self.queue):
            left = self.queue[key]
            step = min(left[0], budget - done)
            left[0] -= step
            done += step
            if left[0] <= 0:
                del self.queue[key]
            if done >= budget:
                break
        return done

    def _drain_to(self, key: tuple, measured: bool) -> None:
        if key not in self.queue:
            return  # finished already, behind the compute
        kind = self.queue[key][1]
        keys = list(self.queue)
        gap = 0.0
        for k in keys[:keys.index(key) + 1]:
            gap += self.queue.pop(k)[0]
        self.ready[0] += gap
        if measured:
            self.parts["comm_exposed"] += gap
            self.exposed[kind] += gap
