"""Shared helpers: launch real torchrun jobs of train.py (real processes, real gloo)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


# ---- tiers ------------------------------------------------------------------------------------
# `make test-fast` runs `pytest -m "not slow"`: unit and in-process tests only. A test that starts
# any process (torchrun, python, sbatch, g++ through DeepSpeed's op builder) belongs to the slow
# tier and must say so with @pytest.mark.slow (or a module-level `pytestmark`). The guard below
# makes a mislabelled test fail in every tier, so the fast tier cannot quietly grow slow.
_spawn_allowed = True
_popen_init = subprocess.Popen.__init__


def _guarded_popen_init(self, *args, **kwargs):
    if not _spawn_allowed:
        raise RuntimeError("this test starts a process but is not marked @pytest.mark.slow; mark it "
                           "(the fast tier, `make test-fast`, runs in-process tests only)")
    _popen_init(self, *args, **kwargs)


subprocess.Popen.__init__ = _guarded_popen_init


def pytest_runtest_setup(item):
    # Runs before any fixture of the item, module-scoped ones included.
    global _spawn_allowed
    _spawn_allowed = item.get_closest_marker("slow") is not None


def pytest_runtest_teardown(item, nextitem):
    global _spawn_allowed
    _spawn_allowed = True  # fixtures' teardown and collection may spawn freely


def base_env(**extra) -> dict:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1",
                "HYDRA_FULL_ERROR": "1"})
    env.update(extra)
    return env


def run_train(run_dir: Path, nproc: int, *overrides: str, check: bool = True, env: dict | None = None,
              timeout: float = 300) -> subprocess.CompletedProcess:
    """torchrun train.py with 'nproc' ranks into run_dir; fails the test with the output on error."""
    cmd = [*TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", str(ROOT / "train.py"),
           f"run.dir={run_dir}", "logging.wandb.mode=disabled", "logging.progress=false", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=base_env(**(env or {})), capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"train.py failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def run_python(*args: str, check: bool = True, timeout: float = 300, env: dict | None = None,
               cwd: Path = ROOT) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=base_env(**(env or {})),
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"python {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def load_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(run_dir) / "model.safetensors"))


def read_metrics(run_dir: Path) -> list[dict]:
    with open(Path(run_dir) / "metrics.jsonl") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def max_rel_diff(a: dict, b: dict) -> float:
    """max over tensors of |a-b|_inf / max(|b|_inf, 1e-12)."""
    assert a.keys() == b.keys(), f"different tensor names: {sorted(a.keys() ^ b.keys())}"
    worst = 0.0
    for k in a:
        x, y = a[k].double(), b[k].double()
        worst = max(worst, ((x - y).abs().max() / y.abs().max().clamp_min(1e-12)).item())
    return worst


def rel_l2_diff(a: dict, b: dict) -> float:
    """max over tensors of ‖a−b‖₂ / ‖b‖₂: the relative error of each tensor as a whole. Unlike an
    elementwise max it does not single out the few elements whose gradient is ~0, where Adam's
    normalised update turns last-bit summation differences into lr-sized steps."""
    assert a.keys() == b.keys(), f"different tensor names: {sorted(a.keys() ^ b.keys())}"
    return max(((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-12)).item() for k in a)
