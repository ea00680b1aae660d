"""The predicted side of the ledger: what a strategy should hold per rank, term by term.

`predict` names no strategy: it asks the strategy registry (zerolab.strategies.memory_model)
for the class that implements the strategy, and that class's `predict_memory` adds the terms
(zerolab.strategies.memory_protocol.MemoryModel). This module holds what every prediction
shares: the Prediction and its terms, and the notation below.

Notation: Ψ parameters, N data-parallel ranks, c bytes per compute-dtype element (4 fp32,
2 bf16/fp16), k optimizer-state elements per parameter (measured from the optimizer), s bytes
per state element (the dtype of the tensors the optimizer updates).
Every term carries a sentence saying where it comes from, so the CLI can print the ledger and
a run can hold each category against what its strategy measures.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from zerolab.memory.shapes import ModelShape, optimizer_state_elements
from zerolab.memory.storage import CATEGORIES, MODEL_STATES
from zerolab.precision import COMPUTE_BYTES
from zerolab.strategies import KNOWN, memory_model

MIXED = ("bf16", "fp16")  # precisions with an fp32 master copy
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
    strategy: str  # the strategy's label (MemoryModel.memory_identity): its name, or name-<stage>
    precision: str
    optim: str
    world: int
    model: str
    n_params: int
    state_elements: float
    terms: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    why: str = ""  # why this implementation differs from the ZeRO paper's formula (set by its builder)
    paper_stage: int = 0  # the ZeRO paper's stage it is held against (MemoryModel.memory_identity)
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

    def to_dict(self) -> dict:
        from zerolab.memory.paper import paper_bytes, paper_formula, paper_k, paper_split, vs_paper  # reads Prediction

        return {"strategy": self.strategy, "precision": self.precision, "optim": self.optim, "world": self.world,
                "model": self.model, "n_params": self.n_params, "state_elements_per_param": self.state_elements,
                "bytes": self.bytes(), "transient_bytes": self.transient_bytes,
                "bytes_per_param": {k: v / self.n_params for k, v in self.bytes().items()},
                "terms": [vars(t) for t in self.terms], "notes": list(self.notes),
                "paper_bytes": paper_bytes(self), "paper": {"formula": paper_formula(self), "K": paper_k(self),
                                                            "bytes_by_category": paper_split(self)},
                "vs_paper": vs_paper(self)}


def predicted_strategies() -> list[str]:
    """Every strategy the ledger can be asked about, in the order the CLI lists them."""
    return list(KNOWN)


def predict(shape: ModelShape, strategy: str, world: int = 1, precision: str = "bf16", optim: str = "adamw",
            stage: int = 0, bucket_mb: float = 25.0, state_elements: float | None = None,
            reduce_dtype: str = "auto", rank: int = 0) -> Prediction:
    """Predicted bytes on one rank. `state_elements` overrides the measured optimizer state
    (elements per parameter), e.g. for tests of the formulas."""
    if world < 1:
        raise ValueError(f"--world must be >= 1, got {world}")
    if precision not in COMPUTE_BYTES:
        raise ValueError(f"unknown precision {precision!r}; known: {', '.join(COMPUTE_BYTES)}")
    try:
        model = memory_model(strategy)
    except KeyError as e:
        raise ValueError(e.args[0]) from None
    label, paper_stage = model.memory_identity(stage)  # raises ValueError for a stage the strategy lacks
    k = optimizer_state_elements(optim) if state_elements is None else float(state_elements)
    pred = Prediction(label, precision, optim, world, shape.name, shape.n_params, k, paper_stage=paper_stage)
    model.predict_memory(pred, shape, world=world, precision=precision, k=k, stage=stage, bucket_mb=bucket_mb,
                         reduce_dtype=reduce_dtype, rank=rank)
    return pred


# ---- what the strategies' predict_memory share ---------------------------------------------------
def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def fmt_n(n: int) -> str:
    return f"{n:,}"


def dtype_name(precision: str) -> str:
    return "fp32" if precision == "fp32" else ("fp16" if precision == "fp16" else "bf16")


def state_bytes(precision: str) -> int:
    return 2 if precision == "bf16_pure" else 4  # bf16_pure keeps its optimizer state in bf16


def human_bytes(v: float) -> str:
    for unit, scale in (("GB", GB), ("MB", 1e6), ("kB", 1e3)):
        if v >= scale:
            return f"{v / scale:.2f} {unit}"
    return f"{int(v)} B"
