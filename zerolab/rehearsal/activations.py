"""Any model's activations, measured on fake tensors: the planner's figures for a user's model."""
from __future__ import annotations

import dataclasses

import torch

from zerolab.rehearsal.fake import RehearsalMode, whole_windows


def activation_model(mcfg, seq: int, precision: str):
    """`predict(micro_batch, checkpointing)` -> an ActivationPrediction for model config `mcfg`
    (any source) at sequence `seq`: the bytes one forward and its loss save for backward, as the
    trainer's meter counts them, measured on fake tensors (CPU kernels) at micro-batches 1, 2 and
    3 for each checkpointing mode and extended linearly from 2 and 3 (every saved tensor is either
    per sequence or shared by the batch, so the bytes are affine in the micro-batch from 2 on; at
    1 some copies are views, e.g. the loss's flattened targets). With checkpointing, the
    recomputed block (the peak's transient) is the difference of the two modes per block."""
    from zerolab.accounting import ActivationMeter
    from zerolab.activations import ActivationPrediction
    from zerolab.models import build_model, find_blocks, lm_loss, place
    from zerolab.precision import Precision
    from zerolab.schema import PrecisionConfig

    dtype = Precision.from_config(PrecisionConfig(name=precision)).compute_dtype
    measured, n_blocks = {}, 0
    with RehearsalMode(), whole_windows():
        for mode in ("none", "blocks"):
            model = build_model(dataclasses.replace(mcfg, block_size=seq, activation_checkpointing=mode, weights=""),
                                device="cpu")
            place(model, torch.device("cpu"), dtype).train()
            found = find_blocks(model, mcfg.blocks)
            n_blocks = len(found.modules) if found is not None else 0
            if mode == "blocks" and not n_blocks:
                break
            for b in (1, 2, 3):
                ids = torch.zeros(b, seq + 1, dtype=torch.long)
                with ActivationMeter(model) as meter:
                    lm_loss(model(ids[:, :-1]), ids[:, 1:])
                measured[mode, b] = meter.bytes

    def predict(micro_batch: int, checkpointing: str) -> ActivationPrediction:
        mode = checkpointing if (checkpointing, 1) in measured else "none"
        at = {m: measured[m, 1] if micro_batch == 1
              else measured[m, 2] + (micro_batch - 2) * (measured[m, 3] - measured[m, 2])
              for m in ("none", "blocks") if (m, 1) in measured}
        pred = ActivationPrediction(mcfg.name, micro_batch, seq, precision, "cpu (rehearsed)", mode)
        pred.add(f"saved for backward, measured on fake tensors ({mode})", at[mode])
        if mode != "none":
            pred.layer_bytes = (at["none"] - at["blocks"]) // n_blocks  # one block recomputed, minus its input
        return pred

    return predict
