"""The ZeRO family's house rules (zerolab/strategies/zero/), and one definition each of what it
shares with the rest (the master's storage, the dtype map), in the fast tier: a class per stage,
so no strategy module tests the stage number to choose behaviour more than a handful of times;
the memory model beside the sharder, never read by it (the runtime imports from
zerolab/strategies/zero/memory.py only the predict_ functions its classes' predict_memory calls;
the constants both need live in zerolab/buckets.py, each with its reason)."""
import ast
import re

from conftest import ROOT

STRATEGIES = ROOT / "zerolab" / "strategies"
MEMORY_MODEL = "zerolab.strategies.zero.memory"
MAX_STAGE_TESTS = 5  # per module: a handful (DeepSpeed's memory model reads its strategy.stage setting)


def stage_tests(source: str) -> int:
    """Comparisons that read a stage number (`stage == 1`, `self.traits.stage < 3`, `s.stage in (1, 2)`)."""
    def is_stage(node):
        return (isinstance(node, ast.Name) and node.id == "stage") or \
            (isinstance(node, ast.Attribute) and node.attr == "stage")
    return sum(1 for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Compare)
               and any(is_stage(n) for n in [node.left, *node.comparators]))


def memory_model_reads(source: str) -> list[str]:
    """What a module takes from the memory model other than a predict_ function called inside a
    predict_memory: each as 'name (line)'."""
    tree = ast.parse(source)
    taken, bad = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name == MEMORY_MODEL for a in node.names):
            bad.append(f"import {MEMORY_MODEL} ({node.lineno})")
        if isinstance(node, ast.ImportFrom) and node.module == MEMORY_MODEL:
            for a in node.names:
                if a.name.startswith("predict_"):
                    taken.add(a.asname or a.name)
                else:
                    bad.append(f"{a.name} ({node.lineno})")
        if isinstance(node, ast.ImportFrom) and node.module == "zerolab.strategies.zero" and \
                any(a.name == "memory" for a in node.names):
            bad.append(f"memory ({node.lineno})")
    allowed = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "predict_memory"
               for n in ast.walk(f)}
    bad += [f"{n.id} ({n.lineno})" for n in ast.walk(tree)
            if isinstance(n, ast.Name) and n.id in taken and id(n) not in allowed]
    return bad


def test_no_strategy_module_tests_the_stage_often():
    counts = {str(p.relative_to(ROOT)): stage_tests(p.read_text()) for p in STRATEGIES.rglob("*.py")}
    # zerolab's sharder chooses by class: its stage classes and their base test no stage at all
    assert [counts[f"zerolab/strategies/zero/{m}.py"] for m in ("base", "stages", "stage3")] == [0, 0, 0]
    assert {k: v for k, v in counts.items() if v > MAX_STAGE_TESTS} == {}


def test_the_stage_scan_counts_stage_tests():
    assert stage_tests("if self.traits.stage == 1 and x:\n    y = stage >= 2 or s.stage in (1, 2)\n") == 3
    assert stage_tests("stages = 3\nstage = 1\nz = staged == 2\n") == 0


def test_no_runtime_module_reads_the_memory_model():
    found = {str(p.relative_to(ROOT)): memory_model_reads(p.read_text()) for p in (ROOT / "zerolab").rglob("*.py")
             if p != STRATEGIES / "zero" / "memory.py"}
    assert {k: v for k, v in found.items() if v} == {}
    # the scan sees the allowed use: the stage classes' predict_memory
    assert "predict_zero12" in (STRATEGIES / "zero" / "declared.py").read_text()


def test_the_memory_scan_finds_a_constant_and_a_call_outside_predict_memory():
    bad = (f"from {MEMORY_MODEL} import MAX_LIVE_BUCKETS, predict_zero3\n"
           "def setup():\n    predict_zero3()\n"
           "class S:\n    def predict_memory(cls):\n        predict_zero3()\n")
    assert memory_model_reads(bad) == ["MAX_LIVE_BUCKETS (1)", "predict_zero3 (3)"]
    assert memory_model_reads(f"from {MEMORY_MODEL} import predict_zero3\n"
                              "def predict_memory():\n    predict_zero3()\n") == []


