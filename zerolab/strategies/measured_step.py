"""A logged step's optimizer update, measured (Strategy.step's `measure`): how long the update
took between two device syncs, and, from zerolab's optimizers (torch's are only timed), the
update-to-weight ratios ‖Δw‖/‖w‖ and the optimizer's own statistics (LAMB's and LARS's trust
ratios). A step that measures nothing never comes here (Strategy._optimizer_step).
"""
from __future__ import annotations

import math
import time
from typing import Callable

import torch

from zerolab.dist import DistContext
from zerolab.numerics import Measure


def measured_step(opt: torch.optim.Optimizer, measure: Measure, ctx: DistContext,
                  all_reduce: Callable[[torch.Tensor], None], note_working_copies: Callable[[], None]) -> dict:
    """opt.step(), measured as `measure` asks; `all_reduce` completes a flat shard's partial sums
    (the strategy's), `note_working_copies` is called right after the update."""
    tracks = hasattr(opt, "pop_update_stats")  # zerolab's optimizers; torch's are only timed
    if tracks:
        opt.track_updates = True
    ctx.synchronize()
    t0 = time.perf_counter()
    try:
        opt.step()
        ctx.synchronize()
    finally:
        if tracks:
            opt.track_updates = False
    extra = {"optim_step_s": time.perf_counter() - t0}
    note_working_copies()
    if tracks:
        extra.update(update_ratios(opt.pop_update_stats(), measure >= Measure.PER_TENSOR, ctx, all_reduce))
        extra.update(opt.step_stats())
    return extra


def update_ratios(records: list[dict], per_tensor: bool, ctx: DistContext,
                  all_reduce: Callable[[torch.Tensor], None]) -> dict:
    """‖Δw‖/‖w‖ over the whole model (and per tensor) from the optimizer's per-tensor sums of
    squares; flat shards give partial sums, completed here by one all-reduce."""
    if not records:
        return {}
    vec = torch.cat([torch.cat([r["update_sq"], r["weight_sq"]]) for r in records]).to(ctx.device)
    if any(r["partial"] for r in records) and ctx.world_size > 1:
        all_reduce(vec)
    vec, out, offset = vec.double().cpu(), {}, 0
    upd_total = weight_total = 0.0
    for r in records:
        n = len(r["names"])
        upd, wsq = vec[offset:offset + n], vec[offset + n:offset + 2 * n]
        offset += 2 * n
        upd_total += upd.sum().item()
        weight_total += wsq.sum().item()
        if per_tensor:
            for name, u, w in zip(r["names"], upd.tolist(), wsq.tolist()):
                if w > 0:
                    out[f"update_ratio/{name}"] = math.sqrt(u / w)
    if weight_total > 0:
        out["update_ratio"] = math.sqrt(upd_total / weight_total)
    return out
