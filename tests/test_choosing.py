"""docs/choosing.md's recipes are what `python -m zerolab plan` says, by the rule the page states.

Fast tier (nothing run): the page's recipe block holds one plan per model (Llama 2 7B, 13B, 70B)
and GPU count (1, 8, 64); its table has one row for each, and each row's `train.py` overrides set
what its plan row names. The rule itself is checked on planted rows.
Slow tier: each recipe's plan run as written, from a directory laid out as a fresh clone is
(nothing downloaded: HF_HUB_OFFLINE=1); the page's rule applied to the rows it prints gives the
table's row: strategy, checkpointing, micro-batch and host memory per node. The nine plans take
one to two minutes on a 2-core machine (10-20 s each)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import ROOT, base_env, run_process

PAGE = ROOT / "docs" / "choosing.md"
MODELS = {"7B": "llama2-7b", "13B": "llama2-13b", "70B": "llama2-70b"}
GPUS = (1, 8, 64)


def recipes_section() -> str:
    return PAGE.read_text().split("\n## Recipes", 1)[1].split("\n## ", 1)[0]


def recipe_commands() -> dict[tuple[str, int], str]:
    """(shape, GPUs) -> the plan command of the recipe block."""
    block = re.search(r"```bash\n(.*?)```", recipes_section(), re.S).group(1)
    out = {}
    for line in filter(None, map(str.strip, block.splitlines())):
        shape = re.search(r"model\.config=(\S+)", line).group(1)
        world = int(re.search(r"--world (\d+)", line).group(1))
        assert (shape, world) not in out, f"two recipes for {shape} on {world} GPUs"
        out[shape, world] = line
    return out


def recipe_rows() -> dict[tuple[str, int], dict]:
    """(shape, GPUs) -> the table's row: the plan row, checkpointing, micro-batch, host, overrides."""
    out = {}
    for line in recipes_section().splitlines():
        if not line.startswith("| Llama 2 "):
            continue
        model, gpus, row, ckpt, mb, host, overrides = [c.strip() for c in line.strip("|").split("|")]
        out[MODELS[model.split()[-1]], int(gpus)] = {
            "strategy": row.strip("`"), "ckpt": ckpt, "mb": int(mb), "host_text": host,
            "overrides": set(overrides.strip("`").split())}
    return out


# ---- the rule the page states ----------------------------------------------------------------
UNIT = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
ROW = re.compile(r"^(\S+)\s+(none|blocks|selective|every_k)\s+(none|\d+)\s+(.*)$")
# 2Ψ elements sent per rank and step (the ZeRO paper, §7); zero3, stage 3 and fsdp send 3Ψ, and
# torch_zero broadcasts the updated parameters after DDP's all-reduce
TWO_PSI = ("ddp", "zero1", "zero2", "deepspeed-0", "deepspeed-1", "deepspeed-2")
LESS_RECOMPUTE_FIRST = ("none", "selective", "blocks")


def plan_rows(out: str) -> list[dict]:
    """The rows a plan prints: strategy, checkpointing, largest micro-batch (0: none fits), host
    memory per node (None: no offload) as printed and in bytes, and the row's place."""
    rows = []
    for line in out.splitlines():
        m = ROW.match(line)
        if not m:
            continue
        name, ckpt, mb, rest = m.groups()
        cells = rest.split()  # peak, states, activations, transient (value, unit each), then host
        host = cells[8:10] if cells[8] != "-" else None
        rows.append({"strategy": name, "ckpt": ckpt, "mb": 0 if mb == "none" else int(mb),
                     "host": float(host[0]) * UNIT[host[1]] if host else None,
                     "host_text": " ".join(host) if host else "-", "order": len(rows)})
    return rows


def offload_level(name: str) -> int:
    return 2 if name.endswith("+offload+p") else 1 if name.endswith("+offload") else 0


def recipe(out: str) -> dict:
    """docs/choosing.md's rule: the first offload level at which a row fits micro-batch 1; there, the
    least recompute at which a row fits micro-batch 2, else the largest micro-batch; then the fewest
    bytes sent per step, the largest micro-batch, the least host memory, the plan's order."""
    fits = [r for r in plan_rows(out) if r["mb"] >= 1]
    assert fits, f"nothing fits:\n{out}"
    level = min(offload_level(r["strategy"]) for r in fits)
    rows = [r for r in fits if offload_level(r["strategy"]) == level]
    two = [r for r in rows if r["mb"] >= 2]
    if two:
        least = min(LESS_RECOMPUTE_FIRST.index(r["ckpt"]) for r in two)
        rows = [r for r in two if LESS_RECOMPUTE_FIRST.index(r["ckpt"]) == least]
    else:
        rows = [r for r in rows if r["mb"] == max(r["mb"] for r in rows)]
    return min(rows, key=lambda r: (r["strategy"].split("+")[0] not in TWO_PSI, -r["mb"], r["host"] or 0, r["order"]))


