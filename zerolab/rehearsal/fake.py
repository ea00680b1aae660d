"""The fake world a dry run steps in: tensors without data, a process group that moves nothing.

- Tensors are fake (torch._subclasses.FakeTensorMode): shapes, dtypes and storage sizes, no data,
  so a 7B model allocates nothing. Every storage is counted by size (accounting.storage_key).
- The process group is torch's fake one (FakeProcessGroup, registered here): each collective
  returns a correctly shaped output and moves nothing, so the strategies' own communication
  code runs unchanged at any rank of any world size.
- A value read back to the host (`.item()`) has no data behind it, except where it never
  depended on data: the loss scale, its counters and the optimizer's step counters are scalars
  that fake tensors keep as constants (they are made with torch.tensor for this), and read
  exactly. Everything else (a loss, a gradient norm, a trust ratio) is answered in one place
  (RehearsalMode): 1.0 for a float, 1 for an integer, False for a flag (no step skipped, nobody
  asked to stop).
- What ranks exchange as objects (the figures gathered for the record) is this rank's own
  (RehearsalContext).
- transformers asks one question of the data itself: whether a batch packs several sequences
  (then it builds a B x T x T mask). On fake tensors it cannot tell and builds the mask; zerolab's
  batches are whole windows and never pack, which is what a real run finds, so the rehearsal
  answers that (whole_windows).
"""
from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from zerolab import dist as zdist
from zerolab.activations import cuda_attention_kernel
from zerolab.errors import ZerolabError
from zerolab.topology import topology_for


def register_fake_backend() -> None:
    """torch's C++ FakeProcessGroup as the `fake` backend, unless something registered it already
    (importing torch.testing's fake_pg, as FSDP2's tests do, registers the same)."""
    if "FAKE" in dist.Backend._plugins:
        return
    from torch._C._distributed_c10d import FakeProcessGroup

    def create(common, options):
        return FakeProcessGroup._create_internal(common.group_rank, common.group_size, options)

    dist.Backend.register_backend("fake", create, extended_api=True, devices=["cpu", "cuda"])


class RehearsalMode(FakeTensorMode):
    """Fake tensors whose host reads are answered (the module docstring says with what)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            if getattr(t, "constant", None) is not None:  # a value fake tensors still know (a counter)
                return t.constant.item()
            return False if t.dtype == torch.bool else 1.0 if t.dtype.is_floating_point else 1
        return super().__torch_dispatch__(func, types, args, kwargs)


@contextlib.contextmanager
def whole_windows():
    """transformers' packed-sequence check, answered "not packed" (module docstring)."""
    masking = None
    if "transformers" in sys.modules:  # (a model=hf job has imported it by now: its config was read)
        import importlib

        masking = importlib.import_module("transformers.masking_utils")
    if masking is None or not hasattr(masking, "find_packed_sequence_indices"):
        yield
        return
    found = masking.find_packed_sequence_indices
    masking.find_packed_sequence_indices = lambda _position_ids: None
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = found


@dataclass
class RehearsalContext(zdist.DistContext):
    """Rank `rank` of `world_size` on the fake group: object exchanges return this rank's own."""

    rehearsal: bool = True

    def broadcast_object(self, obj, src: int = 0):
        return obj  # (the fake group would hand back whatever bytes its buffer held)

    def gather_objects(self, obj) -> list:
        return [obj] * self.world_size

    def all_reduce_mean(self, value: float) -> float:
        return value

    def barrier(self) -> None:
        pass

    def device_mesh(self):
        # A DeviceMesh computes this rank's coordinates from a real tensor of ranks.
        with unset_fake_temporarily():
            return super().device_mesh()

    def node_mesh(self):
        with unset_fake_temporarily():  # (as device_mesh)
            return super().node_mesh()


def join_fake_world(world: int, rank: int, ranks_per_node: int = 0, target: str = "cpu") -> RehearsalContext:
    """The fake process group; its nodes are dist.ranks_per_node's when set (else one node), so the
    comm counter and the predictor's record see which groups cross nodes. `target`: the device
    type whose kernels the rehearsal dispatches (target_kernels), which the ledger then predicts."""
    if dist.is_initialized():
        raise ZerolabError("a dry run needs a process without a process group (it makes a fake one)")
    register_fake_backend()
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world)
    host = dist.new_group(backend="fake") if world > 1 else None
    return RehearsalContext(rank=rank, local_rank=0, world_size=world, device=torch.device("cpu"), backend="fake",
                            store=None, host_group=host,
                            topology=topology_for(ranks_per_node, world) if ranks_per_node > 0 else None,
                            kernels=target)


