"""README.md's command blocks, run as written, from a directory laid out as a fresh clone is (the
repository's .venv, train.py, conf/ and launch/ as links; nothing downloaded: HF_HUB_OFFLINE=1).

Every ```bash block of README.md is either run here or named in ELSEWHERE with the test that runs
it (a fast-tier test keeps that list whole: a new block must say where it runs). Run here: "Will
it fit?" and "Will it be fast?" (the dry runs and plans of the shipped `llama2-7b` shape at 8 and
64 ranks, on fake tensors) and "Running"'s lines that need no Slurm cluster. Each line must exit 0,
and the dry runs must print the figures README's tables state beside them (model states and
peak per rank at 64 ranks), so the tables cannot drift from what the commands say."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import ROOT, base_env, run_process

# README headings whose bash block is run by another test (or cannot run inside the suite), and why.
ELSEWHERE = {
    "Quick start": "`make run` is the default job (about 4 minutes; tests/test_sweep.py runs the same sweep at "
                   "gpt_tiny), `make test` is this suite",
    "Your model": "tests/test_first_use_runs.py runs these lines as written",
}
RUN_HERE = ("Will it fit?", "Will it be fast?", "Running")
SLURM = re.compile(r"^sbatch |launcher=slurm")  # tests/test_slurm.py runs sbatch and the submitit sweep


def readme_blocks() -> dict[str, list[str]]:
    """{heading: the shell lines of the bash blocks under it, comments cut}."""
    text = (ROOT / "README.md").read_text()
    out = {}
    for section in re.split(r"\n## ", text)[1:]:
        heading, _, body = section.partition("\n")
        lines = [line.split("  #")[0].strip() for block in re.findall(r"```bash\n(.*?)```", body, re.S)
                 for line in block.splitlines() if line.strip()]
        if lines:
            out[heading.strip()] = lines
    return out


def test_every_readme_block_is_run_by_a_test():
    """Fast tier (nothing is run): each block's heading is run here or says which test runs it."""
    blocks = readme_blocks()
    assert set(blocks) == set(RUN_HERE) | set(ELSEWHERE), sorted(blocks)
    assert all(not SLURM.search(line) for heading in RUN_HERE[:2] for line in blocks[heading])


@pytest.fixture
def clone(tmp_path) -> Path:
    for name in (".venv", "train.py", "conf", "launch", "zerolab", "hydra_plugins"):
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


def run_as_written(command: str, cwd: Path) -> str:
    proc = run_process(["bash", "-c", command], timeout=540, cwd=cwd,
                       env=base_env(HF_HUB_OFFLINE="1", PATH=f"{ROOT / '.venv' / 'bin'}:{base_env()['PATH']}"))
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def table_row(heading: str, first_cell: str) -> list[str]:
    """The cells of README's table row under `heading` whose first cell is `first_cell`."""
    body = (ROOT / "README.md").read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    row = next(line for line in body.splitlines() if line.startswith(f"| {first_cell} |"))
    return [c.strip() for c in row.strip("|").split("|")]


@pytest.mark.slow
@pytest.mark.timeout(1500)  # README's 7B dry runs and plans as written: ~225 s quiet, 600+ beside a heavy job
def test_will_it_fit_and_will_it_be_fast_run_as_written(clone):
    fit, fast = readme_blocks()["Will it fit?"], readme_blocks()["Will it be fast?"]
    offload = [line for line in fit if "--host-mem" in line]
    fit = [line for line in fit if line not in offload]
    assert len(offload) == 1 and all("model.config=llama2-7b" in line for line in fit + fast)  # every clone has it
    outputs = [run_as_written(line, clone) for line in fit + fast]
    one_gpu_offload_is_what_readme_says(run_as_written(offload[0], clone))
    # the dry run at 64 ranks says what README's table says at 64 GPUs (GB, as printed)
    row = table_row("Will it fit?", "64")
    states, peak = row[4], row[5].split()[0]
    for out in (outputs[0], outputs[2]):  # (fit's dry run, fast's dry run)
        assert "6,738,415,616 parameters" in out  # Llama 2 7B, as its publisher counts it
        assert re.search(rf"^model states\s+{re.escape(states)} GB\s+{re.escape(states)} GB\s+\+0$", out, re.M), out
        assert re.search(rf"^peak\s+{re.escape(peak)} GB", out, re.M), out
        # a rank's model states: 16 bytes x parameters / 64 plus bucket padding (fewer than 64 elements
        # in each of fewer than 2,000 buckets, 16 bytes each), within the printed 0.005 GB
        assert 16 * 6_738_415_616 / 64 - 5e6 <= float(states) * 1e9 <= 16 * (6_738_415_616 + 63 * 2000) / 64 + 5e6
        # nothing of the model is allocated: the dry run's own peak RSS stays under 2 GB
        rss, unit = re.search(r"this process's peak RSS ([\d.]+) (GB|MB)", out).groups()
        assert float(rss) * (1e9 if unit == "GB" else 1e6) < 2e9, out
    assert "tokens/s" in outputs[2] and "tokens/s" in outputs[3]  # the time model priced them


