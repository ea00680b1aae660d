"""DeepSpeed's ZeRO (stage 1, 2 or 3) as a zerolab strategy: the reference to compare against.

The DeepSpeed config is built from zerolab's config (micro batch, accumulation, clipping,
precision and loss scaling, bucket sizes, overlap) and `strategy.ds_config_overrides` is merged
last, so any DeepSpeed key can be set. `deepspeed.initialize` runs inside the process group
zerolab already created under torchrun: no `deepspeed` launcher, no `--local_rank`.

Accumulation: the trainer calls backward once per micro-batch and step once per optimizer step.
DeepSpeed's own boundary flag is driven from `no_sync()` (False inside, True outside), so its
reductions happen exactly where DDP's would; the trainer already divides the loss by the number
of micro-batches, so DeepSpeed must not divide again (`scale_wrt_gas=False`).

Communication is measured, not estimated: the collectives DeepSpeed issues through its comm
layer (`deepspeed.comm`) are counted by thin wrappers around that layer's backend object.
"""
from __future__ import annotations

import copy
import logging
import math
import os
import warnings
from contextlib import contextmanager
from typing import Optional

import torch
import torch.nn as nn

from zerolab import ds_ops
from zerolab.accounting import NotPredicted, StorageCounter
from zerolab.buckets import bucket_cap
from zerolab.errors import ConfigError, ZerolabError
from zerolab.precision import COMPUTE_BYTES
from zerolab.numerics import Measure, StepInfo
from zerolab.schema import DeepSpeedSettings
from zerolab.strategies.base import Lossy, OptimizerFactory, Strategy, Traits, larger_of, set_lr
from zerolab.strategies.deepspeed_checkpoint import DeepSpeedCheckpointing
from zerolab.strategies.deepspeed_memory import ds_zero_config, predict_ds_memory

INSTALL_HINT = "pip install deepspeed==0.19.8"

log = logging.getLogger(__name__)


class DeepSpeedMissing(ZerolabError):
    """strategy=deepspeed, and DeepSpeed does not import: the message says how to install it."""

    same_on_every_rank = True  # every rank imports it at the same point of setup and fails alike


def import_deepspeed():
    """DeepSpeed, or an error that says how to install it (a broken install fails on import)."""
    ds_ops.use_prebuilt()  # the ops `make install` built, not a first-use compile
    try:
        import deepspeed
        from deepspeed.utils import safe_get_full_fp32_param  # noqa: F401  (used below)
    except Exception as err:  # ImportError, but also a half-installed package raising anything
        raise DeepSpeedMissing(
            f"strategy=deepspeed needs DeepSpeed, and importing it failed ({type(err).__name__}: {err}). "
            f"Install it with `{INSTALL_HINT}` (with --no-build-isolation, after torch), or pick another "
            "strategy (ddp, zero1, zero2, torch_zero, fsdp).") from err
    return deepspeed


def deep_merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


DEEPSPEED_OPTIMIZERS = ("adamw", "adam")  # DeepSpeed's own; any other optimizer is zerolab's, as a client