# ---- the target's kernels ------------------------------------------------------------------------
# A rehearsal runs on the CPU, so torch dispatches CPU kernels. Where a CUDA kernel saves other
# tensors for backward, or does other work, a rehearsal for a GPU runs what CUDA runs, on the same
# fake tensors (their meta kernels give CUDA's shapes; the autograd formulas are device-agnostic):
#  - attention (F.scaled_dot_product_attention): with dropout the CPU falls back to the math path,
#    which keeps every b·a·s² score, dropout and probability matrix; CUDA runs its flash kernel
#    (fp16/bf16, no explicit mask, head dim <= 256 and a multiple of 8: output, an fp32 logsumexp
#    and its RNG state saved) or its memory-efficient one (any float dtype, a mask as an additive
#    bias; its logsumexp padded to 32 rows), in torch's default order (flash, memory-efficient,
#    math; torch._C._get_sdp_priority_order()).
#  - dropout (F.dropout): the CPU draws a noise tensor in the input's dtype and multiplies, saving
#    the noise (2 or 4 bytes per element); CUDA's fused native_dropout saves a bool mask (1 byte).
#  - layer norm (F.layer_norm): the CPU kernel keeps each row's mean and rstd in the input's dtype,
#    CUDA's in fp32; both save the input, weight and bias.
# What stays the CPU's: the math attention for a case neither fused kernel takes (the CPU's upcasts
# 16-bit inputs to fp32, CUDA's does not). The ledger counts CUDA's kernels (zerolab.activations,
# device "cuda"), and a GPU-target dry run of zerolab's GPT equals it.
@contextlib.contextmanager
def target_kernels(target: str):
    """While the rehearsal runs: F.scaled_dot_product_attention and F.dropout dispatch what CUDA runs
    when `target` is "cuda" (the comment above says what and why); a "cpu" target changes nothing,
    so a dry run of a CPU job still equals a real one to the byte."""
    if target != "cuda":
        yield
        return
    functional = torch.nn.functional
    attention, dropout = functional.scaled_dot_product_attention, functional.dropout

    def cuda_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                       enable_gqa=False):
        kernel = cuda_attention_kernel(query.dtype in (torch.float16, torch.bfloat16), query.shape[-1],
                                       query.dtype == torch.float32, masked=attn_mask is not None,
                                       grouped=enable_gqa and key.shape[-3] != query.shape[-3],
                                       same_dims=key.shape[-1] == query.shape[-1] == value.shape[-1])
        if kernel == "flash":
            return torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale)[0]
        if kernel == "efficient":
            if attn_mask is not None and attn_mask.dtype == torch.bool:  # as SDPA turns a bool mask into a bias
                attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype).masked_fill_(~attn_mask, float("-inf"))
            grads = any(t.requires_grad for t in (query, key, value))
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, attn_mask, grads, dropout_p, is_causal, scale=scale)[0]
        return attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                         scale=scale, enable_gqa=enable_gqa)

    def cuda_dropout(input, p=0.5, training=True, inplace=False):
        if not training or inplace or not 0.0 < p < 1.0:  # where CUDA takes the same path as the CPU
            return dropout(input, p, training, inplace)
        return torch.ops.aten.native_dropout(input, p, True)[0]

    def cuda_layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
        return _CudaLayerNorm.apply(input, tuple(normalized_shape), weight, bias, eps)

    layer_norm = functional.layer_norm
    functional.scaled_dot_product_attention, functional.dropout = cuda_attention, cuda_dropout
    functional.layer_norm = cuda_layer_norm
    try:
        yield
    finally:
        functional.scaled_dot_product_attention, functional.dropout = attention, dropout
        functional.layer_norm = layer_norm


class _CudaLayerNorm(torch.autograd.Function):
    """native_layer_norm saving what CUDA's kernel saves: the input, weight and bias, and each row's
    mean and rstd in fp32 (the CPU kernel's are in the input's dtype)."""

    @staticmethod
    def forward(ctx, input, normalized_shape, weight, bias, eps):
        out, mean, rstd = torch.ops.aten.native_layer_norm(input, normalized_shape, weight, bias, eps)
        ctx.normalized_shape = normalized_shape
        ctx.save_for_backward(input, weight, bias, mean.float(), rstd.float())
        return out

    @staticmethod
    def backward(ctx, grad):
        input, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(
            grad, input, ctx.normalized_shape, mean.to(input.dtype), rstd.to(input.dtype), weight, bias,
            [True, weight is not None, bias is not None])
        return dx, None, dw, db, None
