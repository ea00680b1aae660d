"""Published GPU runs, each mapped onto zerolab's settings: what bench/predict_gpu.py predicts.

torchtitan (pytorch/torchtitan): FSDP2, bf16 parameters with fp32 gradient reduction (its
defaults: `strategy=fsdp precision=bf16`), no torch.compile, no Float8.
- torchtitan docs/performance.md: Llama 3 8B (sequence 8192, local batch 1) and Llama 2 13B (sequence 4096,
  local batch 2) on 64 A100 80GB. Its "selective layer" checkpointing recomputes every second
  block (`every_k`, k=2); "selective op" saves the outputs of its compute-heavy ops
  (`selective`); "no" is `none`.
- benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3, "FSDP" rows: Llama 3.1 8B on 8
  and on 128 H100 (96 GB HBM2e, 500 W: the `h100-hbm2e` entry; 400 Gb/s RDMA per GPU), sequence
  8192, local batch 2, selective (op) checkpointing; 82.4 and 67.0 GiB of memory.
mosaicml/llm-foundry, scripts/train/benchmarking/README.md: MPT under FSDP FULL_SHARD, bf16, flash
attention, no activation checkpointing, sequence 2048, on H100 80GB SXM (`h100`). An MPT block is
mapped to a transformers GPT-2 config of its width, depth and heads (MLP 4 x width), vocabulary
50,368, no dropout (MPT trains without) and MPT's activation, torch's exact GELU (one kernel;
GPT-2's default `gelu_new` is a Python tanh formula of eight elementwise kernels on the largest
activation, which MPT does not run): MPT's blocks have no biases and use ALiBi, which GPT-2's
biases and learned positions do not change by more than a fraction of a percent of the FLOPs.

Every row's ratio is a prediction but the one zerolab.predict.gpu.FITTED_ON names.
"""
from __future__ import annotations

import dataclasses
import gzip
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from zerolab.predict.gpu import FITTED_ON
from zerolab.predict.hardware import DEVICES, LINKS
from zerolab.predict.model import Prediction, predict
from zerolab.predict.record import HOST, Collective, Op, StepRecord, Sync, Wait
from zerolab.predict.topology import Network

EVENTS = {cls.__name__: cls for cls in (Op, Collective, Wait, Sync)}
TITAN_A100 = "torchtitan docs/performance.md"
TITAN_H100 = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
FOUNDRY = "llm-foundry scripts/train/benchmarking/README.md"
CHECKPOINTING = {"none": ["model.activation_checkpointing=none"],
                 "layer": ["model.activation_checkpointing=every_k", "model.checkpoint_every_k=2"],
                 "op": ["model.activation_checkpointing=selective"]}


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    model: str  # a shipped shape (zerolab/models/shapes/) or "gpt2:WIDTH:LAYERS:HEADS"
    seq: int
    micro_batch: int
    checkpointing: str  # CHECKPOINTING's key: the published run's setting
    hardware: str
    world: int
    published: int  # tokens/s per GPU
    memory_gib: float = 0.0  # published peak memory, where the row is also a memory check

    def overrides(self, config: str) -> list[str]:
        return ["model=hf", f"model.config={config}", f"model.block_size={self.seq}", "strategy=fsdp",
                "precision=bf16", "optim=adamw", f"data.micro_batch={self.micro_batch}",
                *CHECKPOINTING[self.checkpointing]]

    def mapping(self) -> str:
        shape = self.model if not self.model.startswith("gpt2:") else \
            "GPT-2 width {}, {} layers, {} heads".format(*self.model.split(":")[1:])
        return (f"{shape}, seq {self.seq}, micro-batch {self.micro_batch}, checkpointing {self.checkpointing} "
                f"({' '.join(CHECKPOINTING[self.checkpointing])}); {self.source}")

    def role(self) -> str:
        return "fitted" if self.name == FITTED_ON else "predicted"


