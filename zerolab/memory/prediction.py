"""The predicted side of the ledger: what a strategy should hold per rank, term by term.

`predict` names no strategy: it asks the strategy registry (zerolab.strategies.strategy_class)
for the class that implements the strategy, and that class's `predict_memory` adds the terms
(Strategy.predict_memory). Prediction and its terms
live in zerolab/accounting/terms.py, below the strategies that fill them in.
"""
from __future__ import annotations

from zerolab.accounting import ModelShape, Prediction
from zerolab.memory.shapes import optimizer_state_elements
from zerolab.precision import COMPUTE_BYTES
from zerolab.precision_modes import Mode
from zerolab.strategies import REGISTRY, strategy_class

def prediction_dict(pred: Prediction) -> dict:
    """A prediction as JSON values, with the ZeRO paper's figure beside it."""
    from zerolab.memory.paper import paper_bytes, paper_formula, paper_k, paper_split, vs_paper

    return {"strategy": pred.strategy, "precision": pred.precision, "optim": pred.optim, "world": pred.world,
            "model": pred.model, "n_params": pred.n_params, "state_elements_per_param": pred.state_elements,
            "bytes": pred.bytes(), "transient_bytes": pred.transient_bytes,
            "bytes_per_param": {k: v / pred.n_params for k, v in pred.bytes().items()},
            "terms": [vars(t) for t in pred.terms], "notes": list(pred.notes),
            "paper_bytes": paper_bytes(pred), "paper": {"formula": paper_formula(pred), "K": paper_k(pred),
                                                        "bytes_by_category": paper_split(pred)},
            "vs_paper": vs_paper(pred)}


def predicted_strategies() -> list[str]:
    """Every strategy the ledger can be asked about, in the order the CLI lists them."""
    return list(REGISTRY)


def predict(shape: ModelShape, strategy: str, world: int = 1, precision: str = "bf16", optim: str = "adamw",
            stage: int = 0, bucket_mb: float = 25.0, state_elements: float | None = None,
            reduce_dtype: str = "auto", rank: int = 0, ranks_per_node: int | None = None,
            settings: dict | None = None, mode: Mode = Mode()) -> Prediction:
    """Predicted bytes on one rank. `state_elements` overrides the measured optimizer state
    (elements per parameter), e.g. for tests of the formulas; `ranks_per_node` (default: all on
    one node) lays the ranks out in nodes; `settings`: the run's whole strategy section as a dict,
    for settings the keywords do not carry (a library's own config overrides); `mode`: how a bf16
    run holds its master and state (precision.master, ...: zerolab/precision_modes.py)."""
    if world < 1:
        raise ValueError(f"--world must be >= 1, got {world}")
    if precision not in COMPUTE_BYTES:
        raise ValueError(f"unknown precision {precision!r}; known: {', '.join(COMPUTE_BYTES)}")
    try:
        model = strategy_class(strategy)
    except KeyError as e:
        raise ValueError(e.args[0]) from None
    label, zero_stage = model.memory_identity(stage)  # raises ValueError for a stage the strategy lacks
    k = optimizer_state_elements(optim) if state_elements is None else float(state_elements)
    pred = Prediction(label, precision, optim, world, shape.name, shape.n_params, k, stage=zero_stage)
    model.predict_memory(pred, shape, world=world, precision=precision, k=k, stage=stage, bucket_mb=bucket_mb,
                         reduce_dtype=reduce_dtype, rank=rank, ranks_per_node=ranks_per_node or world,
                         settings=settings or {}, mode=mode)
    return pred


