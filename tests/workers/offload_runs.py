"""Worker for tests/test_offload.py, run under torchrun: trains a list of jobs one after the other
in one process group (one launch for them all: starting ranks costs more than these jobs), each
as train.py would (Trainer.fit: metrics.jsonl, summary.json, model.safetensors, checkpoints), in
OUT_DIR/<name>. The jobs come as a JSON list of [name, [override, ...]]."""
import json
import sys

from zerolab import dist as zdist
from zerolab.config import compose, validate
from zerolab.trainer import Trainer


def main(out_dir: str, jobs: list) -> None:
    ctx = zdist.init(compose([]).dist)
    for name, overrides in jobs:
        cfg = validate(compose([*overrides, f"run.dir={out_dir}/{name}"]), ctx.world_size)
        trainer = Trainer(cfg, ctx)
        try:
            trainer.fit()
        finally:
            trainer.close()
    zdist.shutdown(ctx)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
