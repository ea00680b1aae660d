"""The documentation cannot drift from the code (fast tier: nothing is run, no process started).

Every fenced code block and inline code span of README.md and docs/**/*.md is read, and:

1. each Hydra override given to `train.py`, `launch/torchrun.sh`, `launch/slurm.sbatch` or
   `make run ... ARGS="..."` (and each inline span made only of overrides, or naming one dotted
   config key) names a key of zerolab's closed schema (`zerolab.schema_keys.SCHEMA_KEYS`, free-form
   dicts such as strategy.ds_config_overrides included) or a config group of conf/ with an
   existing option (every value of a `-m` comma list); `hydra.launcher.*` keys must be the
   torchrun or submitit launcher's;
2. each `python -m zerolab SUBCOMMAND --flag` names a command of `zerolab.__main__.COMMANDS` and
   a flag of its parser (read from its `--help`, called in-process);
3. each repository path (zerolab/..., tests/..., conf/..., train.py, Makefile, ...) exists;
4. each relative link (README.md -> docs/page.md#anchor, page.md -> page.md#anchor) reaches a
   file and a heading whose anchor is the same on GitHub and on the MkDocs site.

Each command line's overrides also compose (Hydra's composition and zerolab's validation), for the
world size it launches. The last tests plant mistakes and check that each is reported."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import os
import re
import shlex
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


# ---- reading markdown -------------------------------------------------------------------------
FENCE = re.compile(r"^ {0,3}(```+|~~~+)")
SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
COMMENT = re.compile(r"<!--.*?-->", re.S)


def split_markdown(text: str) -> tuple[list[tuple[int, str]], str]:
    """(fenced blocks as (line number of the first body line, body), the text outside them with
    each block's lines blanked, so line numbers still count)."""
    blocks, prose, body, fence, start = [], [], [], None, 0
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence is None and m:
            fence, start, body = m.group(1), n + 1, []
            prose.append("")
        elif fence is not None and line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
            blocks.append((start, "\n".join(body)))
            fence = None
            prose.append("")
        elif fence is not None:
            body.append(line)
            prose.append("")
        else:
            prose.append(line)
    return blocks, COMMENT.sub(lambda m: "\n" * m.group(0).count("\n"), "\n".join(prose))


def inline_spans(prose: str) -> list[tuple[int, str]]:
    """Inline code spans (line number, content); a span may run over a line break."""
    return [(prose.count("\n", 0, m.start()) + 1, " ".join(m.group(2).split())) for m in SPAN.finditer(prose)]


def logical_lines(block: str, first: int) -> list[tuple[int, str]]:
    """Lines of a code block with backslash continuations joined."""
    out, pending, start = [], "", first
    for n, line in enumerate(block.splitlines(), first):
        if not pending:
            start = n
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
        else:
            out.append((start, pending + line))
            pending = ""
    if pending:
        out.append((start, pending))
    return out


def words(line: str) -> list[str]:
    """Shell words of a line, comments dropped; a line shlex cannot read (an apostrophe in
    program output) falls back to whitespace."""
    try:
        return shlex.split(line, comments=True)
    except ValueError:
        return line.split("#", 1)[0].split()


SHELL_OPS = {"|", "||", "&&", ";", "&", ">", ">>", "2>", "2>&1", "<"}


def is_operator(tok: str) -> bool:
    return tok in SHELL_OPS or tok.startswith((">", "2>"))


def until_operator(tokens: list[str]) -> list[str]:
    """The words of the first command (`a --x | b`: `a --x`)."""
    for i, tok in enumerate(tokens):
        if is_operator(tok):
            return tokens[:i]
    return tokens


def commands(tokens: list[str]) -> list[list[str]]:
    """The commands of one line, split at shell operators (`cd x && python train.py a=b`)."""
    out: list[list[str]] = [[]]
    for tok in tokens:
        if is_operator(tok):
            out.append([])
        else:
            out[-1].append(tok)
    return [c for c in out if c]


def placeholder(text: str) -> bool:
    return any(mark in text for mark in ("<", ">", "...", "…", "$", "*"))


# ---- 1. Hydra overrides ------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def groups() -> dict[str, set[str]]:
    """Config groups of conf/ and their options (the yaml files in each)."""
    return {d.name: {p.stem for p in d.glob("*.yaml")} for d in (ROOT / "conf").iterdir() if d.is_dir()}


@functools.lru_cache(maxsize=None)
def launcher_keys() -> set[str]:
    """`hydra.launcher.*` keys: zerolab's torchrun launcher's and hydra-submitit-launcher's."""
    from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf
    from hydra_plugins.zerolab_torchrun.torchrun_launcher import TorchrunLauncherConf

    return {f.name for cls in (TorchrunLauncherConf, SlurmQueueConf) for f in dataclasses.fields(cls)}


SCRIPTS = ("train.py", "launch/torchrun.sh", "launch/slurm.sbatch")
HYDRA_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                          "--config-dir", "-cd", "--info", "-i"}
OVERRIDE = re.compile(r"^(\+\+|\+|~)?[a-z_][a-z0-9_]*(\.[a-z0-9_]+)*(=\S*)?$")
def _sections() -> tuple[str, ...]:
    """The schema's sections (every field of Config that is itself a dataclass), read from it."""
    import dataclasses

    from zerolab.schema import Config

    return tuple(f.name for f in dataclasses.fields(Config) if str(f.type).endswith("Config"))


