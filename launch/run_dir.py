"""Print the run directory train.py will use for these Hydra overrides, and create it.

The launch scripts call this before starting any rank, so that they know where to put the rank
logs and the status file, and so that every node of a multi-node job is handed the same
`run.dir=` (the trainer's own choice would be made by one rank 0 only after rendezvous). The name
comes from zerolab.run.directory.new_run_dir: <run.root>/<experiment>/<time>-<strategy>[-job<id>]; a
requeued Slurm job gets the directory its first start chose (found by its job id).
Composing the config also validates it: a bad override, a user's model that cannot be built
(zerolab.models.preflight: a missing model.config, a target that does not import, a window past
its positions, no blocks for zero3/fsdp), a given token file that is missing, empty or too short
(zerolab.data.check_token_file), a run.dir that another job holds (zerolab/run/lock.py)
or a fresh start over another run's record (zerolab/run/record.py) exits with code 2 here, before any
allocation or process group is used.

  python launch/run_dir.py strategy=zero2 trainer.max_steps=5   ->  /abs/runs/default/...-zero2
"""
import glob
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zerolab.run import lock as runlock, record  # noqa: E402
from zerolab.checkpoint import check_resume_path, checkpoint_dir  # noqa: E402
from zerolab.config import ConfigError, check_overrides, compose, config_groups  # noqa: E402
from zerolab.data import check_token_file  # noqa: E402
from zerolab.job import model_preflight  # noqa: E402
from zerolab.models.sources import vocab_fix  # noqa: E402
from zerolab.run.directory import new_run_dir  # noqa: E402



def requeued_run_dir(cfg) -> str | None:
    """A requeued Slurm job (same job id, SLURM_RESTART_COUNT > 0) continues in its own directory."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job or int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) == 0:
        return None
    found = sorted(glob.glob(os.path.join(glob.escape(cfg.run.root), glob.escape(cfg.experiment),
                                          f"*-{glob.escape(cfg.strategy.name)}-job{job}")))
    return found[-1] if found else None


def choose(overrides: list[str]) -> str:
    # Unknown keys first, with zerolab's suggestion rather than Hydra's advice to add them with +.
    check_overrides(overrides, config_groups())
    cfg = compose(overrides)
    check_resume_path(cfg.checkpoint.resume)
    model_preflight(cfg)  # a user's model: config, code, window, blocks, weights; model=hf's vocabulary
    if cfg.data.kind == "text" and cfg.data.path:
        # A given token file that cannot give a window of each split, or holds a token the model's
        # vocabulary lacks: exit 2 here, seconds after the launch, not after every rank has started
        # (the ranks check it again themselves).
        check_token_file(cfg.data.path, cfg.model.block_size, cfg.data.val_fraction, cfg.model.vocab_size,
                         vocab_fix(cfg.model))
    path = os.path.abspath(cfg.run.dir or requeued_run_dir(cfg) or new_run_dir(cfg))
    runlock.check_free(path)  # a held directory: refuse before the launcher writes logs into it
    record.check(cfg, path, checkpoint_dir(cfg, path))  # another run's record: a fresh start here is refused
    os.makedirs(path, exist_ok=True)
    return path


def main(argv: list[str]) -> int:
    try:
        print(choose(argv))
    except ConfigError as err:
        print(f"zerolab: configuration error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # Hydra's own errors: unknown key, unknown group option
        print(f"zerolab: configuration error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
