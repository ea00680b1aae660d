"""DeepSpeed's C++ ops, built once at install time instead of on a run's first use.

On CPU, DeepSpeed compiles two small ops the first time a run needs them: its shared-memory
collectives (`deepspeed_shm_comm`, loaded when its comm layer starts) and its fused Adam
(`fused_adam`, for optimizer type Adam/AdamW); with optimizer offload, on a CPU or a GPU machine,
its CPU Adam (`cpu_adam`, the host's step). A first-use compile takes minutes on a busy
2-core machine, inside a run or a test, and a compile killed half-way leaves a lock that makes
the next run wait. So `make install` builds them into the virtualenv (`<venv>/torch_extensions`),
next to the torch they were compiled against, and every zerolab DeepSpeed run looks there first.
TORCH_EXTENSIONS_DIR, when set, wins (torch's own convention). The Dockerfile and the GPU install
(docs/launch.md) run the same command: each op of the list that the machine's DeepSpeed
accelerator has is built (on CUDA: cpu_adam, and fused_adam where a GPU is visible, since DeepSpeed
builds a CUDA op for the GPU it sees; without one it builds on the first run, with nvcc).

    python -m zerolab.ds_ops build      # what `make install` runs
    python -m zerolab.ds_ops status     # which ops are built, where
"""
from __future__ import annotations

import logging
import os
import sys
import time

from zerolab.errors import ZerolabError

_log = logging.getLogger("zerolab")

# The builder classes DeepSpeed's CPU accelerator loads for zerolab's configurations.
CPU_OPS = {"ShareMemCommBuilder": "deepspeed_shm_comm", "FusedAdamBuilder": "fused_adam"}
# and the one strategy.offload_optimizer needs: DeepSpeedCPUAdam, the host's step (minutes to compile)
OFFLOAD_OPS = {"CPUAdamBuilder": "cpu_adam"}


def ops_dir() -> str:
    """Where torch.utils.cpp_extension builds and finds DeepSpeed's ops for this interpreter."""
    return os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(sys.prefix, "torch_extensions")


def use_prebuilt() -> str:
    """Point this process's extension builds at ops_dir() (before DeepSpeed loads any op)."""
    os.environ["TORCH_EXTENSIONS_DIR"] = path = ops_dir()
    return path


def built_ops(ops: dict = CPU_OPS) -> dict[str, bool]:
    """op name -> whether its shared library exists under ops_dir() (any torch build tag), for the
    ops of `ops` (builder -> op name)."""
    # With TORCH_EXTENSIONS_DIR set, torch builds into <dir>/<op>/; its default cache adds a
    # <python+device tag>/ level (py311_cpu/<op>/).
    root = ops_dir()
    subdirs = [os.path.join(root, d) for d in os.listdir(root)] if os.path.isdir(root) else []
    return {op: any(os.path.exists(os.path.join(d, f"{op}.so")) or os.path.exists(os.path.join(d, op, f"{op}.so"))
                    for d in [os.path.join(root, op), *subdirs]) for op in ops.values()}


def missing_reason() -> str | None:
    """None when every CPU op is built; otherwise a sentence naming what is missing and the fix."""
    missing = [op for op, ok in built_ops().items() if not ok]
    if not missing:
        return None
    return (f"DeepSpeed's CPU ops {', '.join(missing)} are not built in {ops_dir()}; a run would compile them "
            f"on first use (minutes). Build them once with `make install` or `python -m zerolab.ds_ops build`")


def _build_one(builder_name: str) -> str:
    """Build one op (in a process of its own: build() runs them side by side); what to print."""
    path = use_prebuilt()
    from deepspeed.accelerator import get_accelerator

    import torch
    from deepspeed.ops.op_builder.builder import CUDAOpBuilder

    t0, op = time.perf_counter(), {**CPU_OPS, **OFFLOAD_OPS}[builder_name]
    accel = get_accelerator()
    builder = accel.create_op_builder(builder_name)
    if builder is None:
        return f"{op}: not an op of DeepSpeed's {accel.device_name()} accelerator, skipped (its runs do not load it)"
    if isinstance(builder, CUDAOpBuilder) and not torch.cuda.is_available():
        return (f"{op}: a CUDA op, built for the GPU DeepSpeed sees, and none is visible here: it builds on "
                f"the first run on a GPU (nvcc)")
    if not builder.is_compatible():
        return f"{op}: not compatible with this machine, skipped (DeepSpeed falls back without it)"
    builder.load(verbose=False)
    return f"{op}: built in {path} ({time.perf_counter() - t0:.0f} s)"


