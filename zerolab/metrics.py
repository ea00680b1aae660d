"""Metrics: metrics.jsonl in the run directory is the source of truth; wandb mirrors it.

Only rank 0 writes. Per-rank figures are gathered to rank 0 by the trainer and logged as
`rank{r}/...` keys of the same record: one wandb run per job, not one per rank.
"""
from __future__ import annotations

import json
import logging
import math
import os
from typing import Optional

from zerolab.config import LoggingConfig

log = logging.getLogger(__name__)


def _jsonable(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no inf/nan; keep them readable instead of failing
    return v


class MetricsSink:
    def __init__(self, run_dir: str, cfg: LoggingConfig, is_main: bool, experiment: str,
                 job_type: str, config: dict):
        self.is_main = is_main
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.file = open(self.path, "a", buffering=1) if is_main else None
        self.wandb = self._init_wandb(cfg, run_dir, experiment, job_type, config) if is_main else None

    @staticmethod
    def _init_wandb(cfg: LoggingConfig, run_dir: str, experiment: str, job_type: str, config: dict):
        mode = cfg.wandb.mode
        if mode == "auto":
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        if mode == "disabled":
            return None
        import wandb

        return wandb.init(project=cfg.wandb.project, entity=cfg.wandb.entity or None, dir=run_dir,
                          # a sweep's jobs share one group (set by hydra_plugins/zerolab_torchrun)
                          group=os.environ.get("ZEROLAB_WANDB_GROUP") or experiment,
                          job_type=job_type, config=config, mode=mode,
                          name=os.path.basename(run_dir), reinit="finish_previous")

    def log(self, record: dict) -> None:
        if not self.is_main:
            return
        self.file.write(json.dumps({k: _jsonable(v) for k, v in record.items()}) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "step"}, step=record.get("step"))

    def close(self, summary: Optional[dict] = None) -> None:
        if self.file:
            self.file.close()
        if self.wandb is not None:
            if summary:
                self.wandb.summary.update({k: v for k, v in summary.items() if not isinstance(v, (dict, list))})
            self.wandb.finish()


def read_jsonl(path: str) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]
