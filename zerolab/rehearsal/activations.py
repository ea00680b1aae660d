"""Any model's activations, measured on fake tensors: the planner's figures for a user's model."""
from __future__ import annotations

import dataclasses

import torch

from zerolab.rehearsal.fake import RehearsalMode, whole_windows

MODES = ("none", "blocks", "selective")


def activation_model(mcfg, seq: int, precision: str):
    """`predict(micro_batch, checkpointing)` -> an ActivationPrediction for model config `mcfg`
    (any source) at sequence `seq`: the bytes one forward and its loss save for backward, as the
    trainer's meter counts them, measured on fake tensors (CPU kernels) at micro-batches 1, 2 and
    3 for each checkpointing mode (none, blocks, selective) and extended linearly from 2 and 3
    (every saved tensor is either per sequence or shared by the batch, so the bytes are affine in
    the micro-batch from 2 on; at 1 some copies are views, e.g. the loss's flattened targets).

    With checkpointing, the recomputed block (the peak's transient) is what one block's backward
    holds that its forward did not keep: under `blocks` the difference of none and blocks per
    block (a block's saved tensors less its input). Under `selective` the block also finds the op
    outputs the policy kept, but only those its backward reads are not recomputed; some kept
    outputs are read by no backward (a Llama block's q projection, rotated before attention saves
    anything; its down projection, added to the residual). So the kept outputs the plain forward
    also saves are measured directly: the model without checkpointing runs each block under the
    selective policy's caching mode alone (no checkpoint: autograd saves as usual, the meter sees
    it), and the kept outputs whose storages the meter counted are subtracted."""
    from zerolab.activations import ActivationPrediction
    from zerolab.precision import Precision
    from zerolab.schema import PrecisionConfig

    dtype = Precision.from_config(PrecisionConfig(name=precision)).compute_dtype
    measured, n_blocks = _measured(mcfg, seq, dtype)

    def at(mode: str, micro_batch: int) -> int:
        return (measured[mode, 1] if micro_batch == 1
                else measured[mode, 2] + (micro_batch - 2) * (measured[mode, 3] - measured[mode, 2]))

    def predict(micro_batch: int, checkpointing: str) -> ActivationPrediction:
        mode = checkpointing if (checkpointing, 1) in measured else "none"
        pred = ActivationPrediction(mcfg.name, micro_batch, seq, precision, "cpu (rehearsed)", mode)
        pred.add(f"saved for backward, measured on fake tensors ({mode})", at(mode, micro_batch))
        if mode != "none":
            # one block's saved tensors less its input (what blocks keeps): the recomputed block
            pred.layer_bytes = (at("none", micro_batch) - at("blocks", micro_batch)) // n_blocks
            if mode == "selective":  # and less the kept outputs its backward reads
                pred.layer_bytes -= at("kept", micro_batch) // n_blocks
        return pred

    return predict


def _measured(mcfg, seq: int, dtype) -> tuple[dict, int]:
    """{(mode, micro-batch): bytes} for MODES and "kept" (the kept outputs the plain forward also
    saves: the model without checkpointing, each block under the selective policy alone), at
    micro-batches 1, 2 and 3; and the number of blocks (0: no mode but none is measured)."""
    from zerolab.accounting import ActivationMeter
    from zerolab.accounting.storage import storage_key
    from zerolab.models import build_model, find_blocks, lm_loss, place
    from zerolab.models.recompute import kept_while

    measured, n_blocks = {}, 0
    with RehearsalMode(), whole_windows():
        for mode in (*MODES, "kept"):
            built = "none" if mode == "kept" else mode
            model = build_model(dataclasses.replace(mcfg, block_size=seq, activation_checkpointing=built, weights=""),
                                device="cpu")
            place(model, torch.device("cpu"), dtype).train()
            found = find_blocks(model, mcfg.blocks)
            n_blocks = len(found.modules) if found is not None else 0
            if mode != "none" and not n_blocks:
                break
            for b in (1, 2, 3):
                ids = torch.zeros(b, seq + 1, dtype=torch.long)
                kept: list[torch.Tensor] = []
                with ActivationMeter(model) as meter, kept_while(found.modules if mode == "kept" else [], kept):
                    lm_loss(model(ids[:, :-1]), ids[:, 1:])
                # kept: the kept outputs whose storages autograd saved too, each storage once
                read = {storage_key(t): t.untyped_storage().nbytes() for t in kept if meter.holds(t)}
                measured[mode, b] = sum(read.values()) if mode == "kept" else meter.bytes
    return measured, n_blocks
