"""The host's own Python in the strategy's code, timed in a dry run (zerolab.predict.record's
recorder installs it; HostSections says what it times and how)."""
from __future__ import annotations

import time
from contextlib import contextmanager

import torch


class HostSections:
    """The host's own Python in the strategy's code, timed in the dry run: a step's ops are priced
    by their kernels (and a calibrated host time per kernel), but a strategy also runs Python that
    dispatches little: a hook per gradient that finds its bucket and launches a collective, a step
    that loops over buckets and parameters, a module pre-hook that gathers and frees a unit. The
    dry run runs that same Python on this host, so each section's own time is measured there: its
    wall time less the time inside the recorder's dispatch handler and process-group wrappers (the
    fake kernels and the recording), less `per_dispatch_s` for each dispatch (what reaching the
    Python handler costs, measured at install), less the sections inside it. Each becomes an Op
    "host:<what>" with that time (no kernel) where the section ends (Recorder.host_op). The sections:

    - every hook on the model's parameters and modules when the recorder is installed (the
      strategy's: zero1/2's post-accumulate-grad hooks, zero3's and FSDP2's pre-forward hooks);
    - the strategy's backward, less the autograd engine's run (its ops and hooks are their own);
    - the strategy's step (its Python, the optimizer's, numerics');
    - "other": the trainer's Python between the phases (the batch, the instruments).

    What no section holds: Python inside the autograd engine other than those hooks (FSDP2's
    post-backward autograd functions and final callbacks, DDP's comm hook, checkpointing's
    recomputation), and C++ bookkeeping (DDP's reducer). On a GPU the host is assumed to run ahead
    of the device: these sections cost nothing there (zerolab.predict.model)."""

    def __init__(self, rec):
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
        if emit:
            rec.host_op(what, phase, max(0.0, own))

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
