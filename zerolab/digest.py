"""The end-of-run digest that `python -m zerolab compare` checks parity with.

Two questions decide whether two strategies trained the same model:

1. Do they compute the same function? Every rank evaluates the same fixed held-out batches
   (the first windows of the validation split, whatever the rank or world size) with the final
   model; rank 0 saves each batch's loss and the logits (fp32) in `eval_logits.safetensors`.
2. Where do their weights differ for a reason other than rounding? Some weights have a true
   gradient of exactly zero: the key third of the GPT's `attn.qkv.bias` (softmax ignores a
   constant shift of a row of scores). fp32 rounding leaves noise there, and Adam divides that
   noise by its own root-mean-square, so each summation order takes its own lr-sized random walk.
   Rank 0 finds such elements from the run itself: it recomputes the gradient of the digest
   batches at the final weights in float64 (rounding ~1e-16, so a zero gradient shows as ~0)
   and in fp32, and marks each element whose float64 |g| is no larger than the fp32 result's
   error: a gradient fp32 cannot resolve, so its direction is rounding noise. Their flat indices go to
   `grad_noise.safetensors`; the
   report compares weights without them and lists them apart.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch

from zerolab.atomic import atomic_path
from zerolab.errors import ConfigError
from zerolab.models import build_model, lm_loss

DIGEST_BATCHES = 2  # fixed validation batches ...
DIGEST_SEQS = 2  # ... of this many sequences each
MAX_LOGIT_ELEMENTS = 1 << 20  # 4 MiB of fp32 logits per batch at most: later positions are dropped
PROBE_MAX_PARAMS = 50_000_000  # the float64 probe holds two float64 copies of the model on rank 0


def digest_batches(data, device) -> list:
    """The same windows for every rank, world size and strategy: val windows 0, 1, 2, ..."""
    return [data.val_batch(i, 0, 1, DIGEST_SEQS, device) for i in range(DIGEST_BATCHES)]


@torch.no_grad()
def eval_logits(model: torch.nn.Module, batches: list) -> tuple[list[float], list[torch.Tensor]]:
    """Per-batch loss and (possibly truncated) fp32 logits. Every rank must call it: a sharded
    model's forward is collective."""
    was_training = model.training
    model.eval()
    losses, logits = [], []
    for b in batches:
        out = model(b.x).float()
        losses.append(lm_loss(out, b.y).item())
        keep = max(1, min(out.shape[1], MAX_LOGIT_ELEMENTS // (out.shape[0] * out.shape[2])))
        logits.append(out[:, :keep].cpu().contiguous())
    model.train(was_training)
    return losses, logits


def noise_mask(grad64: torch.Tensor, grad32: torch.Tensor) -> torch.Tensor:
    """Elements whose gradient fp32 cannot resolve: the fp32 result's error (against float64)
    is at least as large as the gradient itself (signal-to-rounding-noise <= 1)."""
    return grad64.abs() <= (grad32.double() - grad64).abs()


def _probe_grads(model_cfg, weights: dict[str, torch.Tensor], batches: list, dtype) -> Optional[dict]:
    # Any model source rebuilds from its config (model=hf from its config.json, model=custom from
    # its target), without model.weights: the run's final weights are loaded below.
    try:
        probe = build_model(model_cfg, device="cpu", weights=False).to(dtype)
    except ConfigError:  # the source no longer resolves here (a moved config, a target off the path)
        return None
    if sum(p.numel() for p in probe.parameters()) > PROBE_MAX_PARAMS:
        return None
    try:
        probe.load_state_dict({k: v.to(dtype) for k, v in weights.items()}, strict=True)
    except RuntimeError:  # Trainer(model=...) with a module of its own: not rebuildable here
        return None
    probe.eval()
    for b in batches:  # summed over the digest batches
        lm_loss(probe(b.x.cpu()), b.y.cpu()).backward()
    return {k: p.grad for k, p in probe.state_dict(keep_vars=True).items()
            if isinstance(p, torch.nn.Parameter) and p.grad is not None}


def gradient_noise(model_cfg, weights: dict[str, torch.Tensor], batches: list) -> Optional[dict[str, torch.Tensor]]:
    """{state_dict key: flat indices of noise-level elements} for tensors that have any; None when
    the probe cannot run (a model zerolab did not build, or one too large for float64 copies).
    The gradient of the digest batches at the final weights, once in float64 (the reference:
    rounding ~1e-16) and once in fp32 (what training computes)."""
    g64 = _probe_grads(model_cfg, weights, batches, torch.float64)
    g32 = _probe_grads(model_cfg, weights, batches, torch.float32) if g64 is not None else None
    if g32 is None:
        return None
    out = {}
    for key, g in g64.items():
        idx = noise_mask(g, g32[key]).flatten().nonzero().flatten()
        if idx.numel():
            out[key] = idx
    return out


def write_digest(model: torch.nn.Module, data, model_cfg, weights: Optional[dict], run_dir: str,
                 is_main: bool, device, save: Optional[Callable[[str, dict], bool]] = None) -> dict:
    """Collective (every rank evaluates); rank 0 writes the files with `save(name, tensors)`
    (default: atomically into run_dir; zerolab.run.results.FinalFiles.save_tensors records a full disk
    instead of raising) and returns summary.json's `eval_digest` entry ({} on other ranks)."""
    batches = digest_batches(data, device)
    losses, logits = eval_logits(model, batches)
    if not is_main:
        return {}
    save = save or (lambda name, tensors: _save_atomic(os.path.join(run_dir, name), tensors))
    tensors = {f"logits/{i}": t for i, t in enumerate(logits)}
    tensors["loss"] = torch.tensor(losses, dtype=torch.float32)
    entry = {"file": "eval_logits.safetensors", "batches": DIGEST_BATCHES, "seqs_per_batch": DIGEST_SEQS,
             "batch_losses": losses, "loadavg_end": list(os.getloadavg())}
    if not save("eval_logits.safetensors", tensors):
        entry["file"] = None
    noise = gradient_noise(model_cfg, weights, batches) if weights is not None else None
    if noise is not None:
        if save("grad_noise.safetensors",
                {k: v.contiguous() for k, v in noise.items()} or {"_none": torch.zeros(0, dtype=torch.int64)}):
            entry["noise_level"] = {k: int(v.numel()) for k, v in noise.items()}
    return entry


def _save_atomic(path: str, tensors: dict) -> bool:
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file(tensors, tmp)
    return True
