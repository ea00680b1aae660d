"""The figures the pages state, read against the code that makes them or the record that holds
them (fast tier: the commands run in this process, nothing is started).

- A transcript on a page (a code block whose first line is `$ python -m zerolab ...`) is what that
  command prints now: each line the page shows is a line of the output, in order (the page may
  leave lines out, or mark them `...`; lines that hold a wall time or an RSS, which depend on the machine, are not
  compared). The ledger and the planner are deterministic, so equality is the right test.
- docs/below-the-floor.md's bytes-per-parameter table is `python -m zerolab memory --modes`'s,
  and its sentence on zero1/zero2's fp32 gradient shard (4Ψ/N above the paper for zero1, 2Ψ/N for
  zero2, none for zero3) is what that table's columns differ by.
- The fitted share of the memory bandwidth README and docs/predict.md state is
  `zerolab.predict.gpu.MEMORY_SHARE`; the rows of README's "Will it be fast?" table are the ones
  bench/RESULTS.md records.
- README's list of shipped model shapes is the list zerolab resolves.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import shlex

import pytest

from conftest import ROOT

MACHINE_DEPENDENT = re.compile(r"\d s\b|\d s[,;)]|RSS|rehearsed in")
PURE = ("memory", "plan", "lr", "optim-state", "dry-run")  # commands that read no file: their output is the code's


def transcripts() -> list[tuple[str, int, list[str], list[str]]]:
    """(page, line, argv after `python -m zerolab`, the lines shown) of every transcript block."""
    out = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text()
        for m in re.finditer(r"^```[^\n]*\n(\$ python -m zerolab [^\n]*)\n(.*?)^```", text, re.S | re.M):
            argv = shlex.split(m.group(1).removeprefix("$ python -m zerolab "), comments=True)
            if argv[0] not in PURE:
                continue
            shown = [line.rstrip() for line in m.group(2).splitlines()]
            out.append((page.name, text.count("\n", 0, m.start()) + 2, argv, shown))
    return out


def zerolab_output(argv: list[str], cwd) -> str:
    """What `python -m zerolab ARGV` prints, run in this process (in `cwd`: --plot writes there)."""
    from zerolab.__main__ import main

    out, here = io.StringIO(), os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out):
            assert main(list(argv)) in (0, None)
    finally:
        os.chdir(here)
    return out.getvalue()


def in_order(shown: list[str], printed: list[str]) -> list[str]:
    """The shown lines that are not, in order, lines of the printed output (blank and machine-
    dependent lines aside)."""
    missing, i = [], 0
    for line in shown:
        if not line.strip() or line.strip() == "..." or MACHINE_DEPENDENT.search(line):
            continue
        try:
            i = printed.index(line, i) + 1
        except ValueError:
            missing.append(line)
    return missing


TRANSCRIPTS = transcripts()


def test_the_pages_hold_transcripts():
    assert {page for page, *_ in TRANSCRIPTS} >= {"memory.md", "optim-precision.md"}


@pytest.mark.parametrize("page, line, argv, shown", [
    pytest.param(*t, id=f"{t[0]}:{t[1]}", marks=[pytest.mark.slow] if t[2][0] == "dry-run" else [])  # a rehearsal: ~5 s
    for t in TRANSCRIPTS])
def test_a_transcript_is_what_the_command_prints(page, line, argv, shown, tmp_path):
    printed = [p.rstrip() for p in zerolab_output(argv, tmp_path).splitlines()]
    missing = in_order(shown, printed)
    assert not missing, f"docs/{page}:{line}: `python -m zerolab {' '.join(argv)}` no longer prints:\n" + \
        "\n".join(missing[:10])


def modes_rows(text: str) -> dict[str, list[str]]:
    return {m.group(1): m.group(2).split() for m in re.finditer(r"^(ddp|zero[123])\s+(.*)$", text, re.M)}


def test_below_the_floor_states_the_ledgers_bytes_per_parameter(tmp_path):
    page = (ROOT / "docs" / "below-the-floor.md").read_text()
    command = "python -m zerolab memory --modes --params 6.74e9 --world 64"
    assert f"`{command}`" in page
    table = page.split(f"`{command}`", 1)[1].split("```", 2)[1]
    printed = modes_rows(zerolab_output(shlex.split(command)[3:], tmp_path))
    assert modes_rows(table) == printed
    # the text: zerolab's fp32 gradient shard puts zero1 4Ψ/N and zero2 2Ψ/N above the paper, zero3 on it.
    # Column 1 is the fp32 master; the figures are printed to 4 significant digits (±0.0005 at these sizes).
    world = 64
    above = {name: float(row[1]) - float(row[0]) for name, row in printed.items()}
    assert above["zero1"] == pytest.approx(4 / world, abs=1e-3)
    assert above["zero2"] == pytest.approx(2 / world, abs=1e-3)
    assert above["zero3"] == pytest.approx(0, abs=1e-3) and above["ddp"] == 0
    assert "zero1 4Ψ/N above the paper's figure" in page.replace("\n", " ")
    assert "zero2 2Ψ/N above" in page.replace("\n", " ")


def test_the_gpu_memory_share_the_pages_state_is_the_codes():
    from zerolab.predict.gpu import FITTED_ON, MEMORY_SHARE

    readme = (ROOT / "README.md").read_text().replace("\n", " ")
    predict = (ROOT / "docs" / "predict.md").read_text().replace("\n", " ")
    share = f"{100 * MEMORY_SHARE:.1f} %"
    assert f"share of the memory bandwidth, {share}, the one figure fitted" in readme
    assert f"| bytes at a share of the memory bandwidth | {share} | {share} |" in predict
    assert f"(`bench/predict_gpu.py --fit`): {MEMORY_SHARE}," in predict
    assert FITTED_ON.startswith("llama3-8b-a100") and "Llama 3 8B with \"selective layer\"" in predict


def test_the_will_it_be_fast_rows_are_the_records():
    """Each README row's published and predicted tokens/s and their ratio are those of
    bench/RESULTS.md's latest record of bench/predict_gpu.py, row for row."""
    readme = (ROOT / "README.md").read_text().split("\n## Will it be fast?\n", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in readme.splitlines()
            if line.startswith(("| torchtitan", "| llm-foundry"))]
    assert len(rows) == 10
    record = (ROOT / "bench" / "RESULTS.md").read_text()
    latest = record.split("## The time model by kind of kernel against ten published GPU runs")[-1].split("\n## ")[0]
    recorded = [[c.strip() for c in line.strip("|").split("|")] for line in latest.splitlines()
                if line.startswith(("| torchtitan", "| llm-foundry"))]
    assert [r[-3:] for r in rows] == [r[2:5] for r in recorded]
    assert [r[1] for r in rows] == [r[1] for r in recorded]