def build() -> int:
    use_prebuilt()
    from deepspeed.accelerator import get_accelerator

    print(f"DeepSpeed's {get_accelerator().device_name()} accelerator: building its ops of "
          f"{', '.join({**CPU_OPS, **OFFLOAD_OPS}.values())} into {ops_dir()}")
    # Each op is a compiler run or two that uses one core: on 2 cores, building the three side by
    # side takes about half as long as one after another. Each has its own build directory and lock.
    import concurrent.futures
    import multiprocessing

    names = [*CPU_OPS, *OFFLOAD_OPS]
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(len(names), os.cpu_count() or 1),
                                                mp_context=multiprocessing.get_context("spawn")) as pool:
        for line in pool.map(_build_one, names):
            print(line)
    return 0

# ---- DeepSpeed's op builds ---------------------------------------------------------------------
# DeepSpeed compiles its C++ ops on first use with torch.utils.cpp_extension, which serialises
# builders with a `lock` file created O_EXCL in the op's build directory and removed when the build
# ends; every other process polls for the file to go. A builder killed mid-build leaves the file,
# and everyone after waits forever. A live builder is visible: the build runs ninja and the
# compiler with the build directory as their working directory. So a lock with no process working
# in its directory, older than the moment between taking the lock and starting ninja, is stale.
LOCK_GRACE_S = 30.0  # a lock younger than this may be a builder that has not started ninja yet
OPS_WAIT_S = 1800.0  # the longest zerolab waits for a live build of another process


def extensions_root() -> str:
    """Where torch puts JIT-built extensions (TORCH_EXTENSIONS_DIR, else torch's default)."""
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return root
    # torch names its default root per Python and accelerator; ask it rather than repeat the rule
    probe = cpp_extension._get_build_directory("zerolab_probe", verbose=False)  # creates it, empty
    try:
        os.rmdir(probe)
    except OSError:
        pass  # another rank removed it first
    return os.path.dirname(probe)


def op_names() -> list[str]:
    """Names of the ops DeepSpeed's accelerator here can build (their build directories' names)."""
    import importlib

    from deepspeed.accelerator import get_accelerator

    module = importlib.import_module(get_accelerator().op_builder_dir())
    return sorted({v.NAME for v in vars(module).values() if isinstance(getattr(v, "NAME", None), str)})


def _builders_in(build_dir: str) -> list[int]:
    """Pids of processes whose working directory is build_dir (ninja, the compiler)."""
    want, pids = os.path.realpath(build_dir), []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.path.realpath(os.readlink(f"/proc/{entry}/cwd")) == want:
                    pids.append(int(entry))
            except OSError:
                continue  # gone, or not ours to look at
    return pids


def check_op_locks(root: str, names: list[str], wait_s: float = OPS_WAIT_S) -> None:
    """Returns when no op build lock under root is held; waits (bounded) while a live build holds
    one; raises a ZerolabError naming a stale lock instead of letting DeepSpeed wait on it forever."""
    deadline, said = time.monotonic() + wait_s, set()
    while True:
        held = [os.path.join(root, n, "lock") for n in names if os.path.exists(os.path.join(root, n, "lock"))]
        if not held:
            return
        lock = held[0]
        try:
            age = time.time() - os.stat(lock).st_mtime
        except FileNotFoundError:
            continue  # released just now
        pids = _builders_in(os.path.dirname(lock)) if os.path.isdir("/proc") else [0]
        if not pids and age > LOCK_GRACE_S:
            raise ZerolabError(
                f"DeepSpeed op build lock {lock} is stale: it is {age:.0f} s old and no process is building in "
                f"{os.path.dirname(lock)} (a build was killed mid-way), so DeepSpeed would wait on it forever. "
                f"Remove it (rm {lock}) and run again, which rebuilds the op; `make install` prebuilds all of "
                f"them. If another machine shares {root} and is building there right now, wait for it instead.")
        if time.monotonic() > deadline:
            raise ZerolabError(f"DeepSpeed op build lock {lock} has been held for {age:.0f} s by processes "
                               f"{pids} building in {os.path.dirname(lock)}; gave up after {wait_s:.0f} s. "
                               f"Check those processes, or remove the lock (rm {lock}) if they are stuck.")
        if lock not in said:
            _log.warning("waiting for another process to finish building DeepSpeed op %s (lock %s, builders %s)",
                        os.path.basename(os.path.dirname(lock)), lock, pids or "starting")
            said.add(lock)
        time.sleep(1.0)  # torch's own waiters poll the lock file the same way



def main(argv: list[str]) -> int:
    if argv[:1] == ["build"]:
        return build()
    if argv[:1] == ["status"]:
        for op, ok in {**built_ops(), **built_ops(OFFLOAD_OPS)}.items():
            print(f"{op}: {'built' if ok else 'missing'} in {ops_dir()}")
        return 0 if missing_reason() is None else 1
    print("usage: python -m zerolab.ds_ops {build,status}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
