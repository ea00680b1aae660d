"""Checkpoints: sharded, name-keyed, atomic, reshardable; export for inference.

On disk (checkpoint.dir, default <run dir>/checkpoints):

  step_00000020/
    meta.json            written by rank 0 (its field "meta_sha256" is the digest of the rest):
                         step, world size, strategy, checkpoint format, precision, optimizer,
                         config, LR schedule, loss scaler, sampler position, optimizer scalars
                         (the step counter), versions, the piece index, and the sha256 and size
                         of every file
    rank0.safetensors    rank r's pieces "<kind>/<param>@<start>:<end>": elements [start, end)
    rank1.safetensors    of the flattened tensor (kind = master | exp_avg | ...), plus that
    ...                  rank's RNG state as "rng/cpu" (and "rng/cuda")
    <native files>       a strategy with its own format (checkpoint_format = "native") writes
                         them here itself; meta.json records and checksums each
  latest                 "step_00000020", replaced last
  .tmp-step_00000030/    a save in progress, or one a crash interrupted: never read

A save writes everything into the .tmp- directory, fsyncs every file and the directory, renames
the directory into place, and only then replaces `latest`; a crash at any point leaves the
previous checkpoint intact. Loading asks the strategy which element ranges it owns now and
assembles each from whatever pieces were saved, so N ranks of any pieces-format strategy load
into M ranks of any other. Tensors are read with safetensors and metadata is JSON: nothing is
unpickled; a native format's torch.save files are scanned for globals and loaded weights_only
with the writing strategy's allow-list (Strategy.checkpoint_globals).

The package, by concern: format (meta.json, safetensors writing, safe torch.load), reshard (the
pieces format), store (verify, list, choose, check, publish), checkpointer (save and resume
during training; failure: a save that fails, on every rank together), export (export and import).
"""
from zerolab.checkpoint.checkpointer import Checkpointer, checkpoint_dir
from zerolab.checkpoint.export import EXPORT_DTYPES, export, export_main, import_weights
from zerolab.checkpoint.format import (FORMAT, FORMAT_VERSION, FORMATS, LATEST, META, CheckpointError,
                                       check_torch_file, load_torch_file, meta_digest, meta_text, read_meta,
                                       safe_torch_load, write_safetensors, writer_class)
from zerolab.checkpoint.reshard import (PieceReader, model_layout, optimizer_scalars, restore_optimizer_scalars)
from zerolab.checkpoint.store import (check_compatible, check_resume_path, list_checkpoints, newest_good, resolve,
                                      verify)

# The names these had when zerolab.checkpoint was one module (tests and scripts import them).
_meta_text, _check_compatible = meta_text, check_compatible

__all__ = ["Checkpointer", "checkpoint_dir", "CheckpointError", "EXPORT_DTYPES", "FORMAT", "FORMATS", "FORMAT_VERSION",
           "LATEST", "META", "PieceReader", "check_compatible", "check_resume_path", "check_torch_file", "export",
           "export_main", "import_weights",
           "list_checkpoints", "load_torch_file", "meta_digest", "meta_text", "model_layout", "newest_good",
           "optimizer_scalars", "read_meta", "resolve", "restore_optimizer_scalars", "safe_torch_load", "verify",
           "write_safetensors", "writer_class"]