SECTIONS = _sections()
FILE_SUFFIX = re.compile(r"\.(safetensors|jsonl?|ya?ml|py|md|png|bin|pt|txt|out|err|lock)$")


def check_override(token: str) -> str | None:
    """None if `token` is an override zerolab accepts, else what is wrong with it."""
    from zerolab.schema_keys import _known, suggest

    body = token.lstrip("+~")
    key, has_value, value = body.partition("=")
    if placeholder(key):
        return None
    if key == "hydra" or key.startswith(("hydra.", "hydra/")):
        parts = key.split(".")
        if parts[:2] == ["hydra", "launcher"] and len(parts) > 2 and parts[2] not in launcher_keys():
            return f"{token}: {parts[2]!r} is not a setting of the torchrun or submitit launcher"
        return None
    if "/" in key:
        return f"{token}: {key!r} is not a config group of conf/"
    if key in groups():
        if not has_value or placeholder(value) or token.startswith("~"):
            return None
        for option in re.split(r"[,|]", value):
            if option and option != "null" and option not in groups()[key]:
                return (f"{token}: conf/{key}/{option}.yaml does not exist "
                        f"(options: {', '.join(sorted(groups()[key]))})")
        return None
    if not _known(key):
        return f"{token}: no such config key; {suggest(key)}"
    return None


def override_args(tokens: list[str]) -> tuple[list[str], list[str]]:
    """(overrides, problems) in the words of one command line."""
    overrides, problems = [], []
    for command in commands(tokens):
        for i, tok in enumerate(command):
            if tok.endswith(SCRIPTS):
                more, bad = script_args(command[i + 1:])
            elif tok == "make" and "run" in command[i + 1:]:
                more, bad = make_args(command[i + 1:])
            else:
                continue
            overrides, problems = overrides + more, problems + bad
            break
    return overrides, problems


def script_args(args: list[str]) -> tuple[list[str], list[str]]:
    overrides, problems, skip = [], [], False
    for tok in args:
        if skip:
            skip = False
        elif tok.startswith("-"):
            skip = tok in HYDRA_FLAGS_WITH_VALUE
        elif "=" in tok or tok.startswith("~"):
            overrides.append(tok)
        elif not placeholder(tok):
            problems.append(f"{tok}: not a Hydra override (key=value)")
    return overrides, problems


def make_args(args: list[str]) -> tuple[list[str], list[str]]:
    overrides, problems = [], []
    for tok in args:
        var, _, value = tok.partition("=")
        if var == "STRATEGIES":
            overrides.append(f"strategy={value}")
        elif var == "ARGS":
            more, bad = script_args(words(value))
            overrides += more
            problems += bad
    return overrides, problems


