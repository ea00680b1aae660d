"""The only ways zerolab opens a torch.save file: weights_only, allow-listed, scanned first.

A native checkpoint format may consist of torch.save files (DeepSpeed's do), whose loaders call
torch.load(weights_only=False), which would run any code a replaced file carries. Below the
strategies (DeepSpeed's checkpoint code opens its files through here) and the checkpoint package.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from zerolab.errors import CheckpointError

# A native format may consist of torch.save files (DeepSpeed's do), whose loaders call
# torch.load(weights_only=False), which would run any code a replaced file carries. zerolab lets
# such a file be opened only after (1) a static scan of its pickle refused every global beyond
# torch's tensors and plain containers and the writing strategy's allow-list
# (Strategy.checkpoint_globals), and (2) inside `safe_torch_load`, which turns every torch.load
# into a weights_only one with the same allow-list, so a payload the scan could not see is refused too.
def load_torch_file(path: str, map_location: str = "cpu"):
    """torch.load restricted to tensors and plain containers (weights_only=True): a file that
    would need to unpickle code (a callable, a custom class) is refused, never executed."""
    import pickle

    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"{path}: refused, it holds pickled objects other than tensors and plain "
                              f"containers, which zerolab never unpickles ({str(err).splitlines()[0]})") from err


def check_torch_file(path: str, allowed=(), owner: str = "its writer") -> None:
    """Refuses a torch.save file whose pickle names a global outside torch's weights_only set and
    `allowed`, without unpickling anything (the pickle opcodes are read, never run)."""
    from torch.serialization import get_unsafe_globals_in_checkpoint

    try:
        unsafe = get_unsafe_globals_in_checkpoint(path)
    except Exception as err:  # noqa: BLE001  (not a torch.save zip archive, or a malformed pickle)
        raise CheckpointError(f"{path}: refused, it is not a torch.save archive zerolab can inspect without "
                              f"unpickling it ({type(err).__name__}: {err})") from err
    refused = sorted(g for g in unsafe if g not in allowed)
    if refused:
        raise CheckpointError(f"{path}: refused, its pickle names {', '.join(refused)}, which is not a tensor, a plain "
                              f"container or one of the classes {owner}'s checkpoints hold; zerolab never "
                              f"unpickles it. Delete this checkpoint or restore it from a trusted copy")


def _allowed_objects(names) -> list:
    import importlib

    out = []
    for name in names:
        module, attr = name.rsplit(".", 1)
        try:
            out.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):
            continue  # another library version: a file that needs it is refused, never run
    return out


@contextmanager
def safe_torch_load(allowed=()):
    """Within: every torch.load (a library's own included, which may ask for weights_only=False)
    is a weights_only load that accepts only torch's safe set and `allowed` (dotted names)."""
    import pickle

    original = torch.load

    def load(f, *args, **kwargs):
        kwargs["weights_only"] = True
        try:
            return original(f, *args, **kwargs)
        except pickle.UnpicklingError as err:
            raise CheckpointError(f"{f}: refused while loading, it holds pickled objects outside the allow-list "
                                  f"({str(err).splitlines()[0]})") from err

    torch.load = load
    try:
        with torch.serialization.safe_globals(_allowed_objects(allowed)):
            yield
    finally:
        torch.load = original
