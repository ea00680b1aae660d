"""The model shapes zerolab ships (zerolab/models/shapes/: published open models' config.json, no
weights), so that `model=hf model.config=llama2-7b` runs on a fresh clone without a download.

Each shape is built on the meta device (nothing allocated) and its parameter count compared with
the count its publisher states, to the parameter: a wrong hidden size, head count, KV-head count,
vocabulary or tied head changes it. The names resolve where model.config is read (compose, the
dry run), a local path of the same name wins, and a name that is neither a path nor shipped is
refused with the shipped names listed. Fast tier: no process is started."""
from __future__ import annotations

import json
import re

import pytest

from conftest import ROOT, bench_module

SHAPES = ROOT / "zerolab" / "models" / "shapes"

# The parameter counts the publishers state (the models' cards and papers), exact.
PUBLISHED = {
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3.1-8b": 8_030_261_248,
    "llama3.1-70b": 70_553_706_496,
    "mistral-7b": 7_241_732_096,
    "qwen2.5-7b": 7_615_616_512,
    "gpt2-xl": 1_557_611_200,
}


def test_the_shipped_names_are_the_published_models():
    from zerolab.models.sources import shipped_shapes

    assert shipped_shapes() == sorted(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_shipped_shape_has_its_published_parameter_count(name):
    import torch
    from transformers import AutoModelForCausalLM

    from zerolab.models.sources import hf_config
    from zerolab.schema import ModelConfig

    config = hf_config(ModelConfig(kind="hf", config=name))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[name]


def test_each_shape_names_its_source_beside_it():
    """zerolab/models/shapes/README.md has a row per file: the model, its hub repository, its count."""
    readme = (SHAPES / "README.md").read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([\w.-]+)` \|.*$", readme, re.M)}
    assert set(rows) == set(PUBLISHED)
    for name, row in rows.items():
        assert re.search(r"`[\w-]+/[\w.-]+`", row), row  # the hub repository the config was written from
        assert f"{PUBLISHED[name]:,}" in row, row


def test_the_shapes_agree_with_the_benchmarks_own_configs():
    """bench/fit.py wrote its Llama 2 7B shape out by hand: the shipped file says the same on every
    key they share. The published runs' table (zerolab/predict/published.py) names shipped shapes
    themselves, so there is nothing of theirs to disagree."""
    from zerolab.models.sources import shipped_shapes
    from zerolab.predict.published import RUNS

    LLAMA_7B = bench_module("fit").LLAMA_7B
    ours = json.loads((SHAPES / "llama2-7b.json").read_text())
    shared = set(ours) & set(LLAMA_7B) - {"max_position_embeddings"}
    assert {"hidden_size", "num_hidden_layers", "vocab_size"} <= shared
    assert {k: ours[k] for k in shared} == {k: LLAMA_7B[k] for k in shared}
    named = {run.model for run in RUNS if not run.model.startswith("gpt2:")}
    assert named and named <= set(shipped_shapes()), named


def test_a_shipped_name_resolves_and_a_local_path_wins(tmp_path, monkeypatch):
    from zerolab.config import compose
    from zerolab.models import resolve
    from zerolab.models.sources import config_file

    assert config_file("llama2-7b") == str(SHAPES / "llama2-7b.json")
    cfg = compose(["model=hf", "model.config=mistral-7b", "model.block_size=4096"], world_size=1)
    resolve(cfg.model)  # what the job and the dry run do before anything is built
    assert cfg.model.vocab_size == 32000  # the shape's vocabulary
    monkeypatch.chdir(tmp_path)
    (tmp_path / "llama2-7b").mkdir()
    (tmp_path / "llama2-7b" / "config.json").write_text("{}")
    assert config_file("llama2-7b") == "llama2-7b/config.json"  # the user's own directory of that name


def test_a_name_neither_a_path_nor_shipped_lists_the_shipped_ones(tmp_path, monkeypatch):
    from zerolab.config import compose
    from zerolab.errors import ConfigError
    from zerolab.models import resolve

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:  # a name (not a path): which names there are
        resolve(compose(["model=hf", "model.config=llama7b"], world_size=1).model)
    said = str(err.value)
    assert "model.config=llama7b: no such file or directory, no shipped shape of that name" in said
    assert all(name in said for name in PUBLISHED), said
    with pytest.raises(ConfigError, match=r"^model.config=llama7b/config.json: no such file or directory$"):
        resolve(compose(["model=hf", "model.config=llama7b/config.json"], world_size=1).model)  # a path
    with pytest.raises(ConfigError, match="gpt2-xl, llama2-13b, llama2-70b, llama2-7b"):
        compose(["model=hf"], world_size=1)  # no model.config at all: the shipped names are offered
