"""The user's models, in one process (fast tier): transformers causal LMs built from configs written
here (model=hf; hidden size 64, 2 layers, vocabulary 512), a custom nn.Module from a file written
outside the repository (model=custom), their repeated blocks, config resolution without network,
refusals as ConfigErrors, tied weights, names in weights and exports, meta-device builds, and
one-rank runs (activation checkpointing with a frozen embedding under zero3, the ledger's shapes).
The same models under 3 real ranks: tests/test_models_runs.py.
"""
from __future__ import annotations

import json
import socket
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from conftest import fixed_corpus, rel_l2_diff
from zerolab.config import ConfigError, compose

import transformers  # noqa: E402,F401  (pinned in pyproject.toml: a broken install fails, it does not skip)

# ---- what the tests build on ---------------------------------------------------------------------
TINY = dict(vocab_size=512, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)


def write_configs(d: Path) -> dict[str, Path]:
    """Tiny transformers configs: Llama with grouped-query attention (4 heads, 2 KV heads), an untied
    head and a padding row (padding_idx: HF's _init_weights zeroes it); GPT-2 with its tied head;
    Qwen2 with q/k/v biases. Hidden size 64, 2 layers, vocabulary 512."""
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    d.mkdir(parents=True, exist_ok=True)
    configs = {
        "llama": LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=0, **TINY),
        "gpt2": GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=128, bos_token_id=1,
                           eos_token_id=2),
        "qwen2": Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, **TINY),
    }
    out = {}
    for name, c in configs.items():
        out[name] = d / f"{name}.json"
        c.to_json_file(str(out[name]))
    return out


# A model of the user's own, in a file outside the repository: a tied head, blocks two levels down
# (body.trunk.stack), a position table registered on the root and read inside every block.
CUSTOM_SOURCE = textwrap.dedent('''
    import types

    import torch
    import torch.nn as nn
    import torch.nn.functional as F


    class Block(nn.Module):
        def __init__(self, dim, heads):
            super().__init__()
            self.heads = heads
            self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.qkv = nn.Linear(dim, 3 * dim, bias=False)
            self.proj = nn.Linear(dim, dim, bias=False)
            self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

        def forward(self, x, pos):
            x = x + pos  # the root's position table, used inside the block
            B, T, C = x.shape
            q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2)
                       for t in self.qkv(self.ln1(x)).split(C, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
            return x + self.out(F.gelu(self.fc(self.ln2(x))))


    class Trunk(nn.Module):
        def __init__(self, dim, heads, layers):
            super().__init__()
            self.stack = nn.ModuleList(Block(dim, heads) for _ in range(layers))


    class Body(nn.Module):
        def __init__(self, dim, heads, layers):
            super().__init__()
            self.trunk = Trunk(dim, heads, layers)


    class TinyLM(nn.Module):
        def __init__(self, vocab=512, dim=64, heads=4, layers=2, window=64):
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.pos = nn.Parameter(torch.randn(window, dim) * 0.02)
            self.body = Body(dim, heads, layers)
            self.norm = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, vocab, bias=False)
            self.head.weight = self.embed.weight  # tied

        def forward(self, ids):
            x, pos = self.embed(ids), self.pos[:ids.shape[1]]
            for block in self.body.trunk.stack:
                x = block(x, pos)
            return self.head(self.norm(x))


    class WithOutput(TinyLM):  # returns an object holding the logits, as transformers models do
        def forward(self, ids):
            return types.SimpleNamespace(logits=super().forward(ids), aux=1)


    class Flat(nn.Module):  # no repeated blocks
        def __init__(self, vocab=512, dim=32):
            super().__init__()
            self.embed, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)

        def forward(self, ids):
            return self.head(self.embed(ids))


    def make(**kwargs):  # a factory works as a target too
        return TinyLM(**kwargs)


    def not_a_module():
        return 3


    class NotModule:
        pass
''')
CUSTOM_MODULE = "zerolab_user_lm"  # the module's name: not a name inside this repository