def test_the_shared_bounds_say_why():
    """The bounds the sharder runs and the memory model adds up live below both, each with its reason."""
    source = (ROOT / "zerolab" / "buckets.py").read_text()
    for name in ("MAX_IN_FLIGHT", "MAX_LIVE_BUCKETS"):
        comment = re.search(rf"((?:^#.*\n)+){name} = \d+$", source, re.M)
        assert comment and "Why" in comment.group(1), name


def test_the_master_is_rounded_and_stored_in_one_place():
    """zerolab/master.py alone splits, rebuilds and rounds a master (its MasterStorage, used by
    ddp's MasterCopy, the ZeRO shard and the optimizers' stored path, and derived_weight)."""
    primitives = {"split_", "rebuild", "round_to_bf16_"}
    users = {}
    for path in (ROOT / "zerolab").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "zerolab.master":
                used = primitives & {a.name for a in node.names}
                if used:
                    users[str(path.relative_to(ROOT))] = sorted(used)
    assert users == {}


def test_one_precision_to_dtype_map():
    """zerolab/precision.py's COMPUTE_DTYPES and DTYPE_NAMES are the map: no module of the time
    model (zerolab/predict/) writes its own table of torch dtypes or precision names."""
    from zerolab.precision import COMPUTE_BYTES, COMPUTE_DTYPES, DTYPE_NAMES

    assert {DTYPE_NAMES[d] for d in COMPUTE_DTYPES.values()} == {"fp32", "bf16", "fp16"}
    assert COMPUTE_BYTES == {p: d.itemsize for p, d in COMPUTE_DTYPES.items()}
    own = []
    for path in (ROOT / "zerolab" / "predict").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            keys = node.keys if isinstance(node, ast.Dict) else []
            if any(isinstance(k, ast.Constant) and k.value == "bf16_pure" for k in keys) or \
                    any(isinstance(k, ast.Attribute) and k.attr in ("bfloat16", "float16") for k in keys):
                own.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert own == [], own


# ---- the package's shape (issue 53): parts with narrow interfaces, where a tensor lives decided once ----
ZERO = STRATEGIES / "zero"
STAGE_MODULES = ("base.py", "stages.py", "stage3.py")
# how the shard is stored and where: storage.py decides, host.py is the host's place
PLACE_OR_MODE = re.compile(r"offload|precision\.(master|grad_shard)|master_weights|master_mode", re.IGNORECASE)


def test_no_stage_module_names_offload_or_the_master_mode():
    """The stage modules ask the shard's storage (storage.py) for what they need; which kind of
    storage it is and where it lives (offload: host.py) is decided there, never tested here."""
    found = {m: [n for n, line in enumerate((ZERO / m).read_text().splitlines(), 1) if PLACE_OR_MODE.search(line)]
             for m in STAGE_MODULES}
    assert {m: lines for m, lines in found.items() if lines} == {}
    assert PLACE_OR_MODE.search("self.settings.offload_optimizer") and PLACE_OR_MODE.search("precision.master")


def classes(path):
    return [node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)]


def test_every_class_has_one_base_at_most():
    """Parts composed by the strategy, not mixins: each class derives from one class at most (and,
    as every class of zerolab, fits in 250 lines: tests/test_house.py)."""
    bases = {f"{p.name}:{c.name}": len(c.bases) for p in ZERO.glob("*.py") for c in classes(p)}
    assert {k: v for k, v in bases.items() if v > 1} == {}
    assert "base.py:ZeroBase" in bases and "storage.py:ShardStorage" in bases  # the scan sees the package


def private_reads(source: str) -> list[str]:
    """`x._name` where x is not self, cls or super(): one object reading another's private attribute."""
    def own(node):
        return (isinstance(node, ast.Name) and node.id in ("self", "cls")) or \
            (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super")
    return [f"{node.attr} ({node.lineno})" for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Attribute)
            and node.attr.startswith("_") and not node.attr.startswith("__") and not own(node.value)]


def test_no_part_reads_another_parts_private_attributes():
    found = {p.name: private_reads(p.read_text()) for p in ZERO.glob("*.py")}
    assert {k: v for k, v in found.items() if v} == {}
    assert private_reads("self._a\nsuper()._b\nx.__len__\nself.shard._c\n") == ["_c (4)"]
