"""zerolab's closed schema: every key the config may hold, and the one-line refusals of any other.

Hydra already rejects wrongly typed values, and unknown keys given without `+`, because every
group merges into one of zerolab/schema.py's dataclasses. The schema is closed: `check_keys`
refuses a key that is not a field of those dataclasses however it got in (`+key=...` adds keys to
a struct config), and `check_overrides` refuses one on the command line before Hydra runs, so the
message can suggest the nearest valid key instead of Hydra's advice to append it with `+`.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from typing import Any, Dict, Iterable

from omegaconf import DictConfig

from zerolab.errors import ConfigError
from zerolab.schema import Config


# ---- the closed schema -----------------------------------------------------------------------
def _schema(cls=Config, prefix: str = "") -> dict[str, Any]:
    """Every dotted key of the schema -> its dataclass (a section), FREE (a free-form dict such as
    strategy.ds_config_overrides, whose keys are DeepSpeed's) or None (a value)."""
    keys: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key, kind = prefix + f.name, hints[f.name]
        if dataclasses.is_dataclass(kind):
            keys[key] = kind
            keys.update(_schema(kind, key + "."))
        else:
            keys[key] = FREE if typing.get_origin(kind) in (dict, Dict) else None
    return keys


FREE = "free-form"
SCHEMA_KEYS = _schema()
CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


def suggest(key: str) -> str:
    """'did you mean X?' for the valid key nearest to `key`, else what its section holds."""
    values = [k for k, kind in SCHEMA_KEYS.items() if not isinstance(kind, type)]
    name = key.rsplit(".", 1)[-1]
    same_name = [k for k in values if k.rsplit(".", 1)[-1] == name]  # right key, wrong section
    close = same_name or difflib.get_close_matches(key, values if "." in key else list(SCHEMA_KEYS), n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]}?"
    section = key.rsplit(".", 1)[0] if "." in key else ""
    if section in SCHEMA_KEYS and not isinstance(SCHEMA_KEYS[section], type):
        return f"{section} is a value, with no keys below it."
    if section in SCHEMA_KEYS:
        names = [k[len(section) + 1:] for k in SCHEMA_KEYS
                 if k.startswith(section + ".") and k.count(".") == key.count(".")]
        return f"{section} has: {', '.join(names)}."
    return f"the top-level keys are: {', '.join(k for k in SCHEMA_KEYS if '.' not in k)}."


def _unknown(key: str, given: str = "") -> ConfigError:
    how = f" (given as {given})" if given else ""
    return ConfigError(f"Could not override '{key}'{how}: no such key; {suggest(key)} zerolab's schema is "
                       f"closed (zerolab/schema.py): `+` cannot add keys either (only below "
                       f"strategy.ds_config_overrides, which takes DeepSpeed's keys).")


def _known(key: str) -> bool:
    parts = key.split(".")
    for i in range(1, len(parts) + 1):
        kind = SCHEMA_KEYS.get(".".join(parts[:i]), "unknown")
        if kind == FREE:
            return True  # anything below a free-form dict
        if kind == "unknown" or (kind is None and i < len(parts)):
            return False
    return True


def config_groups(config_dir: str = CONF_DIR) -> dict[str, list[str]]:
    """The config groups of conf/ (model, strategy, ...) and their options (the yaml files)."""
    return {d: sorted(f[:-5] for f in os.listdir(os.path.join(config_dir, d)) if f.endswith(".yaml"))
            for d in sorted(os.listdir(config_dir)) if os.path.isdir(os.path.join(config_dir, d))}


def check_overrides(overrides: Iterable[str], groups: "dict[str, list[str]] | Iterable[str]" = ()) -> None:
    """Refuse command-line overrides of keys the schema lacks, with or without `+`/`++`/`~`, and
    options a config group does not have (`strategy=nonexistent`), each in one line, before Hydra
    composes anything. `groups`: top-level config group names that are not keys (e.g. `launcher`),
    or {group: options} to check the options too (config_groups()); `hydra.*` and `group/option`
    overrides are Hydra's business and pass through."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Glob

    options = groups if isinstance(groups, dict) else {}
    parser = OverridesParser.create()
    for arg in overrides:
        try:
            (override,) = parser.parse_overrides([arg])
        except Exception:  # not an override Hydra can parse: Hydra reports it
            continue
        key = override.key_or_group
        if override.package is not None or "/" in key or key.split(".")[0] == "hydra":
            continue
        if "." not in key and key in groups:
            if key in options and not override.is_delete() and not isinstance(override.value(), Glob):
                given = (list(override.sweep_string_iterator()) if override.is_sweep_override()
                         else [override.get_value_element_as_str()])
                for value in given:
                    if value not in options[key] and value != "null":
                        raise ConfigError(f"{key}={value}: no such option of config group {key}; choose one of "
                                          f"{', '.join(options[key])} (conf/{key}/*.yaml)")
            continue
        if not _known(key):
            raise _unknown(key, arg)


def check_keys(cfg: DictConfig, prefix: str = "") -> None:
    """Refuse keys of a composed config that its schema lacks (added with `+key=...`)."""
    for name in cfg.keys():
        key = prefix + str(name)
        if key not in SCHEMA_KEYS:
            raise _unknown(key)
        node = cfg._get_node(name)
        if isinstance(SCHEMA_KEYS[key], type) and isinstance(node, DictConfig) and not node._is_missing() \
                and not node._is_none():
            check_keys(node, key + ".")


def free_dicts_merge(overrides: Iterable[str]) -> list[str]:
    """`key={...}` for a free-form dict of the schema (model.kwargs, strategy.ds_config_overrides)
    as Hydra's `++key={...}`: a structured config refuses keys its schema does not declare, and a
    free-form dict declares none, so Hydra would reject the plain form ("Could not override") and
    advise `+`. Given as `++` the value is merged into the dict. Other overrides pass unchanged."""
    out = []
    for arg in overrides:
        key, eq, _ = arg.partition("=")
        if eq and not key.startswith(("+", "~")) and SCHEMA_KEYS.get(key) == FREE:
            arg = "++" + arg
        out.append(arg)
    return out
