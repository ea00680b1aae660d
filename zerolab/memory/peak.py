"""The peak of a training step per rank: one composition, used by the planner (predicted parts),
the ledger of a run (predicted parts) and the trainer's CPU accounting (measured parts).

Peak = the larger of two moments of a step:
  backward  model states (params, grads, master, optimizer state, buffers) + activations (every
            tensor the forward saved for backward, at its largest when backward starts) + the
            transients of that moment:
              - logits buffers: 8 bytes per logit (b·s·V). Backward of the loss holds the fp32
                gradient of the log-probabilities and of the (fp32-cast) logits at once; the
                forward's logits (c bytes) and their fp32 copy are gone by then and are never
                more than that.
              - one checkpointed block recomputed (its activations minus what it kept: its
                input, and with selective checkpointing the kept op outputs), with activation
                checkpointing.
              - the strategy's own buffers alive during backward (buckets copied for reduction,
                gathered weights).
  step      model states + what exists inside the optimizer step only (fp32 gradient copies,
            all-gather input chunks).
Not counted: the gradients of activations flowing through one layer during backward, autograd's
and the kernels' scratch space, the CUDA context, allocator fragmentation, NCCL/gloo buffers.
"""
from __future__ import annotations

from dataclasses import dataclass

from zerolab.accounting import CATEGORIES

LOGIT_BUFFER_BYTES = 8  # fp32 gradient of the log-probabilities + of the fp32 logits, per logit
PARTS = ("model_states", "activations", "transient")  # the split logged as mem/peak_<part>_bytes
PEAK_WARN_RATIO = 1.10  # measured peak or activations above predicted by more than 10%: a warning


def logits_buffer_bytes(micro_batch: int, seq: int, vocab: int) -> int:
    return LOGIT_BUFFER_BYTES * micro_batch * seq * vocab


def recompute_bytes(act_pred) -> int:
    """One checkpointed block recomputed during backward: its activations (layer_bytes of an
    activation prediction) minus what its backward finds already kept, counted in the
    activations: its input, and under selective checkpointing the kept op outputs it reads
    (kept_bytes; 0 where only the input is kept)."""
    if act_pred.checkpointing == "none" or not act_pred.layer_bytes:
        return 0
    return act_pred.layer_bytes - (getattr(act_pred, "kept_bytes", 0) or act_pred.block_input_bytes)


@dataclass
class Peak:
    bytes: int
    phase: str  # "backward" | "step": the moment that sets the peak
    parts: dict  # model_states, activations, transient at that moment
    categories: dict  # params, grads, master, optim_state, buffers, activations, transient

    def to_dict(self) -> dict:
        return {"peak_bytes": self.bytes, "phase": self.phase, **{f"{k}_bytes": v for k, v in self.parts.items()}}


def peak_of(states: dict, activations: int, transient_backward: int, transient_step: int) -> Peak:
    """The step's peak from its parts: `states` bytes by category (CATEGORIES: what stays
    between steps), the activations saved by one micro-batch's forward, and the transients of
    the backward and of the optimizer step."""
    base = {k: int(states.get(k, 0)) for k in CATEGORIES}
    backward = {**base, "activations": int(activations), "transient": int(transient_backward)}
    step = {**base, "activations": 0, "transient": int(transient_step)}
    bwd, stp = sum(backward.values()), sum(step.values())
    cats, phase = (backward, "backward") if bwd >= stp else (step, "step")
    parts = {"model_states": sum(base.values()), "activations": cats["activations"], "transient": cats["transient"]}
    return Peak(max(bwd, stp), phase, parts, cats)


def predicted_peak(pred, act_pred, mcfg, micro_batch: int, seq: int) -> Peak:
    """The device's peak from a zerolab.memory Prediction (model states and the strategy's transient
    terms, each with Term.when) and a zerolab.activations prediction for the same run; what the
    prediction places on the host (Term.place: offload) is not in it."""
    device = [t for t in pred.terms if t.category == "transient" and t.place == "device"]
    comm_bwd = sum(t.bytes for t in device if t.when != "step")
    comm_step = sum(t.bytes for t in device if t.when == "step")
    model_bwd = logits_buffer_bytes(micro_batch, seq, mcfg.vocab_size) + recompute_bytes(act_pred)
    return peak_of(pred.bytes("device"), act_pred.bytes, model_bwd + comm_bwd, comm_step)
