"""Worker for tests/test_offload.py, run under torchrun: trains a list of jobs one after the other
in one process group (one launch for them all: starting ranks costs more than these jobs), in
OUT_DIR/<name>. The jobs come as a JSON list of [name, [override, ...], whole]: a whole job runs as
train.py would (Trainer.fit: metrics.jsonl, summary.json, model.safetensors, checkpoints); the
others only step, checkpoint where checkpoint.every says, and write their final weights
(model.safetensors), which is all their checks read and takes a few seconds less per job."""
import json
import sys

from safetensors.torch import save_file

from zerolab import dist as zdist
from zerolab.config import compose, validate
from zerolab.trainer import Trainer


def steps_only(trainer: Trainer, run_dir: str) -> None:
    for step in range(trainer.start_step, trainer.cfg.trainer.max_steps):
        trainer.train_step(step)
        if trainer.saves_step(step):
            trainer.save(step + 1)
    weights = trainer.strategy.consolidated_state_dict()
    if trainer.ctx.is_main:
        save_file(weights, f"{run_dir}/model.safetensors")


def main(out_dir: str, jobs: list) -> None:
    ctx = zdist.init(compose([]).dist)
    for name, overrides, whole in jobs:
        cfg = validate(compose([*overrides, f"run.dir={out_dir}/{name}"]), ctx.world_size)
        trainer = Trainer(cfg, ctx)
        try:
            trainer.fit() if whole else steps_only(trainer, f"{out_dir}/{name}")
        finally:
            trainer.close()
    zdist.shutdown(ctx)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
