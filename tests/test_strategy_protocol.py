"""The strategy protocol carries what a strategy is: its checkpoint format, the settings it reads,
whether it is the reference. Code outside strategies/ (trainer, checkpoint, report) asks the
class, never the name; a setting that has no effect under the chosen strategy is warned about
once; checkpoints written before the format was recorded still load."""
import io
import json
import logging
import re
import tokenize
from pathlib import Path

import pytest
import torch

from conftest import ROOT, fixed_corpus, run_train
from zerolab.config import compose
from zerolab.schema import BY_STRATEGY, applies_rules
from zerolab.strategies import REGISTRY, all_names, names_where, reference_strategy, strategy_class

TINY = ["model=gpt_tiny", "trainer.eval_every=0", "data.micro_batch=2", "logging.wandb.mode=disabled",
        "logging.progress=false", "run.save_model=false"]


# ---- what each strategy declares ---------------------------------------------------------------
def test_every_strategy_declares_format_settings_and_one_reference():
    import dataclasses

    from zerolab.schema import STRATEGY_SETTINGS, StrategyConfig
    from zerolab.strategies.base import Traits

    # every strategy.* key but the name is the chosen strategy's to read (BY_STRATEGY)
    decided = {k for k, rule in applies_rules().items() if rule == BY_STRATEGY}
    assert {f"strategy.{f.name}" for f in dataclasses.fields(StrategyConfig) if f.name != "name"} <= decided
    for name in REGISTRY:
        cls = strategy_class(name)
        assert cls.name == name and isinstance(cls.traits, Traits), name
        assert cls.checkpoint_format in ("pieces", "native", "none"), name
        assert cls.traits.settings in STRATEGY_SETTINGS, f"{name}'s settings are not a dataclass of the schema's"
        assert cls.traits.also_reads <= decided, f"{name} reads settings left to no strategy: {cls.traits.also_reads}"
    assert reference_strategy() == "ddp"
    # and no setting is orphaned: every one a strategy decides is read by some strategy
    cfg = compose(TINY)
    used = {k for k in decided for name in REGISTRY if strategy_class(name).reads(k, cfg)}
    assert decided <= used, f"strategy-decided settings no strategy reads: {sorted(decided - used)}"
    # every strategy writes zerolab's pieces (format 5); "native" is only read, from DeepSpeed's
    # checkpoints of before, by the class that can still read them
    assert names_where(checkpoint_format="pieces") == list(REGISTRY)
    assert [n for n in REGISTRY if hasattr(strategy_class(n), "load_native")] == ["deepspeed"]
    # the default lists of `make run`, bench/compare.py and bench/zero.py come from the registry
    assert all_names().split(",") == list(REGISTRY)
    assert names_where(zerolab_sharder=True) == ["zero1", "zero2", "zero3"]
    assert names_where(not_rehearsable="") == [n for n in REGISTRY if n != "deepspeed"]


def test_a_strategy_reads_exactly_its_settings_dataclass():
    """strategy.reshard_after_forward is zero3's and DeepSpeed's (its stage 3); bucket_mb everyone's
    who has buckets."""
    cfg = compose(TINY)
    assert strategy_class("zero3").reads("strategy.reshard_after_forward", cfg)
    assert not strategy_class("zero2").reads("strategy.reshard_after_forward", cfg)
    assert strategy_class("deepspeed").reads("strategy.reshard_after_forward", cfg)
    assert not strategy_class("fsdp").reads("strategy.bucket_mb", cfg)
    assert strategy_class("deepspeed").reads("strategy.ds_config_overrides", cfg)
    assert not strategy_class("deepspeed").reads("trainer.nonfinite", cfg)  # DeepSpeed decides non-finite steps


def _code_words(path: Path) -> set[str]:
    """Identifiers and the words inside string literals of a file, comments and docstrings left out."""
    words, prev = set(), None
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type == tokenize.STRING and prev in (tokenize.INDENT, tokenize.NEWLINE, tokenize.DEDENT, None):
            prev = tok.type  # a docstring (a string statement of its own)
            continue
        if tok.type in (tokenize.NAME, tokenize.STRING,
                        tokenize.FSTRING_MIDDLE if hasattr(tokenize, "FSTRING_MIDDLE") else -1):
            words |= set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", tok.string.lower()))
        if tok.type not in (tokenize.NL, tokenize.COMMENT):
            prev = tok.type
    return words


def test_trainer_checkpoint_and_report_name_no_strategy():
    files = [ROOT / "zerolab" / "trainer.py", *sorted((ROOT / "zerolab" / "report").glob("*.py")),
             *sorted((ROOT / "zerolab" / "checkpoint").glob("*.py"))]
    assert len(files) > 8  # the packages were found
    for f in files:
        named = _code_words(f) & set(REGISTRY)
        assert not named, f"{f.relative_to(ROOT)} names strategies {sorted(named)} in code: ask the strategy class"