def write_custom(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{CUSTOM_MODULE}.py").write_text(CUSTOM_SOURCE)
    return d


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    return write_configs(tmp_path_factory.mktemp("hf-configs"))


@pytest.fixture
def custom(tmp_path, monkeypatch):
    d = write_custom(tmp_path / "outside")
    monkeypatch.syspath_prepend(str(d))
    sys.modules.pop(CUSTOM_MODULE, None)
    yield d
    sys.modules.pop(CUSTOM_MODULE, None)


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """No test here may reach a network: HF_HUB_OFFLINE=1, and a socket connect fails the test."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def refuse(*args, **kwargs):
        raise AssertionError(f"a network connection was attempted: {args}")
    monkeypatch.setattr(socket.socket, "connect", refuse)


def hf(config: Path, *extra: str, strategy: str = "ddp"):
    cfg = compose(["model=hf", f"model.config={config}", f"strategy={strategy}", *extra])
    from zerolab.job import model_preflight

    model_preflight(cfg)
    return cfg


def build(cfg, device="cpu", seed=0):
    from zerolab.models import build_model

    torch.manual_seed(seed)
    return build_model(cfg.model, device=device)


# ---- units: the repeated blocks ------------------------------------------------------------------
@pytest.mark.parametrize("name, blocks, root", [
    ("llama", "model.layers", {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}),
    ("gpt2", "transformer.h", {"transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight",
                               "transformer.ln_f.bias"}),
    ("qwen2", "model.layers", {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"})])
def test_blocks_of_transformers_models(configs, name, blocks, root):
    """The decoder layers are the blocks, found on a meta build (no memory); everything else is the
    root, GPT-2's tied head included (lm_head.weight is transformer.wte.weight: one parameter)."""
    from zerolab.models import block_of_parameters, find_blocks

    model = build(hf(configs[name]), device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    found = find_blocks(model)
    assert found.name == blocks and len(found.modules) == 2
    block_of = block_of_parameters(model)
    names = dict(model.named_parameters(remove_duplicate=False))
    assert {n for n, p in names.items() if block_of[id(p)] == -1} == root | (
        {"lm_head.weight"} if name == "gpt2" else set())
    assert {block_of[id(p)] for n, p in names.items() if n.startswith(f"{blocks}.1.")} == {1}
    if name == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight


def test_blocks_of_a_custom_model_and_of_odd_ones(custom):
    """Two levels down, found; a list of mixed classes, a list inside a block (experts) and an empty
    one are not blocks; model.blocks names them where the search would not."""
    from zerolab.models import block_of_parameters, find_blocks
    from zerolab_user_lm import Flat, TinyLM

    model = TinyLM()
    assert find_blocks(model).name == "body.trunk.stack"
    block_of = block_of_parameters(model)
    assert block_of[id(model.pos)] == -1 and block_of[id(model.head.weight)] == -1  # root; tied
    assert block_of[id(model.body.trunk.stack[1].fc.weight)] == 1
    assert find_blocks(Flat()) is None

    class Expert(nn.Linear):
        pass

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList(Expert(4, 4) for _ in range(8))  # longer than the layer list

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.mixed = nn.ModuleList([nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)])
            self.empty = nn.ModuleList()
            self.layers = nn.ModuleList(MoE() for _ in range(3))
            self.seq = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

    net = Net()
    assert find_blocks(net).name == "layers"
    assert find_blocks(net, "seq").name == "seq"  # named: a Sequential is accepted
    with pytest.raises(ConfigError, match="model.blocks=nope: Net has no submodule 'nope'.*layers"):
        find_blocks(net, "nope")
    with pytest.raises(ConfigError, match="model.blocks=layers.0: 'layers.0' is a MoE, not a non-empty"):
        find_blocks(net, "layers.0")


def test_zerolab_gpt_keeps_its_blocks():
    from zerolab.models import block_of_parameters, build_model, find_blocks

    model = build_model(compose(["model=gpt_tiny"]).model, device="meta")
    assert find_blocks(model).name == "blocks"
    assert block_of_parameters(model)[id(model.wte.weight)] == -1
    assert find_blocks(build_model(compose(["model=mlp"]).model, device="meta")) is None


# ---- model=hf: resolution, vocabulary, window ----------------------------------------------------
def test_config_file_directory_and_cached_hub_id(configs, tmp_path, monkeypatch):
    """A config.json, a saved model's directory and a hub id in the local cache all resolve,
    offline, with no network; the vocabulary becomes the config's."""
    import huggingface_hub.constants

    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "config.json").write_text(configs["gpt2"].read_text())
    cache = tmp_path / "hub"  # the layout huggingface_hub writes: models--org--name/snapshots/<rev>/
    snap = cache / "models--someorg--tiny-llama" / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(configs["llama"].read_text())
    (cache / "models--someorg--tiny-llama" / "refs").mkdir()
    (cache / "models--someorg--tiny-llama" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    for spec, kind in ((configs["qwen2"], "qwen2"), (saved, "gpt2"), ("someorg/tiny-llama", "llama")):
        cfg = hf(spec)
        assert cfg.model.vocab_size == 512
        assert build(cfg, device="meta").config.model_type == kind


def test_refusals_of_model_hf(configs, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(ConfigError, match="model=hf needs model.config=PATH"):
        compose(["model=hf"])
    with pytest.raises(ConfigError, match=f"model.config={tmp_path}/nope.json: no such file or directory$"):
        hf(tmp_path / "nope.json")
    with pytest.raises(ConfigError, match="no hub id 'someorg/not-here' with a config.json in the local Hugging Face "
                                          "cache .*zerolab never downloads"):
        hf("someorg/not-here")  # offline and uncached: refused at once (a socket connect would fail the test)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="the directory holds no config.json"):
        hf(tmp_path / "empty")
    with pytest.raises(ConfigError, match=r"model.block_size=256 is longer than .* \(max_position_embeddings 128\)"):
        hf(configs["llama"], "model.block_size=256")
    with pytest.raises(ConfigError, match="model.vocab_size=1000, but .* has vocab_size 512"):
        hf(configs["llama"], "model.vocab_size=1000")
    bert = tmp_path / "bert.json"
    bert.write_text(json.dumps({"model_type": "no_such_model", "vocab_size": 10}))
    with pytest.raises(ConfigError, match="model_type 'no_such_model' is no causal LM"):
        hf(bert)


def test_data_vocabulary_larger_than_the_model_is_refused(configs, tmp_path):
    """The data check reads model=hf's own vocabulary (512), set before it runs."""
    import numpy as np

    from zerolab.data import check_data

    tokens = tmp_path / "tokens.bin"
    np.concatenate([np.arange(600), np.zeros(4000)]).astype(np.uint16).tofile(tokens)
    cfg = hf(configs["llama"], f"data.path={tokens}")
    with pytest.raises(ConfigError, match="599"):
        check_data(cfg.data, cfg.model.block_size, cfg.model.vocab_size)


# ---- model=custom ---------------------------------------------------------------------------------
def test_custom_targets_and_their_refusals(custom):
    """A class, a factory and a module returning .logits build; a missing module, a missing name,
    something that is not an nn.Module, and logits of the wrong width are refused."""
    from zerolab.job import model_preflight

    def custom_cfg(target, *extra, strategy="ddp"):
        cfg = compose(["model=custom", f"model.target={CUSTOM_MODULE}:{target}", "model.vocab_size=512",
                       f"strategy={strategy}", *extra])
        model_preflight(cfg)
        return cfg

    ids = torch.randint(0, 512, (2, 16))
    for target in ("TinyLM", "make", "WithOutput"):
        model = build(custom_cfg(target))
        assert model(ids).shape == (2, 16, 512)  # .logits taken out by the source
    assert build(custom_cfg("make", "+model.kwargs.dim=32"))(ids).shape == (2, 16, 512)
    with pytest.raises(ConfigError, match="model=custom needs model.target=pkg.module:Name"):
        compose(["model=custom", "model.target=just_a_name"])
    with pytest.raises(ConfigError, match="importing no_such_pkg.lm failed .*Python path"):
        model_preflight(compose(["model=custom", "model.target=no_such_pkg.lm:LM"]))
    with pytest.raises(ConfigError, match="has no Missing"):
        custom_cfg("Missing")
    with pytest.raises(ConfigError, match="is a class that is not an nn.Module"):
        custom_cfg("NotModule")
    with pytest.raises(ConfigError, match="returned a int, not an nn.Module"):
        custom_cfg("not_a_module")
    with pytest.raises(ConfigError, match=r"maps token ids \[2, 64\] to \(2, 64, 512\), not logits "
                                          r"\[2, 64, model.vocab_size=256\]"):
        model_preflight(compose(["model=custom", f"model.target={CUSTOM_MODULE}:TinyLM"]))


def test_no_blocks_is_refused_where_blocks_are_needed(custom):
    from zerolab.job import model_preflight

    flat = ["model=custom", f"model.target={CUSTOM_MODULE}:Flat", "model.vocab_size=512"]
    model_preflight(compose([*flat, "strategy=zero2"]))  # zero2 needs no blocks
    for extra in (["strategy=zero3"], ["strategy=fsdp"], ["model.activation_checkpointing=blocks"]):
        with pytest.raises(ConfigError, match=r"has no repeated blocks .* works block by block: name them with "
                                              r"model.blocks=PATH"):
            model_preflight(compose([*flat, *extra]))
    with pytest.raises(ConfigError, match="'embed' is a Embedding, not a non-empty"):
        model_preflight(compose([*flat, "strategy=zero3", "model.blocks=embed"]))


# ---- initialisation, buffers, weights -------------------------------------------------------------
def test_init_follows_the_seed_and_buffers_keep_their_dtype(configs):
    """transformers' init draws from torch's RNG: the same seed gives the same model on every rank
    and world size, another seed another model. The padding row is zero. A strategy's cast to bf16
    casts the parameters; RoPE's inv_freq stays fp32 with its values (as from_config(dtype=bf16)
    keeps it)."""
    cfg = hf(configs["llama"])
    a, b, c = build(cfg, seed=5), build(cfg, seed=5), build(cfg, seed=6)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert a.model.embed_tokens.padding_idx == 0 and not a.model.embed_tokens.weight[0].any()
    inv = a.model.rotary_emb.inv_freq.clone()
    a.to(dtype=torch.bfloat16)
    assert a.lm_head.weight.dtype == torch.bfloat16
    assert a.model.rotary_emb.inv_freq.dtype == torch.float32 and torch.equal(a.model.rotary_emb.inv_freq, inv)
    assert a.config.use_cache is False  # a training forward builds no KV cache


def test_weights_from_a_saved_model_and_their_refusals(configs, tmp_path):
    """model.weights: a save_pretrained directory (the tied head written once), a single file, a
    sharded index; a file of another model is refused naming the keys."""
    cfg = hf(configs["gpt2"])
    src = build(cfg, seed=11)
    src.save_pretrained(tmp_path / "saved")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "saved" / "model.safetensors"), "pt") as st:
        assert "lm_head.weight" not in st.keys()  # save_pretrained writes a tied weight once
    shards = tmp_path / "sharded"
    src.save_pretrained(shards, max_shard_size="100KB")
    assert (shards / "model.safetensors.index.json").exists()
    for spec in (tmp_path / "saved", tmp_path / "saved" / "model.safetensors", shards):
        loaded = build(hf(configs["gpt2"], f"model.weights={spec}"), seed=0)
        assert rel_l2_diff(dict(loaded.state_dict()), dict(src.state_dict())) == 0
        assert loaded.lm_head.weight is loaded.transformer.wte.weight  # still tied
    with pytest.raises(ConfigError, match="model.weights=.* lacks model.embed_tokens.weight"):
        hf(configs["llama"], f"model.weights={tmp_path / 'saved'}")
    with pytest.raises(ConfigError, match="neither model.safetensors nor model.safetensors.index.json"):
        hf(configs["gpt2"], f"model.weights={tmp_path}")