def override_problems(text: str) -> list[str]:
    blocks, prose = split_markdown(text)
    found: list[tuple[int, str]] = []
    lines = [ln for start, body in blocks for ln in logical_lines(body, start)]
    for n, line in lines + inline_spans(prose):
        overrides, problems = override_args(words(line))
        found += [(n, p) for p in problems]
        found += [(n, p) for p in map(check_override, overrides) if p]
    for n, span in inline_spans(prose):
        toks = span.split()
        if any(t.endswith(SCRIPTS) or t == "make" for t in toks) or not all(OVERRIDE.match(t) for t in toks):
            continue
        for tok in toks:
            key = tok.lstrip("+~").split("=", 1)[0]
            first = key.split(".")[0]
            if "=" in tok and (first in SECTIONS or first in groups() or first == "hydra"):
                found += [(n, p) for p in [check_override(tok)] if p]
            elif "=" not in tok and "." in key and first in SECTIONS + ("hydra",) and not FILE_SUFFIX.search(key):
                found += [(n, p) for p in [check_override(tok)] if p]
    return [f"line {n}: {p}" for n, p in sorted(set(found))]


# ---- 1b. every documented command's overrides compose ---------------------------------------------
def _first_values(overrides: list[str]) -> list[str]:
    """A sweep's comma lists (`-m strategy=ddp,zero1`) as their first value: the line composes
    when each of its values does, and their options are checked one by one above."""
    return [o.split(",")[0] if "=" in o and "{" not in o and "[" not in o else o for o in overrides]


def composition_problems(text: str) -> list[str]:
    """Each command line of the fenced blocks whose overrides name only real keys (check_override)
    composed as train.py would compose it (Hydra's composition, then zerolab's validation), for
    the world size the line launches (torchrun's --nproc_per_node or NPROC=, the launch scripts'
    and `make run`'s default of 2 ranks on a CPU, else 1).
    Hydra's own keys (hydra.*) are Hydra's, checked above; placeholders stay as written."""
    from zerolab.config import compose

    blocks, _ = split_markdown(text)
    found = []
    for n, line in [ln for start, body in blocks for ln in logical_lines(body, start)]:
        toks = words(line)
        overrides, bad = override_args(toks)
        if not overrides or bad or any(map(check_override, overrides)):
            continue
        nproc = [t.split("=", 1)[1] for t in toks if t.startswith(("--nproc_per_node=", "NPROC="))]
        launched = any(t.endswith(("launch/torchrun.sh", "launch/slurm.sbatch")) or t == "make" for t in toks)
        world = int(nproc[0]) if nproc and nproc[0].isdigit() else 2 if launched else 1  # the scripts' default: 2
        keep = [o for o in _first_values(overrides) if not o.lstrip("+~").startswith("hydra.")]
        try:
            compose(keep, world_size=world)
        except Exception as err:  # noqa: BLE001  (Hydra's and zerolab's refusals alike)
            found.append(f"line {n}: `{' '.join(keep)}` does not compose: {str(err).splitlines()[0][:200]}")
    return found


# ---- 2. python -m zerolab SUBCOMMAND --flag -----------------------------------------------------
ZEROLAB = re.compile(r"-m zerolab(?![\w.])")


@functools.lru_cache(maxsize=None)
def cli_help(argv: tuple[str, ...]) -> str:
    """What `python -m zerolab <argv> --help` prints, run in this process."""
    from zerolab.__main__ import main

    out, columns = io.StringIO(), os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "500"  # argparse wraps at the terminal width: keep every flag whole
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            try:
                main([*argv, "--help"])
            except SystemExit:
                pass
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    return out.getvalue()


def cli_flags(argv: tuple[str, ...]) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", cli_help(argv)))


def cli_actions(sub: str) -> set[str]:
    """Positional choices such as `data`'s {prepare}."""
    return {a for group in re.findall(r"^ {2}\{([\w,-]+)\}", cli_help((sub,)), re.M) for a in group.split(",")}


