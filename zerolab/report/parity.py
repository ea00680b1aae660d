"""Parity against the baseline: function space first (the held-out digest each run saved),
then the final weights, with rounding-noise-level elements listed apart, and a known cause."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from zerolab.report.band import band_verdict, loss_band
from zerolab.report.runs import Run, strategy_class


# Parity tolerance on max relative |Δparam| against a baseline of the same precision. fp32 runs
# of the same math agree to ~1e-7 (tests); 16-bit runs round differently on every path, so
# their figure is shown for information with a loose bound.
TOLERANCE = {"fp32": 1e-5, "bf16": 5e-2, "fp16": 5e-2, "bf16_pure": 5e-2}
# Function-space tolerance on max |Δlogit| of the fixed held-out batches, relative to the
# baseline's max |logit|. fp32 weights that agree to ~1e-7 (above) move logits by about as much
# after a few layers; 1e-4 leaves three orders of magnitude for that while a real difference
# (DeepSpeed + a client LAMB: weights 4e-2 apart) is far above it.
FUNCTION_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2, "fp16": 5e-2, "bf16_pure": 5e-2}


def _load(path: Path) -> Optional[dict]:
    from safetensors.torch import load_file

    return load_file(str(path)) if path.exists() else None


def function_parity(run: Run, base: Run) -> Optional[dict]:
    """Δ of the end-of-run digest (zerolab.digest): the same fixed held-out batches through both
    final models. None when either run has no digest (runs from before it existed)."""
    a, b = _load(run.path / "eval_logits.safetensors"), _load(base.path / "eval_logits.safetensors")
    if a is None or b is None or a.keys() != b.keys():
        return None
    keys = [k for k in a if k.startswith("logits/")]
    if any(a[k].shape != b[k].shape for k in keys):
        return None
    d_logit = max((a[k].double() - b[k].double()).abs().max().item() for k in keys)
    scale = max(b[k].double().abs().max().item() for k in keys)
    d_loss = (a["loss"].double() - b["loss"].double()).abs().max().item()
    return {"max_dlogit": d_logit, "rel_dlogit": d_logit / max(scale, 1e-12), "d_eval_loss": d_loss}


def noise_elements(run: Run) -> Optional[dict]:
    """{tensor: flat indices} of elements whose gradient is at fp32 rounding level (the run's
    grad_noise.safetensors), or None when the run did not probe."""
    found = _load(run.path / "grad_noise.safetensors")
    return None if found is None else {k: v for k, v in found.items() if k != "_none"}


def known_cause(run: Run, base: Run) -> str:
    """A cause zerolab knows for a real difference, or ''."""
    for r in (run, base):
        cls = strategy_class(r.strategy)
        cause = cls.known_cause(r.config) if cls else ""
        if cause:
            return f"{r.label}: {cause}"
    return ""


def weight_deltas(a: dict, b: dict, noise: dict) -> tuple[dict, list[dict]]:
    """Per tensor, max |Δ| and max |Δ| / max |b| over the elements outside `noise` ({tensor:
    indices} at rounding-noise level), and a row for each tensor with noise-level elements."""
    import torch

    deltas, noise_rows = {}, []
    for k in a:
        x, y = a[k].double().flatten(), b[k].double().flatten()
        diff = (x - y).abs()
        scale = max(y.abs().max().item(), 1e-12)
        if k in noise:
            idx = noise[k]
            noise_rows.append({"tensor": k, "elements": int(idx.numel()), "of": int(diff.numel()),
                               "max_abs": diff[idx].max().item(), "max_rel": diff[idx].max().item() / scale})
            keep = torch.ones_like(diff, dtype=torch.bool)
            keep[idx] = False
            diff = diff[keep]
        d = diff.max().item() if diff.numel() else 0.0
        deltas[k] = (d, d / scale)
    return deltas, noise_rows


def parity(run: Run, base: Run) -> dict:
    """Function space first (Δ of the fixed held-out logits and losses), then the final weights:
    max |Δ| and max relative |Δ| (per tensor: max|Δ| / max|base|) over elements whose gradient is
    not at rounding-noise level; those are shown apart (see zerolab.digest)."""
    import torch

    a, b = _load(run.path / "model.safetensors"), _load(base.path / "model.safetensors")
    if a is None or b is None:
        return {"status": "no weights"}
    bad = {"status": "MISMATCH", "max_abs": float("inf"), "max_rel": float("inf"), "tol": 0.0}
    if a.keys() != b.keys():
        return {**bad, "detail": f"different tensors: {sorted(a.keys() ^ b.keys())[:5]}", "worst": ""}
    for k in a:
        if a[k].shape != b[k].shape:
            return {**bad, "detail": f"{k}: shape {tuple(a[k].shape)} vs {tuple(b[k].shape)}", "worst": k}
    na, nb = noise_elements(run), noise_elements(base)
    noise = {k: torch.unique(torch.cat([x[k] for x in (na, nb) if x and k in x])) for k in {*(na or {}), *(nb or {})}}
    deltas, noise_rows = weight_deltas(a, b, noise)
    rel_by = {k: rel for k, (_, rel) in deltas.items()}
    worst = max(rel_by, key=rel_by.get)
    same_prec = run.precision == base.precision
    tol = TOLERANCE.get(run.precision, 1e-5) if same_prec else float("nan")
    ftol = FUNCTION_TOLERANCE.get(run.precision, 1e-4) if same_prec else float("nan")
    fn = function_parity(run, base)
    out = {"max_abs": max(d for d, _ in deltas.values()), "max_rel": rel_by[worst], "worst": worst, "tol": tol,
           "function_tol": ftol, "noise_level": noise_rows, "noise_probe": na is not None or nb is not None,
           **(fn or {})}
    same = [(run.summary.get(k), base.summary.get(k)) for k in ("steps", "global_batch", "model", "optimizer")]
    if not same_prec:
        return {**out, "status": "n/a (precision differs)"}
    if any(x != y for x, y in same):
        return {**out, "status": "n/a (steps/batch/model/optimizer differ)"}
    banded = held_in_band(run, base, a, b, fn)
    return {**out, **(banded or verdict(run, base, rel_by, tol, fn, ftol))}


def held_in_band(run: Run, base: Run, a: dict, b: dict, fn: Optional[dict]) -> Optional[dict]:
    """The verdict of a run that rounds on purpose (or whose baseline does: Strategy.lossy), held
    within its loss band (zerolab/report/band.py) instead of match/MISMATCH; None when neither does."""
    lossy = [(who, r, _lossy(r)) for who, r in (("the run", run), ("the baseline", base))]
    named = [(who, r, x) for who, r, x in lossy if x is not None]
    if not named:
        return None
    levels = tuple(x.forward_levels if x else 0 for _, _, x in lossy)
    max_weight = max(max(t.abs().max().item() for t in w.values()) for w in (a, b))
    decay = float(run.config.get("optim", {}).get("weight_decay", 0.0) or 0.0)
    band = loss_band(run.metrics, base.metrics, levels, max_weight, decay)
    diff = sum((a[k].double() - b[k].double()).pow(2).sum().item() for k in b)
    norm = sum(b[k].double().pow(2).sum().item() for k in b)
    what = "; ".join(f"{who} ({r.label}): {x.what}" for who, r, x in named)
    return band_verdict(named[0][2].kind, what, band, (diff / max(norm, 1e-24)) ** 0.5, fn)


def _lossy(run: Run):
    cls = strategy_class(run.strategy)
    return cls.lossy(run.config) if cls else None


def verdict(run: Run, base: Run, rel_by: dict, tol: float, fn: Optional[dict], ftol: float) -> dict:
    """match or MISMATCH, and for a mismatch what is off and any known cause."""
    off = sorted((k for k, r in rel_by.items() if r > tol), key=lambda k: -rel_by[k])
    fn_off = fn is not None and fn["rel_dlogit"] > ftol
    if not (off or fn_off):
        return {"status": "match"}
    what = []
    if fn is not None:
        what.append(f"function: max |Δlogit| {fn['max_dlogit']:.2e} ({fn['rel_dlogit']:.1e} of the logit "
                    f"scale), Δeval-loss {fn['d_eval_loss']:.2e}" + ("" if fn_off else " (within tolerance)"))
    if off:
        what.append(f"{len(off)} tensor(s) above {tol:.0e}: " +
                    ", ".join(f"{k} {rel_by[k]:.1e}" for k in off[:3]) + (" ..." if len(off) > 3 else ""))
    out = {"status": "MISMATCH", "detail": "; ".join(what)}
    cause = known_cause(run, base)
    if cause:
        out["cause"] = cause
    return out