def test_the_readme_lists_the_shipped_shapes():
    from zerolab.models.sources import shipped_shapes

    readme = (ROOT / "README.md").read_text()
    listed = readme.split("is a shape zerolab ships", 1)[1].split("(`zerolab/models/shapes/README.md`)", 1)[0]
    assert sorted(re.findall(r"`([\w.-]+)`", listed)) == shipped_shapes()


def howto_lines() -> list[tuple[str, int, list[str]]]:
    """(page, line, argv) of each `python -m zerolab memory|lr|optim-state|plan` line in the code
    blocks of README.md and docs/ that holds no placeholder and rehearses nothing (plan's --exact
    and --hardware rehearse a dry run per row: README's are run by tests/test_readme_runs.py).
    Plans of a transformers shape measure its activations on fake tensors (10-20 s each): README's
    are run as written by tests/test_readme_runs.py and docs/choosing.md's nine recipes by
    tests/test_choosing.py, both in the slow tier."""
    out = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        if page.name == "choosing.md":
            continue
        text = page.read_text()
        for m in re.finditer(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M):
            start = text.count("\n", 0, m.start()) + 2
            for n, line in enumerate(m.group(1).replace("\\\n", " ").splitlines(), start):
                found = re.match(r"^(?:\.venv/bin/)?python -m zerolab ((?:memory|lr|optim-state|plan) .*)$", line)
                if not found or any(mark in line for mark in ("<", "...", "--exact", "--hardware")):
                    continue
                if page.name == "README.md" and "model=hf" in line:
                    continue
                out.append((page.name, n, shlex.split(found.group(1), comments=True)))
    return out


HOWTO = howto_lines()


def test_the_pages_how_to_lines_run_as_written(tmp_path):
    """Each such line exits 0 in this process, from an empty directory (what --plot writes goes there)."""
    assert len(HOWTO) >= 10, HOWTO
    for page, line, argv in HOWTO:
        try:
            zerolab_output(argv, tmp_path)
        except (AssertionError, SystemExit) as err:
            raise AssertionError(f"{page}:{line}: python -m zerolab {' '.join(argv)}: {err!r}") from None
