"""The planner's tables after its memory table (zerolab.plan): `--exact`'s rows rehearsed on rank 0,
and `--hardware`'s rows ranked by predicted speed, offload rows with their host bytes per node."""
from __future__ import annotations

from zerolab.accounting import human_bytes


def format_exact(fits: list, confirmed: list[dict], budget: int) -> str:
    lines = ["", f"--exact: each row rehearsed on rank 0 (python -m zerolab dry-run), against the budget "
                 f"{human_bytes(budget)}:",
             f"{'strategy':<12} {'ckpt':<9} {'plan mb':>7} {'rehearsed peak':>15}  verdict"]
    for f, c in zip(fits, confirmed):
        if c["not_rehearsed"]:
            verdict, shown = f"not rehearsed: {c['not_rehearsed'].split(' (')[0]}", "-"
        elif c["rehearsed_micro_batch"] == f.micro_batch:
            verdict, shown = "fits, as planned", human_bytes(c["planned_peak_rehearsed_bytes"])
        else:
            verdict = (f"over the budget at mb {f.micro_batch}; the largest that fits: "
                       f"{c['rehearsed_micro_batch'] or 'none'}")
            shown = human_bytes(c["planned_peak_rehearsed_bytes"])
        lines.append(f"{f.label:<12} {f.checkpointing:<9} {f.micro_batch or 'none':>7} {shown:>15}  {verdict}")
    lines.append("A rehearsal runs the job's own step on fake tensors with CPU kernels: where they save other "
                 "tensors than a GPU's (attention with dropout), its activations are the CPU's.")
    return "\n".join(lines)


def format_speed(speed: dict) -> str:
    w = max([12] + [len(r["strategy"]) for r in speed["rows"]])
    host = any(r.get("host_bytes_per_node") for r in speed["rows"])  # offload rows: their host bytes per node
    lines = ["", f"predicted speed on {speed['world']} x {speed['hardware']}, fastest first "
                 f"(a prediction is a model, not a measurement):",
             f"{'strategy':<{w}} {'ckpt':<9} {'mb':>4} {'peak/rank':>10} {'step':>11} {'tokens/s/dev':>13} {'MFU':>6} "
             f"{'exposed comm':>13}" + (f" {'host/node':>10}" if host else "")]
    for r in speed["rows"]:
        lines.append(f"{r['strategy']:<{w}} {r['checkpointing']:<9} {r['micro_batch']:>4} "
                     f"{human_bytes(r['peak_bytes']):>10} {r['step_s'] * 1e3:>8.1f} ms "
                     f"{r['tokens_per_s_per_device']:>13,.0f} {100 * r['mfu']:>5.1f}% "
                     f"{100 * r['comm_exposed_share']:>12.1f}%"
                     + (f" {human_bytes(r['host_bytes_per_node']) if r['host_bytes_per_node'] else '-':>10}"
                        if host else ""))
    if not speed["rows"]:
        lines.append("(nothing fits at these micro-batches)")
    lines += [f"not rehearsed, no time predicted: {s['strategy']} ({s['why'].split(' (')[0]})"
              for s in speed["not_rehearsed"]]
    lines += ["assumptions:", *(f"  - {a}" for a in speed["assumptions"])]
    return "\n".join(lines)