def cli_problems_in_line(line: str) -> list[str]:
    from zerolab.__main__ import COMMANDS

    problems = []
    for m in ZEROLAB.finditer(line):
        tokens = until_operator(words(line[m.end():]))
        if not tokens or tokens[0] in ("-h", "--help", "help"):
            continue
        sub, rest = tokens[0].rstrip(").,;:"), tokens[1:]
        if sub.isupper() or placeholder(sub):  # `python -m zerolab COMMAND ...`: a placeholder
            continue
        if sub not in COMMANDS:
            problems.append(f"python -m zerolab {sub}: no such command (commands: {', '.join(COMMANDS)})")
            continue
        argv = (sub,)
        actions = cli_actions(sub)
        if actions:
            if rest and rest[0] in actions:
                argv, rest = (sub, rest[0]), rest[1:]
            elif not (rest and rest[0] in ("-h", "--help")):
                problems.append(f"python -m zerolab {sub}: needs one of {', '.join(sorted(actions))}")
                continue
        flags = cli_flags(argv)
        for tok in rest:
            flag = tok.split("=", 1)[0]
            if flag.startswith("-") and flag != "-" and not placeholder(flag) and flag not in flags:
                problems.append(f"python -m zerolab {' '.join(argv)}: no flag {flag}")
    return problems


def cli_problems(text: str) -> list[str]:
    blocks, prose = split_markdown(text)
    lines = [ln for start, body in blocks for ln in logical_lines(body, start)] + inline_spans(prose)
    return [f"line {n}: {p}" for n, line in lines for p in cli_problems_in_line(line)]


# ---- 3. repository paths -----------------------------------------------------------------------
REPO_PATH = re.compile(
    r"(?<![\w./~$-])("
    r"(?:zerolab|tests|bench|launch|conf|docs|hydra_plugins|\.ci)/[\w./*<>{}…-]*"
    r"|(?:train\.py|Makefile|pyproject\.toml|mkdocs\.yml|Dockerfile|README\.md|\.gitignore)(?![\w.])"
    r")")
TEST_FILE = re.compile(r"^test_\w+\.py$")


def path_problems(text: str) -> list[str]:
    blocks, prose = split_markdown(text)
    spans = inline_spans(prose)
    chunks = [(n, line) for start, body in blocks for n, line in enumerate(body.splitlines(), start)] + spans
    problems = []
    for n, chunk in chunks:
        for m in REPO_PATH.finditer(chunk):
            path = m.group(1).rstrip(".,:;)")
            if not placeholder(path) and "{" not in path and not (ROOT / path).exists():
                problems.append(f"line {n}: {path} does not exist")
    for n, span in spans:  # the tests table names test files without their folder
        if TEST_FILE.match(span) and not (ROOT / "tests" / span).exists():
            problems.append(f"line {n}: tests/{span} does not exist")
    return problems


# ---- 4. links ----------------------------------------------------------------------------------
LINK = re.compile(r"(?<!\\)!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def slug_mkdocs(title: str) -> str:  # python-markdown's toc.slugify, which MkDocs uses
    value = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode("ascii")
    value = re.sub(r"[^\w\s-]", "", value).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


def slug_github(title: str) -> str:
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


@functools.lru_cache(maxsize=None)
def anchors(path: Path) -> frozenset[str]:
    """Anchors of a page's headings that GitHub and MkDocs both give it."""
    _, prose = split_markdown(path.read_text())
    found = set()
    for line in prose.splitlines():
        m = HEADING.match(line)
        if m:
            title = re.sub(r"`([^`]*)`", r"\1", m.group(2))
            title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)
            if slug_mkdocs(title) == slug_github(title):
                found.add(slug_mkdocs(title))
    return frozenset(found)


