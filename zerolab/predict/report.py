"""A prediction as text: the step's parts, throughput, the collectives per link, and the model's assumptions."""
from __future__ import annotations

from zerolab.predict.model import Prediction
from zerolab.predict.timeline import PARTS

LABELS = {"compute": "compute", "optimizer": "optimizer", "comm_exposed": "exposed communication", "other": "other"}
HEADLINE = "a prediction is a model, not a measurement"


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


def format_prediction(p: Prediction, label: str = "") -> str:
    lines = [f"predicted step on {p.world} x {p.hardware}{' ' + label if label else ''} ({HEADLINE}):",
             f"  step {p.step_s * 1e3:,.1f} ms | {p.tokens_per_s_per_device:,.0f} tokens/s per device | "
             f"MFU {100 * p.mfu:.1f} % of the {p.dtype} peak"]
    for name in PARTS:
        share = 100 * p.parts[name] / p.step_s if p.step_s else 0.0
        lines.append(f"  {LABELS[name]:<23}{p.parts[name] * 1e3:>11,.1f} ms {share:6.1f} %")
    if p.collectives:
        lines.append(f"  collectives of one rank per step: {'kind':<15}{'count':>6}{'buffers':>14}"
                     f"{'sent in node':>15}{'sent across':>14}{'time':>11}{'exposed':>11}  algorithm")
        for c in p.collectives:
            lines.append(f"  {'':<34}{c['kind']:<15}{c['count']:>6}{_mb(c['bytes']):>14}{_mb(c['intra_bytes']):>15}"
                         f"{_mb(c['inter_bytes']):>14}{c['seconds'] * 1e3:>8.1f} ms{c['exposed_s'] * 1e3:>8.1f} ms"
                         f"  {'/'.join(c['algorithms'])}")
        lines.append(f"  {'':<34}(communication runs {p.comm_s * 1e3:,.1f} ms of the step; "
                     f"{100 * (1 - p.parts['comm_exposed'] / p.comm_s) if p.comm_s else 100:.0f} % hidden)")
    if p.unpriced:
        named = ", ".join(f"{name} x{n} ({100 * share:.1f} % of the step)" for name, n, share in p.unpriced[:8])
        lines.append(f"  priced by their bytes alone (no FLOP formula): {named}")
    lines.append("  assumptions:")
    lines += [f"    - {a}" for a in p.assumptions]
    return "\n".join(lines)
