"""This CPU's kernels, measured by the calibration (zerolab.predict.calibrate), and an op's price from them.

A roofline with one matmul rate and one memory bandwidth prices a small model's step on one CPU
core 20-25 % short (bench/RESULTS.md): a matmul's rate depends on its shape (a narrow one packs
more than it multiplies), an elementwise op's bytes run from cache or from memory by their size,
and GELU, the norms and softmax compute too much per element to stream at the bandwidth. So the
calibration also times every op of reference training steps, and an op is priced from the
measured ops nearest to it.

The reference steps (`reference_rows`) are this module's own, not zerolab's models: a small
pre-norm transformer (two blocks of causal SDPA attention and an MLP, a final norm, a head,
cross-entropy, torch's fused AdamW) in two styles, GPT's (LayerNorm, GELU, biases) and Llama's
(RMSNorm, gated SiLU, no biases), at widths 96-512, 128-512 tokens a sequence and head dims 32-128;
after each backward, what a data-parallel strategy does with the gradients beside the model (`bookkeeping`):
each gradient copied, averaged, into a flat buffer (a bucket) and a chunk of it summed into a shard,
the global norm and the clip (zerolab.numerics), flat pieces split and concatenated (FSDP2's
copies), torch's composed foreach AdamW over the tensors (what an optimizer over DTensors runs),
fused AdamW over flat pieces, the buffers zeroed.

Each op is timed as it is dispatched (a TorchDispatchMode around its kernel call, median of
`REPEATS` steps) and kept under its name with its shape: a matmul's or attention's dims
(ops.gemm_dims), any other op's bytes and kernel count (zerolab.predict.ops counts both).
What a step took beyond its timed ops, per kernel (each the median over the reference steps):
`host_s_per_kernel` over the whole step (Python modules, autograd, views), and
`host_s_per_kernel_step` over what follows the backward alone (the bookkeeping and the optimizer:
loops over tensors under no_grad, a foreach op's kernels dispatched from C++), which prices the
ops of a recorded step's optimizer phase. The second is several times smaller (bench/RESULTS.md):
the whole step's figure priced the optimizer of a strategy with hundreds of small kernels (DDP's,
FSDP2's) far too long. The model's pass alone is not given its own figure: what it takes beyond
its ops grows with the tensors' sizes (9-290 us a kernel across the reference shapes), so per
kernel it is no figure a prediction could carry to another model.

`table_seconds` prices an op at the rate (FLOPs, or bytes where it has no FLOPs, per second) of the
measured ops of its name nearest to it in log-shape (inverse-distance weighted, the 3 nearest), or
None for a name the reference steps never ran (the roofline prices it).
"""
from __future__ import annotations

import math
import statistics
import time
from collections import defaultdict

import torch
import torch.nn as nn
import torch.nn.functional as F

# (style, width, sequences, tokens a sequence, head dim): 2 blocks each, vocabulary 512; the head dims
# 32, 64 and 128 of small and large models (the CPU's flash kernel runs a narrow head slower per FLOP)
SHAPES = (("gpt", 96, 8, 128, 32), ("gpt", 192, 4, 256, 64), ("gpt", 384, 8, 128, 64), ("gpt", 512, 2, 512, 128),
          ("llama", 160, 4, 256, 32), ("llama", 320, 8, 128, 64))
VOCAB, LAYERS, REPEATS, NEAREST = 512, 2, 5, 3
HOST_KEYS = ("host_s_per_kernel", "host_s_per_kernel_step")  # the whole step, what follows its backward
STEP_PHASES = ("optimizer",)  # the recorded phases priced at host_s_per_kernel_step


