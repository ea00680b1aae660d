"""Worker for tests/test_models_runs.py, run under torchrun: trains short jobs of the user's models
(model=hf configs written by the test, a model=custom module from a directory outside the
repository on PYTHONPATH) under several strategies, one after another in one process group, and
writes (rank 0) per run: the final fp32 weights, and per rank the model states measured after the
last step beside the ledger's prediction.

argv: OUT_DIR STEPS CASES_JSON, CASES_JSON = [{"key": ..., "overrides": [...]}, ...].
"""
import json
import os
import sys

import torch
from safetensors.torch import save_file

from zerolab import dist as zdist
from zerolab.config import compose
from zerolab.job import model_preflight
from zerolab.trainer import Trainer


def run_case(ctx, out_dir: str, steps: int, key: str, overrides: list[str]) -> dict:
    cfg = compose([*overrides, f"trainer.max_steps={steps}", "trainer.eval_every=0", "logging.wandb.mode=disabled",
                   "logging.progress=false", "run.save_model=false", f"run.dir={out_dir}/runs/{key.replace('/', '_')}"])
    model_preflight(cfg)  # what zerolab.job.run does first: model=hf's vocabulary into cfg.model
    torch.manual_seed(cfg.trainer.seed)
    trainer = Trainer(cfg, ctx)
    for step in range(steps):
        trainer.train_step(step)
        trainer.strategy.comm.pop_step()
    measured = trainer.strategy.memory()
    predicted = trainer.memory.predicted
    weights = trainer.strategy.consolidated_state_dict()
    per_rank = ctx.gather_objects({"measured": measured,
                                   "predicted": predicted[ctx.rank].bytes() if predicted else None})
    trainer.close()
    if ctx.is_main:
        name = key.replace("/", "__")
        save_file(weights, os.path.join(out_dir, f"{name}.safetensors"))
    return {"per_rank": per_rank, "n_params": trainer.n_params, "vocab_size": cfg.model.vocab_size}


def main(out_dir: str, steps: int, cases_json: str) -> None:
    os.environ.setdefault("WANDB_MODE", "disabled")
    with open(cases_json) as fh:
        cases = json.load(fh)
    ctx = zdist.init(compose([]).dist)
    results = {case["key"]: run_case(ctx, out_dir, steps, case["key"], case["overrides"]) for case in cases}
    if ctx.is_main:
        with open(os.path.join(out_dir, "results.json"), "w") as fh:
            json.dump({"world_size": ctx.world_size, "results": results}, fh)
    zdist.shutdown(ctx)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
