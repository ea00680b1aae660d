"""CPU/gloo: every collective and every wait of a profiled step, seen from Python (the package's
docstring says how they become exposed and in-flight time)."""
from __future__ import annotations

import math
import time

import torch

from zerolab.profile.intervals import NULL, WAIT

# Every ProcessGroup method that starts a collective (torch.distributed's functions all end in one).
COLLECTIVES = ("allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced",
               "allgather_into_tensor_coalesced",
               "_allgather_base", "all_gather_single", "all_gather_single_coalesced", "reduce_scatter",
               "reduce_scatter_single", "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced",
               "_reduce_scatter_base", "broadcast", "reduce", "alltoall", "alltoall_base", "all_to_all_single",
               "barrier", "gather", "scatter", "send", "recv", "recv_anysource", "_end_coalescing")


class CommWatch:
    """While installed (a profiled step, and the step before a run of them), every collective
    started on a ProcessGroup and every Work.wait are timed, whoever calls them: the class
    attributes are replaced and put back on uninstall(). Records, in time.perf_counter seconds:
    `launched` [start, end] per collective (end: its future's done-callback, or the end of a wait
    for it), `waits` (the host inside a launch or a wait: exposed), and `in_flight` for waits on
    collectives launched before the watch began."""

    def __init__(self, trace: bool = False):
        from torch._C._distributed_c10d import ProcessGroup, Work

        self.classes, self.trace = (ProcessGroup, Work), trace
        self.get_future = Work.get_future  # the original: the watch's own done-callbacks are not "handed out"
        self.launched: list[list] = []
        self.waits: list[tuple[float, float]] = []
        self.in_flight: list[tuple[float, float]] = []
        self.live: dict[int, tuple] = {}  # id(work) -> (work, its launched entry), until waited for
        self.handed: list[tuple] = []  # (future, entry) given to another consumer (DDP's reducer) while in flight
        self.saved: dict = {}

    def install(self) -> None:
        pg, work = self.classes
        for name in COLLECTIVES:
            if name in vars(pg):
                self._patch(pg, name, self._launcher)
        self._patch(work, "wait", self._waiter)
        self._patch(work, "get_future", self._future)

    def _patch(self, cls, name: str, make) -> None:
        self.saved[cls, name] = vars(cls)[name]  # the raw attribute, to put back exactly
        setattr(cls, name, make(getattr(cls, name)))

    def uninstall(self) -> None:
        for (cls, name), raw in self.saved.items():
            setattr(cls, name, raw)
        self.saved.clear()

    def _launcher(self, original):
        watch = self

        def collective(pg, *args, **kwargs):
            t0 = time.perf_counter()
            work = original(pg, *args, **kwargs)
            t1 = time.perf_counter()
            watch.waits.append((t0, t1))  # the host inside the call (all of it where the backend completes it there)
            entry = [t0, None if work is not None else t1]
            watch.launched.append(entry)
            if work is not None:
                watch.live[id(work)] = (work, entry)
                try:
                    watch.get_future(work).add_done_callback(lambda _, e=entry: e.__setitem__(1, time.perf_counter()))
                except RuntimeError:  # a Work without a future: its wait ends it
                    pass
            return work
        return collective

    def _waiter(self, original):
        watch = self

        def wait(work, *args, **kwargs):
            live = watch.live.pop(id(work), None)
            done = live is None and (work.is_completed() or watch._future_done(work))
            with (torch.profiler.record_function(WAIT) if watch.trace else NULL):
                t0 = time.perf_counter()
                try:
                    return original(work, *args, **kwargs)
                finally:
                    t1 = time.perf_counter()
                    watch.waits.append((t0, t1))
                    if live is not None:
                        live[1][1] = min(live[1][1] or t1, t1)
                    else:  # launched before the watch began: in flight since then, unless already complete
                        watch.in_flight.append((t0 if done else -math.inf, t1))
        return wait

    def _future(self, original):
        watch = self

        def get_future(work):
            fut = original(work)
            live = watch.live.get(id(work))
            if live is not None:
                watch.handed.append((fut, live[1]))
            return fut
        return get_future

    def _future_done(self, work) -> bool:
        try:
            return self.get_future(work).done()
        except RuntimeError:  # a Work without a future
            return False

    def wait_handed(self) -> None:
        """At the end of backward (an autograd callback queued before the reducer's): wait here,
        timed, for the futures handed to a consumer that would wait for them in C++."""
        for fut, entry in self.handed:
            if not fut.done():
                t0 = time.perf_counter()
                fut.wait()
                t1 = time.perf_counter()
                self.waits.append((t0, t1))
                entry[1] = min(entry[1] or t1, t1)
        self.handed.clear()

    def finish_in_flight(self) -> None:
        """Wait (untimed, the watch uninstalled) for the collectives still in flight."""
        for work, _ in list(self.live.values()):
            work.wait()

    def intervals(self, end: float) -> tuple[list, list]:
        """(exposed, in flight) so far; a collective still running is in flight until `end`."""
        flight = [(a, b if b is not None else end) for a, b in self.launched] + self.in_flight
        return list(self.waits), flight

    def keep_running(self, end: float, carry: bool) -> None:
        """Forget what a step recorded; with `carry`, keep the collectives still in flight at
        `end` (the next step waits for them)."""
        self.launched = [e for e in self.launched if carry and (e[1] is None or e[1] > end)]
        kept = {id(e) for e in self.launched}
        self.live = {k: v for k, v in self.live.items() if id(v[1]) in kept}
        self.waits, self.in_flight, self.handed = [], [], []