class _Block(nn.Module):
    def __init__(self, d: int, head_dim: int, llama: bool):
        super().__init__()
        self.heads, self.llama = d // head_dim, llama
        self.n1, self.n2 = (nn.RMSNorm(d), nn.RMSNorm(d)) if llama else (nn.LayerNorm(d), nn.LayerNorm(d))
        hidden = 3 * d if llama else 4 * d
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=not llama), nn.Linear(d, d, bias=not llama)
        self.up = nn.Linear(d, 2 * hidden if llama else hidden, bias=not llama)
        self.down = nn.Linear(hidden, d, bias=not llama)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(self.n1(x)).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).contiguous().view(b, t, c)
        x = x + self.proj(y)
        h = self.up(self.n2(x))
        if self.llama:
            gate, h = h.chunk(2, dim=-1)
            h = F.silu(gate) * h
        else:
            h = F.gelu(h)
        return x + self.down(h)


class _Reference(nn.Module):
    def __init__(self, d: int, tokens: int, head_dim: int, llama: bool):
        super().__init__()
        self.embed, self.position = nn.Embedding(VOCAB, d), nn.Embedding(tokens, d)
        self.blocks = nn.ModuleList(_Block(d, head_dim, llama) for _ in range(LAYERS))
        self.norm, self.head = (nn.RMSNorm(d) if llama else nn.LayerNorm(d)), nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.position(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def bookkeeping(params: list[torch.Tensor], flat: torch.Tensor, shard: torch.Tensor, composed, pieces_opt,
                ranks: int = 2) -> None:
    """What a data-parallel strategy does with the gradients beside the model (module docstring).
    `composed`: torch's foreach AdamW over `params`; `pieces_opt`: fused AdamW over two flat pieces."""
    from zerolab.numerics import decide_on_device, multiply, norm_sq

    grads = [p.grad for p in params]
    offset = 0
    for g in grads:  # each gradient into its bucket, averaged (zero2's hook; DDP's bucket copy)
        torch.div(g.view(-1), ranks, out=flat[offset:offset + g.numel()])
        offset += g.numel()
    chunk = flat.numel() // ranks
    shard.add_(flat[:chunk])  # a reduced chunk summed into the gradient shard
    shard.copy_(flat[chunk:2 * chunk])
    flat.div_(ranks)
    multiply(grads, decide_on_device(norm_sq(grads, flat.device), None, 1.0).multiplier)  # the global norm, the clip
    torch.split_with_sizes_copy(flat, [chunk, flat.numel() - chunk])
    torch._chunk_cat([g.view(-1) for g in grads], 0, ranks)  # FSDP2's reduce-scatter input
    composed.step()
    for piece in pieces_opt.param_groups[0]["params"]:
        piece.grad = shard
    pieces_opt.step()
    flat.zero_()
    shard.zero_()


def _timed(func, args, kwargs, rows: list) -> object:
    from zerolab.predict.ops import cost, gemm_dims

    t0 = time.perf_counter()
    out = func(*args, **kwargs)
    seconds = time.perf_counter() - t0
    flops, moved, kernels, _, _ = cost(func, args, kwargs, out)
    if kernels:
        rows.append((func._overloadpacket.__name__, flops, moved, kernels, tuple(gemm_dims(func, args)), seconds))
    return out


def reference_rows(style: str, d: int, sequences: int, tokens: int, head_dim: int) -> tuple[list, list]:
    """One reference step's ops, each (name, FLOPs, bytes, kernels, dims, median seconds over
    REPEATS timed steps, half), and the median wall time untimed of each half of the step: [the
    model's pass (forward and backward: half 0), what follows it (the bookkeeping and the
    optimizer: half 1)]."""
    from torch.utils._python_dispatch import TorchDispatchMode

    torch.manual_seed(0)
    model = _Reference(d, tokens, head_dim, style == "llama")
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, fused=True)
    n = sum(p.numel() for p in params)
    flat, shard = torch.zeros(-(-n // 2) * 2), torch.zeros(-(-n // 2))
    composed = torch.optim.AdamW(params, foreach=True)
    pieces_opt = torch.optim.AdamW([nn.Parameter(torch.zeros_like(shard)) for _ in range(2)], fused=True)
    idx, target = torch.randint(0, VOCAB, (sequences, tokens)), torch.randint(0, VOCAB, (sequences, tokens))

    def step(between=lambda: None) -> None:
        F.cross_entropy(model(idx).view(-1, VOCAB), target.view(-1)).backward()
        between()
        bookkeeping(params, flat, shard, composed, pieces_opt)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    class Timed(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return _timed(func, args, kwargs or {}, self.rows)

    step()  # optimizer states exist from here
    walls, runs, cut = [], [], []
    for _ in range(REPEATS):  # untimed and timed steps in turns: a slower moment of the machine hits both
        t = [time.perf_counter()]
        step(lambda: t.append(time.perf_counter()))
        t.append(time.perf_counter())
        walls.append((t[1] - t[0], t[2] - t[1]))
        mode = Timed()
        mode.rows = []
        with mode:
            step(lambda: cut.append(len(mode.rows)))
        runs.append(mode.rows)
    rows = [(*r[:5], statistics.median(run[i][5] for run in runs), int(i >= cut[0])) for i, r in enumerate(runs[0])]
    return rows, [statistics.median(w[half] for w in walls) for half in (0, 1)]


def measure_table() -> dict:
    """{"kernels": name -> [[dims or [bytes, kernels], work, seconds], ...], and HOST_KEYS' two
    figures (module docstring)}: every reference step's ops, each distinct (name, shape) once (its
    median over the steps that ran it), work = FLOPs where the op has them, else bytes."""
    points: dict = defaultdict(list)
    beyond: list = [[], []]  # the whole step, what follows its backward (HOST_KEYS)
    for shape in SHAPES:
        rows, walls = reference_rows(*shape)
        for which, (wall, mine) in enumerate([(sum(walls), rows), (walls[1], [r for r in rows if r[6] == 1])]):
            beyond[which].append(max(0.0, wall - sum(r[5] for r in mine)) / max(1, sum(r[3] for r in mine)))
        for name, flops, moved, k, dims, seconds, _ in rows:
            key = list(dims) if dims else [moved, k]
            points[(name, tuple(key), flops or moved)].append(seconds)
    table: dict = defaultdict(list)
    for (name, key, work), seconds in points.items():
        table[name].append([list(key), work, statistics.median(seconds)])
    # the median over the steps: a difference of two timed totals, so one disturbed step moves its own only
    return {"kernels": dict(table), **{key: statistics.median(b) for key, b in zip(HOST_KEYS, beyond)}}


def merge_tables(tables: list[dict]) -> dict:
    """Several ranks' tables, measured at once, as one: each entry's median seconds over the ranks."""
    merged: dict = defaultdict(lambda: defaultdict(list))
    for t in tables:
        for name, entries in t["kernels"].items():
            for key, work, seconds in entries:
                merged[name][(tuple(key), work)].append(seconds)
    return {"kernels": {name: [[list(k), w, statistics.median(s)] for (k, w), s in by.items()]
                        for name, by in merged.items()},
            **{key: statistics.median(t[key] for t in tables) for key in HOST_KEYS if key in tables[0]}}


def table_seconds(name: str, flops: float, nbytes: int, kernels: int, dims: tuple, table: dict):
    """An op's seconds at the measured rate of its name's nearest ops (module docstring), or None."""
    entries = table.get(name)
    if not entries:
        return None
    where = _logs(list(dims) if dims else [nbytes, kernels])
    near = sorted((sum((a - b) ** 2 for a, b in zip(where, _logs(key))), work, seconds)
                  for key, work, seconds in entries if len(key) == len(where))[:NEAREST]
    if not near:
        return None
    work = flops or nbytes
    weights = [1.0 / (distance + 1e-3) for distance, _, _ in near]
    if not work:  # an op that moves nothing measurable (a 0-element fill): the nearest ops' own time
        return sum(w * s for w, (_, _, s) in zip(weights, near)) / sum(weights)
    rate = sum(w * (x / s if s > 0 and x else 0.0) for w, (_, x, s) in zip(weights, near)) / sum(weights)
    return work / rate if rate > 0 else None


def _logs(values) -> list[float]:
    return [math.log(max(float(v), 1.0)) for v in values]
