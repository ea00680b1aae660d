"""zerolab's training entry point.

  python train.py [key=value ...]                                  # one process
  torchrun --standalone --nproc_per_node=2 train.py strategy=zero2 # two ranks

A configuration problem (unknown key, bad value, batch that does not divide) exits with code 2
before any process group is created.
"""
import sys
import traceback

import hydra
from omegaconf import DictConfig

from zerolab.config import ConfigError

_task_started = False


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    global _task_started
    _task_started = True
    from zerolab.preempt import Preempted
    from zerolab.trainer import run

    try:
        run(cfg)
    except ConfigError as err:
        print(f"zerolab: configuration error: {err}", file=sys.stderr)
        sys.exit(2)
    except Preempted as err:  # stopped on SIGTERM/SIGUSR1 after a checkpoint: not a crash
        print(err, file=sys.stderr, flush=True)
        sys.exit(err.exit_code)


if __name__ == "__main__":
    try:
        main()
    except SystemExit as exit_:
        # Hydra exits with 1 when composing the config fails (unknown key, wrong type, unknown
        # group option); before the task started that is a configuration error: exit 2.
        if exit_.code == 1 and not _task_started:
            sys.exit(2)
        raise
    except Exception:  # with HYDRA_FULL_ERROR=1 Hydra re-raises instead of exiting
        if _task_started:
            raise
        traceback.print_exc()
        sys.exit(2)
