"""Save and resume during training: collective, atomic, and agreed by every rank.

Every strategy writes zerolab's "pieces" (its rank's name-keyed element ranges of every tensor,
zerolab/checkpoint/reshard.py), so a checkpoint of N ranks of any strategy resumes on M ranks of
any other. Every rank writes rank<r>.safetensors with its pieces, its RNG state and its own model
buffers; rank 0 writes meta.json and publishes. A "native" checkpoint (a library's own files, which
DeepSpeed runs wrote before every strategy wrote pieces) is still read, by its writing strategy.
Model buffers (BatchNorm statistics, a custom running scale) are model state that each rank
updates from its own batches: each rank saves its own, and a resume at the same world size gives
each its own back; at another world size every rank loads rank 0's (reshard.py says why).
"""
from __future__ import annotations

import datetime
import logging
import os
import shutil
from dataclasses import asdict

import torch

from zerolab.checkpoint.format import FORMAT, FORMAT_VERSION, META, CheckpointError, meta_text, read_meta, \
    write_safetensors
from zerolab.checkpoint.reshard import BUFFER_PREFIX, PieceReader, buffer_source, module_buffers, optimizer_scalars, \
    restore_optimizer_scalars, rng_tensors
from zerolab.checkpoint.failure import agree, on_every_rank, save_failure
from zerolab.checkpoint.store import check_compatible, make_room, newest_good, prune, publish, resolve, verify

log = logging.getLogger("zerolab")


def checkpoint_dir(cfg, run_dir: str) -> str:
    """Where a run's checkpoints go: checkpoint.dir, else <run dir>/checkpoints."""
    return os.path.abspath(cfg.checkpoint.dir or os.path.join(run_dir, "checkpoints"))


