"""Activation checkpointing: which blocks recompute their forward in backward instead of
keeping its activations (model.activation_checkpointing), and how, for any model.

One way for every model: the block runs under torch's non-reentrant checkpoint with the RNG state
preserved (dropout draws the same masks again), and the tensors it is called with, which
checkpoint keeps alive to recompute it, are reported to the activation meter (keep_for_backward).
zerolab's GPT calls `checkpointed_call` from its own forward (it reads its config there); any
other model (model=hf, model=custom) has the forward of each chosen block wrapped
(`checkpoint_blocks`), so the model's own code, which calls its blocks, needs no change. The
block's module hooks (zero3's gather and free, FSDP2's) stay outside the recomputation: in
backward a block's weights are gathered again before its output's gradient reaches it, which is
before anything is recomputed (torchtitan wraps blocks the same way, inside fully_shard).
Non-reentrant checkpoint also gives gradients to blocks whose input needs none (a frozen
embedding), where the reentrant one silently gives none.

`selective` is op-level checkpointing, torchtitan's "op" policy (torchtitan's
activation-checkpoint module: `_save_list` and its custom policy): every block runs under the
same checkpoint with torch's `create_selective_checkpoint_contexts` as its `context_fn`, so the
outputs of the compute-heavy ops are kept from the forward and every other op is recomputed in
backward. What is kept (`SAVED_OPS`, `selective_policy`):
  - the matmuls, except every second one in a block's forward. A matmul is aten.mm (what a Linear
    without bias dispatches for its flattened input, torchtitan's only matmul op) and aten.addmm
    (the same GEMM with the bias added in it: what a Linear with bias dispatches for a contiguous
    input on this CPU, and on CUDA). Both are one Linear's output; counting only mm would
    keep every second bias-free Linear and no Linear with bias, a policy other than torchtitan's
    for the same model. aten.bmm is not counted: torchtitan does not keep it, and a Linear never
    dispatches it.
  - attention: the outputs of SDPA's fused kernels (CUDA flash, memory-efficient and cuDNN, CPU
    flash) and of its math kernel where it is one op. On the CPU with attention dropout SDPA runs
    its math path as separate ops (matmuls through bmm, softmax, dropout), which are recomputed.
  - the functional reduce-scatter (torchtitan keeps it: tensor parallelism's; zerolab issues none
    inside a block).
The counter of matmuls starts over with each block's forward (a fresh policy per checkpoint call,
as torchtitan's context_fn makes a fresh one), so every block keeps the same ones: in zerolab's
GPT qkv and fc, with proj and the MLP's proj recomputed; in a Llama block q, v, gate and down.
The kept outputs are held by the checkpoint's cache, not as autograd's saved tensors: the policy
reports each to the activation meter (keep_for_backward) when it keeps it, beside the block's
inputs. The recomputation replays the block's ops with the same RNG state and the same kernels,
so the loss and the gradients equal those without checkpointing bitwise on the CPU.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from zerolab.accounting.saved import keep_for_backward

CHECKPOINTING = ("none", "blocks", "every_k", "selective")

_aten = torch.ops.aten
MATMULS = frozenset({_aten.mm.default, _aten.addmm.default})
ATTENTION = frozenset(getattr(_aten, name).default for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_attention_math") if hasattr(_aten, name))
SAVED_OPS = MATMULS | ATTENTION | frozenset({torch.ops._c10d_functional.reduce_scatter_tensor.default})


def checkpointed_blocks(n_layer: int, mode: str, every_k: int = 1) -> list[bool]:
    """Which blocks run under activation checkpointing: none, all (blocks), or blocks
    0, k, 2k, ... (every_k: one block in k recomputes, the others keep their activations)."""
    if mode not in CHECKPOINTING:
        raise ValueError(f"activation checkpointing {mode!r} is not one of {', '.join(CHECKPOINTING)}")
    if mode == "every_k" and every_k < 1:
        raise ValueError(f"checkpoint_every_k={every_k} must be >= 1")
    k = every_k if mode == "every_k" else 1
    return [mode != "none" and i % k == 0 for i in range(n_layer)]


def tensors_in(obj) -> list[torch.Tensor]:
    """The tensors in a module's inputs or output: a tensor, or a tuple/list/dict holding some
    (transformers' layers return tuples and ModelOutput dicts)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in tensors_in(item)]
    return []


def selective_policy(report=keep_for_backward):
    """A fresh op policy for one block's forward (torchtitan's): keep the outputs of SAVED_OPS,
    except every second matmul, and recompute everything else. `report` is told each kept output
    (the activation meter's keep_for_backward). In torch 2.13 the policy is asked in the forward
    only (the recomputation replays what the forward decided); a recomputation's call, in torch
    versions that make one, counts apart, so it decides the same."""
    matmuls = {False: 0, True: 0}

    def policy(ctx, func, *args, **kwargs):
        if func in MATMULS:
            matmuls[ctx.is_recompute] += 1
            if matmuls[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        if func not in SAVED_OPS:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if not ctx.is_recompute:
            report(*tensors_in(getattr(ctx, "op_output", None)))
        return CheckpointPolicy.MUST_SAVE
    return policy


def selective_contexts():
    """checkpoint's context_fn for `selective`: the forward's caching mode and the
    recomputation's cached mode, sharing one cache, with a fresh selective_policy."""
    return create_selective_checkpoint_contexts(selective_policy())


def checkpointed_call(fn, *args, selective: bool = False, **kwargs):
    """fn(*args, **kwargs) keeping only its inputs for backward (and, `selective`, the outputs
    selective_policy keeps), which runs it again. With grad disabled (eval) it simply runs."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    keep_for_backward(*tensors_in((args, kwargs)))  # held by checkpoint, not autograd's saved tensors
    if selective:
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, context_fn=selective_contexts,
                          **kwargs)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


def checkpoint_blocks(blocks: nn.Module, mode: str, every_k: int = 1) -> int:
    """Wrap the forward of the chosen blocks (checkpointed_blocks) in checkpointed_call; returns
    how many. The block stays the same module (names, hooks and parameters unchanged)."""
    chosen = [b for b, again in zip(blocks, checkpointed_blocks(len(blocks), mode, every_k)) if again]
    for block in chosen:
        block.forward = _wrapped(block.forward, mode == "selective")
    return len(chosen)


def _wrapped(forward, selective: bool):
    def recomputed(*args, **kwargs):
        return checkpointed_call(forward, *args, selective=selective, **kwargs)
    return recomputed


@contextlib.contextmanager
def kept_while(blocks, kept: list):
    """Run each of `blocks` (for the duration) under the selective policy's caching mode alone,
    without checkpoint: autograd saves as usual, and the outputs the policy would keep are appended
    to `kept`. What a block's recomputation finds kept and reads is then measurable: the kept
    outputs whose storages autograd also saved (zerolab.rehearsal.activation_model)."""
    originals = [block.forward for block in blocks]

    def caching(forward):
        def run(*args, **kwargs):
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            caching_mode, _ = create_selective_checkpoint_contexts(selective_policy(lambda *ts: kept.extend(ts)))
            with caching_mode:
                return forward(*args, **kwargs)
        return run

    for block, forward in zip(blocks, originals):
        block.forward = caching(forward)
    try:
        yield kept
    finally:
        for block, forward in zip(blocks, originals):
            block.forward = forward