def test_lm_loss_takes_logits_or_an_object_holding_them():
    from types import SimpleNamespace

    from zerolab.models import lm_loss

    logits, y = torch.randn(2, 3, 7), torch.randint(0, 7, (2, 3))
    assert torch.equal(lm_loss(SimpleNamespace(logits=logits), y), lm_loss(logits, y))


def test_transformers_is_imported_only_inside_the_hf_source():
    """Runs of zerolab's own models never import transformers: no module of zerolab imports it at
    its top level, and inside functions only zerolab/models/sources.py does (checked by reading the
    code: this process imported it already). A new process checks the run itself: test_models_runs."""
    import ast

    from conftest import ROOT

    for path in (ROOT / "zerolab").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n.split(".")[0] == "transformers" for n in names):
                assert path.name == "sources.py" and node not in tree.body, (path, node.lineno)


# ---- one rank: runs, ledger, digest, export ----------------------------------------------------------
RUN = ["trainer.eval_every=0", "trainer.eval_batches=1", "data.micro_batch=2", "optim.warmup_steps=1",
       "logging.wandb.mode=disabled", "logging.progress=false"]


def test_checkpointing_with_a_frozen_embedding_under_zero3(configs, one_rank, tmp_path):
    """Activation checkpointing on the Llama's decoder layers under zero3, with the embedding frozen
    (so the first block's input needs no gradient, where reentrant checkpointing would give its
    weights none), equals ddp without checkpointing; the checkpointed blocks' inputs are counted
    as activations kept, and fewer bytes are saved."""
    from zerolab.trainer import Trainer

    out, acts = {}, {}
    for label, strategy, ac in (("ddp", "ddp", "none"), ("zero3_ac", "zero3", "blocks")):
        cfg = hf(configs["llama"], *RUN, f"model.activation_checkpointing={ac}", f"data.path={fixed_corpus()}",
                 "trainer.max_steps=3", f"run.dir={tmp_path / label}", "run.save_model=false", strategy=strategy)
        model = build(cfg, seed=cfg.trainer.seed)
        model.model.embed_tokens.weight.requires_grad_(False)
        trainer = Trainer(cfg, one_rank, model=model)
        for step in range(3):
            trainer.train_step(step)
            acts[label] = trainer.memory.activations
        out[label] = trainer.strategy.consolidated_state_dict()
        trainer.close()
    assert 0 < acts["zero3_ac"] < acts["ddp"]
    trained = {k: v for k, v in out["ddp"].items() if k != "model.embed_tokens.weight"}
    # One rank: the same sums in the same order but zero3's buckets (fp32, 3 steps): measured 1.7e-8;
    # a block left without gradients would not move at all (a relative change of ~1e-3 per step).
    assert rel_l2_diff({k: out["zero3_ac"][k] for k in trained}, trained) < 1e-6


