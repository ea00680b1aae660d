"""The Dockerfile cannot be built here (no Docker engine), so it is parsed and checked: a CUDA base
image with a fixed tag, the same torch/deepspeed pins and Python version as pyproject.toml, the
sources it copies exist and are not excluded, a non-root user, and an exec-form torchrun entrypoint."""
from __future__ import annotations

import fnmatch
import json
import re
import sys
import tomllib

import pytest

from conftest import ROOT, base_env, run_process


def instructions(path=ROOT / "Dockerfile") -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        pending += " " + stripped.rstrip("\\").strip() if pending else stripped.rstrip("\\").strip()
        if not stripped.endswith("\\"):
            keyword, _, args = pending.partition(" ")
            out.append((keyword.upper(), args.strip()))
            pending = ""
    assert not pending, "Dockerfile ends inside a continued line"
    return out


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def pins(text: str) -> dict[str, str]:
    return {m.group(1).lower(): m.group(2) for m in re.finditer(r"([A-Za-z0-9_.\-]+)==([0-9][^\s\"',;]*)", text)}


def test_dockerfile_parses_into_known_instructions():
    known = {"ARG", "FROM", "ENV", "RUN", "WORKDIR", "COPY", "USER", "ENTRYPOINT", "CMD", "LABEL", "EXPOSE"}
    found = instructions()
    assert found and all(k in known for k, _ in found), [k for k, _ in found if k not in known]
    assert [k for k, _ in found if k not in ("ARG",)][0] == "FROM"


def test_base_image_is_cuda_with_a_fixed_tag():
    args = dict(a.split("=", 1) for k, a in instructions() if k == "ARG" and "=" in a)
    image = next(a for k, a in instructions() if k == "FROM")
    image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)
    name, _, tag = image.partition(":")
    assert "cuda" in name and tag and tag != "latest", image
    # Ubuntu 22.04 is the base whose python3.11 package is used below.
    assert "ubuntu22.04" in tag


def test_pins_match_pyproject():
    dockerfile_pins = pins(" ".join(a for k, a in instructions() if k == "RUN"))
    project_pins = pins(" ".join(pyproject()["project"]["dependencies"]))
    assert dockerfile_pins.get("torch") == project_pins["torch"] == "2.13.0"
    assert dockerfile_pins.get("deepspeed") == project_pins["deepspeed"]
    for name, version in dockerfile_pins.items():  # anything else pinned must agree too
        if name in project_pins:
            assert version == project_pins[name], f"{name}: Dockerfile {version}, pyproject {project_pins[name]}"


def test_python_version_satisfies_requires_python():
    requires = pyproject()["project"]["requires-python"]
    assert requires == ">=3.11,<3.12", "update the Dockerfile's python3.11 when this changes"
    runs = " ".join(a for k, a in instructions() if k == "RUN")
    assert "python3.11 -m venv" in runs


def test_copied_sources_exist_and_are_not_ignored():
    ignored = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
               if p.strip() and not p.startswith("#")]
    for must in (".venv", ".git", "runs"):
        assert must in ignored, f".dockerignore should exclude {must}"
    for k, a in instructions():
        if k != "COPY":
            continue
        *sources, _dest = a.split()
        for src in sources:
            assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
            assert not any(fnmatch.fnmatch(src, pat) for pat in ignored), f"COPY {src} is excluded by .dockerignore"
    copied = " ".join(a for k, a in instructions() if k == "COPY")
    for needed in ("pyproject.toml", "zerolab", "train.py", "conf"):
        assert needed in copied.split(), f"the image needs {needed}"


def test_runs_as_non_root_with_a_torchrun_entrypoint():
    found = instructions()
    users = [a for k, a in found if k == "USER"]
    assert users and users[-1] not in ("root", "0"), "the image must end as a non-root user"
    last_user = max(i for i, (k, _) in enumerate(found) if k == "USER")
    assert all(k != "RUN" for k, _ in found[last_user:]), "installs belong before USER"
    entry = json.loads(next(a for k, a in found if k == "ENTRYPOINT"))  # exec form: signals reach torchrun
    assert entry[0] == "torchrun"
    cmd = json.loads(next(a for k, a in found if k == "CMD"))
    assert "train.py" in cmd


# ---- DeepSpeed's ops: the image and the GPU install build them as `make install` does ------------
OPS_BUILD = re.compile(r"(?:(?:^|\s)(?:\S*/)?python3?(?:\.\d+)?|\$\(PY\)) -m zerolab\.ds_ops build\b")
INSTALLS_ZEROLAB = re.compile(r"pip install .*(?:-e )?\.(?:\[\w+\])?'?(?:\s|$)")