RUNS = (
    Run("llama3-8b-a100-layer", TITAN_A100, "llama3.1-8b", 8192, 1, "layer", "a100", 64, 2904),
    Run("llama3-8b-a100-op", TITAN_A100, "llama3.1-8b", 8192, 1, "op", "a100", 64, 2973),
    Run("llama2-13b-a100-none", TITAN_A100, "llama2-13b", 4096, 2, "none", "a100", 64, 2162),
    Run("llama2-13b-a100-layer", TITAN_A100, "llama2-13b", 4096, 2, "layer", "a100", 64, 1914),
    Run("llama2-13b-a100-op", TITAN_A100, "llama2-13b", 4096, 2, "op", "a100", 64, 1904),
    Run("llama3.1-8b-h100x8-op", TITAN_H100, "llama3.1-8b", 8192, 2, "op", "h100-hbm2e", 8, 5762, 82.4),
    Run("llama3.1-8b-h100x128-op", TITAN_H100, "llama3.1-8b", 8192, 2, "op", "h100-hbm2e", 128, 5605),
    Run("mpt-1b-h100x8", FOUNDRY, "gpt2:2048:24:16", 2048, 14, "none", "h100", 8, 45455),
    Run("mpt-7b-h100x8", FOUNDRY, "gpt2:4096:32:32", 2048, 6, "none", "h100", 8, 10643),
    Run("mpt-13b-h100x64", FOUNDRY, "gpt2:5120:40:40", 2048, 2, "none", "h100", 64, 4800),
)


def gpt2_config(model: str, seq: int) -> dict:
    width, layers, heads = (int(x) for x in model.split(":")[1:])
    return {"model_type": "gpt2", "n_embd": width, "n_layer": layers, "n_head": heads, "vocab_size": 50368,
            "n_positions": seq, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "activation_function": "gelu"}


def predict_row(run: Run, r) -> Prediction:
    dev = DEVICES[run.hardware]
    topo = Network(run.world, 8, LINKS[dev.intra], LINKS[dev.inter], dev)
    return predict(r.record, topo, r.tokens_per_rank, r.flops_per_token, "bf16")


def order_agrees(predicted: dict) -> list[tuple[str, bool, list, list]]:
    """Per hardware kind: (kind, same order, rows by published tokens/s, rows by predicted)."""
    out = []
    for hardware in dict.fromkeys(r.hardware for r in RUNS if r.name in predicted):
        rows = [r for r in RUNS if r.hardware == hardware and r.name in predicted]
        published = [r.name for r in sorted(rows, key=lambda r: -r.published)]
        by_model = sorted(published, key=lambda n: -predicted[n])
        out.append((hardware, published == by_model, published, by_model))
    return out


def _event(kind: str, fields: list):
    cls = EVENTS[kind]
    if cls is Collective:
        fields[3] = tuple(fields[3])
    elif cls is Op:
        fields[9] = tuple(fields[9])  # dims
    return cls(*fields)


def save(r, path: Path) -> None:
    """What pricing a rehearsal needs, gzipped JSON: its recorded step and shape, and its memory
    peak (bench/predict_gpu.py keeps them; tests price them without rehearsing). Not its host
    sections: a GPU prices them at nothing, and their times differ from one rehearsal to the next."""
    rec = r.record
    events = [e for e in rec.events if not (isinstance(e, Op) and e.name.startswith(HOST))]
    data = {"tokens_per_rank": r.tokens_per_rank, "flops_per_token": r.flops_per_token,
            "peak_bytes": r.measured.get("mem/peak_bytes", 0), "streams": rec.streams,
            "events_recorded": rec.events_recorded, "unpriced": dict(rec.unpriced),
            "events": [[type(e).__name__, _fields(e)] for e in events]}
    with gzip.open(path, "wt") as f:
        json.dump(data, f)


def _fields(e) -> list:
    """An event's fields as saved: an op's without host_s (0: host sections are not saved)."""
    fields = list(dataclasses.astuple(e))
    return fields[:10] if isinstance(e, Op) else fields


def load(path: Path) -> SimpleNamespace:
    with gzip.open(path, "rt") as f:
        data = json.load(f)
    events = [_event(kind, fields) for kind, fields in data["events"]]
    record = StepRecord(events, [e for e in events if isinstance(e, Collective)], Counter(data["unpriced"]),
                        data["streams"], data["events_recorded"])
    return SimpleNamespace(record=record, tokens_per_rank=data["tokens_per_rank"],
                           flops_per_token=data["flops_per_token"], peak_bytes=data["peak_bytes"])