def one_gpu_offload_is_what_readme_says(out: str) -> None:
    """README's 13B on one 24 GB GPU: no row without offload fits; each parameter-offload row README
    names (zerolab's zero3, DeepSpeed's stage 3, FSDP2) fits, with checkpointed blocks, the
    micro-batch and the host memory README states for it."""
    readme = (ROOT / "README.md").read_text()
    text = " ".join(readme.split("A 13B model on one 24 GB GPU", 1)[1].split("\n\n")[0].split())
    stated = re.findall(r"`([\w+-]+)` (?:fits )?micro-batch (\d+) with ([\d.]+) GB", text)
    assert [name for name, _, _ in stated] == ["zero3+offload+p", "deepspeed-3+offload+p", "fsdp+offload+p"], text
    assert "checkpointed blocks" in text and "nothing fits without offload" in text, text
    row_start = re.compile(r"^\S+\s+(none|blocks|selective)\s+(none|\d+)\s")
    rows = [line.split() for line in out.splitlines() if row_start.match(line)]
    fits = {(r[0], r[1]): r for r in rows if r[2] != "none"}
    assert rows and all("offload" in name for name, _ in fits), out  # without offload nothing fits
    for name, mb, host in stated:
        row = fits[(name, "blocks")]
        assert row[2] == mb and round(float(row[-3])) == round(float(host)) and row[-2] == "GB", row


@pytest.mark.slow
def test_the_running_lines_without_slurm_run_as_written(clone):
    lines = [line for line in readme_blocks()["Running"] if not SLURM.search(line)]
    assert [line.split()[0] for line in lines] == [".venv/bin/python", ".venv/bin/torchrun", "launch/torchrun.sh",
                                                   ".venv/bin/python"], lines  # what this test expects to start
    for line in lines:
        run_as_written(line, clone)
    assert len(list((clone / "runs").rglob("summary.json"))) == 3  # three trainings, each finished


# ---- the pages' lines that rehearse a job (dry-run; plan with --exact or --hardware) ----------------
# Each is either one of README's lines (run above) or run by the test below; the fast test keeps
# every such line in one of the two.
REHEARSING = re.compile(r"^(?:\.venv/bin/)?python -m zerolab (dry-run .*|plan .*--(?:exact|hardware)\b.*)$")


def pages_rehearsing_lines() -> list[tuple[str, int, str]]:
    """(page, line number, the command after `python -m zerolab `) of each rehearsing line in docs/'s
    code blocks (transcripts, `$ ...`, are tests/test_doc_figures.py's)."""
    out = []
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text()
        for m in re.finditer(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M):
            start = text.count("\n", 0, m.start()) + 2
            for n, line in enumerate(m.group(1).replace("\\\n", " ").splitlines(), start):
                found = REHEARSING.match(" ".join(line.split("  #")[0].split()))
                if found:
                    out.append((page.name, n, found.group(1)))
    return out


def readme_zerolab_commands() -> set[str]:
    return {" ".join(line.split()).split("python -m zerolab ", 1)[1] for lines in readme_blocks().values()
            for line in lines if "python -m zerolab " in line}


# docs lines run by test_the_pages_own_rehearsing_lines_run_as_written, as (page, command prefix)
PAGES_OWN = (("memory.md", "dry-run --world 8 --hardware h100 --gpus-per-node 8 model=hf model.config=llama3.1-8b"),)


def test_every_rehearsing_line_of_the_pages_is_run():
    """Fast tier: each is README's (run by test_will_it_fit_and_will_it_be_fast_run_as_written) or one
    of PAGES_OWN (run below)."""
    readme = readme_zerolab_commands()
    lines = pages_rehearsing_lines()
    assert len(lines) >= 3, lines
    for page, n, command in lines:
        assert command in readme or any(page == p and command.startswith(c) for p, c in PAGES_OWN), \
            f"docs/{page}:{n}: {command} is neither README's nor in PAGES_OWN"


@pytest.mark.slow
def test_the_pages_own_rehearsing_lines_run_as_written(clone):
    """docs/memory.md's selective-checkpointing dry run of torchtitan's Llama 3.1 8B on 8 H100s prints
    the figures the page's table states beside it (model states and activations kept, GB)."""
    own = [(page, command) for page, _, command in pages_rehearsing_lines()
           if any(page == p and command.startswith(c) for p, c in PAGES_OWN)]
    assert len(own) == len(PAGES_OWN), own
    (page, command), = own
    out = run_as_written(f".venv/bin/python -m zerolab {command}", clone)
    table = (ROOT / "docs" / page).read_text().split(command, 1)[1]
    states = re.search(r"^\| model states[^|]*\| ([\d.]+) \|", table, re.M).group(1)
    kept = re.search(r"^\| activations kept[^|]*\| ([\d.]+) \|", table, re.M).group(1)
    assert re.search(rf"^model states\s+{re.escape(states)} GB\s+{re.escape(states)} GB", out, re.M), out
    assert re.search(rf"^activations\s+{re.escape(kept)} GB", out, re.M), out
