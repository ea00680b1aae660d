"""What the ZeRO paper says a strategy sends per step, beside what zerolab measured it sending.

Rajbhandari et al. 2019, §7 (the ring cost model zerolab.comm counts in): data parallelism
all-reduces the gradients, 2Ψ elements per rank per step (times (N−1)/N); stages 1 and 2 send the
same 2Ψ (a reduce-scatter of the gradients, an all-gather of the updated parameters); stage 3
sends 3Ψ, 1.5 times as much (the parameters are all-gathered in the forward and again in the
backward, the gradients reduce-scattered). A measured volume above the paper's for the strategy's
stage is the implementation's own choice, and the report says so.
"""
from __future__ import annotations

from zerolab.report.runs import Run, strategy_class

OVER = 1.05  # measured above the paper's volume by more than this factor: said (the count is exact, not sampled)



def zero_stage(run: Run) -> int:
    """The ZeRO stage the run's strategy implements (DeepSpeed: its strategy.stage); 0 when unknown."""
    cls = strategy_class(run.strategy)
    if cls is None:
        return 0
    stage = int(run.config.get("strategy", {}).get("stage") or 0)
    try:
        return int(cls.memory_identity(stage)[1])
    except (ValueError, TypeError):  # a stage the ledger has no model of (DeepSpeed's 0: plain data parallelism)
        return stage


def paper_factor(run: Run) -> float:
    """The paper's volume for the run's stage, in units of 2Ψ(N−1)/N: 1, or 1.5 for stage 3."""
    return 1.5 if zero_stage(run) >= 3 else 1.0


def comm_note(run: Run) -> str:
    """Why the run's measured volume sits where it does against 2Ψ: '' when at the paper's."""
    st = run.stats
    measured = st["comm_per_step"][0] if st.get("comm_per_step") else float("nan")
    paper = st["comm_theory"] * paper_factor(run)
    notes = []
    if paper_factor(run) > 1:
        notes.append("stage 3: the paper's own 3Ψ (parameters gathered in forward and backward)")
    if measured > paper * OVER:
        cls = strategy_class(run.strategy)
        why = cls.traits.comm_extra if cls is not None else ""  # what the strategy declares about its volume
        notes.append(f"{measured / paper:.2f}× the paper's: " + (why or f"{run.strategy}'s own collectives"))
    return "; ".join(notes)
