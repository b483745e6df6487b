"""Error texts of an invalid config: one line per problem, naming the field and the fix (an unknown key with the
closest accepted one, a section with variants with its names and their keys), and the variant lookup the
``--set`` overrides share. Every function takes the root model (:class:`~sapo_megatron.config.RunConfig`)."""

from __future__ import annotations

import difflib
import logging
from typing import Any, get_args

from pydantic import BaseModel, ValidationError

_logger = logging.getLogger(__name__)

Sections = type[BaseModel] | dict[str, type[BaseModel]] | None
"""What sits at a location: a section's model, ``{name: model}`` for a section with variants, or None."""


def format_validation_error(err: ValidationError, root: type[BaseModel]) -> str:
    """``invalid configuration:`` and one line per problem of ``err`` (raised validating ``root``)."""
    lines = []
    for item in err.errors():
        loc = ".".join(str(p) for p in item["loc"] if not str(p).startswith("function-after"))
        lines.append(f"  - {loc or 'config'}: {_explain(item, root)}")
    return "invalid configuration:\n" + "\n".join(lines)


def _explain(item: Any, root: type[BaseModel]) -> str:
    if item["type"] == "extra_forbidden":
        return "unknown key" + _suggestion(item, root)
    if item["type"] == "missing":
        return "required field is missing"
    if isinstance(
        section_at(tuple(item["loc"]), root), dict
    ):  # algorithm.loss / correction: name the variants
        return _variant_problem(item, root)
    message = str(item["msg"]).removeprefix("Value error, ")
    if "input" in item and item["type"] not in ("value_error",):
        message += f" (got {item['input']!r})"
    return message


def _suggestion(item: Any, root: type[BaseModel]) -> str:
    key, section_loc = str(item["loc"][-1]), item["loc"][:-1]
    known = _known_keys(section_loc, root)
    close = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    if known:
        hint += f"{' A' if close else '; a'}ccepted keys: {', '.join(sorted(known))}"
    return hint + _other_variants_hint(key, section_loc, root)


def _known_keys(section_loc: tuple[Any, ...], root: type[BaseModel]) -> list[str]:
    """The keys the config section at ``section_loc`` accepts (a variant's own keys after its tag, e.g.
    ``("algorithm", "loss", "grpo")``); [] when the location is not a section."""
    model = section_at(section_loc, root)
    return list(model.model_fields) if isinstance(model, type) else []


def section_at(loc: tuple[Any, ...], root: type[BaseModel]) -> Sections:
    """What sits at ``loc`` under ``root``: a section's model, ``{name: model}`` for a section with
    variants (a union discriminated by ``name``; the next part of ``loc`` is then the name), or None."""
    current: Sections = root
    for part in map(str, loc):
        if part.startswith("function-"):  # a validator's frame in pydantic's error location, not a key
            continue
        if isinstance(current, dict):
            current = current.get(part)
        elif current is not None:
            field = current.model_fields.get(part)
            current = _section_type(field.annotation) if field else None
    return current


def _section_type(annotation: Any) -> Sections:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    members = get_args(annotation)
    if members and all(
        isinstance(m, type) and issubclass(m, BaseModel) and "name" in m.model_fields for m in members
    ):
        # a union tagged by Literal names; a list of named entries (eval.datasets) has no tags
        return {tag: m for m in members for tag in get_args(m.model_fields["name"].annotation)} or None
    return None


def drop_keys_of_other_variant(
    section: dict[str, Any],
    section_loc: tuple[str, ...],
    name: str,
    root: type[BaseModel],
    keep: set[str] | frozenset[str] = frozenset(),
) -> None:
    """Switching a variant by ``--set`` drops the old one's keys the new one does not take (``keep``: keys given
    in the same ``--set``, left for validation) – with a warning naming those set to other than the old variant's
    defaults (a setting the switch loses), never silently; defaults (compare's arms switch from them) go quietly."""
    variants = section_at(section_loc, root)
    if not isinstance(variants, dict) or name not in variants or section.get("name") == name:
        return  # not a section with variants, an unknown name, or no switch: validation reports any other key
    accepted = variants[name].model_fields
    dropped = [k for k in section if k not in accepted and k not in keep]
    old = variants.get(str(section.get("name")))
    defaults = {k: f.default for k, f in old.model_fields.items()} if old is not None else {}
    lost = [k for k in dropped if k not in defaults or section[k] != defaults[k]]
    if lost:
        where = ".".join(section_loc)
        _logger.warning(
            "--set %s.name=%s drops %s: settings of %s that %s does not take (YAML with them would be an error)",
            where,
            name,
            ", ".join(f"{key}={section[key]!r}" for key in lost),
            section.get("name", "the default"),
            name,
        )
    for key in dropped:
        del section[key]


def _variant_problem(item: Any, root: type[BaseModel]) -> str:
    """An unknown or missing ``name`` in a section with variants: list the names and their keys."""
    loc = tuple(str(p) for p in item["loc"])
    variants = section_at(loc, root)
    assert isinstance(variants, dict)  # the caller checked
    given = item.get("input")
    if not isinstance(given, dict):
        problem = f"expected a mapping with a 'name', got {given!r}"
    elif "name" in given:
        problem = f"unknown name {given['name']!r}"
    else:
        problem = "no 'name' given"
    choices = "; ".join(f"{tag} ({_settings_of(model)})" for tag, model in variants.items())
    example = f"--set '{'.'.join(loc)}={{name: {next(iter(variants))}}}'"
    return f"{problem}; choose one of: {choices}. Example: {example}"


def _settings_of(model: type[BaseModel]) -> str:
    return ", ".join(k for k in model.model_fields if k != "name") or "no settings"


def _other_variants_hint(key: str, section_loc: tuple[Any, ...], root: type[BaseModel]) -> str:
    """For a key of another variant (``eps_high`` under ``loss: {name: sapo}``): which variants take it and
    how to switch."""
    if len(section_loc) < 2:
        return ""
    variants = section_at(section_loc[:-1], root)
    if not isinstance(variants, dict):
        return ""
    owners = [tag for tag, model in variants.items() if key in model.model_fields]
    if not owners:
        return ""
    path = ".".join(map(str, section_loc[:-1]))
    return (
        f"; {key!r} is a setting of {path} {' / '.join(owners)}, not {section_loc[-1]}: to switch, "
        f"--set {path}.name={owners[0]}"
    )
