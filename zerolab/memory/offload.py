"""`python -m zerolab memory --offload`: the device and the host bytes of every strategy that
offloads (its class's offload_modes: ZeRO-Offload's optimizer offload, Ren et al., USENIX ATC 2021;
ZeRO-Infinity's parameter offload, Rajbhandari et al., SC 2021), per rank and per node, beside the
estimate of the implementation its memory_reference names, where that class gives one
(offload_reference). The ledger's figures are exact for the strategy's own packing (padding
included); neither side counts activations or transients.
"""
from __future__ import annotations

from zerolab.accounting import GB, ModelShape, host_per_node
from zerolab.memory.prediction import predict, predicted_strategies
from zerolab.strategies import strategy_class


def _label(name: str, settings: dict) -> str:
    return " ".join([name, *("+opt" for k in ("offload_optimizer",) if settings.get(k)),
                     *("+params" for k in ("offload_params",) if settings.get(k))])


def offload_rows(shape: ModelShape, world: int, precision: str, optim: str, bucket_mb: float) -> list[dict]:
    """One row per strategy and offload mode: the ledger's device and host bytes on rank 0 and the
    host bytes of its node (every rank on one node), and the reference's estimate where it has one."""
    rows = []
    for name in predicted_strategies():
        cls = strategy_class(name)
        for settings in getattr(cls, "offload_modes", lambda: [])():
            pred = predict(shape, name, world, precision, optim, bucket_mb=bucket_mb, settings=settings)
            by = pred.by_place()
            row = {"mode": _label(name, settings), "device_bytes": by["device"]["total"],
                   "host_bytes": by["host"]["total"], "host_per_node_bytes": host_per_node([pred] * world, world)[0]}
            ref = cls.offload_reference(shape, world, settings)
            if ref is not None:
                row.update(reference=cls.traits.memory_reference[0], reference_device_bytes=ref.device,
                           reference_host_per_node_bytes=ref.host_per_node, reference_source=ref.source)
            rows.append(row)
    return rows


def format_offload(shape: ModelShape, world: int, precision: str, optim: str, bucket_mb: float) -> str:
    rows = offload_rows(shape, world, precision, optim, bucket_mb)
    refs = sorted({r["reference"] for r in rows if "reference" in r})
    gb = lambda v: f"{v / GB:>10.3f}" if v is not None else f"{'-':>10}"
    beside = f", beside {' and '.join(refs)}'s own estimate" if refs else ""
    lines = [f"{shape.name}: {shape.n_params:,} parameters | N = {world} on one node | {precision} | {optim} | "
             f"GB, model states and buffers (the ledger){beside}", "",
             f"{'':<20}{'zerolab':>30}{'/'.join(refs) or 'reference':>22}",
             f"{'mode':<20}{'device':>10}{'host':>10}{'host/node':>10}{'device':>11}{'host/node':>11}"]
    for r in rows:
        lines.append(f"{r['mode']:<20}{gb(r['device_bytes'])}{gb(r['host_bytes'])}{gb(r['host_per_node_bytes'])} "
                     f"{gb(r.get('reference_device_bytes'))} {gb(r.get('reference_host_per_node_bytes'))}")
    lines += ["", "device and host: per rank; host/node: the node's ranks together (they share its memory).",
              "+opt: strategy.offload_optimizer=true (master, optimizer state, gradient shard and the step on the "
              "host); +params: strategy.offload_params=true (the weight shards on the host too).",
              "'-': the reference has no estimate for that mode (or needs the largest layer, which a bare parameter "
              "count does not give). Its figures: "
              + "; ".join(sorted({r["reference_source"] for r in rows if "reference_source" in r})) + "."]
    return "\n".join(lines)
