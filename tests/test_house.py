"""The house rules, checked in the fast tier: the layers of pyproject.toml's import-linter contract
hold, no two zerolab modules or packages import each other (function-level imports included),
the step reads on one screen (Trainer.train_step and Trainer.fit at most 40 lines each, naming no
fault, progress-board or profiler call: those sit behind zerolab/run/instruments.py), no module in
zerolab over 450 lines, no class over 250 and no function over 60, ruff and vulture find nothing
(their configuration: pyproject.toml, tests/vulture_whitelist.py), and the Strategy base class
keeps a narrow surface."""
import ast
import contextlib
import io
import os
import re
import sys
import tomllib
from pathlib import Path
from collections import defaultdict

import pytest

from conftest import ROOT, run_linter

PACKAGE = ROOT / "zerolab"
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 450
MAX_CLASS_LINES = 250  # a class a reader holds in their head (nanotron's ZeRO-1 optimizer is one)
MAX_LOOP_LINES = 40  # Trainer.train_step and Trainer.fit: one screen each
MAX_STRATEGY_SURFACE = 22  # public members of the Strategy base class (docs/writing-a-strategy.md lists them)


def _contract() -> dict:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = config["contracts"]
    return contract


def test_the_layers_contract_holds():
    import logging

    from importlinter.cli import lint_imports

    # import-linter configures logging with dictConfig, which disables every logger that exists
    # (zerolab's among them): put them back as they were for the tests after this one.
    loggers = [lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    disabled = [lg.disabled for lg in loggers]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.chdir(ROOT):
            code = lint_imports(no_cache=True, no_logo=True)
    finally:
        for lg, was in zip(loggers, disabled):
            lg.disabled = was
    assert code == 0, out.getvalue()[-4000:]


def _top_level_units() -> set[str]:
    return {f"zerolab.{p.stem}" for p in PACKAGE.glob("*.py") if p.stem != "__init__"} | \
           {f"zerolab.{p.name}" for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}


def test_every_module_is_in_a_layer():
    listed = {m.strip() for layer in _contract()["layers"] for m in layer.replace("|", ":").split(":")}
    assert _top_level_units() == listed, (f"not in a layer: {sorted(_top_level_units() - listed)}; "
                                          f"listed but missing: {sorted(listed - _top_level_units())}")


def test_architecture_page_lists_the_layers_of_the_contract():
    """docs/architecture.md's table of layers names, top to bottom, the modules of each layer of
    pyproject.toml's contract (its foundation row once lacked master and precision_modes)."""
    import re

    page = (ROOT / "docs" / "architecture.md").read_text().split("## The layers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in page.splitlines() if line.startswith("| ") and "`" in line.split("|")[2]]
    documented = [sorted(re.findall(r"`([a-z_]+)`", row.split("|")[2])) for row in rows]
    contract = [sorted(m.strip().removeprefix("zerolab.") for m in layer.replace("|", ":").split(":"))
                for layer in _contract()["layers"]]
    assert documented == contract


def import_graph() -> dict[str, set[str]]:
    """zerolab top-level module or package -> the others it imports, at any depth of its code."""
    edges = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        unit = ".".join(parts[:2])
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = parts[:len(parts) - node.level + (rel.name == "__init__")] if node.level else []
                names = [".".join(base + ([node.module] if node.module else []))] if node.level else [node.module]
            else:
                continue
            for name in names:
                if name and name.startswith("zerolab.") and ".".join(name.split(".")[:2]) != unit:
                    edges[unit].add(".".join(name.split(".")[:2]))
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_between_modules():
    edges = import_graph()
    assert "zerolab.strategies" in edges and "zerolab.schema" in edges["zerolab.config"]  # the scan sees imports
    assert cycles(edges) == []


def test_the_cycle_scan_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _functions(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_no_module_or_function_is_long():
    long = []
    for path in PACKAGE.rglob("*.py"):
        lines = len(path.read_text().splitlines())
        if lines > MAX_MODULE_LINES:
            long.append(f"{path.relative_to(ROOT)} ({lines} lines)")
        for node in _functions(path):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


def long_classes(source: str) -> dict[str, int]:
    """The classes of `source` (nested ones too) over MAX_CLASS_LINES: name -> lines."""
    sizes = {node.name: node.end_lineno - node.lineno + 1 for node in ast.walk(ast.parse(source))
             if isinstance(node, ast.ClassDef)}
    return {name: n for name, n in sizes.items() if n > MAX_CLASS_LINES}


def test_no_class_is_long():
    """A class over MAX_CLASS_LINES is split into parts with narrow interfaces (a helper object, a
    module of functions), not more bases: tests/test_zero_house.py holds the ZeRO package's classes
    to one base each."""
    long = {f"{p.relative_to(ROOT)}:{name}": n for p in sorted(PACKAGE.rglob("*.py"))
            for name, n in long_classes(p.read_text()).items()}
    assert not long, f"classes over {MAX_CLASS_LINES} lines (split them into parts): {long}"


def test_the_class_scan_finds_a_long_class():
    source = "class Short:\n    pass\n\n\nclass Outer:\n    class Long:\n" + "        x = 1\n" * MAX_CLASS_LINES
    assert long_classes(source) == {"Outer": MAX_CLASS_LINES + 2, "Long": MAX_CLASS_LINES + 1}


def test_the_step_reads_on_one_screen():
    """train_step and fit: short, and the instruments are called through one object (`watch`),
    never the fault injector, the progress board or the profiler by name."""
    source = (PACKAGE / "trainer.py").read_text()
    loop = {n.name: n for n in _functions(PACKAGE / "trainer.py") if n.name in ("train_step", "fit")}
    assert set(loop) == {"train_step", "fit"}
    for name, node in loop.items():
        assert node.end_lineno - node.lineno + 1 <= MAX_LOOP_LINES, (name, node.end_lineno - node.lineno + 1)
        body = ast.get_source_segment(source, node)
        named = [w for w in ("fault", "board", "progress", "profiler") if re.search(rf"\b{w}\b", body)]
        assert not named, f"Trainer.{name} calls {named} directly"


def test_the_strategy_base_class_is_narrow():
    from zerolab.strategies.base import Strategy

    surface = sorted(n for n in dir(Strategy) if not n.startswith("_"))
    assert len(surface) <= MAX_STRATEGY_SURFACE, surface
    page = (ROOT / "docs" / "writing-a-strategy.md").read_text()
    assert [n for n in surface if f"`{n}`" not in page] == [], "docs/writing-a-strategy.md must name every member"


def test_ruff_finds_nothing():
    ruff = Path(sys.executable).parent / "ruff"  # the dev extra's (pyproject.toml), beside this interpreter
    assert ruff.exists(), f"no {ruff}: ruff is part of the dev extra (make install)"
    out = run_linter([str(ruff), "check", "--quiet", str(ROOT)])
    assert out == "", out


def test_vulture_finds_no_unused_code():
    from vulture import core
    from vulture.config import make_config

    with contextlib.chdir(ROOT):
        cfg = make_config(argv=[])
        v = core.Vulture(verbose=False, ignore_names=cfg["ignore_names"], ignore_decorators=cfg["ignore_decorators"])
        v.scavenge(cfg["paths"], exclude=cfg["exclude"])
        unused = [item.get_report() for item in v.get_unused_code(min_confidence=cfg["min_confidence"])]
    assert not unused, "\n".join(unused)


@pytest.mark.parametrize("setting, strategy", [("logging.layer_stats_every=2", "torch_zero"),
                                                ("logging.layer_stats_every=2", "deepspeed"),
                                                ("optim.impl=foreach", "deepspeed")])
def test_a_setting_the_strategy_does_not_read_warns_once(setting, strategy, caplog, monkeypatch):
    import zerolab.config
    from zerolab.config import compose

    monkeypatch.setattr(zerolab.config, "_warned", set())
    monkeypatch.delenv("RANK", raising=False)
    with caplog.at_level("WARNING", logger="zerolab"):
        compose([f"strategy={strategy}", setting])
        compose([f"strategy={strategy}", setting])  # validated twice in one process: still one warning
    lines = [r.getMessage() for r in caplog.records if "has no effect" in r.getMessage()]
    key = setting.split("=")[0]
    assert len(lines) == 1 and lines[0].startswith(f"{key}=") and f"under strategy={strategy}" in lines[0], lines


def test_a_setting_for_another_optimizer_or_model_warns(caplog, monkeypatch):
    import zerolab.config
    from zerolab.config import compose

    monkeypatch.setattr(zerolab.config, "_warned", set())
    monkeypatch.delenv("RANK", raising=False)
    with caplog.at_level("WARNING", logger="zerolab"):
        compose(["optim=adamw", "optim.momentum=0.8", "model=mlp", "model.n_layer=4", "precision.min_scale=2"])
        compose(["optim=lars", "optim.momentum=0.8", "strategy=zero2", "optim.impl=foreach"])  # all of them apply
    lines = sorted(r.getMessage() for r in caplog.records if "has no effect" in r.getMessage())
    assert [line.split("=")[0] for line in lines] == ["model.n_layer", "optim.momentum", "precision.min_scale"], lines
    assert "with optim.name=adamw (it applies with optim.name in sgd_momentum, lars)" in lines[1]


def test_a_missing_prerequisite_fails_on_ci_and_skips_elsewhere(monkeypatch):
    """conftest.missing: the skip names the reason; with CI=true the test fails instead (the Slurm
    tests, the tmpfs of the disk-full tests and DeepSpeed's built ops go through it)."""
    from conftest import missing

    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true and a prerequisite is missing: no sbatch"):
        missing("no sbatch")
    monkeypatch.setenv("CI", "")
    with pytest.raises(pytest.skip.Exception, match="no sbatch"):
        missing("no sbatch")


def test_the_slurm_check_names_every_missing_binary(monkeypatch):
    import test_slurm

    monkeypatch.setenv("PATH", "")
    if os.geteuid() == 0:
        reason = test_slurm.why_no_slurm()
        assert all(b in reason for b in test_slurm.SLURM_BINARIES), reason
    make = (ROOT / "Makefile").read_text()
    assert f"SLURM_BINARIES := {' '.join(test_slurm.SLURM_BINARIES)}" in make  # one list, checked by make too