def link_problems(text: str, where: Path) -> list[str]:
    _, prose = split_markdown(text)
    prose = SPAN.sub(lambda m: " " * len(m.group(0)), prose)
    problems = []
    for m in LINK.finditer(prose):
        target = m.group(1)
        if re.match(r"^[a-z]+:", target):
            continue
        n = prose.count("\n", 0, m.start()) + 1
        file, _, anchor = target.partition("#")
        dest = (where.parent / file).resolve() if file else where
        if not dest.exists():
            problems.append(f"line {n}: link {target}: {file} does not exist")
        elif where.parent.name == "docs" and ROOT / "docs" not in dest.parents:
            problems.append(f"line {n}: link {target} leaves docs/ (mkdocs --strict refuses it): use a code span")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"line {n}: link {target}: no heading #{anchor} in {dest.relative_to(ROOT)} (or GitHub "
                            f"and MkDocs give that heading different anchors: keep it to words, spaces, hyphens)")
    return problems


def problems(text: str, where: Path = ROOT / "README.md") -> list[str]:
    return override_problems(text) + cli_problems(text) + path_problems(text) + link_problems(text, where)


# ---- the docs as they are ----------------------------------------------------------------------
@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_match_the_code(path):
    found = problems(path.read_text(), path)
    assert not found, f"{path.relative_to(ROOT)}:\n" + "\n".join(found)


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_documented_overrides_compose(path):
    found = composition_problems(path.read_text())
    assert not found, f"{path.relative_to(ROOT)}:\n" + "\n".join(found)


def test_a_line_that_does_not_compose_is_reported():
    assert composition_problems(block("python train.py model.kwargs={dim:64} model=custom model.target=m:C")) == []
    bad = composition_problems(block("python train.py data.global_batch=7 data.micro_batch=2"))
    assert len(bad) == 1 and "does not compose" in bad[0] and "data.global_batch=7" in bad[0]


def test_every_page_is_in_the_site_nav():
    import yaml  # (PyYAML: Hydra and OmegaConf depend on it)

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]

    def pages(node):
        if isinstance(node, str):
            yield node
        elif isinstance(node, list):
            for item in node:
                yield from pages(item)
        elif isinstance(node, dict):
            for item in node.values():
                yield from pages(item)

    listed = set(pages(nav))
    on_disk = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert listed == on_disk, f"in the nav only: {listed - on_disk}; not in the nav: {on_disk - listed}"


SESSION_LABEL = re.compile(r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|this|last|"
                           r"previous|next|earlier|later|same|another|other)\s+sessions?\b|\bsessions?'s?\b", re.I)


def test_measurements_are_labelled_by_date_and_commit():
    """Not by the work session that took them ("fifth session"): a reader has no such list."""
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
             for p in [*DOC_FILES, ROOT / "bench" / "RESULTS.md"]
             for n, line in enumerate(p.read_text().splitlines(), 1) if SESSION_LABEL.search(line)]
    assert not found, "\n".join(found)


# ---- paragraphs a reader can take in -------------------------------------------------------------
MAX_WORDS = 200
BULLET = re.compile(r"^\s*[-*+]\s+")
ORDERED = re.compile(r"^\s*(\d+)[.)]\s+")


def prose_chunks(text: str) -> list[tuple[int, str]]:
    """(first line, words) of each paragraph and list item outside code blocks, tables, headings and
    HTML comments. A bullet starts an item; a number starts one where CommonMark lets it interrupt
    a paragraph (`1.`, or inside a list): "field\n22) and ..." is one paragraph."""
    _, prose = split_markdown(text)
    out, current, start, in_item = [], [], 0, False
    for n, line in enumerate(prose.splitlines(), 1):
        stripped, number = line.strip(), ORDERED.match(line)
        item = bool(BULLET.match(line)) or bool(number and (not current or in_item or number.group(1) == "1"))
        if not stripped or stripped.startswith(("|", "#")) or item:
            if current:
                out.append((start, " ".join(current)))
            current, in_item, start = ([stripped], True, n) if item else ([], False, n)
            continue
        if not current:
            start = n
        current.append(stripped)
    if current:
        out.append((start, " ".join(current)))
    return out


def long_paragraphs(text: str) -> list[str]:
    return [f"line {n}: {len(chunk.split())} words ({chunk[:60]}...)" for n, chunk in prose_chunks(text)
            if len(chunk.split()) > MAX_WORDS]


