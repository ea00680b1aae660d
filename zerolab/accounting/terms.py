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

from zerolab.accounting.storage import CATEGORIES, MODEL_STATES, PLACES, placed
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
    # Where the bytes live (PLACES): "device" (the accelerator's memory) or "host" (the node's CPU
    # memory, shared by its ranks: ZeRO-Offload's master, state and gradient shard)
    place: str = "device"


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

    def add(self, category: str, nbytes: float, what: str, when: str = "backward", place: str = "device") -> None:
        if place not in PLACES:
            raise ValueError(f"place={place!r} is not one of {', '.join(PLACES)}")
        self.terms.append(Term(category, int(math.ceil(nbytes)), what, when, place))

    def bytes(self, place: str | None = None) -> dict[str, int]:
        """Bytes by category (CATEGORIES, model_states, total), every place together, or only
        `place`'s ("device" or "host"). The keys of StorageCounter.result()'s categories, so
        predicted and measured line up."""
        out = {c: 0 for c in CATEGORIES}
        for t in self.terms:
            if t.category in out and (place is None or t.place == place):
                out[t.category] += t.bytes
        out["model_states"] = sum(out[c] for c in MODEL_STATES)
        out["total"] = sum(out[c] for c in CATEGORIES)
        return out

    def by_place(self) -> dict[str, dict[str, int]]:
        """The planner's and the time model's view: {"device": bytes, "host": bytes}, each
        `bytes(place)` (by category, model_states, total). device is what must fit in one GPU;
        host is this rank's share of its node's CPU memory (host_per_node multiplies it by the
        ranks of a node). Transients are not in it: transient_bytes(place)."""
        return {place: self.bytes(place) for place in PLACES}

    def placed(self) -> dict[str, int]:
        """The prediction in the measured record's flat keys (StorageCounter.result: "device",
        "host" totals and "host/<category>"), for holding one against the other."""
        return placed(self.bytes(), self.bytes("host"))

    def transient_bytes_at(self, place: str = "device") -> int:
        """The transient terms that live in `place` (pinned host staging buffers are on the host)."""
        return sum(t.bytes for t in self.terms if t.category == "transient" and t.place == place)

    @property
    def transient_bytes(self) -> int:
        return sum(t.bytes for t in self.terms if t.category == "transient")


def host_per_node(preds: list[Prediction], ranks_per_node: int) -> list[int]:
    """Host bytes of each node (its ranks share one host's memory): the sum of its ranks'
    predicted host totals, ranks laid out node-major as zerolab.topology numbers them. `preds`:
    one Prediction per rank (memory.ledger_for_run), or one for every rank alike."""
    hosts = [p.bytes("host")["total"] for p in preds]
    return [sum(hosts[i:i + ranks_per_node]) for i in range(0, len(hosts), ranks_per_node)]



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