def overrides_of(row: dict) -> set[str]:
    """The train.py overrides that run a plan row: its strategy (and DeepSpeed's stage), its offload,
    its checkpointing, its micro-batch."""
    name = row["strategy"].split("+")[0]
    strategy, _, stage = name.partition("-")
    out = {f"strategy={strategy}", f"data.micro_batch={row['mb']}"}
    if stage:
        out.add(f"strategy.stage={stage}")
    if offload_level(row["strategy"]) >= 1:
        out.add("strategy.offload_optimizer=true")
    if offload_level(row["strategy"]) == 2:
        out.add("strategy.offload_params=true")
    if row["ckpt"] != "none":
        out.add(f"model.activation_checkpointing={row['ckpt']}")
    return out


# ---- fast: the page's shape ---------------------------------------------------------------------
def test_one_recipe_per_model_and_gpu_count_with_its_overrides():
    commands, rows = recipe_commands(), recipe_rows()
    cells = {(shape, n) for shape in MODELS.values() for n in GPUS}
    assert set(commands) == cells and set(rows) == cells, (sorted(commands), sorted(rows))
    for cell, line in commands.items():
        assert line.startswith("python -m zerolab plan ") and "--host-mem" in line and "--exact" not in line, line
        assert ("--gpus-per-node 8" in line) == (cell[1] > 8), line  # nodes of eight past one node
    for cell, row in rows.items():
        assert row["overrides"] == overrides_of(row), (cell, row["overrides"] ^ overrides_of(row))


PLANTED = """\
zero2                 none         none   99.00 GB     25.00 GB    70.00 GB     4.00 GB           -  activations
zero2                 blocks          1   70.00 GB     25.00 GB    40.00 GB     5.00 GB           -  transient
zero3                 selective       2   70.00 GB     13.00 GB    50.00 GB     7.00 GB           -  activations
zero3                 blocks          9   70.00 GB     13.00 GB    50.00 GB     7.00 GB           -  activations
zero2+offload         none            2   60.00 GB     13.00 GB    45.00 GB     2.00 GB   109.13 GB  activations
fsdp                  selective       2   69.00 GB     13.00 GB    50.00 GB     6.00 GB           -  activations
deepspeed-2           selective       2   69.00 GB     13.00 GB    50.00 GB     6.00 GB           -  activations
"""


def test_the_rule_on_planted_rows():
    """No offload before offload (zero2+offload's "none" loses); at micro-batch 2 the least recompute
    (selective beats blocks' 9); then 2Ψ before 3Ψ (deepspeed-2 over zero3 and fsdp)."""
    assert (recipe(PLANTED)["strategy"], recipe(PLANTED)["ckpt"]) == ("deepspeed-2", "selective")
    no_two_psi = PLANTED.replace("deepspeed-2 ", "deepspeed-3 ")
    assert (recipe(no_two_psi)["strategy"], recipe(no_two_psi)["ckpt"]) == ("zero3", "selective")  # plan's order
    only_offload = "\n".join(line for line in PLANTED.splitlines() if "offload" in line or " none " in line[:30])
    assert recipe(only_offload)["strategy"] == "zero2+offload" and recipe(only_offload)["host_text"] == "109.13 GB"


# ---- slow: the plans, run as written ------------------------------------------------------------
@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("clone")
    for name in (".venv", "train.py", "conf", "launch", "zerolab", "hydra_plugins"):
        (where / name).symlink_to(ROOT / name)
    return where


@pytest.mark.slow
@pytest.mark.timeout(1500)  # the page's nine plans as written: ~150 s quiet, 470-510 beside a CPU-heavy job
def test_each_recipe_is_what_its_plan_says(clone):
    rows = recipe_rows()
    env = base_env(HF_HUB_OFFLINE="1", PATH=f"{ROOT / '.venv' / 'bin'}:{base_env()['PATH']}")
    wrong = []
    for cell, command in recipe_commands().items():
        proc = run_process(["bash", "-c", command], timeout=300, cwd=clone, env=env)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        got, want = recipe(proc.stdout), rows[cell]
        if [got[k] for k in ("strategy", "ckpt", "mb", "host_text")] != \
                [want[k] for k in ("strategy", "ckpt", "mb", "host_text")]:
            wrong.append(f"{cell}: the plan gives {got}, the page {want}")
    assert not wrong, "\n".join(wrong)