def makefile_install_recipe() -> list[str]:
    """The recipe lines of the Makefile's install stamp (what `make install` runs), comments dropped."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("$(STAMP):"))
    recipe = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        if not line.strip().startswith("#"):
            recipe.append(line.strip())
    return recipe


def gpu_install_lines() -> list[str]:
    """The shell lines of docs/launch.md's GPU install (the first bash block under "On GPUs")."""
    section = (ROOT / "docs" / "launch.md").read_text().split("\n## On GPUs\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def ops_build_after_zerolab(lines: list[str], where: str) -> None:
    """`python -m zerolab.ds_ops build` is run, once, after zerolab (whose module it is) is installed."""
    builds = [i for i, line in enumerate(lines) if OPS_BUILD.search(line)]
    installs = [i for i, line in enumerate(lines) if INSTALLS_ZEROLAB.search(line)]
    assert len(builds) == 1, f"{where}: runs the op build {len(builds)} times: {lines}"
    assert installs and installs[0] < builds[0], f"{where}: the op build comes before zerolab is installed: {lines}"


def test_the_image_and_the_gpu_install_build_deepspeeds_ops_as_make_install_does():
    """`make install` builds DeepSpeed's ops with zerolab.ds_ops (cpu_adam among them: what
    DeepSpeed's optimizer offload runs); the Dockerfile and docs/launch.md's GPU install run the
    same command after installing zerolab, with the same pins, so a first offload run on a GPU
    machine compiles nothing at start-up."""
    from zerolab import ds_ops

    assert "cpu_adam" in ds_ops.OFFLOAD_OPS.values()  # built with the others (ds_ops.build)
    recipe = makefile_install_recipe()
    ops_build_after_zerolab(recipe, "Makefile")
    ops_build_after_zerolab([a for k, a in instructions() if k == "RUN"], "Dockerfile")
    ops_build_after_zerolab(gpu_install_lines(), "docs/launch.md's GPU install")
    # the GPU install pins what the Makefile and the image pin
    docs_pins, make_pins = pins(" ".join(gpu_install_lines())), pins(" ".join(recipe))
    assert docs_pins["torch"] == make_pins["torch"] and docs_pins["deepspeed"] == make_pins["deepspeed"], docs_pins
    # the image's non-root user can load them: torch takes a lock file in an op's directory on every load
    after_build = [a for k, a in instructions() if k == "RUN"]
    assert any("chown" in a and "/opt/venv/torch_extensions" in a for a in after_build), after_build


def test_a_planted_missing_op_build_is_reported():
    lines = ["pip install --no-build-isolation -e .", "echo done"]
    try:
        ops_build_after_zerolab(lines, "planted")
    except AssertionError as err:
        assert "runs the op build 0 times" in str(err)
    else:
        raise AssertionError("a missing op build passed")
    try:
        ops_build_after_zerolab(["python -m zerolab.ds_ops build", *lines], "planted")
    except AssertionError as err:
        assert "before zerolab is installed" in str(err)
    else:
        raise AssertionError("an op build before the install passed")


CUDA_OPS_PROBE = """
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.op_builder.cpu import CPUAdamBuilder
from zerolab import ds_ops
assert get_accelerator().device_name() == "cuda"
print(ds_ops._build_one("ShareMemCommBuilder"))
print(ds_ops._build_one("FusedAdamBuilder"))
builder = get_accelerator().create_op_builder("CPUAdamBuilder")
print("cpu_adam builder:", type(builder) is CPUAdamBuilder, builder.is_compatible())
"""


@pytest.mark.slow
def test_the_images_op_build_keeps_cpu_adam_for_a_cuda_run(tmp_path):
    """`docker build` sees no GPU, so the Dockerfile names DeepSpeed's CUDA accelerator
    (DS_ACCELERATOR=cuda) for the op build. Under it, zerolab.ds_ops skips the CPU accelerator's
    shared-memory op (a CUDA run does not load it) and the CUDA fused_adam (built for the GPU
    DeepSpeed sees: on the first run), and builds cpu_adam: the CUDA accelerator's builder is the
    CPU accelerator's class, so the op `make install` builds here is the one a GPU run loads. (Real
    DeepSpeed 0.19.8 on this CPU-only torch; nothing is compiled.)"""
    env = base_env(DS_ACCELERATOR="cuda", TORCH_EXTENSIONS_DIR=str(tmp_path))
    proc = run_process([sys.executable, "-c", CUDA_OPS_PROBE], env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "deepspeed_shm_comm: not an op of DeepSpeed's cuda accelerator, skipped" in lines[0], lines
    assert lines[1].startswith("fused_adam: a CUDA op") and "first run on a GPU" in lines[1], lines
    assert lines[2] == "cpu_adam builder: True True", lines
    assert not any(tmp_path.iterdir()), "the probe built something"
