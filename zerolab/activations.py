"""Activations: the bytes a forward leaves behind for its backward, measured and predicted.

Measured (`ActivationMeter`, zerolab/accounting/saved.py, below the models that report to it): a
forward run inside the meter counts every tensor autograd saves
for backward (torch.autograd.graph.saved_tensors_hooks), each storage once, so the q, k and v
views of one qkv output count as that one buffer. Parameters saved for backward (a Linear saves
its weight, a LayerNorm its weight and bias) are model states, not activations: the meter leaves
out every storage that belongs to a parameter or buffer of the model when the meter starts, and
any saved tensor that is an nn.Parameter or a view of one (FSDP2's unsharded parameters and
DeepSpeed stage 3's gathered ones have storages the model did not hold when the meter started).
Blocks run under activation checkpointing save nothing through the hooks (torch's checkpoint
swaps in its own); the block's inputs, which checkpoint keeps alive to recompute the block, are
reported through `keep_for_backward` (zerolab.models.recompute, for zerolab's GPT and any other
model's blocks alike), and so are the op outputs selective checkpointing keeps in the checkpoint's
cache (its policy reports each as it keeps it), so the meter sees what backward really holds.
The measured side works for any model; the prediction below is for zerolab's own models only (a
transformers or custom model has no prediction: the monitor leaves it out). Outside a meter the
hooks do not exist and cost nothing.

What the meter does not see: the logits and other temporaries of the forward that are not saved
(zerolab.plan counts them as transient), and gradients. Measured on CPU here (torch 2.13); on
CUDA other kernels save other tensors (see the prediction's device argument), untested here.

Predicted (`predict_activations`): the same bytes from the model config, written out tensor by
tensor below, for zerolab's GPT and next-token MLP. The bytes do not depend on the strategy:
every strategy runs the same forward with weights in the compute dtype (ddp, zero1/2 and
DeepSpeed cast the model; FSDP's MixedPrecisionPolicy casts the gathered weights), so the same
tensors are saved in the same dtypes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Optional

from zerolab.accounting.saved import ActivationMeter, keep_for_backward  # noqa: F401  (the measured side)
from zerolab.models.recompute import CHECKPOINTING, checkpointed_blocks  # noqa: F401
from zerolab.precision import COMPUTE_BYTES

# ---- predicted --------------------------------------------------------------------------------
# Notation (Korthikanti et al. 2022): b micro-batch, s sequence length, h width (n_embd), a heads,
# L layers, V vocabulary, c bytes per compute-dtype element (4 fp32; 2 bf16, fp16, bf16_pure).
#
# Korthikanti et al. count Megatron's layer at sbh(34 + 5as/h) bytes in 16-bit with 1-byte dropout
# masks: attention 11sbh + 5as²b (QKV input 2sbh, Q and K 4sbh, softmax 2as²b, its dropout mask
# as²b, dropped softmax 2as²b, V 2sbh, projection input 2sbh, dropout mask sbh), MLP 19sbh (input
# 2sbh, GELU input 8sbh, GELU output 8sbh, dropout mask sbh) and two LayerNorm inputs 4sbh.
# zerolab's layer differs in what torch's kernels save; every term of `_gpt_layer` names the
# autograd node that saves it (verify with loss.grad_fn's `_saved_*` attributes):
#  - attention is F.scaled_dot_product_attention. Fused kernels (CUDA flash / memory-efficient,
#    and CPU flash, which torch picks on CPU only when dropout_p == 0) save q, k, v (views of the
#    one qkv output: 3bsh), their output (bsh) and an fp32 logsumexp (b·a·s); no s² term. On CPU
#    with attention dropout torch falls back to the math path, which saves q·√scale, kᵀ·√scale
#    and a contiguous v (3bsh), the softmax, the dropout noise and the dropped softmax (3·b·a·s²),
#    all in fp32 when the inputs are 16-bit (the CPU math path upcasts them). With b = 1 the
#    contiguous v is a view, which keeps the whole qkv output (3bsh) instead of a bsh copy.
#  - the attention output is transposed and reshaped before the output projection, which saves
#    it as its input: a copy (bsh) after the math path; a view of the output the fused kernels
#    saved anyway (they write it in (b, s, a, d) memory order), so no extra bytes.
#  - dropout on CUDA (native_dropout) saves a bool mask, 1 byte per element; on CPU torch draws a
#    noise tensor in the input's dtype and multiplies, saving the noise: c bytes per element.
#  - LayerNorm saves its input and per-row mean and rstd: in the input dtype on CPU, fp32 on CUDA.
#  - the residual adds save nothing; GELU saves its input (4bsh), the MLP projection its input
#    (the GELU output, 4bsh).
# Selective checkpointing (zerolab.models.recompute.selective_policy) keeps, per block, its input
# and the outputs of the 1st and 3rd matmuls (qkv: 3bsh, fc: 4bsh) and of a fused SDPA kernel (its
# output bsh and logsumexp), term by term in `_selective_kept`; the peak's recomputed block is the
# layer less what it kept and reads (kept_bytes).
# Outside the layers: the token ids (the trainer's x and y are views of one b×(s+1) int64 window
# tensor, saved by the embedding; the loss saves y flattened, a bs int64 copy unless b = 1, and
# an fp32 scalar total_weight), the position ids
# (s int64), the embedding dropout's mask, the final LayerNorm (input, output, stats) and the loss:
# lm_loss upcasts the logits to fp32 and log_softmax saves its fp32 output (4·bsV bytes). The
# logits themselves are not saved (the head saves its input), so they are transient (planner).

DEVICES = ("cpu", "cuda")
INT64 = 8


@dataclass
class ActTerm:
    what: str
    bytes: int
    count: int = 1  # how many times it occurs (layers)

    @property
    def total(self) -> int:
        return self.bytes * self.count


@dataclass
class ActivationPrediction:
    model: str
    micro_batch: int
    seq: int
    precision: str
    device: str
    checkpointing: str
    terms: list = field(default_factory=list)
    layer_bytes: int = 0  # one non-checkpointed transformer layer (the recompute working set)
    block_input_bytes: int = 0  # what a checkpointed block keeps of it: its input
    # of layer_bytes, what a recomputed block finds kept from its forward (0: its input alone;
    # selective: also the kept op outputs its backward reads); the rest is the recompute's transient
    kept_bytes: int = 0

    def add(self, what: str, nbytes: float, count: int = 1) -> None:
        if nbytes and count:
            self.terms.append(ActTerm(what, int(nbytes), count))

    @property
    def bytes(self) -> int:
        return sum(t.total for t in self.terms)

    def to_dict(self) -> dict:
        return {"model": self.model, "micro_batch": self.micro_batch, "seq": self.seq,
                "precision": self.precision, "device": self.device, "checkpointing": self.checkpointing,
                "bytes": self.bytes, "layer_bytes": self.layer_bytes, "block_input_bytes": self.block_input_bytes,
                "kept_bytes": self.kept_bytes,
                "terms": [{"what": t.what, "bytes": t.bytes, "count": t.count} for t in self.terms]}


def _gpt_layer(b: int, s: int, h: int, a: int, c: int, dropout: float, device: str) -> list[tuple[str, int]]:
    """One transformer block's saved tensors: (what, bytes)."""
    bsh = b * s * h
    stats_bytes = c if device == "cpu" else 4
    mask = c if device == "cpu" else 1  # bytes per dropout-mask element
    terms = [
        ("ln_1 input (the residual stream; LayerNorm)", bsh * c),
        ("ln_1 mean and rstd (LayerNorm)", 2 * b * s * stats_bytes),
        ("ln_1 output (qkv Linear input)", bsh * c),
    ]
    if device == "cpu" and dropout > 0:  # CPU math attention: fp32 when the inputs are 16-bit
        f = 4 if c == 2 else c
        terms += [("q·√scale, kᵀ·√scale (CPU math attention)", 2 * bsh * f)]
        if b == 1 and f == c:  # v's (b·a, s, d) reshape is a view of the qkv output only when b == 1
            terms += [("v, a view of the whole qkv output (CPU math attention, b = 1)", 3 * bsh * c)]
        else:
            terms += [("v, a contiguous copy (CPU math attention)", bsh * f)]
        terms += [("softmax, dropout noise, dropped softmax (CPU math attention, b·a·s²)", 3 * b * a * s * s * f),
                  ("attention output, transposed copy (proj Linear input)", bsh * c)]
    else:
        # CUDA's kernel (cuda_attention_kernel): FlashAttention keeps an unpadded logsumexp and its
        # RNG state, a (2,) and a 0-d uint64; the memory-efficient kernel pads the logsumexp to 32
        # rows and keeps its philox seed and offset, two int64 scalars. Both, with or without dropout.
        kernel = cuda_attention_kernel(c == 2, h // a, c == 4) if device == "cuda" else "cpu flash"
        lse_s = 32 * math.ceil(s / 32) if kernel == "efficient" else s
        # The kernels write their output in (b, s, a, d) memory order, so the transpose + reshape
        # before the projection is a view: the projection's input is the saved output itself.
        terms += [("qkv output: q, k, v views (fused attention)", 3 * bsh * c),
                  ("attention output = proj Linear input (fused attention)", bsh * c),
                  ("logsumexp, fp32 (fused attention)", b * a * lse_s * 4)]
        if device == "cuda":
            terms += [(f"RNG state ({kernel} attention)", 24 if kernel == "flash" else 16)]
    if dropout > 0:
        terms += [("residual dropout mask after attn proj", bsh * mask)]
    terms += [
        ("ln_2 input (the residual stream; LayerNorm)", bsh * c),
        ("ln_2 mean and rstd (LayerNorm)", 2 * b * s * stats_bytes),
        ("ln_2 output (fc Linear input)", bsh * c),
        ("fc output (GELU input, 4h)", 4 * bsh * c),
        ("GELU output (MLP proj Linear input, 4h)", 4 * bsh * c),
    ]
    if dropout > 0:
        terms += [("MLP dropout mask", bsh * mask)]
    return terms


def _selective_kept(b: int, s: int, h: int, a: int, c: int, dropout: float, device: str) -> list[tuple[str, int, int]]:
    """What `selective` (zerolab.models.recompute.selective_policy) keeps of one block beyond its
    input: (what, bytes, of those the bytes the plain layer saves too, i.e. what its recomputed
    backward reads instead of recomputing). The block's four Linears dispatch four matmuls (addmm
    with bias, mm without): qkv (1st, kept), attention's proj (2nd, recomputed), fc (3rd, kept)
    and the MLP's proj (4th, recomputed)."""
    bsh = b * s * h
    kept = []
    fused = not (device == "cpu" and dropout > 0)
    # qkv: the fused kernels save their q, k, v views of it, so the plain layer holds it too. The
    # CPU math path (dropout) saves scaled copies instead, and v as a view of it only when b = 1
    # in the compute dtype (see _gpt_layer).
    f = 4 if c == 2 else c
    qkv_in_layer = fused or (b == 1 and f == c)
    kept.append(("qkv Linear output (1st matmul)", 3 * bsh * c, 3 * bsh * c if qkv_in_layer else 0))
    if fused:  # the SDPA kernel is one op: its outputs are kept, all saved by the layer (_gpt_layer):
        # the output, the fp32 logsumexp (padded to 32 rows by CUDA's memory-efficient kernel) and,
        # on CUDA, the RNG state
        kernel = cuda_attention_kernel(c == 2, h // a, c == 4) if device == "cuda" else "cpu flash"
        lse = (32 * math.ceil(s / 32) if kernel == "efficient" else s) * b * a * 4
        rng = 0 if device == "cpu" else 24 if kernel == "flash" else 16
        att = bsh * c + lse + rng
        kept.append(("attention output, fp32 logsumexp and RNG state (the SDPA kernel's outputs)", att, att))
    # with CPU attention dropout SDPA is separate ops (bmm, softmax, dropout): all recomputed
    kept.append(("fc Linear output (3rd matmul; the GELU input)", 4 * bsh * c, 4 * bsh * c))
    return kept


def predict_activations(mcfg, micro_batch: int, seq: Optional[int] = None, precision: str = "fp32",
                        device: str = "cpu", checkpointing: Optional[str] = None,
                        every_k: Optional[int] = None, dropout: Optional[float] = None) -> ActivationPrediction:
    """Bytes saved for backward by one forward of zerolab's model on one rank. `mcfg` is a
    zerolab ModelConfig; `seq` defaults to its block_size; checkpointing, every_k and dropout
    default to the config's."""
    if precision not in COMPUTE_BYTES:
        raise ValueError(f"unknown precision {precision!r}; known: {', '.join(COMPUTE_BYTES)}")
    if device not in DEVICES:
        raise ValueError(f"device {device!r} is not one of {', '.join(DEVICES)}")
    if micro_batch < 1:
        raise ValueError(f"micro-batch must be >= 1, got {micro_batch}")
    b, s = micro_batch, seq or mcfg.block_size
    c, V = COMPUTE_BYTES[precision], mcfg.vocab_size
    mode = checkpointing or getattr(mcfg, "activation_checkpointing", "none")
    k = every_k or getattr(mcfg, "checkpoint_every_k", 1)
    p = mcfg.dropout if dropout is None else dropout
    pred = ActivationPrediction(mcfg.name, b, s, precision, device, mode)
    ids = ("token ids: the b×(s+1) int64 window tensor x and y view (Embedding)", b * (s + 1) * INT64)
    # y (a column slice of the window tensor) is contiguous only when b == 1: otherwise the
    # flattening in lm_loss copies it. cross_entropy also saves total_weight, an fp32 scalar.
    target = ("targets, y flattened: a bs int64 copy (cross entropy; a view when b = 1) and total_weight",
              (b * s * INT64 if b > 1 else 0) + 4)
    logprobs = ("log-probabilities, fp32 b·s·V (log_softmax in lm_loss)", b * s * V * 4)
    if mcfg.kind == "mlp":
        if mode != "none":
            raise ValueError("activation checkpointing applies to GPT blocks only (model.kind=mlp)")
        H = b * s * mcfg.mlp_hidden
        pred.add(*ids)
        pred.add("embedding output (first Linear input)", H * c)
        pred.add("Linear output (GELU input)", H * c, mcfg.mlp_depth)
        pred.add("GELU output (next Linear or LayerNorm input)", H * c, mcfg.mlp_depth)
        pred.add("LayerNorm mean and rstd", 2 * b * s * (c if device == "cpu" else 4))
        pred.add("LayerNorm output (head input)", H * c)
        pred.add(*logprobs)
        pred.add(*target)
        return pred
    h, a, L = mcfg.n_embd, mcfg.n_head, mcfg.n_layer
    pred.add(*ids)
    pred.add("position ids (s int64, Embedding)", s * INT64)
    if p > 0:
        pred.add("embedding dropout mask", b * s * h * (c if device == "cpu" else 1))
    layer = _gpt_layer(b, s, h, a, c, p, device)
    pred.layer_bytes, pred.block_input_bytes = sum(x for _, x in layer), b * s * h * c
    ckpt = checkpointed_blocks(L, mode, k)
    full, recomputed = ckpt.count(False), ckpt.count(True)
    for what, nbytes in layer:
        pred.add(f"layer: {what}", nbytes, full)
    pred.add("checkpointed layer: its input, kept to recompute the block", b * s * h * c, recomputed)
    pred.kept_bytes = pred.block_input_bytes
    if mode == "selective":  # the kept op outputs, held by each block's checkpoint cache
        for what, nbytes, in_layer in _selective_kept(b, s, h, a, c, p, device):
            pred.add(f"selective layer: {what}", nbytes, recomputed)
            pred.kept_bytes += in_layer
    pred.add("ln_f input (the last block's output)", b * s * h * c)
    pred.add("ln_f mean and rstd", 2 * b * s * (c if device == "cpu" else 4))
    pred.add("ln_f output (lm_head input)", b * s * h * c)
    pred.add(*logprobs)
    pred.add(*target)
    return pred


CUDA_FLASH_MAX_HEAD_DIM = 256  # FlashAttention-2's largest head dimension (sm80 and later)


def cuda_attention_kernel(half: bool, head_dim: int, fp32: bool, masked: bool = False, grouped: bool = False,
                          same_dims: bool = True) -> str:
    """Which kernel CUDA's scaled_dot_product_attention takes, in torch's default order (flash,
    memory-efficient, math: torch._C._get_sdp_priority_order()): "flash" for fp16/bf16 (`half`)
    without an explicit mask, head dim <= 256 and a multiple of 8 (it takes grouped key/value heads
    as they are); "efficient" for any float dtype, a mask as a bias, not grouped, head dim a multiple
    of 4 (fp32) or 8; else "math"."""
    if half and not masked and same_dims and head_dim <= CUDA_FLASH_MAX_HEAD_DIM and head_dim % 8 == 0:
        return "flash"
    if not grouped and same_dims and head_dim % (4 if fp32 else 8) == 0:
        return "efficient"
    return "math"


__all__: Iterable[str] = ["ActivationMeter", "keep_for_backward", "predict_activations", "ActivationPrediction",
                          "checkpointed_blocks"]
