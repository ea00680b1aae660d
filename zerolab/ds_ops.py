"""DeepSpeed's C++ ops, built once at install time instead of on a run's first use.

On CPU, DeepSpeed compiles two small ops the first time a run needs them: its shared-memory
collectives (`deepspeed_shm_comm`, loaded when its comm layer starts) and its fused Adam
(`fused_adam`, for optimizer type Adam/AdamW). A first-use compile takes minutes on a busy
2-core machine, inside a run or a test, and a compile killed half-way leaves a lock that makes
the next run wait. So `make install` builds them into the virtualenv (`<venv>/torch_extensions`),
next to the torch they were compiled against, and every zerolab DeepSpeed run looks there first.
TORCH_EXTENSIONS_DIR, when set, wins (torch's own convention).

    python -m zerolab.ds_ops build      # what `make install` runs
    python -m zerolab.ds_ops status     # which ops are built, where
"""
from __future__ import annotations

import os
import sys
import time

# The builder classes DeepSpeed's CPU accelerator loads for zerolab's configurations.
CPU_OPS = {"ShareMemCommBuilder": "deepspeed_shm_comm", "FusedAdamBuilder": "fused_adam"}


def ops_dir() -> str:
    """Where torch.utils.cpp_extension builds and finds DeepSpeed's ops for this interpreter."""
    return os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(sys.prefix, "torch_extensions")


def use_prebuilt() -> str:
    """Point this process's extension builds at ops_dir() (before DeepSpeed loads any op)."""
    os.environ["TORCH_EXTENSIONS_DIR"] = path = ops_dir()
    return path


def built_ops() -> dict[str, bool]:
    """op name -> whether its shared library exists under ops_dir() (any torch build tag)."""
    # With TORCH_EXTENSIONS_DIR set, torch builds into <dir>/<op>/; its default cache adds a
    # <python+device tag>/ level (py311_cpu/<op>/).
    root = ops_dir()
    subdirs = [os.path.join(root, d) for d in os.listdir(root)] if os.path.isdir(root) else []
    return {op: any(os.path.exists(os.path.join(d, f"{op}.so")) or os.path.exists(os.path.join(d, op, f"{op}.so"))
                    for d in [os.path.join(root, op), *subdirs]) for op in CPU_OPS.values()}


def missing_reason() -> str | None:
    """None when every CPU op is built; otherwise a sentence naming what is missing and the fix."""
    missing = [op for op, ok in built_ops().items() if not ok]
    if not missing:
        return None
    return (f"DeepSpeed's CPU ops {', '.join(missing)} are not built in {ops_dir()}; a run would compile them "
            f"on first use (minutes). Build them once with `make install` or `python -m zerolab.ds_ops build`")


def build() -> int:
    path = use_prebuilt()
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    if accel.device_name() != "cpu":
        print(f"DeepSpeed accelerator is {accel.device_name()}: its ops build on first use (not prebuilt here)")
        return 0
    for builder_name, op in CPU_OPS.items():
        t0 = time.perf_counter()
        builder = accel.create_op_builder(builder_name)
        if builder is None or not builder.is_compatible():
            print(f"{op}: not compatible with this machine, skipped (DeepSpeed falls back without it)")
            continue
        builder.load(verbose=False)
        print(f"{op}: built in {path} ({time.perf_counter() - t0:.0f} s)")
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["build"]:
        return build()
    if argv[:1] == ["status"]:
        for op, ok in built_ops().items():
            print(f"{op}: {'built' if ok else 'missing'} in {ops_dir()}")
        return 0 if missing_reason() is None else 1
    print("usage: python -m zerolab.ds_ops {build,status}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
