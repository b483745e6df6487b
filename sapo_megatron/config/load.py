"""From a YAML file (or the embedded default) and ``--set`` overrides to a validated :class:`RunConfig`: read
within limits (:mod:`.yaml_io`), old keys mapped to their new names with a warning (:mod:`.deprecated`),
relative paths resolved, ``"auto"`` model sizes filled from the data, validated with one line per problem
(:mod:`.messages`), the layout checked (:mod:`.layout`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from sapo_megatron.config.deprecated import migrate_old_keys
from sapo_megatron.config.layout import validate_layout
from sapo_megatron.config.messages import format_validation_error
from sapo_megatron.config.run import RunConfig
from sapo_megatron.config.yaml_io import read_yaml, set_dotted
from sapo_megatron.data.datasets import DatasetKeys
from sapo_megatron.errors import ConfigError
from sapo_megatron.eval.config import refuse_old_eval_keys
from sapo_megatron.model.arch import ArchError


def load_config(
    path: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    *,
    world_size: int | None = None,
    check_layout: bool = True,
) -> RunConfig:
    """Load, resolve and validate a YAML run config (or the embedded default when ``path`` is None). The layout
    is checked against ``world_size`` when given (dry run, planner), else against ``launch.*``; not at all with
    ``check_layout=False`` (the planner's layout search replaces it)."""
    if path is None:
        from sapo_megatron.defaults import embedded_default_dict

        raw, base_dir = embedded_default_dict(), Path.cwd()
    else:
        raw, base_dir = read_yaml(Path(path)), Path(path).resolve().parent
    apply_overrides(raw, overrides or {})
    resolve_relative_paths(raw, base_dir)
    return config_from_dict(
        raw, world_size=world_size, check_layout=check_layout, source=str(path or "the embedded default")
    )


def apply_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> None:
    """Set each ``{dotted key: value}`` of ``--set`` in the raw config (see :func:`.yaml_io.set_dotted`)."""
    for dotted, value in overrides.items():
        set_dotted(raw, dotted, value, RunConfig)


def config_from_dict(
    raw: dict[str, Any],
    *,
    world_size: int | None = None,
    check_layout: bool = True,
    source: str = "the config",
) -> RunConfig:
    """Validate a config mapping; raise :class:`ConfigError` with one readable line per problem. The layout is
    checked against ``world_size`` when given, else against ``launch.nodes × launch.procs_per_node``. Keys of
    the previous release are mapped to their new names, one warning each naming ``source``."""
    refuse_old_eval_keys(raw)
    raw = migrate_old_keys(raw, source)
    try:
        raw = fill_auto_sizes(raw)
        cfg = RunConfig.model_validate(raw)
        cfg.model.arch  # noqa: B018 - parse the HF config now, not after process groups exist
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, RunConfig)) from None
    except ArchError as err:
        raise ConfigError(f"model.hf_config: {err}") from None
    if check_layout:
        validate_layout(cfg, world_size or cfg.launch.world_size)
    return cfg


TINY = "tiny"
"""``model.hf_config: tiny``: the embedded demo's architecture with its sizes following the data."""
TINY_VL = "tiny_vl"
"""``model.hf_config: tiny_vl``: the CPU VL demo's architecture with its ids and sizes following the data."""


