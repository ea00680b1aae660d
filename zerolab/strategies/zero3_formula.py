"""zero3's memory model until zerolab has its own ZeRO-3: the ZeRO paper's P_os+g+p, every model
state divided by N (Rajbhandari et al. 2019). `python -m zerolab memory --strategy zero3` prints
it; no run can choose it (zerolab.strategies.PREDICTION_ONLY).

When zerolab's ZeRO-3 strategy lands, its class implements predict_memory for what it allocates
(as zero.py does for zero1/zero2), takes zero3's entry in zerolab.strategies.KNOWN, and this
file goes.
"""
from __future__ import annotations

import math

from zerolab.memory.prediction import MIXED, ceil_div, dtype_name
from zerolab.precision import COMPUTE_BYTES
from zerolab.strategies.memory_protocol import MemoryModel


class Zero3Formula(MemoryModel):
    name = "zero3"
    paper_stage, memory_reference = 3, ("deepspeed", 3)  # the paper's stage 3, beside DeepSpeed's

    @classmethod
    def predict_memory(cls, p, shape, *, world, precision, k, **_) -> None:
        """The ZeRO paper's P_os+g+p: every model state divided by N (formula only)."""
        n, c, dt, N = shape.n_params, COMPUTE_BYTES[precision], dtype_name(precision), world
        shard = ceil_div(n, N)
        p.add("params", shard * c, f"{dt} weight shard: ⌈Ψ/N⌉ × {c}")
        p.add("grads", shard * c, f"{dt} gradient shard: ⌈Ψ/N⌉ × {c}")
        s = 2 if precision == "bf16_pure" else 4
        if precision in MIXED:
            p.add("master", shard * 4, "fp32 master shard: ⌈Ψ/N⌉ × 4")
        p.add("optim_state", shard * k * s, f"optimizer state shard: ⌈Ψ/N⌉ × {k:g} × {s}")
        biggest = max(math.prod(s_) for s_ in shape.shapes)
        p.add("transient", biggest * c, "one layer's weights all-gathered for forward/backward (largest tensor)")
        p.notes.append("formula only (Rajbhandari et al. 2019); zerolab has no own stage-3 sharder")
        p.why = "zerolab has no stage-3 sharder: this is the formula itself, with ⌈Ψ/N⌉ shards"
        p.explain_always = True  # "same as the paper" still says it is the formula itself