class Checkpointer:
    def __init__(self, cfg, ctx, run_dir: str, layout: dict, model: "torch.nn.Module | None" = None):
        """`layout`: model_layout of the model, taken before the strategy partitioned it; `model`:
        that module, which the strategy trains (not a wrapper), whose buffers each rank saves.
        Without it a model that has persistent buffers cannot be checkpointed."""
        self.cfg, self.ctx, self.layout, self.model = cfg, ctx, layout, model
        self.run_dir, self.dir = os.path.abspath(run_dir), checkpoint_dir(cfg, run_dir)
        self.last_saved: str | None = None  # the newest checkpoint this run wrote
        # Updates skipped before this run started (those of the checkpoint it resumed from): a run
        # whose settings cannot skip one adds none to it (format._validate_skips checks).
        self.skipped_before = 0

    # ---- save ----------------------------------------------------------------------------------
    def save(self, step: int, strategy, schedule, sampler) -> str:
        """Collective. Every rank writes its file; rank 0 writes meta.json and publishes.
        A failure on any rank (disk full, say) fails the save on every rank together: outcomes
        are agreed by the collectives the save needs anyway, the temp directory is removed, the
        previous checkpoint stays as it was, and a CheckpointError says what happened."""
        strategy.report_pending()  # a step decided on the device may have left non-finite weights: never save them
        ctx, name = self.ctx, f"step_{step:08d}"
        tmp, final = os.path.join(self.dir, f".tmp-{name}"), os.path.join(self.dir, name)
        if self.layout["buffers"] and self.model is None:
            raise CheckpointError(f"model buffers {self.layout['buffers'][:5]} cannot be saved: this Checkpointer "
                                  "was given no module to read them from (Checkpointer(..., model=the module))")
        failure = None
        if ctx.is_main:
            try:
                os.makedirs(self.dir, exist_ok=True)
                # Room first: the save needs space for one checkpoint beside the ones it must keep.
                for old in make_room(self.dir, self.cfg.checkpoint.keep_last):
                    log.info("checkpoint: removed %s before saving step %d (checkpoint.keep_last=%d)", old, step,
                             self.cfg.checkpoint.keep_last)
                shutil.rmtree(tmp, ignore_errors=True)
                os.makedirs(tmp)
            except OSError as err:
                failure = save_failure(self, step, err, tmp)
        agree(ctx.gather_objects(failure), tmp)
        report, where = None, os.path.join(tmp, f"rank{ctx.rank}.safetensors")
        try:
            report = self._write_rank_file(tmp, step, strategy)  # collective where the strategy gathers
        except Exception as err:  # noqa: BLE001  (torch.save reports a full disk as RuntimeError)
            failure = save_failure(self, step, err, where)
        reports = ctx.gather_objects(report if failure is None else {"failure": failure})
        agree([r.get("failure") for r in reports], tmp)
        if ctx.is_main:
            try:
                meta = self._meta(step, strategy, schedule, sampler, reports)
                publish(tmp, final, self.dir, meta_text(meta))
                prune(self.dir, self.cfg.checkpoint.keep_last)
            except OSError as err:
                failure = save_failure(self, step, err, os.path.join(tmp, META))
        agree([ctx.broadcast_object(failure)], tmp)
        if ctx.is_main:
            log.info("checkpoint: step %d saved to %s", step, final)
        self.last_saved = final
        return final

    def _write_rank_file(self, tmp: str, step: int, strategy) -> dict:
        ctx = self.ctx
        pieces = strategy.checkpoint_state()
        entries, index = [], []
        for key, pc in sorted(pieces.items()):
            tname = f"{key}@{pc.start}:{pc.end}"
            entries.append((tname, pc.tensor.dtype, (pc.end - pc.start,), lambda t=pc.tensor: t.reshape(-1)))
            index.append({"key": key, "tensor": tname, "start": pc.start, "end": pc.end, "shape": list(pc.shape),
                          "dtype": str(pc.tensor.dtype).removeprefix("torch.")})
        for key, t in rng_tensors(ctx.device).items():
            entries.append((key, t.dtype, tuple(t.shape), lambda t=t: t))
        if self.layout["buffers"]:  # each rank its own (they differ: each updates them from its own batches)
            for name, t in module_buffers(self.model, self.layout["buffers"]).items():
                entries.append((BUFFER_PREFIX + name, t.dtype, tuple(t.shape), lambda t=t: t.detach()))
        fname = f"rank{ctx.rank}.safetensors"
        info = write_safetensors(os.path.join(tmp, fname), entries, {"format": FORMAT, "rank": ctx.rank, "step": step})
        return {"file": fname, "rank": ctx.rank, **info, "pieces": index,
                "scalars": optimizer_scalars(strategy.optimizer_states())}

    def _meta(self, step, strategy, schedule, sampler, reports) -> dict:
        import safetensors

        import zerolab
        from zerolab.schema import to_dict

        cfg, pieces, shapes = self.cfg, {}, self.layout["params"]
        for r in reports:
            for pc in r["pieces"]:
                name = pc["key"].split("/", 1)[1]
                if shapes.get(name) != pc["shape"]:
                    raise CheckpointError(f"rank {r['rank']} saved {pc['key']} with shape {pc['shape']}, "
                                          f"the model has {shapes.get(name)}")
                pieces.setdefault(pc["key"], []).append({"file": r["file"], "tensor": pc["tensor"],
                                                         "start": pc["start"], "end": pc["end"], "dtype": pc["dtype"]})
        scalars = next((r["scalars"] for r in reports if r["scalars"]), {})
        count = scalars.get("step", {}).get("value")
        return {
            "format": FORMAT, "format_version": FORMAT_VERSION,
            "checkpoint_format": strategy.checkpoint_format,
            "step": step, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "world_size": self.ctx.world_size, "strategy": cfg.strategy.name, "precision": cfg.precision.name,
            "optimizer": cfg.optim.name, "config": to_dict(cfg),
            "versions": {"zerolab": zerolab.__version__, "torch": torch.__version__,
                         "safetensors": safetensors.__version__},
            "lr_schedule": {**asdict(schedule), "next_lr": schedule(step)},
            "loss_scaler": strategy.precision.scaler.state_dict(),  # (a library's own scaler mirrors itself there)
            "sampler": {"next_step": step, "seed": sampler.seed, "global_batch": sampler.global_batch},
            "optimizer_scalars": scalars,
            # the steps whose update was skipped (a non-finite gradient norm, an fp16 overflow): with the
            # optimizer's count of updates they add up to the step (format.validate_meta checks it)
            **({"skipped_updates": step - int(count), "skipped_updates_before": self.skipped_before}
               if count is not None else {}),
            **self.layout, "pieces": pieces,
            "files": {r["file"]: {"rank": r["rank"], "bytes": r["bytes"], "sha256": r["sha256"]} for r in reports},
        }

    # ---- resume --------------------------------------------------------------------------------
    def resume(self, strategy, schedule, sampler) -> int:
        """Collective. Loads the checkpoint chosen by checkpoint.resume; returns the step to start at.
        Rank 0 picks and verifies it; every rank checks compatibility before any state changes."""
        ctx, cfg, want = self.ctx, self.cfg, self.cfg.checkpoint.resume
        choice = None
        if ctx.is_main:
            try:
                if want == "auto":
                    path = newest_good(self.dir)
                    if path is None:
                        log.info("checkpoint.resume=auto: no checkpoint in %s, starting at step 0", self.dir)
                    else:
                        log.info("checkpoint.resume=auto: resuming from %s", path)
                else:
                    path = resolve(want)
                    verify(path)
                choice = ("ok", path)
            except CheckpointError as err:
                choice = ("error", str(err))
        status, value = ctx.broadcast_object(choice)
        if status == "error":
            raise on_every_rank(CheckpointError(value))  # rank 0 decided for all: it alone says it
        if value is None:
            return 0
        path = value
        try:  # every rank reads the same meta.json and config: the same verdict everywhere
            meta = read_meta(path)
            check_compatible(meta, path, cfg, strategy, self.layout)
        except CheckpointError as err:
            raise on_every_rank(err)
        step = int(meta["step"])
        # The steps the restored optimizer did not count (the skipped updates; every step before an
        # import, whose optimizer starts afresh at 0): the base of this run's own skipped_updates.
        count = meta["optimizer_scalars"].get("step", {}).get("value")
        self.skipped_before = step - int(count) if isinstance(count, (int, float)) else 0
        schedule.resume_from(meta["lr_schedule"])  # re-derives the peak lr if the global batch changed
        self._note_differences(meta, schedule, sampler)

        reader = PieceReader(path, meta)
        if meta["checkpoint_format"] == "native":
            # The strategy restores its weights, optimizer state and loss scaler from its own files,
            # which verify() checksummed and scanned.
            strategy.load_native(path, meta)
        else:
            strategy.load_checkpoint_state(reader)
            restore_optimizer_scalars(strategy.optimizer_states(), meta["optimizer_scalars"])
            scaler = strategy.precision.scaler
            if scaler.enabled and meta["precision"] == "fp16":
                scaler.load_state_dict(meta["loss_scaler"])  # (restore_step hands it to a library's own scaler)
        strategy.restore_step(step)
        self._restore_buffers(reader, meta)
        if reader.weights_only and ctx.is_main:
            log.warning("checkpoint: %s holds weights only (imported from %s): the optimizer state starts fresh",
                        path, meta.get("imported_from", {}).get("strategy", "?"))
        self._restore_rng(reader, meta, step)
        if ctx.is_main:
            log.info("checkpoint: resumed at step %d from %s (%s, %d ranks -> %s, %d ranks)", step, path,
                     meta["strategy"], meta["world_size"], cfg.strategy.name, ctx.world_size)
        ctx.barrier()
        return step

    @torch.no_grad()
    def _restore_buffers(self, reader: PieceReader, meta: dict) -> None:
        """Each rank its own saved buffers at the same world size, rank 0's at another (reshard.py)."""
        names, ctx = self.layout["buffers"], self.ctx
        if not names:
            return
        if self.model is None:
            raise CheckpointError(f"model buffers {names[:5]} cannot be restored: this Checkpointer was given no "
                                  "module (Checkpointer(..., model=the module))")
        src = buffer_source(meta, ctx.rank, ctx.world_size)
        saved = reader.buffers(src, names)
        if saved is None:  # a weights-only import of a checkpoint
            if ctx.is_main:
                log.warning("checkpoint: no model buffers saved (imported weights): %s start from their initial "
                            "values", ", ".join(names[:5]))
            return
        for name, t in module_buffers(self.model, names).items():
            t.copy_(saved[name])
        if src != ctx.rank and ctx.is_main:
            log.warning("checkpoint: model buffers (%s) are rank 0's for every rank: saved with %d ranks, resumed "
                        "with %d, where a rank number no longer names the same data", ", ".join(names[:3]),
                        meta["world_size"], ctx.world_size)

    def _restore_rng(self, reader: PieceReader, meta: dict, step: int) -> None:
        ctx = self.ctx
        rng = reader.rng(ctx.rank) if meta["world_size"] == ctx.world_size else {}
        if "rng/cpu" in rng:
            torch.set_rng_state(rng["rng/cpu"])
            if "rng/cuda" in rng and ctx.device.type == "cuda":
                torch.cuda.set_rng_state(rng["rng/cuda"], ctx.device)
        else:
            torch.manual_seed(self.cfg.trainer.seed + 1 + ctx.rank + 1_000_003 * step)
            if ctx.is_main:
                log.warning("checkpoint: no RNG state for these ranks (saved with %d ranks, resumed with %d): dropout "
                            "RNG streams are re-seeded, so the run is not bitwise identical to one that never stopped",
                            meta["world_size"], ctx.world_size)

    def _note_differences(self, meta: dict, schedule, sampler) -> None:
        if not self.ctx.is_main:
            return
        keys = ("warmup_steps", "max_steps", "decay", "min_lr_ratio", "base_lr")  # batch scaling: resume_from
        now, saved = asdict(schedule), meta["lr_schedule"]
        changed = {k: (saved.get(k), now.get(k)) for k in keys if saved.get(k) != now.get(k)}
        if changed:
            log.warning("checkpoint: the LR schedule differs from the checkpoint's (saved, now): %s; "
                        "continuing with the new one", changed)
        if meta["sampler"]["global_batch"] != sampler.global_batch or meta["sampler"]["seed"] != sampler.seed:
            log.warning("checkpoint: global batch or seed changed (%s saved); the data order after the resume "
                        "differs from the original run's", meta["sampler"])
        if meta["precision"] != self.cfg.precision.name:
            log.warning("checkpoint: saved in precision=%s, resumed in precision=%s (fp32 master weights carry over)",
                        meta["precision"], self.cfg.precision.name)
