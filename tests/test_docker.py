"""The Dockerfile cannot be built here (no Docker engine), so it is parsed and checked: a CUDA base
image with a fixed tag, the same torch/deepspeed pins and Python version as pyproject.toml, the
sources it copies exist and are not excluded, a non-root user, and an exec-form torchrun entrypoint."""
from __future__ import annotations

import fnmatch
import json
import re
import tomllib

from conftest import ROOT


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