def test_ledger_shapes_and_digest_probe_of_a_transformers_model(configs):
    """The ledger's ModelShape of GPT-2 puts each layer's tensors in its block and the tied
    embedding in the root; zero3's prediction packs it unit by unit; the digest's gradient-noise
    probe rebuilds the model from its config and finds the key bias, whose true gradient is zero."""
    from zerolab.digest import gradient_noise
    from zerolab.memory import predict
    from zerolab.memory.shapes import shape_from_model

    cfg = hf(configs["gpt2"])
    model = build(cfg)
    shape = shape_from_model(model)
    names = [n for n, p in model.named_parameters()]
    assert len(shape.tensors) == len(names) and set(shape.blocks) == {-1, 0, 1}
    assert [b for n, b in zip(names, shape.blocks) if n.startswith("transformer.h.1.")] == [1] * 12
    assert shape.n_params == sum(p.numel() for p in model.parameters())
    assert predict(shape, "zero3", 3, "fp32", "adamw").bytes()["params"] > 0
    ids = torch.randint(0, 512, (2, 17))
    batch = type("Batch", (), {"x": ids[:, :-1], "y": ids[:, 1:]})
    noise = gradient_noise(cfg.model, {k: v.clone() for k, v in model.state_dict().items()}, [batch])
    assert noise is not None and "transformer.h.0.attn.c_attn.bias" in noise
    key = noise["transformer.h.0.attn.c_attn.bias"]
    assert ((key >= 64) & (key < 128)).float().mean() > 0.9  # the key third of q|k|v


