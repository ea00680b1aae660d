"""Where the step goes: a profiled step's parts on every rank, MFU on every logged step, traces.

`profile.steps=[5,6]` (1-based optimizer steps, as in metrics.jsonl) splits each of those steps,
on every rank, into four disjoint parts that add up to the step's own time (`time/step_s`):

  time/compute_s         forward and backward (the model's forward pre-hook to the strategy's
                         backward returning), less the exposed communication inside them
  time/optimizer_s       the strategy's step (unscale, clip, update), less the exposed communication inside it
  time/comm_exposed_s    the part of the step in which this rank made no progress because it
                         waited for a collective
  time/other_s           the rest: data, host work between the phases, the trainer's bookkeeping

and `time/comm_s`, all the time some collective of this rank was in flight (launch to
completion), of which `comm_exposed_s` is the part that was not hidden.

How it is measured. On CPU/gloo there are no streams: a collective runs on gloo's threads while
the training thread goes on, until the training thread waits for it. For the profiled steps only,
every ProcessGroup collective (whoever issues it from Python: zerolab's sharders, DDP's comm hook,
FSDP2, DeepSpeed's comm layer, ZeroRedundancyOptimizer) and every `Work.wait` are wrapped: a
collective's launch and its completion (a done-callback on its future) bound its time in flight;
the host inside a launch or a wait is exposed. DDP's reducer waits for its buckets' futures in
C++, where no wrapper sees it: a callback queued on the autograd engine at the start of backward
(it runs before the reducer's own) waits for those futures first, in Python, at the same moment
and with the same result. On CUDA the device timeline decides instead: torch.profiler's kernels,
exposed = |comm kernels| − |comm kernels ∩ other kernels|, inside the device spans of the phases
(record_function ranges). Holistic Trace Analysis' get_comm_comp_overlap has the idea; this is
zerolab's own arithmetic (step_parts, device_parts).

The parts are disjoint by construction: exposed is taken out first, compute and optimizer are
their windows less it, other is what remains of the step's window (step_parts).

MFU on every logged step: tokens/s per device × FLOPs per token (flops_per_token) ÷ the device's
peak (peak_flops: trainer.peak_flops, else a table of known GPUs, else one short matmul).

`profile.trace=true`: a Chrome trace (torch.profiler) per rank of each run of consecutive profiled
steps, <run dir>/traces/steps<first>-<last>-rank<r>.json.gz, with the phases and waits as spans.

Profiling off costs nothing: no wrapper, no torch profiler, no synchronisation; a step that is
not profiled gets a shared null context. One step before each run of profiled steps, the wrappers
are installed too (nothing is derived from it), so the collectives it leaves in flight (zero1/2
all-gather the updated weights behind the next forward) are known from their launch.
"""
from __future__ import annotations

import math
import os
import statistics
import time
from contextlib import contextmanager, nullcontext
from typing import Optional

import torch
import torch.nn as nn

from zerolab.models import find_blocks
from zerolab.schema import Config, global_batch

NULL = nullcontext()  # what a step that is not profiled gets: nothing is created per step
STEP, COMPUTE, OPTIMIZER, WAIT = "zerolab:step", "zerolab:compute", "zerolab:optimizer", "zerolab:wait"
PARTS = ("time/compute_s", "time/optimizer_s", "time/comm_exposed_s", "time/other_s")  # disjoint; sum = step_s


# ---- FLOPs per token --------------------------------------------------------------------------
def hidden_size(model: nn.Module, blocks: Optional[nn.Module] = None) -> int:
    """d: the in_features of the first Linear of the first block, else an embedding's width."""
    for m in (next(iter(blocks)).modules() if blocks is not None and len(blocks) else ()):
        if isinstance(m, nn.Linear):
            return m.in_features
    return next((m.embedding_dim for m in model.modules() if isinstance(m, nn.Embedding)), 0)


