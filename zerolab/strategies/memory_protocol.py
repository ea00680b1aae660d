"""The memory half of the strategy protocol: what the ledger (zerolab.memory) asks of a strategy.

Strategy inherits it, so every strategy predicts its own bytes per rank next to the code that
allocates them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from zerolab.accounting import ModelShape, Prediction


class MemoryModel:
    name: str = "?"
    # The ZeRO stage (Rajbhandari et al. 2019) the strategy implements, whose formula its
    # prediction is printed beside: 0 plain data parallelism, 1 P_os, 2 P_os+g, 3 P_os+g+p. In
    # zerolab "stage" means this and nothing else (a DeepSpeed run sets it: strategy.stage).
    stage: int = 0
    # The strategy.stage values `python -m zerolab memory --sweep-world` gives a row; () leaves the
    # strategy out of the sweep.
    sweep_stages: tuple[int, ...] = (0,)
    # (strategy, strategy.stage) of another implementation of the same ZeRO stage, predicted
    # beside this one by `python -m zerolab memory --strategy <this>`; None: none.
    memory_reference: Optional[tuple[str, int]] = None
    # True when ranks hold different amounts: the ledger of a run then predicts every rank.
    uneven_memory: bool = False

    @classmethod
    def memory_identity(cls, stage: int) -> tuple[str, int]:
        """(label, ZeRO stage) of the prediction for strategy.stage=`stage`; a ValueError
        naming the fix where the strategy has no such stage."""
        return cls.name, cls.stage

    @classmethod
    def predict_memory(cls, pred: "Prediction", shape: "ModelShape", *, world: int, precision: str, k: float,
                       stage: int, bucket_mb: float, reduce_dtype: str, rank: int) -> None:
        """Add this strategy's bytes on rank `rank` of `world` to `pred`, term by term, each with
        the sentence that says where it comes from: pred.add(category, bytes, what), category one
        of zerolab.memory.CATEGORIES or "transient" (alive during part of the step only, not in
        the total). Set pred.why to why the figures differ from the ZeRO paper's, and add notes.

        `shape`: the model's tensors (zerolab.memory.ModelShape); `precision`: fp32 | bf16 | fp16 |
        bf16_pure; `k`: optimizer-state elements per parameter; `stage`, `bucket_mb`,
        `reduce_dtype`: the run's strategy.* settings. Every keyword is always passed; take the
        ones you use and `**_` for the rest. Raise zerolab.memory.NotPredicted for settings the
        strategy cannot run, ValueError for other bad input."""
        raise NotImplementedError(f"strategy {cls.name} has no memory model (MemoryModel.predict_memory)")
