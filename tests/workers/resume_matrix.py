"""One reader resuming several checkpoints in one launch (tests/test_resume_matrix.py).

`read_each([spec])`, called on every rank by tests/ranks.py's `call`: the spec (a JSON file) is a
list of jobs, each the overrides of a run that resumes one checkpoint (checkpoint.resume=...)
into a checkpoint.dir of its own. For each job, in order, in one process group: the Trainer is
built (it resumes while it is built, as train.py's job does), saves at once the state it holds
right after loading (its own pieces, at the checkpoint's step, into its checkpoint.dir), trains
the rest of the run (its final weights in its run.dir), and closes. A job that fails fails the
launch, naming the job.

`train([overrides...])`: train.py's job, for a writer. Both let DeepSpeed train fp16 on a CPU
without AVX512-FP16 as on one with it (tests/workers/ds_fp16_cpu.py says why that is the same
run): the one predicate DeepSpeed's CPU accelerator answers, pinned to yes for fp16 jobs.
"""
import json
import logging
from pathlib import Path

log = logging.getLogger("zerolab")


def _offer_fp16(overrides: list[str]) -> None:
    if "precision=fp16" in overrides:
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        CPU_Accelerator.is_fp16_supported = lambda self: True


def train(args: list[str]) -> None:
    from zerolab.config import compose
    from zerolab.job import run

    _offer_fp16(args)
    run(compose(args))


def read_each(args: list[str]) -> None:
    from zerolab import dist as zdist
    from zerolab.config import compose, validate
    from zerolab.trainer import Trainer

    jobs = json.loads(Path(args[0]).read_text())
    _offer_fp16([o for job in jobs for o in job])
    ctx = None
    for job in jobs:
        cfg = validate(compose(job))
        ctx = ctx or zdist.init(cfg.dist)
        log.info("resume matrix: %s", " ".join(job))
        trainer = Trainer(cfg, ctx)
        try:
            trainer.save(trainer.start_step)  # the state right after loading, in the reader's own layout
            trainer.fit()
        finally:
            trainer.close()
    if ctx is not None:
        zdist.shutdown(ctx)