def test_run_weights_and_hf_export_load_with_from_pretrained(configs, one_rank, tmp_path):
    """A GPT-2 zero3 run (one rank): model.safetensors holds the model's own names, the tied head as
    the same values under both names; with the run's config.json, from_pretrained loads the run
    directory; the zero3 checkpoint exported with --format hf loads with no missing or unexpected
    keys, the head tied again, and holds the run's weights."""
    from transformers import AutoModelForCausalLM

    from zerolab.checkpoint.export import export_main
    from zerolab.run.results import save_model_config
    from zerolab.trainer import Trainer

    run = tmp_path / "run"
    cfg = hf(configs["gpt2"], *RUN, f"data.path={fixed_corpus()}", "trainer.max_steps=2", "checkpoint.every=2",
             f"run.dir={run}", strategy="zero3")
    trainer = Trainer(cfg, one_rank)
    save_model_config(cfg.model, str(run))  # zerolab.job.run does it on rank 0
    trainer.fit()
    trainer.close()
    from conftest import load_weights

    weights = load_weights(run)
    assert set(weights) == set(build(cfg, device="meta").state_dict())
    assert torch.equal(weights["lm_head.weight"], weights["transformer.wte.weight"])
    export = tmp_path / "export"
    assert export_main([str(run / "checkpoints"), "--format", "hf", "--out", str(export)]) == 0
    for d in (run, export):
        model, info = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], (d, info)
        assert model.lm_head.weight is model.transformer.wte.weight and model.dtype == torch.float32
        assert rel_l2_diff(dict(model.state_dict()), weights) == 0
    assert export_main([str(run / "checkpoints"), "--format", "hf", "--out", str(tmp_path / "x"),
                        "--dtype", "bf16"]) == 0
    assert json.loads((tmp_path / "x" / "config.json").read_text())["dtype"] == "bfloat16"
