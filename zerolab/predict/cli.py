"""The hardware arguments `python -m zerolab dry-run` and `python -m zerolab plan` share, the
topology they describe, and what the dry run hands the time model (the step's shape, its record)."""
from __future__ import annotations

import argparse
import dataclasses

from torch._subclasses.fake_tensor import unset_fake_temporarily

from zerolab.errors import ConfigError
from zerolab.models import build_model
from zerolab.predict.hardware import DEVICES, LINKS, OVERRIDES, apply_overrides, device, link
from zerolab.predict.model import Prediction, predict
from zerolab.precision import COMPUTE_DTYPES, DTYPE_NAMES
from zerolab.predict.topology import Network
from zerolab.profile import flops_per_token

DEFAULT_GPUS_PER_NODE = 8


def add_arguments(p: argparse.ArgumentParser, required: bool = False) -> None:
    g = p.add_argument_group("prediction of the step's time (a model, not a measurement: docs/predict.md)")
    g.add_argument("--hardware", required=required, default=None,
                   help=f"predict the step's time on this device: {', '.join([*DEVICES, 'cpu'])} "
                        "(cpu: this machine, after python -m zerolab.predict calibrate)")
    g.add_argument("--gpus-per-node", type=int, default=None,
                   help=f"GPUs per node (default: dist.ranks_per_node if set, else {DEFAULT_GPUS_PER_NODE}); "
                        "must divide --world")
    g.add_argument("--intra-link", default="", help=f"link inside a node (default: the device's): {', '.join(LINKS)}")
    g.add_argument("--inter-link", default="", help="link across nodes, per GPU (default: the device's)")
    g.add_argument("--hw", action="append", default=[], metavar="KEY=VALUE",
                   help=f"override one figure of the device or its links (repeatable): {', '.join(OVERRIDES)}")


def arguments(hardware: str, gpus_per_node: int | None = None, hw: tuple = ()) -> argparse.Namespace:
    """The arguments add_arguments parses, for a caller without a command line."""
    return argparse.Namespace(hardware=hardware, gpus_per_node=gpus_per_node if hardware != "cpu" else None,
                              intra_link="", inter_link="", hw=list(hw))


def topology(args, world: int, ranks_per_node: int = 0) -> Network:
    """The topology the arguments name, for `world` ranks; `ranks_per_node`: the job's
    dist.ranks_per_node (0: not set), the node size when --gpus-per-node is not given.
    ConfigError: unknown names, a node size that does not divide the world, two that disagree."""
    dev = device(args.hardware, ranks_per_host=world)
    given = args.gpus_per_node
    if dev.host_sync:  # this machine: one host, gloo; the link figures are its calibration's
        if args.intra_link or args.inter_link or given is not None:
            raise ConfigError("--hardware cpu is this machine: all ranks on one host, gloo between them "
                              "(--gpus-per-node and the links describe GPU clusters)")
        dev, _, _ = apply_overrides(dev, LINKS["pcie4"], LINKS["pcie4"], args.hw)
        return Network(world, max(world, 1), LINKS["pcie4"], LINKS["pcie4"], dev)
    if given is not None and ranks_per_node and given != ranks_per_node:
        raise ConfigError(f"--gpus-per-node {given} and dist.ranks_per_node={ranks_per_node} disagree: the dry run's "
                          "nodes are the prediction's; give one of them, or the same figure to both")
    intra, inter = link(args.intra_link or dev.intra), link(args.inter_link or dev.inter)
    dev, intra, inter = apply_overrides(dev, intra, inter, args.hw)
    return Network(world, given or ranks_per_node or DEFAULT_GPUS_PER_NODE, intra, inter, dev)


def ranks_per_node(topo: Network) -> int:
    """The job's dist.ranks_per_node for a prediction on `topo` (0 on this machine: one host), so
    that the dry run's process group has the prediction's nodes (node groups, bytes by link)."""
    return 0 if topo.device.host_sync else min(topo.gpus_per_node, topo.world)


def model_flops_per_token(cfg) -> int:
    """Model FLOPs per trained token (zerolab.profile's MFU convention), from the job's model built
    on the meta device: its shapes, nothing allocated."""
    with unset_fake_temporarily():
        model = build_model(dataclasses.replace(cfg.model, activation_checkpointing="none"), device="meta")
    return flops_per_token(model, cfg.model.block_size)["flops_per_token"]


def priced(r, topo: Network) -> Prediction:
    """A rehearsal's recorded step (zerolab.rehearsal.Rehearsal: record, tokens_per_rank,
    flops_per_token, precision) priced on `topo` (zerolab.predict.model)."""
    return predict(r.record, topo, r.tokens_per_rank, r.flops_per_token, DTYPE_NAMES[COMPUTE_DTYPES[r.precision]])
