"""A prediction of bytes per rank, term by term: the vocabulary every strategy's predict_memory
writes in (zerolab/strategies/*.py) and the ledger reads (zerolab/memory/).

Notation: Ψ parameters, N data-parallel ranks, c bytes per compute-dtype element (4 fp32,
2 bf16/fp16), k optimizer-state elements per parameter (measured from the optimizer), s bytes
per state element (the dtype of the tensors the optimizer updates).
Every term carries a sentence saying where it comes from, so the CLI can print the ledger and
a run can hold each category against what its strategy measures.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from zerolab.accounting.storage import CATEGORIES, MODEL_STATES
from zerolab.precision import COMPUTE_DTYPES, DTYPE_NAMES, MIXED, state_bytes  # noqa: F401  (what predictions are written with)

GB, GIB = 1e9, 2 ** 30


class NotPredicted(ValueError):
    """A strategy cannot run these settings (e.g. it has no bf16_pure mode), so it has no
    prediction for them; tables that list several strategies leave it out."""


@dataclass
class Term:
    category: str  # one of CATEGORIES, or "transient" (exists only during part of the step)
    bytes: int
    what: str
    # For a transient term, the part of the step it lives in: "backward" (with the activations:
    # buckets in flight, gathered weights) or "step" (inside the optimizer step, after backward
    # freed the activations). The planner adds each to the peak of its own moment.
    when: str = "backward"


@dataclass
class Prediction:
    strategy: str  # the strategy's label (Strategy.memory_identity): its name, or name-<stage>
    precision: str
    optim: str
    world: int
    model: str
    n_params: int
    state_elements: float
    terms: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    why: str = ""  # why this implementation differs from the ZeRO paper's formula (set by its builder)
    stage: int = 0  # the ZeRO stage whose formula it is held against (Strategy.memory_identity)
    explain_always: bool = False  # print `why` even where the figures equal the paper's (a formula says so)

    def add(self, category: str, nbytes: float, what: str, when: str = "backward") -> None:
        self.terms.append(Term(category, int(math.ceil(nbytes)), what, when))

    def bytes(self) -> dict[str, int]:
        """Same keys as StorageCounter.result(), so predicted and measured line up."""
        out = {c: 0 for c in CATEGORIES}
        for t in self.terms:
            if t.category in out:
                out[t.category] += t.bytes
        out["model_states"] = sum(out[c] for c in MODEL_STATES)
        out["total"] = sum(out[c] for c in CATEGORIES)
        return out

    @property
    def transient_bytes(self) -> int:
        return sum(t.bytes for t in self.terms if t.category == "transient")



# ---- what the strategies' predict_memory share ---------------------------------------------------
def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def fmt_n(n: int) -> str:
    return f"{n:,}"


def dtype_name(precision: str) -> str:
    """The name of a precision mode's compute dtype (bf16_pure computes in bf16), from the one map."""
    return DTYPE_NAMES[COMPUTE_DTYPES[precision]]




def human_bytes(v: float) -> str:
    for unit, scale in (("GB", GB), ("MB", 1e6), ("kB", 1e3)):
        if v >= scale:
            return f"{v / scale:.2f} {unit}"
    return f"{int(v)} B"