def build_ds_config(cfg, world_size: int, grad_element_size: int) -> dict:
    """zerolab config -> DeepSpeed config dict (before strategy.ds_config_overrides)."""
    s, o, p, t = cfg.strategy, cfg.optim, cfg.precision, cfg.trainer
    # DeepSpeed's bucket sizes are in elements, zerolab's in MB of the gradient dtype.
    bucket = bucket_cap(s.bucket_mb, grad_element_size)
    ds = {
        "train_micro_batch_size_per_gpu": cfg.data.micro_batch,
        "gradient_accumulation_steps": t.grad_accum_steps,
        "train_batch_size": cfg.data.micro_batch * t.grad_accum_steps * world_size,
        "gradient_clipping": float(o.grad_clip),
        "zero_optimization": {"stage": s.stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
                              "overlap_comm": bool(s.overlap_comm), "contiguous_gradients": True,
                              "reduce_scatter": True},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if s.stage == 3:
        # Every tensor sharded and every gathered weight freed after its module's forward, as in
        # the ZeRO paper and zerolab's zero3; DeepSpeed's defaults keep tensors under 1e5 elements
        # whole and any weight used again within 1e9 elements gathered (a small model's all of them).
        ds["zero_optimization"].update({"stage3_prefetch_bucket_size": bucket,
                                        "stage3_param_persistence_threshold": 0})
        if s.reshard_after_forward:
            ds["zero_optimization"]["stage3_max_reuse_distance"] = 0
    # ZeRO-Offload / ZeRO-Infinity as DeepSpeed spells them; pinned host buffers need CUDA's driver
    pin = torch.cuda.is_available()
    if s.offload_optimizer:
        ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    if s.offload_params:
        ds["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": pin}
    if p.name == "bf16":
        ds["bf16"] = {"enabled": True}
    elif p.name == "fp16":
        ds["fp16"] = {"enabled": True, "loss_scale": 0,  # 0 = dynamic
                      "initial_scale_power": int(round(math.log2(p.initial_scale))),
                      "loss_scale_window": p.growth_interval, "min_loss_scale": p.min_scale, "hysteresis": 1}
    if o.name in DEEPSPEED_OPTIMIZERS:
        ds["optimizer"] = {"type": "AdamW" if o.name == "adamw" else "Adam",
                           "params": {"lr": o.lr, "betas": list(o.betas), "eps": o.eps,
                                      "weight_decay": o.weight_decay, "adam_w_mode": o.name == "adamw"}}
    else:
        # zerolab's own optimizer is handed over as a client optimizer (see setup).
        ds["zero_allow_untested_optimizer"] = True
    return ds


class _CountingBackend:
    """Counts the bytes of every collective DeepSpeed issues through deepspeed.comm (whose backend
    object `cdb` all its ZeRO code calls), then forwards the call unchanged."""

    # method -> (CommCounter op, name and position of the argument holding the *full* buffer).
    # Positions are fixed here because DeepSpeed's decorators hide the methods' signatures.
    OPS = {"all_reduce": ("all_reduce", "tensor", 0), "reduce": ("reduce_scatter", "tensor", 0),
           "reduce_scatter_tensor": ("reduce_scatter", "input_tensor", 1),
           "broadcast": ("broadcast", "tensor", 0),
           "all_gather_into_tensor": ("all_gather", "output_tensor", 0),
           "all_gather_base": ("all_gather", "output_tensor", 0),
           "all_gather": ("all_gather", "tensor_list", 0), "reduce_scatter": ("reduce_scatter", "input_list", 1)}

    @classmethod
    def install(cls, counter) -> None:
        import deepspeed.comm.comm as ds_comm

        backend = ds_comm.cdb
        if getattr(backend, "_zerolab_counting", False):
            backend._zerolab_counter[0] = counter  # a second engine in the same process
            return
        backend._zerolab_counting, backend._zerolab_counter = True, [counter]
        backend._zerolab_originals = {}
        for method, (op, arg, pos) in cls.OPS.items():
            original = getattr(backend, method, None)
            if original is None:
                continue
            # what to put back: an instance attribute, or nothing (then the class method shows again)
            backend._zerolab_originals[method] = backend.__dict__.get(method)

            def wrapped(*args, _orig=original, _op=op, _arg=arg, _pos=pos, **kwargs):
                full = kwargs.get(_arg, args[_pos] if len(args) > _pos else None)
                if isinstance(full, (list, tuple)) and full and isinstance(full[0], torch.Tensor):
                    full = sum(t.numel() * t.element_size() for t in full)  # list collectives
                    backend._zerolab_counter[0].record(_op, full, 1)
                elif isinstance(full, torch.Tensor):
                    # dist.reduce to one owner costs like a reduce-scatter in the ring model
                    backend._zerolab_counter[0].record(_op, full)
                return _orig(*args, **kwargs)

            setattr(backend, method, wrapped)

    @classmethod
    def uninstall(cls) -> None:
        """Puts deepspeed.comm's backend back as it was before install()."""
        import deepspeed.comm.comm as ds_comm

        backend = ds_comm.cdb
        if backend is None or not getattr(backend, "_zerolab_counting", False):
            return
        for method, original in backend._zerolab_originals.items():
            if original is None:
                delattr(backend, method)
            else:
                setattr(backend, method, original)
        del backend._zerolab_counting, backend._zerolab_counter, backend._zerolab_originals


class DeepSpeedStrategy(DeepSpeedCheckpointing, Strategy):
    name = "deepspeed"
    # DeepSpeed decides a non-finite step itself (skips it under fp16, applies it otherwise), so
    # trainer.nonfinite does nothing here; its step measures no per-layer statistics (also_reads
    # empty; optim.impl: reads). Its engine cannot run on fake tensors: stages 1 and 2 move the
    # module with .to(), stage 3 checks parameters across ranks by their data at its first forward.
    # A rank keeps whole the gradients of the tensors overlapping its partition: uneven memory.
    traits = Traits(settings=DeepSpeedSettings, also_reads=frozenset(), sweep_stages=(1, 2, 3), uneven_memory=True,
                    # measured by collective, stage 2, gpt_mid on 2 ranks: all_reduce 2Ψ + all_gather Ψ
                    comm_extra="DeepSpeed all-reduces each gradient bucket (2Ψ) where the paper reduce-scatters it "
                               "(Ψ): its use_multi_rank_bucket_allreduce, on by default; then it all-gathers the "
                               "parameters (Ψ)",
                    not_rehearsable="DeepSpeed's engine cannot run on fake tensors (stages 1 and 2 move the module "
                                    "with .to(), stage 3 checks parameters across ranks by their data at its first "
                                    "forward)")

    @classmethod
    def reads(cls, key: str, cfg) -> bool:
        # zerolab's optimizer (and so its kernel choice) runs only as a client optimizer: DeepSpeed
        # brings its own Adam and AdamW.
        if key == "optim.impl":
            return cfg.optim.name not in DEEPSPEED_OPTIMIZERS
        return super().reads(key, cfg)

    @classmethod
    def check_config(cls, cfg, world_size: int) -> None:
        super().check_config(cfg, world_size)
        s, name = cfg.strategy, cfg.optim.name
        if s.stage not in (0, 1, 2, 3):
            raise ConfigError(f"strategy.stage={s.stage} is not a DeepSpeed ZeRO stage; use 0, 1, 2 or 3")
        if cfg.precision.name == "bf16_pure":
            raise ConfigError("precision=bf16_pure has no DeepSpeed equivalent (DeepSpeed always keeps fp32 "
                              "master weights in bf16); use precision=bf16 or fp32")
        refuse_offload(cfg)
        if name in ("lamb", "lars") and not s.client_optimizer:
            raise ConfigError(
                f"optim={name} under strategy=deepspeed: DeepSpeed's ZeRO hands the optimizer flat "
                "buffers, so a layer-wise trust ratio would be computed per flat group, not per layer. "
                "Set strategy.client_optimizer=true to run it anyway (and compare parity with ddp), "
                "or use strategy=zero1/zero2, whose LAMB/LARS keep per-tensor norms")

    @classmethod
    def label(cls, strategy_cfg: dict) -> str:
        return f"{cls.name}-s{strategy_cfg.get('stage')}"

    @classmethod
    def known_cause(cls, cfg: dict) -> str:
        s, opt = cfg.get("strategy", {}), cfg.get("optim", {}).get("name", "")
        if int(s.get("stage", 0)) >= 1 and s.get("client_optimizer") and opt in ("lamb", "lars"):
            return (f"DeepSpeed ZeRO stage {s.get('stage')} hands the client optimizer ({opt}) its "
                    f"flat parameter groups, so the per-tensor trust ratios become one per group")
        return ""

    @classmethod
    def lossy(cls, cfg: dict):
        """DeepSpeed 0.19's bf16 master and optimizer states (its bf16 section's keys) round every
        update: the report holds such a run within a loss band, as zerolab's precision.master=bf16."""
        bf16 = ((cfg.get("strategy", {}).get("ds_config_overrides") or {}).get("bf16") or {})
        keys = [k for k in ("bf16_master_weights_and_grads", "bf16_optimizer_states") if bf16.get(k)]
        return Lossy("lossy", f"DeepSpeed's {' and '.join(keys)} round every update in bf16") if keys else None

    def setup(self, model: nn.Module, param_groups: list[dict], make_optimizer: OptimizerFactory) -> nn.Module:
        deepspeed = import_deepspeed()
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its INFO lines drown the progress bar
        cfg = self.cfg
        from deepspeed.accelerator import get_accelerator

        accel = get_accelerator()
        # DeepSpeed offers fp16 where its accelerator says so: on CUDA, and on a CPU only where
        # oneDNN has fp16 kernels (AVX512-FP16, Sapphire Rapids and later). There it trains like
        # every other precision; elsewhere DeepSpeed itself refuses it, so zerolab says why first.
        if cfg.precision.name == "fp16" and not accel.is_fp16_supported():
            raise ConfigError(f"precision=fp16 under strategy=deepspeed: DeepSpeed's {accel.device_name()} "
                              "accelerator does not support fp16 on this machine (on a CPU it needs AVX512-FP16); "
                              "use precision=bf16 or fp32, or zerolab's own strategies (zero1/zero2/zero3), which "
                              "run fp16 on any CPU")
        refuse_missing_kernels(self.settings.ds_config_overrides, accel.device_name())
        # DeepSpeed reads the launcher's variables even when it adopts a process group it did not
        # create; a plain `python train.py` has none, and zerolab knows them (zerolab.dist).
        for var, value in (("LOCAL_RANK", self.ctx.local_rank), ("RANK", self.ctx.rank),
                           ("WORLD_SIZE", self.ctx.world_size)):
            os.environ.setdefault(var, str(value))
        model.to(self.ctx.device)  # DeepSpeed casts to bf16/fp16 itself
        self.names = {id(p): n for n, p in model.named_parameters()}
        grad_bytes = self.precision.compute_dtype.itemsize
        ds_config = deep_merge(build_ds_config(cfg, self.ctx.world_size, grad_bytes), self.settings.ds_config_overrides)
        self.ds_config = ds_config
        # "names" is zerolab's bookkeeping; keep every other group key (weight_decay, lr_scale).
        groups = [{k: v for k, v in g.items() if k != "names"} for g in param_groups]
        client = None
        if "optimizer" not in ds_config:
            name = cfg.optim.name
            if name in ("lamb", "lars"):  # client_optimizer=true (check_config)
                warnings.warn(f"optim={name} as a DeepSpeed client optimizer: ZeRO flattens each param group "
                              "into one tensor, so the per-layer trust ratio becomes a per-group ratio; the "
                              "updates differ from ddp's (see the parity table of `python -m zerolab compare`)")
            client = make_optimizer(param_groups)
        # Ops DeepSpeed builds on first use: never wait silently on a build lock nobody holds.
        ds_ops.check_op_locks(ds_ops.extensions_root(), ds_ops.op_names())
        # The process group exists already (zerolab.dist): DeepSpeed adopts it.
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=client, model_parameters=None if client is not None else groups,
            config=ds_config, dist_init_required=False)
        self.optimizer = self.engine.optimizer  # ZeRO wrapper; its param_groups are the inner optimizer's
        self.inner = getattr(self.optimizer, "optimizer", self.optimizer)
        self.module = self.engine.module
        self.engine.set_gradient_accumulation_boundary(True)
        _CountingBackend.install(self.comm)
        self.comm.pop_step()  # setup traffic is not a training step's
        self._step_mem: dict[str, int] = {}
        return self.engine

    def close(self) -> None:
        _CountingBackend.uninstall()

    @contextmanager
    def no_sync(self):
        self.engine.set_gradient_accumulation_boundary(False)
        try:
            yield
        finally:
            self.engine.set_gradient_accumulation_boundary(True)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)  # the trainer divided by accum already

    def step(self, lr: float, measure: Measure = Measure.NOTHING) -> StepInfo:
        """DeepSpeed's engine steps; `measure` is not measured (the optimizer is DeepSpeed's)."""
        set_lr(self.optimizer, lr)
        if measure or not self._step_mem:  # gradients exist now; DeepSpeed frees some after the step (larger_of)
            self._step_mem = self._measure()
        skipped_before = self.engine.skipped_steps
        self.engine.step()
        self.step_count += 1
        skipped = self.engine.skipped_steps > skipped_before
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        self.mirror_scaler()  # DeepSpeed's fp16 loss scaler into zerolab's (deepspeed_checkpoint.py)
        clip = self.cfg.optim.grad_clip
        clipped = norm * min(1.0, clip / (norm + 1e-6)) if clip > 0 and math.isfinite(norm) else norm
        return StepInfo(grad_norm=norm, grad_norm_clipped=clipped, skipped=skipped)

    # ---- memory ------------------------------------------------------------------------------
    def _measure(self) -> dict[str, int]:
        o, c = self.optimizer, StorageCounter()
        zero = self.ds_config["zero_optimization"]
        # where each state lives, from the config (on a CPU both places are the same memory)
        ph = "host" if (zero.get("offload_param") or {}).get("device") == "cpu" else "device"
        oh = "host" if (zero.get("offload_optimizer") or {}).get("device") == "cpu" else "device"
        params = list(self.module.parameters())
        if zero["stage"] == 3:  # (an override may set it)
            c.add("params", (getattr(p, "ds_tensor", p) for p in params), ph)
            # parameters under stage3_param_persistence_threshold stay whole on every rank
            c.add("params", (p.data for p in params if getattr(p, "ds_persist", False)))
            # hpZ (zero_hpz_partition_size): each tensor's secondary partition over its group
            c.add("params", (t for t in (getattr(p, "ds_secondary_tensor", None) for p in params) if t is not None))
            fp32 = getattr(o, "fp32_partitioned_groups_flat", [])
            c.add("master", fp32, oh)
            c.add("grads", (t.grad for t in fp32), oh)
            c.add("params", getattr(o, "fp16_partitioned_groups_flat", []), ph)
        else:
            # Model params are views into the flat bit16 groups: one storage each.
            c.add("params", getattr(o, "bit16_groups_flat", [])).add("params", params)
            fp32 = getattr(o, "single_partition_of_fp32_groups", [])
            c.add("master", fp32, oh)
            c.add("grads", (t.grad for t in fp32), oh)
            c.add("grads", [getattr(o, "grads_in_partition", None)])
            # offload's 16-bit copy of the partition and the staging buffers on either side
            c.add("buffers", getattr(o, "param_buffer_of_bit16_for_cpu_offload_groups", []), "host")
            c.add("buffers", [getattr(o, "temp_grad_buffer_for_cpu_offload", None)], "host")
            c.add("buffers", [getattr(o, "temp_grad_buffer_for_gpu_offload", None)])
        gh = oh if zero["stage"] == 3 else "device"  # stage 3 fills its gradient partitions on the host
        for grads in getattr(o, "averaged_gradients", {}).values():
            c.add("grads", grads or [], gh)
        c.add("grads", (p.grad for p in params), gh)
        c.add_optimizer(self.inner, oh)
        c.add("buffers", (b for b in getattr(o, "ipg_buffer", None) or [] if isinstance(b, torch.Tensor)))
        c.add("buffers", self.module.buffers())
        return c.result()

    def memory(self) -> dict[str, int]:
        """Bytes by category: the larger of what existed just before the last update (gradients
        are alive then) and what exists now."""
        return larger_of(self._step_mem, self._measure())

    # ---- weights -------------------------------------------------------------------------------
    @torch.no_grad()
    def consolidated_state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        from deepspeed.utils import safe_get_full_fp32_param

        full = {}
        for p in self.module.parameters():  # collective: every rank walks the same order
            t = safe_get_full_fp32_param(p)
            if t is None:  # stage 0: no partitioning, the model holds the weights
                t = p.detach()
            full[id(p)] = t.float().cpu() if self.ctx.is_main else None
        if not self.ctx.is_main:
            return None
        out = {}
        for name, t in self.module.state_dict(keep_vars=True).items():
            # a clone per name: tied weights (wte / lm_head) must not share storage in the file
            out[name] = (full[id(t)] if id(t) in full else t.detach().float().cpu()).clone()
        return out

    # ---- memory prediction (zerolab.memory asks it; Strategy.predict_memory says how) ----------
    @classmethod
    def memory_identity(cls, stage: int) -> tuple[str, int]:
        if stage not in (1, 2, 3):
            raise ValueError(f"strategy=deepspeed needs --stage 1, 2 or 3 (got {stage})")
        return f"deepspeed-{stage}", stage

    @classmethod
    def predict_memory(cls, p, shape, *, world, precision, k, stage, bucket_mb, rank, settings, **_) -> None:
        """DeepSpeed 0.19 as it allocates, at the moment of the optimizer update, where its model
        states peak, for the zero_optimization config the run gives it (strategies/deepspeed_memory.py)."""
        if precision == "bf16_pure":
            raise NotPredicted("DeepSpeed has no bf16_pure mode (its bf16 ZeRO keeps fp32 master weights); "
                               "use --precision bf16")
        zero = ds_zero_config(settings, stage, bucket_cap(bucket_mb, COMPUTE_BYTES[precision]))
        predict_ds_memory(p, shape, zero, world=world, precision=precision, k=k, rank=rank)