def fill_auto_sizes(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with ``model.hf_config: tiny`` (``tiny_vl``) expanded and the ``"auto"`` sizes of an inline ``model.hf_config``
    taken from the tokenizer and the prompts (:mod:`sapo_megatron.data.sizing`); unchanged without any."""
    from sapo_megatron.data.sizing import CONTEXT_FIELD, auto_fields, token_sizes
    from sapo_megatron.data.tokenizer import load_tokenizer

    model: dict[str, Any] = raw["model"] if isinstance(raw.get("model"), dict) else {}
    if model.get("hf_config") == TINY:
        from sapo_megatron.defaults import tiny_model

        model = {**model, "hf_config": tiny_model()}
        raw = {**raw, "model": model}
    data: dict[str, Any] = raw["data"] if isinstance(raw.get("data"), dict) else {}
    if model.get("hf_config") == TINY_VL:
        return _fill_tiny_vl(raw, model, str(data.get("tokenizer", "char")))
    fields = auto_fields(model.get("hf_config"))
    if not fields:
        return raw
    tokenizer = load_tokenizer(str(data.get("tokenizer", "char")))
    hf = {**model["hf_config"], **token_sizes(tokenizer, fields)}
    hf = {key: value for key, value in hf.items() if value is not None}
    if CONTEXT_FIELD in fields:
        hf[CONTEXT_FIELD] = 1 << 20  # provisional: the prompts are measured with the validated settings
        hf[CONTEXT_FIELD] = _measured_context({**raw, "model": {**model, "hf_config": hf}}, tokenizer)
    return {**raw, "model": {**model, "hf_config": hf}}


def _fill_tiny_vl(raw: dict[str, Any], model: dict[str, Any], tokenizer_spec: str) -> dict[str, Any]:
    """``model.hf_config: tiny_vl``: :data:`~sapo_megatron.defaults.DEMO_VL_MODEL` with the image token ids and
    vocabulary of ``data.tokenizer`` (a VL tokenizer folder) and the context the prompts (images expanded) need."""
    from sapo_megatron.data.sizing import CONTEXT_FIELD
    from sapo_megatron.data.tokenizer import load_tokenizer
    from sapo_megatron.data.vision import PROCESSOR_FILE
    from sapo_megatron.data.vl_demo import vl_model_ids
    from sapo_megatron.defaults import DEMO_VL_MODEL

    if not (Path(tokenizer_spec) / PROCESSOR_FILE).is_file():
        raise ConfigError(
            f"model.hf_config: tiny_vl needs data.tokenizer to be a VL tokenizer folder (the image tokens and "
            f"{PROCESSOR_FILE}); {tokenizer_spec!r} is not one",
            hint="write one with `python -m sapo_megatron.data.vl_demo OUT --tokenizer-only [--base qwen3]` and "
            "set data.tokenizer: OUT/tokenizer",
        )
    tokenizer = load_tokenizer(tokenizer_spec)
    ids = vl_model_ids(tokenizer_spec)
    text = {
        **DEMO_VL_MODEL["text_config"],
        "vocab_size": ids.pop("vocab_size"),
        "eos_token_id": tokenizer.eos_id,
    }
    text[CONTEXT_FIELD] = 1 << 20  # provisional: the prompts are measured with the validated settings
    hf = {**DEMO_VL_MODEL, **ids, "text_config": text}
    text[CONTEXT_FIELD] = _measured_context({**raw, "model": {**model, "hf_config": hf}}, tokenizer)
    return {**raw, "model": {**model, "hf_config": hf}}


def _measured_context(raw: dict[str, Any], tokenizer: Any) -> int:
    """The context ``raw``'s prompts (with tools and images), responses and SFT sequences need."""
    from sapo_megatron.data.sizing import context_size, measured_context
    from sapo_megatron.data.tool_schemas import prompt_tool_schemas
    from sapo_megatron.eval.config import resolve_datasets

    cfg = RunConfig.model_validate(raw)
    sources: list[tuple[str, DatasetKeys, int | None, int]] = [
        (cfg.data.train, cfg.data, cfg.data.train_size, cfg.rollout.max_new_tokens)
    ]
    sources += [(d.path, d.keys, d.size, d.max_new_tokens) for d in resolve_datasets(cfg)]
    mt = cfg.rollout.multi_turn
    measured = measured_context(
        sources,
        tokenizer,
        digits=cfg.data.digits,
        seed=cfg.seed,
        tools=prompt_tool_schemas(mt),
        sft=cfg.sft.steps > 0,
    )
    episode = mt.max_context_tokens if mt is not None and "max_context_tokens" in mt.model_fields_set else 0
    return max(measured, context_size(episode, 0))  # an episode set to grow longer fits


def resolve_relative_paths(raw: dict[str, Any], base_dir: Path) -> None:
    """``model.hf_config`` and ``model.init_path`` relative to the config file's folder, made absolute."""
    model = raw.get("model")
    if not isinstance(model, dict):
        return
    for key in ("hf_config", "init_path"):
        value = model.get(key)
        if (
            isinstance(value, str)
            and not Path(value).is_absolute()
            and not (key == "hf_config" and value in (TINY, TINY_VL))
        ):
            model[key] = str((base_dir / value).resolve())