def flops_per_token(model: nn.Module, seq_len: int) -> dict:
    """Model FLOPs per trained token, forward and backward: 6·N + 12·L·d·T (Chowdhery et al. 2022,
    PaLM, appendix B; nanoGPT's estimate_mfu; causal masking not discounted, recomputation not
    counted: model FLOPs, not hardware FLOPs).

    N counts every parameter a matmul uses, once: all parameters except embedding tables that are
    only looked up (a position table, an untied input embedding). A token embedding tied to the
    output head counts, as the head's weight: nanoGPT's count (PaLM leaves every embedding out).
    L is the number of repeated blocks (zerolab.models.find_blocks, the blocks zero3 and fsdp
    work on; 0 for a model without: no attention term), d their width (hidden_size), T the
    sequence length trained on. Any nn.Module: zerolab's models and the user's (model=hf/custom)."""
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    lookup = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding) and id(m.weight) not in linear}
    n = sum(p.numel() for p in model.parameters() if id(p) not in lookup)
    found = find_blocks(model)
    blocks = found.modules if found is not None else None
    layers, width = (len(blocks) if blocks is not None else 0), hidden_size(model, blocks)
    return {"flops_per_token": 6 * n + 12 * layers * width * seq_len, "n": n, "layers": layers, "width": width,
            "seq": seq_len}


# ---- the device's peak ------------------------------------------------------------------------
# Dense (no structured sparsity) peak FLOP/s by device and compute dtype, from NVIDIA's data sheets:
# "NVIDIA H100 Tensor Core GPU" (H100 SXM: BF16/FP16 989.4 TFLOPS, FP32 66.9; H100 PCIe: 756.5 and
# 51.2; the sheet's headline figures, 1979 and 1513, are with sparsity), "NVIDIA H200 Tensor Core GPU"
# (the H100 SXM's figures), "NVIDIA A100 Tensor Core GPU" (BF16/FP16 312, FP32 19.5), "NVIDIA L4"
# (BF16/FP16 121, FP32 30.3). Matched on torch.cuda.get_device_name(), most specific first.
GPU_PEAKS = [("H100 PCIe", "H100 PCIe", 756.5e12, 51.2e12), ("H200", "H200 SXM", 989.4e12, 66.9e12),
             ("H100", "H100 SXM", 989.4e12, 66.9e12), ("A100", "A100", 312e12, 19.5e12), ("L4", "L4", 121e12, 30.3e12)]


def table_peak(device_name: str, dtype: torch.dtype) -> Optional[tuple[float, str]]:
    for key, label, half, single in GPU_PEAKS:
        if key in device_name:
            kind = "fp32" if dtype == torch.float32 else "bf16/fp16"
            return (single if dtype == torch.float32 else half), f"table: NVIDIA {label} {kind} dense (data sheet)"
    return None