def test_report_asks_the_strategy_class():
    from zerolab.report import Run, known_cause, label_runs

    def run(strategy, **extra):
        return Run(Path(strategy), {"strategy": {"name": strategy, **extra}, "optim": {"name": "lamb"}}, [], {})

    runs = [run("ddp"), run("deepspeed", stage=2, client_optimizer=True), run("zero2"), run("retired_strategy")]
    label_runs(runs)
    assert [r.label for r in runs] == ["ddp", "deepspeed-s2", "zero2", "retired_strategy"]
    assert "per-tensor trust ratios become one per group" in known_cause(runs[1], runs[0])
    assert known_cause(runs[2], runs[0]) == ""


# ---- settings that have no effect ----------------------------------------------------------------
@pytest.fixture()
def fresh_warnings(monkeypatch):
    import zerolab.config

    monkeypatch.setattr(zerolab.config, "_warned", set())
    monkeypatch.delenv("RANK", raising=False)


@pytest.mark.parametrize("overrides, warned", [
    (["strategy=ddp", "strategy.reduce_dtype=fp32"], ["strategy.reduce_dtype"]),
    (["strategy=zero2", "strategy.reduce_dtype=fp32"], []),
    (["strategy=ddp", "strategy.stage=2"], ["strategy.stage"]),
    (["strategy=deepspeed"], []),  # deepspeed.yaml sets stage: 2, which deepspeed reads
    (["strategy=deepspeed", "strategy.stage=0"], []),
    (["strategy=zero1", "strategy.stage=0"], []),  # the default: nobody can tell it was set, and it changes nothing
    (["strategy=fsdp", "strategy.bucket_mb=10"], ["strategy.bucket_mb"]),
    (["strategy=fsdp", "strategy.bucket_mb=25"], []),
    (["strategy=deepspeed", "trainer.nonfinite=skip"], ["trainer.nonfinite"]),
    (["strategy=zero2", "trainer.nonfinite=skip"], []),
    (["strategy=zero2", "strategy.client_optimizer=true", "strategy.overlap_comm=false",
      "+strategy.ds_config_overrides.zero_optimization.round_robin_gradients=true"],
     ["strategy.client_optimizer", "strategy.ds_config_overrides", "strategy.overlap_comm"]),
    (["strategy=zero1", "strategy.find_unused_parameters=true"], ["strategy.find_unused_parameters"]),
    (["strategy=ddp", "strategy.find_unused_parameters=true"], []),
])
def test_setting_without_effect_warns_once_naming_it(overrides, warned, fresh_warnings, caplog):
    with caplog.at_level(logging.WARNING, logger="zerolab"):
        cfg = compose(["model=gpt_tiny", *overrides])
        compose(["model=gpt_tiny", *overrides])  # validated again in one process: no second warning
    lines = [r.getMessage() for r in caplog.records if "has no effect" in r.getMessage()]
    assert sorted(line.split("=", 1)[0] for line in lines) == warned, lines
    for line in lines:
        assert f"under strategy={cfg.strategy.name}" in line


def test_fsdp_on_a_model_without_blocks_warns(tmp_path, monkeypatch, caplog):
    """One FSDP unit holding every parameter is not ZeRO-3: the run says so, naming the model."""
    from zerolab import dist as zdist
    from zerolab.trainer import Trainer

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    cfg = compose(["strategy=fsdp", "model=gpt_tiny", "model.kind=mlp", *TINY, f"data.path={fixed_corpus()}",
                   f"run.dir={tmp_path / 'run'}"])
    ctx = zdist.init(cfg.dist)
    try:
        with caplog.at_level(logging.WARNING, logger="zerolab"):
            trainer = Trainer(cfg, ctx)
        trainer.close()
    finally:
        zdist.shutdown(ctx)
    found = [r.getMessage() for r in caplog.records if "has no .blocks" in r.getMessage()]
    assert len(found) == 1 and "strategy=fsdp: the model (NextTokenMLP) has no .blocks" in found[0], found


@pytest.mark.slow
def test_a_real_run_prints_one_warning_line(tmp_path):
    """Two ranks validate the config; the warning comes once (from rank 0)."""
    proc = run_train(tmp_path / "run", 2, *TINY, "strategy=ddp", "strategy.reduce_dtype=fp32", "trainer.max_steps=1")
    out = proc.stdout + proc.stderr
    assert out.count("strategy.reduce_dtype='fp32' has no effect under strategy=ddp") == 1, out[-3000:]