# ZeRO++'s quantized collectives (Wang et al. 2023) run DeepSpeed's QuantizerBuilder op, which its
# CPU accelerator does not implement (it raises "This op had not been implemented on CPU backend"
# at the first forward or backward); hpZ (zero_hpz_partition_size) needs no kernel and runs.
QUANTIZER_KEYS = ("zero_quantized_weights", "zero_quantized_gradients", "zero_quantized_nontrainable_weights")


def refuse_missing_kernels(overrides: dict, device: str) -> None:
    """Refuse, before the engine is built, ZeRO++ keys whose kernel this accelerator lacks."""
    zero = (overrides or {}).get("zero_optimization") or {}
    asked = [k for k in QUANTIZER_KEYS if zero.get(k)]
    if asked and device == "cpu":
        raise ConfigError(f"strategy.ds_config_overrides sets zero_optimization.{asked[0]}: DeepSpeed's quantized "
                          "collectives need its QuantizerBuilder kernel, which its CPU accelerator does not "
                          "implement. On this machine use zerolab's own: strategy=zero3 strategy.quantize_weights=true "
                          "strategy.quantize_grads=true (docs/nodes.md); or run DeepSpeed's on a GPU "
                          "(zero_hpz_partition_size runs on a CPU too)")


def refuse_offload(cfg) -> None:
    """Refuse, before any process starts, the offload settings DeepSpeed cannot honour."""
    s, name = cfg.strategy, cfg.optim.name
    if s.offload_params and s.stage != 3:
        raise ConfigError(f"strategy.offload_params=true under strategy=deepspeed strategy.stage={s.stage}: DeepSpeed "
                          "offloads parameters (its zero_optimization.offload_param) under stage 3 only, where they "
                          "are partitioned. Use strategy.stage=3, or strategy.offload_optimizer=true alone (stages "
                          "1-3), or zerolab's strategy=zero3 strategy.offload_params=true")
    if s.offload_optimizer and s.stage == 0:
        raise ConfigError("strategy.offload_optimizer=true under strategy=deepspeed strategy.stage=0: DeepSpeed's "
                          "offload_optimizer is part of its ZeRO optimizer (stages 1-3). Use strategy.stage=1, 2 or "
                          "3, or zerolab's strategy=zero1/zero2/zero3 strategy.offload_optimizer=true")
    if (s.offload_optimizer or s.offload_params) and name not in DEEPSPEED_OPTIMIZERS:
        raise ConfigError(f"optim={name} with DeepSpeed's offload: DeepSpeed steps an offloaded optimizer with its own "
                          "CPU kernels (DeepSpeedCPUAdam for adam and adamw) and refuses a client optimizer there. "
                          "Use optim=adamw or adam, or zerolab's own strategy=zero1/zero2/zero3 with "
                          f"strategy.offload_optimizer=true, whose {name} steps on the host unchanged")
