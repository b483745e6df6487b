"""Keys of the previous release, read under their new names until the next release (one warning each).

| old key | new key |
|---|---|
| ``rollout.cpu_http: true`` | ``rollout.engine: cpu_http`` |
| ``rollout.colocated: true`` | ``rollout.colocation: split`` |
| ``rollout.colocate: {...}`` (with or without ``colocated``) | ``rollout.colocation: {name: time_shared, ...}`` |
| ``teachers[].cpu_http: true`` | ``teachers[].engine: cpu_http`` |
| ``trainer.async_rollout: true`` / ``false`` | ``trainer.rollout_mode: one_step_off`` / ``sync`` |

``cpu_http: false``, ``colocated: false`` and ``async_rollout: false`` were the defaults: they are dropped, with the same warning. An old key
next to its new form (``colocate`` and ``colocation``, ``async_rollout`` and ``rollout_mode``), or ``cpu_http: true`` with ``engine: sglang``, is refused:
the two would disagree.
"""

from __future__ import annotations

import warnings
from typing import Any

from sapo_megatron.errors import ConfigError


class DeprecatedConfigKey(FutureWarning):
    """A config key of the previous release; the message names the key that replaces it."""


def migrate_old_keys(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """``raw`` with every old key replaced by its new form (``raw`` itself is not changed); warns once per key,
    naming ``source`` (the config file)."""
    out = dict(raw)
    if isinstance(raw.get("rollout"), dict):
        rollout = _migrate_engine(raw["rollout"], "rollout", source)
        out["rollout"] = _migrate_colocation(rollout, source)
    if isinstance(raw.get("trainer"), dict):
        out["trainer"] = _migrate_rollout_mode(raw["trainer"], source)
    if isinstance(raw.get("teachers"), list):
        out["teachers"] = [
            _migrate_engine(entry, f"teachers[{entry.get('name', i)}]", source)
            if isinstance(entry, dict)
            else entry
            for i, entry in enumerate(raw["teachers"])
        ]
    return out


def deprecated(source: str, old: str, new: str) -> None:
    """One line: ``<source>:0: DeprecatedConfigKey: <old> is deprecated: use <new> ...``."""
    warnings.warn_explicit(
        f"{old} is deprecated: use {new} (the old key is read until the next release)",
        DeprecatedConfigKey,
        filename=source,
        lineno=0,
        module="sapo_megatron.config",
    )


def _migrate_engine(section: dict[str, Any], where: str, source: str) -> dict[str, Any]:
    if "cpu_http" not in section:
        return section
    section = dict(section)
    old, engine = section.pop("cpu_http"), section.get("engine", "cpu")
    if old is True and engine in ("cpu", "cpu_http"):
        section["engine"] = "cpu_http"
        deprecated(source, f"{where}.cpu_http: true", f"{where}.engine: cpu_http")
    elif old is True:
        raise ConfigError(
            f"{where}.cpu_http: true contradicts {where}.engine: {engine}; the CPU engine behind its HTTP server "
            f"is now {where}.engine: cpu_http (drop cpu_http)"
        )
    elif old in (False, None):
        deprecated(source, f"{where}.cpu_http: false", f"{where}.engine (cpu, cpu_http or sglang)")
    else:
        raise ConfigError(f"{where}.cpu_http={old!r}: it is now {where}.engine: cpu_http (drop cpu_http)")
    return section


def _migrate_colocation(section: dict[str, Any], source: str) -> dict[str, Any]:
    old = [key for key in ("colocated", "colocate") if key in section]
    if not old:
        return section
    if "colocation" in section:
        raise ConfigError(
            f"rollout.{old[0]} and rollout.colocation are the old and the new form of one setting: keep "
            "rollout.colocation only"
        )
    section = dict(section)
    colocated, colocate = section.pop("colocated", False), section.pop("colocate", None)
    if isinstance(colocate, dict):
        section["colocation"] = {**colocate, "name": "time_shared"}
        settings = "".join(f", {key}: ..." for key in colocate)
        deprecated(source, "rollout.colocate", f"rollout.colocation: {{name: time_shared{settings}}}")
    elif colocate is not None:
        raise ConfigError(
            f"rollout.colocate={colocate!r}: expected a mapping; it is now rollout.colocation: time_shared"
        )
    elif colocated is True:
        section["colocation"] = {"name": "split"}
        deprecated(source, "rollout.colocated: true", "rollout.colocation: split")
    elif colocated in (False, None):  # the defaults, as a resolved config of the previous release has them
        given = "rollout.colocated: false" if "colocated" in old else "rollout.colocate: null"
        deprecated(source, given, "rollout.colocation: none (the default)")
    else:
        raise ConfigError(
            f"rollout.colocated={colocated!r}: it is now rollout.colocation (none, split or time_shared)"
        )
    return section


def _migrate_rollout_mode(section: dict[str, Any], source: str) -> dict[str, Any]:
    if "async_rollout" not in section:
        return section
    if "rollout_mode" in section:
        raise ConfigError(
            "trainer.async_rollout and trainer.rollout_mode are the old and the new form of one setting: keep "
            "trainer.rollout_mode only (sync, one_step_off or fully_async)"
        )
    section = dict(section)
    old = section.pop("async_rollout")
    if old not in (True, False, None):
        raise ConfigError(
            f"trainer.async_rollout={old!r}: it is now trainer.rollout_mode (sync, one_step_off or fully_async)"
        )
    mode = "one_step_off" if old else "sync"
    section["rollout_mode"] = mode
    deprecated(source, f"trainer.async_rollout: {str(bool(old)).lower()}", f"trainer.rollout_mode: {mode}")
    return section
