"""zerolab's training entry point.

  python train.py [key=value ...]                                  # one process
  torchrun --standalone --nproc_per_node=2 train.py strategy=zero2 # two ranks

A configuration problem (unknown key, bad value, batch that does not divide, unusable data, a run
directory another job holds) exits with code 2, the config checks before any process group is
created. A failure zerolab can explain (zerolab.errors.ZerolabError) is printed as one paragraph
without a traceback (ZEROLAB_DEBUG=1 shows it) and exits with its code. Under torchrun only rank 0
prints a message every rank shares.
"""
import os
import sys
import traceback

import hydra
from omegaconf import DictConfig

from zerolab.config import ConfigError, check_overrides
from zerolab.errors import ZerolabError, debug_enabled, report

CONF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conf")
_task_started = False


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    global _task_started
    _task_started = True
    from zerolab.trainer import run

    try:
        run(cfg)
    except (ConfigError, ZerolabError) as err:
        sys.exit(report(err))


def _check_command_line() -> None:
    """Unknown keys, before Hydra sees them: Hydra would advise `+key=...`, which zerolab refuses
    too (the schema is closed); zerolab's message suggests the nearest valid key instead."""
    overrides = [a for a in sys.argv[1:] if not a.startswith("-") and "=" in a]
    groups = [d for d in os.listdir(CONF) if os.path.isdir(os.path.join(CONF, d))]
    try:
        check_overrides(overrides, groups)
    except ConfigError as err:
        sys.exit(report(err))


if __name__ == "__main__":
    _check_command_line()
    try:
        main()
    except SystemExit as exit_:
        # Hydra exits with 1 when composing the config fails (wrong type, unknown group option);
        # before the task started that is a configuration error: exit 2.
        if exit_.code == 1 and not _task_started:
            sys.exit(2)
        raise
    except Exception as err:  # with HYDRA_FULL_ERROR=1 Hydra re-raises instead of exiting
        if _task_started:
            raise
        # Composing the config failed: the user's input, so the message, not a traceback.
        if debug_enabled():
            traceback.print_exc()
        cause = f"\n{err.__cause__}" if err.__cause__ is not None and str(err.__cause__) not in str(err) else ""
        print(f"zerolab: configuration error: {err}{cause}", file=sys.stderr)
        sys.exit(2)