# ---- checkpoints written before the format was recorded -------------------------------------------
def test_format_2_checkpoint_still_loads(tmp_path, monkeypatch):
    """A pieces checkpoint rewritten as format 2 wrote it (no checkpoint_format field) verifies as
    the pieces format and resumes; the resumed strategy counts steps from the checkpoint's."""
    from zerolab import dist as zdist
    from zerolab.checkpoint import FORMAT_VERSION, meta_text, verify
    from zerolab.trainer import Trainer

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    common = ["strategy=zero1", *TINY, f"data.path={fixed_corpus()}", f"checkpoint.dir={tmp_path / 'ck'}"]
    cfg = compose([*common, f"run.dir={tmp_path / 'a'}"])
    ctx = zdist.init(cfg.dist)
    try:
        a = Trainer(cfg, ctx)
        a.train_step(0)
        a.train_step(1)
        path = a.checkpointer.save(2, a.strategy, a.schedule, a.sampler)
        saved = {k: v.clone() for k, v in a.strategy.consolidated_state_dict().items()}
        a.close()

        meta_file = Path(path) / "meta.json"
        meta = json.loads(meta_file.read_text())
        assert FORMAT_VERSION == 5 and meta["format_version"] == 5 and meta["checkpoint_format"] == "pieces"
        old = {k: v for k, v in meta.items() if k not in ("checkpoint_format", "meta_sha256")}
        meta_file.write_text(meta_text({**old, "format_version": 2}))
        assert verify(path)["checkpoint_format"] == "pieces"

        b = Trainer(compose([*common, f"run.dir={tmp_path / 'b'}", f"checkpoint.resume={path}"]), ctx)
        assert b.start_step == 2 and b.strategy.step_count == 2
        got = b.strategy.consolidated_state_dict()
        assert all(torch.equal(got[k], saved[k]) for k in saved)
        b.close()
    finally:
        zdist.shutdown(ctx)


# ---- the example strategy of docs/writing-a-strategy.md, run as written --------------------------------
def _documented_strategy(tmp_path, monkeypatch) -> str:
    """The page's python block, as a module on the path, registered under its own name."""
    import sys

    page = (ROOT / "docs" / "writing-a-strategy.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "class FlatAllReduceStrategy" in b]
    (tmp_path / "documented_strategy.py").write_text(block)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "documented_strategy", raising=False)
    monkeypatch.setitem(REGISTRY, "flat_allreduce", "documented_strategy:FlatAllReduceStrategy")
    return "flat_allreduce"


def test_the_documented_example_strategy_trains_as_ddp(tmp_path, monkeypatch, one_rank):
    """The page's strategy, registered as it says, trains 4 steps equal to ddp's: on one rank both
    apply the same gradients (an all-reduce of one rank is the identity) through the same
    `_update` and optimizer, so the weights agree exactly; its memory equals its own prediction."""
    from zerolab.trainer import Trainer

    name = _documented_strategy(tmp_path, monkeypatch)
    weights, memory = {}, {}
    for strategy in ("ddp", name):
        cfg = compose([*TINY, "strategy=ddp", f"run.dir={tmp_path / strategy}", "trainer.max_steps=4",
                       f"data.path={fixed_corpus()}", "optim.grad_clip=0.5"])
        cfg.strategy.name = strategy  # (its yaml would say `name: flat_allreduce`; the schema is shared)
        trainer = Trainer(cfg, one_rank)
        try:
            for step in range(4):
                trainer.train_step(step)
            weights[strategy] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
            memory[strategy] = trainer.strategy.memory()
            predicted = trainer.memory.predicted[0].bytes()
        finally:
            trainer.close()
    ddp = {k.removeprefix("module."): v for k, v in weights["ddp"].items()}
    assert ddp.keys() == weights[name].keys()
    assert all(torch.equal(ddp[k], weights[name][k]) for k in ddp), "the example strategy diverged from ddp"
    assert memory[name]["model_states"] == predicted["model_states"]


def test_the_documented_example_refuses_what_it_cannot_run(tmp_path, monkeypatch):
    from zerolab.errors import ConfigError

    name = _documented_strategy(tmp_path, monkeypatch)
    cfg = compose([*TINY, "strategy=ddp", "precision=bf16"])
    with pytest.raises(ConfigError, match="trains fp32 only"):
        strategy_class(name).check_config(cfg, 1)