def test_no_paragraph_or_list_item_runs_over_200_words():
    """A reader takes a paragraph in at once; past 200 words it is two, or a list, or a table."""
    found = [f"{p.relative_to(ROOT)}: {problem}" for p in DOC_FILES for problem in long_paragraphs(p.read_text())]
    assert not found, "\n".join(found)


def test_a_long_paragraph_or_item_is_found_and_code_and_tables_are_not():
    words = " ".join(["word"] * 201)
    assert len(long_paragraphs(f"Intro.\n\n{words[:600]}\n{words[600:]}\n")) == 1  # over two lines
    assert len(long_paragraphs(f"- short\n- {words}\n")) == 1  # one list item
    assert long_paragraphs(f"- {words[:500]}\n- {words[500:]}\n") == []  # two items, each short
    assert long_paragraphs(f"```text\n{words}\n```\n| {words} |\n<!-- {words} -->\n") == []
    assert len(long_paragraphs(f"{words[:300]}\n22) {words[300:]}\n")) == 1  # not a list: one paragraph


DIARY = re.compile(r"\btried and not kept\b|\(before: |\bbefore the fix\b|\bonce got\b|\bused to\b|"
                   r"\bearlier (?:one-factor )?model\b", re.I)


def test_the_pages_state_the_current_fact_not_its_history():
    """What was tried, and what a figure was before, belongs in bench/RESULTS.md; a page states the
    current fact (with its date and commit where it is a measurement)."""
    found = []
    for path in DOC_FILES:
        prose = " ".join(split_markdown(path.read_text())[1].split())  # a phrase may run over a line break
        found += [f"{path.relative_to(ROOT)}: ...{prose[max(0, m.start() - 40):m.end() + 40]}..."
                  for m in DIARY.finditer(prose)]
    assert not found, "\n".join(found)


def test_readme_stays_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300, (
        "README.md: at most 300 lines; move text into docs/")


# ---- the checker finds planted mistakes --------------------------------------------------------
def block(*lines: str) -> str:
    return "```bash\n" + "\n".join(lines) + "\n```\n"


def test_a_good_snippet_passes():
    text = block(
        "python train.py trainer.max_steps=5 +strategy.ds_config_overrides.zero_optimization.x=1  # comment",
        "torchrun --standalone --nproc_per_node=2 train.py strategy=zero2 run.dir=runs/x \\",
        "    checkpoint.every=50 ~fault.at_step",
        "python train.py -m launcher=slurm hydra.launcher.tasks_per_node=8 strategy=ddp,zero1,zero3",
        "make run STRATEGIES=ddp,zero2 ARGS=\"trainer.max_steps=100 model=gpt_small\"",
        "python -m zerolab memory --params 7e9 --strategy ddp --sweep-world 1,8 --json",
        "python -m zerolab data prepare --src DIR --out corpus.bin",
        "cat zerolab/config.py conf/model/gpt_tiny.yaml runs/long/checkpoints",
    ) + "Set `checkpoint.resume=auto` or `model.activation_checkpointing`; see `train.py`, `test_docs.py`.\n"
    assert problems(text) == []


@pytest.mark.parametrize("snippet, expected", [
    (block("python train.py trainer.max_stepz=5"),
     "trainer.max_stepz=5: no such config key; did you mean trainer.max_steps?"),
    (block("launch/torchrun.sh strategy=zero9"), "conf/strategy/zero9.yaml does not exist"),
    (block("python train.py -m strategy=ddp,zero4"), "conf/strategy/zero4.yaml does not exist"),
    (block("sbatch launch/slurm.sbatch \\", "    optim.learning_rate=1"), "optim.learning_rate=1: no such config key"),
    (block("make run ARGS=\"trainer.maxsteps=3\""), "trainer.maxsteps=3: no such config key"),
    (block("python train.py -m hydra.launcher.round=3"), "'round' is not a setting"),
    (block("python train.py strategy zero2"), "strategy: not a Hydra override"),
    (block("cd /tmp && python train.py model=gpt_huge | tee log"), "conf/model/gpt_huge.yaml does not exist"),
    ("Set `trainer.max_step=3` first.\n", "trainer.max_step=3: no such config key"),
    ("Set `strategy.reshard_after_fwd`.\n", "strategy.reshard_after_fwd: no such config key"),
])
def test_a_bad_override_is_reported(snippet, expected):
    assert any(expected in p for p in problems(snippet)), problems(snippet)


