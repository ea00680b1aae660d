"""The ZeRO paper beside zerolab: the paper's per-rank formula for the stage a prediction is held
against (Prediction.stage, declared by each strategy), its figure, and why the ledger's
figure differs.

Rajbhandari et al. 2019 (ZeRO, §5.1 and Figure 1): per rank, 2Ψ of 16-bit weights, 2Ψ of 16-bit
gradients and KΨ of optimizer states (K = 12 for mixed-precision Adam: fp32 master weights,
momentum and variance, 4 bytes each); stage 1 (P_os) divides the optimizer states by N, stage 2
(P_os+g) also the gradients, stage 3 (P_os+g+p) also the weights. For other precisions and
optimizers the same formula is taken with c = compute-dtype bytes instead of 2 and
K = master bytes + the optimizer's state elements × their bytes.
"""
from __future__ import annotations

from zerolab.accounting import CATEGORIES, GB, MIXED, Prediction, human_bytes, state_bytes
from zerolab.precision import COMPUTE_BYTES

PAPER_FORMULA = {0: "({c}+{c}+K)Ψ", 1: "{c}Ψ+{c}Ψ+KΨ/N", 2: "{c}Ψ+({c}+K)Ψ/N", 3: "({c}+{c}+K)Ψ/N"}


def paper_k(pred: Prediction) -> float:
    """The paper's K: optimizer-state bytes per parameter (master copy included)."""
    return (4 if pred.precision in MIXED else 0) + pred.state_elements * state_bytes(pred.precision)


def paper_k_text(pred: Prediction) -> str:
    k, s = pred.state_elements, state_bytes(pred.precision)
    parts = (["fp32 master 4"] if pred.precision in MIXED else []) + [f"{k:g} state elements × {s}"]
    return f"K = {paper_k(pred):g} ({' + '.join(parts)})"


def paper_formula(pred: Prediction) -> str:
    return PAPER_FORMULA[pred.stage].format(c=COMPUTE_BYTES[pred.precision])


def paper_split(pred: Prediction) -> dict[str, float]:
    """The paper's bytes per rank by category (exact fractions of Ψ; no padding, no buffers)."""
    stage, n, N = pred.stage, pred.n_params, pred.world
    c, s = COMPUTE_BYTES[pred.precision], state_bytes(pred.precision)
    div = lambda at: N if stage >= at else 1  # the stage at which a state starts being divided
    return {"params": c * n / div(3), "grads": c * n / div(2),
            "master": (4 * n if pred.precision in MIXED else 0) / div(1),
            "optim_state": pred.state_elements * s * n / div(1), "buffers": 0.0}


def paper_bytes(pred: Prediction) -> int:
    return int(round(sum(paper_split(pred).values())))


def vs_paper(pred: Prediction) -> str:
    """One line: which categories differ from the paper's, by how much, and why."""
    ours, paper = pred.bytes(), paper_split(pred)
    n, N = pred.n_params, pred.world
    parts = []
    for cat in CATEGORIES:
        d = ours[cat] - paper[cat]
        if abs(d) < 1:  # the paper's exact fraction against whole bytes
            continue
        size = f"{'+' if d > 0 else '-'}{human_bytes(abs(d))}"
        per_shard = d * N / n
        if cat == "buffers":
            parts.append(f"buffers {size} (model buffers; the paper counts model states only)")
        elif abs(per_shard) < 0.01:
            parts.append(f"{cat} {size} (padding)")
        elif N > 1 and abs(per_shard - round(per_shard)) < 0.01 and abs(per_shard) <= 16:
            # a whole number of bytes per parameter of a shard: a term of the form xΨ/N
            parts.append(f"{cat} {size} ({per_shard:+.3g}Ψ/N)")
        else:
            parts.append(f"{cat} {size} ({d / n:+.3g}Ψ)")
    if not parts:
        return "same as the paper" + (f" ({pred.why})" if pred.explain_always else "")
    return ", ".join(parts) + (f": {pred.why}" if pred.why else "")


def gb_figure(v: float) -> str:
    """GB as the paper's Figure 1 prints them: one decimal from 1 GB up, three digits below."""
    x = v / GB
    return f"{x:.1f}" if x >= 1 else f"{x:.3g}"


def format_paper(pred: Prediction, reference: Prediction | None = None) -> list[str]:
    """The block under a single prediction: the paper's formula and figure, this strategy's, and
    `reference`'s, another implementation of the same stage (Traits.memory_reference).
    Figures of 1 GB and up are rounded as the paper's Figure 1 prints them; the differences are
    exact."""
    fig = lambda v: f"{gb_figure(v)} GB" if v >= GB else human_bytes(v)
    lines = [f"vs the ZeRO paper (Rajbhandari et al. 2019), per rank, {paper_k_text(pred)}:",
             f"  {'paper':<22} {paper_formula(pred):<16} {fig(paper_bytes(pred)):>10}"]
    for p in (pred, reference):
        if p is not None:
            lines.append(f"  {p.strategy + ' (ledger)':<22} {'':<16} {fig(p.bytes()['total']):>10}  {vs_paper(p)}")
    return lines
