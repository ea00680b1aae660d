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

The package, in reading order: flops.py (FLOPs per token, the peak), intervals.py (the parts from
intervals), commwatch.py (collectives and waits on CPU), profiler.py (StepProfiler, the trainer's).
"""
from zerolab.profile.commwatch import COLLECTIVES, CommWatch
from zerolab.profile.flops import flops_per_token, measure_matmul, peak_flops, table_peak
from zerolab.profile.intervals import NULL, PARTS, clipped, device_parts, merged, step_parts, subtract, total
from zerolab.profile.profiler import StepProfiler

__all__ = ["COLLECTIVES", "CommWatch", "NULL", "PARTS", "StepProfiler", "clipped", "device_parts", "flops_per_token",
           "measure_matmul", "merged", "peak_flops", "step_parts", "subtract", "table_peak", "total"]