@pytest.mark.parametrize("snippet, expected", [
    (block("python -m zerolab memory --paramz 7e9"), "python -m zerolab memory: no flag --paramz"),
    (block("$ python -m zerolab sweep runs/"), "python -m zerolab sweep: no such command"),
    ("`python -m zerolab data prepare --source x --out y`\n", "python -m zerolab data prepare: no flag --source"),
    ("`python -m zerolab data --src x`\n", "needs one of prepare"),
])
def test_a_bad_flag_is_reported(snippet, expected):
    assert any(expected in p for p in problems(snippet)), problems(snippet)


@pytest.mark.parametrize("snippet, expected", [
    ("See `zerolab/strategies/zero4.py`.\n", "zerolab/strategies/zero4.py does not exist"),
    (block("less launch/torchrun.bash"), "launch/torchrun.bash does not exist"),
    ("| `test_nothing_here.py` | x |\n", "tests/test_nothing_here.py does not exist"),
    ("[the page](docs/nope.md)\n", "docs/nope.md does not exist"),
    ("[the page](docs/launch.md#no-such-heading)\n", "no heading #no-such-heading"),
])
def test_a_bad_path_is_reported(snippet, expected):
    assert any(expected in p for p in problems(snippet)), problems(snippet)


# ---- the home page is the README; code names only files that exist ------------------------------------
def test_the_site_home_page_is_the_readme_not_a_copy():
    """docs/index.md holds no text of its own (the hook fills it from README.md at build time), and
    what the hook makes of the README links only to pages and anchors the site has."""
    import importlib.util

    own = COMMENT.sub("", (ROOT / "docs" / "index.md").read_text()).strip()
    assert own == "", f"docs/index.md must stay empty (edit README.md instead): {own[:200]!r}"
    assert "docs/hooks/readme.py" in (ROOT / "mkdocs.yml").read_text()
    spec = importlib.util.spec_from_file_location("readme_hook", ROOT / "docs" / "hooks" / "readme.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    home = hook.readme_as_home()
    assert home.startswith("# zerolab") and "](docs/" not in home
    assert link_problems(home, ROOT / "docs" / "index.md") == []


SOURCES = [p for d in ("zerolab", "tests", "bench", "launch", "hydra_plugins", "conf") for p in (ROOT / d).rglob("*")
           if p.suffix in (".py", ".sh", ".yaml", ".sbatch") and "__pycache__" not in p.parts] + \
          [ROOT / "train.py", ROOT / "Makefile", ROOT / "pyproject.toml", ROOT / "bench" / "RESULTS.md"]
SOURCES.remove(ROOT / "tests" / "test_docs.py")  # it plants missing names on purpose
OTHER_PROJECTS = re.compile(r"torchtitan|pytorch/|microsoft/|huggingface/|Megatron")  # their docs/ are theirs
NAMED_FILE = re.compile(r"(?<![\w/.-])((?:zerolab|tests|bench|launch|docs|conf)/[\w./-]*\.(?:py|md|yaml|sh|sbatch))")


def test_code_and_comments_name_only_files_that_exist():
    """A comment, docstring or message naming zerolab/x.py or docs/y.md points at a real file, and
    nothing cites a design file outside the repository (the repository stands on its own)."""
    missing = []
    for path in SOURCES:
        text = path.read_text(errors="replace")
        for n, line in enumerate(text.splitlines(), 1):
            if "DESIGN.md" in line:
                missing.append(f"{path.relative_to(ROOT)}:{n}: cites DESIGN.md, which is not in the repository")
            for m in NAMED_FILE.finditer("" if OTHER_PROJECTS.search(line) else line):
                name = m.group(1).rstrip(".")
                if "{" not in name and "<" not in name and "*" not in name and not (ROOT / name).exists():
                    missing.append(f"{path.relative_to(ROOT)}:{n}: names {name}, which does not exist")
    assert not missing, "\n".join(missing)


def test_the_strategy_tables_list_every_registered_strategy():
    """README's table of strategies and the reference strategies' page come from nobody's memory:
    every name in the registry has its row, and no row names a strategy that is not registered."""
    from zerolab.strategies import REGISTRY

    rows = set(re.findall(r"^\| `(\w+)` \|", (ROOT / "README.md").read_text(), re.M))
    assert rows == set(REGISTRY), (f"README's strategy table: missing {set(REGISTRY) - rows}, "
                                   f"unknown {rows - set(REGISTRY)}")


# ---- what a new user reads first: every page reachable, one way to cite, one suite time ---------
def test_the_readme_links_every_page():
    """"Documentation by task" (or any README link) reaches every page of docs/ (index.md is the
    README itself on the site)."""
    _, prose = split_markdown((ROOT / "README.md").read_text())
    linked = {m.group(1).partition("#")[0] for m in LINK.finditer(SPAN.sub(" ", prose))}
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md") if p.name != "index.md"}
    assert pages <= linked, f"README.md links none of {sorted(pages - linked)}"


ZERO_PAPER = re.compile(r"Rajbhandari\s+et\s+al\.?,?\s+(\d{4})")


def test_the_zero_paper_is_cited_one_way():
    """Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models":
    arXiv:1910.02054 (2019), published at SC 2020. zerolab cites it by the arXiv year everywhere,
    and the README gives the full reference once."""
    found = {f"{p.relative_to(ROOT)}: {year}" for p in [*DOC_FILES, ROOT / "bench" / "RESULTS.md", *SOURCES]
             for year in ZERO_PAPER.findall(p.read_text(errors="replace")) if year != "2019"}
    assert not found, sorted(found)
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" in readme
    assert "arXiv:1910.02054" in readme


SUITE_TIME = re.compile(r"`make test`:? (?:took |takes )?(?:on this kind of machine \(2 cores\): )?"
                        r"([\d.]+) min(?:utes)?", re.S)


def test_the_readme_and_the_testing_page_state_one_suite_time_and_the_record_holds_it():
    """README's Quick start and docs/testing.md's "How long they take" state one `make test` time
    each, the same one, with its date; bench/RESULTS.md keeps every recorded run, that one too."""
    readme = (ROOT / "README.md").read_text().split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    testing = (ROOT / "docs" / "testing.md").read_text().split("\n## How long they take\n", 1)[1].split("\n## ", 1)[0]
    results = (ROOT / "bench" / "RESULTS.md").read_text()
    stated = []
    for name, text in (("README.md", readme), ("docs/testing.md", testing)):
        times = SUITE_TIME.findall(text)
        assert len(times) == 1, f"{name}: {times}"
        assert len(set(re.findall(r"20\d\d-\d\d-\d\d", text))) <= 2, f"{name} keeps a diary of dates"
        assert "bench/RESULTS.md" in text, f"{name} does not point to the record"
        stated.append(times[0])
    assert stated[0] == stated[1], stated
    record = results.split("\n## The test suite's times", 1)[1]
    assert f"{stated[0]} min" in record, stated[0]


def test_the_models_page_says_persistent_buffers_are_checkpointed():
    """docs/models.md said persistent buffers were refused at the first save long after checkpoints
    held them (tests/test_checkpoint_buffers.py resumes them bitwise): its bullet points at the
    checkpoint page's account and refuses nothing."""
    bullets = (ROOT / "docs" / "models.md").read_text().split("\n- ")
    bullet = next(b for b in bullets if b.startswith("Persistent buffers")).split("\n\n", 1)[0]
    assert "checkpoints.md#model-buffers" in bullet and "refused" not in bullet and "not saved" not in bullet
