"""The house rules, checked in the fast tier: the layers of pyproject.toml's import-linter contract
hold, no two zerolab modules or packages import each other (function-level imports included),
the trainer reads as a loop (at most 300 lines, no function in zerolab over 60), and vulture finds
no unused code (its configuration and whitelist: pyproject.toml, tests/vulture_whitelist.py)."""
import ast
import contextlib
import io
import os
import tomllib
from collections import defaultdict

import pytest

from conftest import ROOT

PACKAGE = ROOT / "zerolab"
MAX_FUNCTION_LINES = 60
MAX_TRAINER_LINES = 300


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


def test_the_trainer_is_short_and_no_function_is_long():
    assert len((PACKAGE / "trainer.py").read_text().splitlines()) <= MAX_TRAINER_LINES
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


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