def measure_matmul(device: torch.device, dtype: torch.dtype, budget_s: float = 0.1) -> tuple[float, str]:
    """The best FLOP/s of a square matmul in `dtype` on `device`, in about `budget_s`: the largest
    of 512/256/128 (4096 on CUDA) whose first product takes under 20 ms, best of >= 3 products."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rng = torch.Generator(device=device).manual_seed(0)  # its own: the run's random streams stay as they were
    for n in ((4096,) if device.type == "cuda" else (512, 256, 128)):
        a, b = (torch.randn(n, n, device=device, generator=rng).to(dtype) for _ in range(2))
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync()
        if time.perf_counter() - t0 < 0.02:
            break
    best, reps, start = math.inf, 0, time.perf_counter()
    while reps < 3 or (time.perf_counter() - start < budget_s and reps < 50):
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync()
        best, reps = min(best, time.perf_counter() - t0), reps + 1
    dt = str(dtype).replace("torch.", "")
    return 2 * n ** 3 / best, f"measured: {n}x{n} {dt} matmul on {device.type}, best of {reps}, {torch.get_num_threads()} thread(s)"


def peak_flops(configured: float, ctx, dtype: torch.dtype) -> dict:
    """trainer.peak_flops when set; on CUDA the table, when it knows the device; else measured on
    every rank at once (each rank's own device, while the others measure theirs) and averaged."""
    if configured > 0:
        return {"peak_flops": configured, "peak_flops_source": "trainer.peak_flops"}
    if ctx.device.type == "cuda":
        known = table_peak(torch.cuda.get_device_name(ctx.device), dtype)
        if known:
            return {"peak_flops": known[0], "peak_flops_source": known[1]}
    value, how = measure_matmul(ctx.device, dtype)
    per_rank = ctx.gather_objects(value) if ctx.world_size > 1 else [value]
    return {"peak_flops": statistics.mean(per_rank), "peak_flops_source": f"{how}, mean of {len(per_rank)} rank(s)",
            "peak_flops_per_rank": per_rank}


# ---- intervals (seconds) -----------------------------------------------------------------------
def merged(iv) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted((a, b) for a, b in iv if b > a):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def total(iv) -> float:
    return sum(b - a for a, b in merged(iv))


def clipped(iv, lo: float, hi: float) -> list[tuple[float, float]]:
    return merged((max(a, lo), min(b, hi)) for a, b in iv)


def subtract(a, b) -> list[tuple[float, float]]:
    """The parts of intervals `a` outside intervals `b`."""
    out, cut = [], merged(b)
    for lo, hi in merged(a):
        for c0, c1 in cut:
            if c1 <= lo or c0 >= hi:
                continue
            if c0 > lo:
                out.append((lo, c0))
            lo = max(lo, c1)
            if lo >= hi:
                break
        if lo < hi:
            out.append((lo, hi))
    return out


def step_parts(window: tuple[float, float], compute, optimizer, exposed, comm) -> dict:
    """The parts of one step on one rank, from its window and intervals: exposed communication
    first, then compute and optimizer less it (and less each other), other the rest of the window.
    Disjoint by construction, so the four add up to time/step_s exactly; `comm` (in flight) holds
    `exposed` too, so 0 <= comm_exposed_s <= comm_s."""
    lo, hi = window
    e = clipped(exposed, lo, hi)
    c = subtract(clipped(compute, lo, hi), e)
    o = subtract(subtract(clipped(optimizer, lo, hi), e), c)
    parts = {"time/compute_s": total(c), "time/optimizer_s": total(o), "time/comm_exposed_s": total(e)}
    parts["time/other_s"] = max(0.0, (hi - lo) - sum(parts.values()))
    parts["time/comm_s"] = total(clipped(list(comm) + e, lo, hi))
    parts["time/step_s"] = hi - lo
    return parts


def is_comm_kernel(name: str) -> bool:
    return "nccl" in name.lower()


def device_parts(events) -> dict:
    """CUDA: the parts from the device timeline. `events`: (name, kind, start_s, end_s) of the
    step's device activity, kind "kernel" or "annotation" (the device span of a record_function
    range: STEP, COMPUTE, OPTIMIZER). Exposed = communication kernels' time not covered by any
    other kernel (on any stream); the step's window is its STEP span, else its kernels' extent;
    without COMPUTE spans the other kernels' own time stands for compute."""
    spans: dict[str, list] = {}
    comm, busy = [], []
    for name, kind, a, b in events:
        if kind == "annotation":
            spans.setdefault(name, []).append((a, b))
        elif kind == "kernel":
            (comm if is_comm_kernel(name) else busy).append((a, b))
    ends = spans.get(STEP) or comm + busy or [(0.0, 0.0)]
    window = (min(a for a, _ in ends), max(b for _, b in ends))
    return step_parts(window, spans.get(COMPUTE) or busy, spans.get(OPTIMIZER, []), subtract(comm, busy), comm)


def kineto_device_events(prof) -> list[tuple[str, str, float, float]]:
    """The CUDA activity of a stopped torch.profiler session as device_parts' events."""
    out = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() != torch.autograd.DeviceType.CUDA:
            continue
        kind = e.activity_type() if hasattr(e, "activity_type") else ""
        if e.is_user_annotation() or kind == "gpu_user_annotation":
            kind = "annotation"
        elif kind in ("kernel", "") and not e.name().startswith(("Memcpy", "Memset")):
            kind = "kernel"
        out.append((e.name(), kind, e.start_ns() / 1e9, e.end_ns() / 1e9))
    return out


# ---- CPU/gloo: collectives and waits, seen from Python ----------------------------------------------
# Every ProcessGroup method that starts a collective (torch.distributed's functions all end in one).
COLLECTIVES = ("allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "allgather_into_tensor_coalesced",
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


def _mark(name: str, on: bool):
    """A record_function range (a trace's span; on CUDA also the device span device_parts reads)."""
    return torch.profiler.record_function(name) if on else NULL


class Phases:
    """The compute windows (the model's forward pre-hook to the strategy's backward returning,
    one per micro-batch) and the optimizer window (the strategy's step) of one profiled step:
    a forward pre-hook on the model and wrappers on the strategy's instance, removed by undo()."""

    def __init__(self, watch: Optional[CommWatch], mark: bool):
        self.watch, self.mark = watch, mark
        self.compute: list[tuple[float, float]] = []
        self.optimizer: list[tuple[float, float]] = []
        self._start, self._range = None, None

    def _forward(self, module, args) -> None:
        if self._start is None:  # the first forward of a micro-batch (not a recomputation, not a nested call)
            self._range = _mark(COMPUTE, self.mark)
            self._range.__enter__()
            self._start = time.perf_counter()

    def _end_compute(self) -> None:
        if self._start is not None:
            self.compute.append((self._start, time.perf_counter()))
            self._range.__exit__(None, None, None)
            self._start = None

    def _backward_started(self, grad) -> None:
        # Runs first in backward: a callback queued now runs at its end, before DDP's reducer's own.
        if self.watch is not None:
            torch.autograd.Variable._execution_engine.queue_callback(self.watch.wait_handed)

    def attach(self, strategy, model: nn.Module):
        hook = model.register_forward_pre_hook(self._forward, prepend=True)
        before = {k: vars(strategy)[k] for k in ("backward", "step") if k in vars(strategy)}
        backward, step = strategy.backward, strategy.step

        def timed_backward(loss, *args, **kwargs):
            if loss.requires_grad:
                loss.register_hook(self._backward_started)
            try:
                return backward(loss, *args, **kwargs)
            finally:
                self._end_compute()

        def timed_step(*args, **kwargs):
            with _mark(OPTIMIZER, self.mark):
                t0 = time.perf_counter()
                try:
                    return step(*args, **kwargs)
                finally:
                    self.optimizer.append((t0, time.perf_counter()))

        strategy.backward, strategy.step = timed_backward, timed_step

        def undo() -> None:
            hook.remove()
            for k in ("backward", "step"):
                if k in before:
                    setattr(strategy, k, before[k])
                else:
                    delattr(strategy, k)
        return undo


class StepProfiler:
    """The trainer's one object for where the step goes: FLOPs per token and the device's peak
    (MFU on every logged step), and, for profile.steps, each profiled step's parts on this rank."""

    def __init__(self, cfg: Config, ctx, model: nn.Module, run_dir: str, dtype: torch.dtype):
        """`model`: the module about to be trained, before the strategy wraps or shards it.
        Collective when the peak is measured (every rank measures at once)."""
        self.ctx, self.steps = ctx, frozenset(cfg.profile.steps)
        self.flops = flops_per_token(model, cfg.model.block_size)
        self.peak = peak_flops(cfg.trainer.peak_flops, ctx, dtype)
        self.tokens_per_device = global_batch(cfg, ctx.world_size) * cfg.model.block_size / ctx.world_size
        self.cuda = ctx.device.type == "cuda"
        self.trace_dir = os.path.join(run_dir, "traces") if cfg.profile.trace else None
        self.watch: Optional[CommWatch] = None
        self.session, self.session_from = None, 0  # the torch profiler, and the step it started at
        self.parts: dict[int, dict] = {}  # 1-based step -> this rank's parts, until its record takes them
        self.history: dict[str, list[float]] = {}  # every profiled step's parts, for summary.json

    def profiles(self, step: int) -> bool:
        """Whether 0-based `step` is profiled (profile.steps counts from 1)."""
        return step + 1 in self.steps

    def step(self, step: int, strategy, model: nn.Module):
        """The context of 0-based `step`: NULL unless it is profiled or comes just before one."""
        if step + 1 in self.steps:
            return self._profiled(step + 1, strategy, model)
        if step + 2 in self.steps and not self.cuda:
            return self._armed()
        return NULL

    @contextmanager
    def _armed(self):
        """The step before a run of profiled steps: collectives it leaves in flight are known."""
        watch = self.watch = self.watch or CommWatch(self.trace_dir is not None)
        watch.install()
        try:
            yield
        finally:
            watch.uninstall()
            watch.keep_running(time.perf_counter(), carry=True)

    def _session(self, s: int):
        """The torch profiler running for step `s`: on CUDA one per step (its kernels give the
        parts), on CPU with profile.trace one per run of consecutive profiled steps (one trace
        file per rank and run), else none (the watch's own clock is all CPU needs)."""
        if self.session is None and (self.cuda or self.trace_dir is not None):
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if self.cuda else [])
            self.session, self.session_from = torch.profiler.profile(activities=acts), s
            self.session.start()
        return self.session

    def _end_session(self, s: int):
        """Stop the profiler after step `s` when its session ends and write its trace; returns it
        (stopped), or None while it runs on or when there is none."""
        prof = self.session
        if prof is None or not (self.cuda or s + 1 not in self.steps):
            return None
        if self.watch is not None:
            # gloo's threads run a collective inside a profiler range of their own; stopping the
            # profiler under one has crashed the process here (SIGSEGV): let those this step left
            # in flight (zero1/2's all-gathers) finish first, after the step's window.
            self.watch.finish_in_flight()
        prof.stop()
        self.session = None
        if self.trace_dir is not None:
            os.makedirs(self.trace_dir, exist_ok=True)
            name = f"steps{self.session_from}-{s}-rank{self.ctx.rank}.json.gz"
            prof.export_chrome_trace(os.path.join(self.trace_dir, name))
        return prof

    @contextmanager
    def _profiled(self, s: int, strategy, model: nn.Module):
        watch = None if self.cuda else (self.watch or CommWatch(self.trace_dir is not None))
        self.watch = watch
        phases = Phases(watch, mark=self.cuda or self.trace_dir is not None)
        prof = self._session(s)
        undo = phases.attach(strategy, model)
        if watch is not None:
            watch.install()
        try:
            with _mark(STEP, prof is not None):
                t0 = time.perf_counter()
                try:
                    yield
                finally:
                    t1 = time.perf_counter()
        except BaseException:
            if self.session is not None:  # the run is failing: no trace, no parts
                session, self.session = self.session, None
                session.stop()
            raise
        finally:
            if watch is not None:
                watch.uninstall()
            undo()
        if not self.cuda:
            exposed, flight = watch.intervals(t1)
            parts = step_parts((t0, t1), phases.compute, phases.optimizer, exposed, flight)
        stopped = self._end_session(s)
        if self.cuda:  # the step's device activity is all there once the profiler has stopped
            parts = device_parts(kineto_device_events(stopped))
        self.parts[s] = parts
        for k, v in parts.items():
            self.history.setdefault(k, []).append(v)
        if watch is not None:
            watch.keep_running(t1, carry=s + 1 in self.steps)
            if s + 1 not in self.steps:
                self.watch = None

    # ---- what the trainer logs -----------------------------------------------------------------
    def rank_figures(self, step: int) -> dict:
        """This rank's parts of 0-based `step` (gathered into rank{r}/time/...), {} when not profiled."""
        return self.parts.pop(step + 1, {})

    def rates(self, step_s: float) -> dict:
        """A logged step's throughput per device and MFU (model FLOPs ÷ the peak)."""
        per_device = self.tokens_per_device / step_s
        return {"flops_per_token": self.flops["flops_per_token"], "tokens_per_s_per_device": per_device,
                "mfu": per_device * self.flops["flops_per_token"] / self.peak["peak_flops"]}

    def summary(self, step_times: list[float]) -> dict:
        """summary.json's keys: FLOPs per token and its terms, the peak and where it came from, MFU at
        the median step time, and each rank's mean parts over the profiled steps (collective when
        profile.steps is set)."""
        out = {"flops_per_token": self.flops["flops_per_token"], "flops_terms": self.flops, **self.peak}
        if step_times:
            out.update({f"{k}_p50": v for k, v in self.rates(statistics.median(step_times)).items()
                        if k != "flops_per_token"})
        if self.steps:
            mine = {k: statistics.mean(v) for k, v in self.history.items()}
            out["profiled_steps"] = sorted(self.steps)
            out["time_per_rank"] = self.ctx.gather_objects(mine) if self.ctx.world_size > 1 else [mine]
        return out
