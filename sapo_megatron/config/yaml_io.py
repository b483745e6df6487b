"""Reading a config's YAML within limits, and the ``--set KEY=VALUE`` overrides.

A run config is a few kB: a huge file, an alias bomb ("billion laughs"), a deeply nested mapping, a key given twice
or a number Python cannot hold stops with one line naming the file (or the ``--set``) instead of eating memory or
silently keeping the last value. Overrides are YAML values set at a dotted key; setting the ``name`` of a section
with variants switches the variant."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from sapo_megatron.config.messages import drop_keys_of_other_variant, section_at
from sapo_megatron.errors import ConfigError


def read_yaml(path: Path) -> dict[str, Any]:
    """The mapping of sections a config file holds; :class:`ConfigError` for anything else."""
    if path.is_dir():
        raise ConfigError(
            f"config file {path} is a directory: give the YAML file in it (e.g. {path}/run.yaml)"
        )
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"config file {path} is {path.stat().st_size} bytes; a run config is a few kB (the limit is "
            f"{MAX_CONFIG_BYTES})"
        )
    try:
        raw = parse_yaml(path.read_text(encoding="utf-8"), str(path))
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{path} is not UTF-8 text (byte {err.start}: {err.object[err.start : err.start + 4]!r}): save it as "
            "UTF-8"
        ) from None
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{path} must hold a mapping of sections (model, parallel, ...), got {type(raw).__name__}"
        )
    return raw


MAX_CONFIG_BYTES = 1 << 20
MAX_YAML_ALIASES = 100
MAX_YAML_DEPTH = 32
MAX_YAML_VALUES = 100_000
"""Limits of a config's YAML (a run config is a few kB, a handful of anchors, about 5 levels deep): an alias
bomb ("billion laughs"), a huge file or a deeply nested one stops with one line instead of eating memory."""


def parse_yaml(text: str, where: str, *, yaml_errors: bool = False) -> Any:
    """Safe-load ``text`` (a config file, or a ``--set`` value) within the limits above; keys given twice in one
    mapping and values Python cannot hold (a 5000-digit integer) are refused naming ``where``."""
    try:
        value = yaml.load(text, Loader=_UniqueKeyLoader)
    except _DuplicateKey as err:
        raise ConfigError(f"{where}: {err}") from None
    except yaml.YAMLError as err:
        if yaml_errors:  # the caller words it (--set: the problem and its column)
            raise
        raise ConfigError(f"{where} is not valid YAML: {_one_line_yaml_error(err)}") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply (the limit is {MAX_YAML_DEPTH} levels)") from None
    except ValueError as err:  # int() of a number with more digits than Python converts
        raise ConfigError(
            f"{where}: a value YAML cannot convert ({' '.join(str(err).split())[:200]})"
        ) from None
    _check_size(value, where)
    return value


def _one_line_yaml_error(err: yaml.YAMLError) -> str:
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    context = getattr(err, "context", None)
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
    return f"{context + ': ' if context else ''}{problem}{where}"


def _check_size(value: Any, where: str) -> None:
    """Walk the loaded value as the validation will (aliases expanded), stopping at the limits."""
    budget = [MAX_YAML_VALUES]
    stack = [(value, 0)]
    while stack:
        item, level = stack.pop()
        budget[0] -= 1
        if budget[0] < 0:
            raise ConfigError(
                f"{where}: expands to more than {MAX_YAML_VALUES} values (aliases repeated inside aliases: an "
                "alias bomb?)"
            )
        if level > MAX_YAML_DEPTH:
            raise ConfigError(f"{where}: nested too deeply (the limit is {MAX_YAML_DEPTH} levels)")
        if isinstance(item, dict):
            stack.extend((child, level + 1) for child in item.values())
        elif isinstance(item, list):
            stack.extend((child, level + 1) for child in item)


class _DuplicateKey(yaml.YAMLError):
    """A mapping key given twice; the message names both lines."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses a key given twice in one mapping (PyYAML keeps the last one silently)."""

    aliases = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
            if self.aliases > MAX_YAML_ALIASES:
                mark = self.peek_event().start_mark
                raise yaml.YAMLError(
                    f"more than {MAX_YAML_ALIASES} aliases (*name) at line {mark.line + 1}: an alias bomb? "
                    "a run config needs a few"
                )
        return super().compose_node(parent, index)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *base' merges keys; the base may repeat them
                continue
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _DuplicateKey(
                    f"key {key!r} appears twice (lines {seen[key]} and {line}); the second would replace the "
                    "first: merge them"
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def set_dotted(raw: dict[str, Any], dotted: str, value: Any, root: type[BaseModel]) -> None:
    """Apply one ``--set`` override. Setting the ``name`` of a section with variants (``algorithm.loss``,
    ``algorithm.correction``) switches the variant: keys the new one does not accept (e.g. SAPO's ``tau_pos``
    when switching to ``grpo``) are dropped, the shared ones (``kl_coef``, ``agg``, ...) are kept."""
    node = raw
    *parents, leaf = dotted.split(".")
    for depth, key in enumerate(parents):
        if isinstance(node, list):  # eval.datasets.0.size
            node = node[_list_index(node, key, dotted, parents[:depth])]
            continue
        if isinstance(node, dict) and _is_variant_name(node.get(key), (*parents[: depth + 1],), root):
            node[key] = {"name": node[key]}  # `colocation: time_shared` is `colocation: {name: time_shared}`
        node = node.setdefault(key, {}) if isinstance(node, dict) else None
        if not isinstance(node, dict | list):
            raise ConfigError(f"override {dotted}: {key} is not a section")
    if isinstance(node, list):
        node[_list_index(node, leaf, dotted, parents)] = value
        return
    if isinstance(value, dict) and isinstance(node.get(leaf), dict):
        _merge_section(node[leaf], value, (*parents, leaf), root)
        return
    if leaf == "name" and isinstance(value, str):
        drop_keys_of_other_variant(node, tuple(parents), value, root)
    node[leaf] = value


def _is_variant_name(value: Any, loc: tuple[str, ...], root: type[BaseModel]) -> bool:
    """``value`` is a bare variant name given for the section with variants at ``loc``."""
    return isinstance(value, str) and isinstance(section_at(loc, root), dict)


def _list_index(node: list[Any], key: str, dotted: str, parents: list[str]) -> int:
    if key.isdigit() and int(key) < len(node):
        return int(key)
    where = ".".join(parents) or "the value"
    valid = f"0 to {len(node) - 1}" if node else "none: the list is empty"
    raise ConfigError(
        f"override {dotted}: {key!r} is not an entry of {where}, a list of {len(node)} (indices: {valid})",
        hint=f"to replace the whole list, --set '{where}=[...]'",
    )


def _merge_section(
    section: dict[str, Any], value: dict[str, Any], loc: tuple[str, ...], root: type[BaseModel]
) -> None:
    """``--set 'trainer={steps: 1}'`` sets those keys of the section and keeps its others (replacing the whole
    section would silently reset every other key to its default, ``save_every`` among them). A ``name`` in it
    switches the variant first, and the keys given with it are validated as in YAML, in any order."""
    if isinstance(value.get("name"), str):
        drop_keys_of_other_variant(section, loc, value["name"], root, keep=set(value))
    for key, item in value.items():
        if isinstance(item, dict) and isinstance(section.get(key), dict):
            _merge_section(section[key], item, (*loc, str(key)), root)
            continue
        section[key] = item


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` pairs as ``{dotted key: YAML value}``; the command lines of train, eval and compare."""
    overrides = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {pair!r}: expected KEY=VALUE, e.g. --set parallel.tp=2")
        try:
            overrides[key] = _override_value(value, pair)
        except yaml.YAMLError as err:
            raise ConfigError(
                f"--set {pair!r}: the value is not valid YAML ({_yaml_problem(err)})",
                hint="values are YAML: 2, 1e-5, true, [1, 2], {a: 1}; quote a string that looks like YAML, "
                f"e.g. --set \"{key}='{value}'\"",
            ) from err
    return overrides


def _override_value(value: str, pair: str) -> Any:
    """A ``--set`` value: YAML within the config file's limits (no alias bomb, no 5000-digit number); a syntax
    error is left to the caller's message."""
    return parse_yaml(value, f"--set {pair[:80]!r}", yaml_errors=True)


def _yaml_problem(err: Exception) -> str:
    """One line of a YAML error: its problem and the column it was found at."""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    mark = getattr(err, "problem_mark", None)
    return f"{problem} at character {mark.column + 1}" if mark is not None else problem