def test_a_strategy_without_checkpoints_is_refused_them_and_stops_without_one(tmp_path, monkeypatch, one_rank):
    """Every registered strategy writes checkpoints; a new one need not (the page's example
    declares none): checkpoint.every is refused before any rank starts, and a stop signal still
    ends its run after the step, with no checkpoint, the one line saying so and the marker none."""
    from zerolab.errors import ConfigError
    from zerolab.run.preempt import MARKER, Preempted, Stop
    from zerolab.trainer import Trainer

    name = _documented_strategy(tmp_path, monkeypatch)
    assert strategy_class(name).checkpoint_format == "none"
    cfg = compose([*TINY, "strategy=ddp", f"run.dir={tmp_path / 'run'}", f"data.path={fixed_corpus()}",
                   "trainer.max_steps=4", "checkpoint.every=2"])
    cfg.strategy.name = name
    with pytest.raises(ConfigError, match=rf"strategy={name} cannot write checkpoints yet; use one of ddp, "):
        strategy_class(name).check_config(cfg, 1)
    cfg.checkpoint.every = 0
    trainer = Trainer(cfg, one_rank)
    try:
        trainer.train_step(0)
        with pytest.raises(Preempted, match=r"^zerolab: stopped after step 1 of 4 on SIGTERM; checkpoint \(none\); "
                                            r"no checkpoint was written \(this strategy cannot write one\)$"):
            trainer.stop(1, None, Stop(signal="SIGTERM", signalled=(0,), write_failed=(), world_size=1))
    finally:
        trainer.close()
    assert json.loads((tmp_path / "run" / MARKER).read_text())["checkpoint"] is None
    assert not (tmp_path / "run" / "checkpoints").exists()


# ---- docs/writing-a-strategy.md is true to the code ------------------------------------------------
NUMBERS = {n: i for i, n in enumerate("zero one two three four five six seven eight nine ten eleven twelve thirteen "
                                      "fourteen fifteen sixteen seventeen eighteen nineteen twenty".split())}
NUMBERS.update({f"twenty-{w}": 20 + i for w, i in NUMBERS.items() if 0 < i < 10})


def test_the_writing_a_strategy_page_counts_and_names_the_protocol():
    """Its protocol table lists the Strategy base class's public members, each once; the counts in
    its prose are the table's; every metric it cites (`mem/...`) is one zerolab writes."""
    from zerolab.accounting import CATEGORIES
    from zerolab.strategies.base import Strategy

    page = (ROOT / "docs" / "writing-a-strategy.md").read_text()
    rows = re.findall(r"^\| (\w+) \| `(\w+)` \|", page.split("## The protocol")[1].split("\n## ")[0], re.M)
    surface = sorted(n for n in dir(Strategy) if not n.startswith("_"))
    assert sorted(m for _, m in rows) == surface
    count, required = re.search(r"The base class has ([\w-]+) public members; a strategy must write (\w+) of them",
                                page).groups()
    assert (NUMBERS[count], NUMBERS[required]) == (len(surface), sum(kind == "required" for kind, _ in rows))
    sources = "\n".join(p.read_text() for p in (ROOT / "zerolab").rglob("*.py"))
    written = {f"mem/{c}_bytes" for c in CATEGORIES} | set(re.findall(r"\"(mem/\w+)\"", sources))
    cited = set(re.findall(r"`(mem/\w+)`", page))
    assert cited <= written, f"the page cites metrics zerolab never writes: {sorted(cited - written)}"


def test_predict_memory_declares_every_keyword_its_caller_passes():
    """Strategy.predict_memory's signature is what zerolab.memory passes it, keyword for keyword."""
    import ast
    import inspect

    from zerolab.strategies.base import Strategy

    tree = ast.parse((ROOT / "zerolab" / "memory" / "prediction.py").read_text())
    (call,) = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "predict_memory"]
    params = inspect.signature(Strategy.predict_memory).parameters
    declared = {n for n, p in params.items() if p.kind == p.KEYWORD_ONLY}
    assert {k.arg for k in call.keywords} == declared


def test_fsdp_counts_the_gradients_memory_on_measured_steps_only(tmp_path, monkeypatch):
    """FSDP2 frees its gradients inside the step, so memory() keeps what a count found before the
    update. The count walks every storage: it runs on the first step and on steps that measure,
    not on the steps a run does not log; memory() after those still reports the gradients."""
    from zerolab import dist as zdist
    from zerolab.numerics import Measure
    from zerolab.trainer import Trainer

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    cfg = compose(["strategy=fsdp", "model=gpt_tiny", *TINY, "trainer.log_every=100", "trainer.max_steps=100",
                   f"data.path={fixed_corpus()}", f"run.dir={tmp_path / 'run'}"])
    ctx = zdist.init(cfg.dist)
    try:
        trainer = Trainer(cfg, ctx)
        strategy, counted = trainer.strategy, []
        measure = strategy._measure
        monkeypatch.setattr(strategy, "_measure", lambda: counted.append(1) or measure())
        grads = sum(q.numel() * 4 for q in strategy.params)  # fp32 gradient shards of one rank: every element
        trainer.train_step(0)  # the first step counts
        first = strategy.memory()
        counts = len(counted)
        for step in (1, 2):
            assert not trainer.logs_step(step) and trainer.measure(step, False) is Measure.NOTHING
            trainer.train_step(step)
        assert len(counted) == counts, "an unlogged step walked the storages"
        assert strategy.memory()["grads"] == first["grads"] == grads
        trainer.close()
    finally:
        zdist.shutdown(ctx)
