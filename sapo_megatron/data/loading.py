"""The prompt data of a run, built before any process group exists (``train`` and ``train --dry-run`` alike):
tokenizer, prompt renderer and training rows (the eval datasets: sapo_megatron/eval), each row's schema checked and the prompt-length policy
applied, with what was read and done reported on the console.

Without ``data.max_prompt_tokens`` a prompt must still fit the model's context with the longest response:
``model max_position_embeddings - rollout.max_new_tokens`` tokens (what the rollout engine would refuse later).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from sapo_megatron.data.datasets import Dataset, read_dataset
from sapo_megatron.data.prompts import PromptRow, check_encodable
from sapo_megatron.data.render import PromptRenderer, apply_length_policy
from sapo_megatron.data.synthetic import TASKS, Split, make_mixed_rows
from sapo_megatron.data.tokenizer import Tokenizer, load_tokenizer
from sapo_megatron.data.vision import VisionSpec, load_image_processor, vision_spec


@dataclass
class RunData:
    """What :func:`build_run_data` built; ``report`` holds the console lines it printed (or would have)."""

    tokenizer: Any
    renderer: PromptRenderer
    train_rows: list[PromptRow]
    report: list[str] = field(default_factory=list)
    length_counts: dict[str, dict[str, int]] = field(default_factory=dict)
    vision: VisionSpec | None = None


def build_run_data(
    cfg: Any, *, verbose: bool = False, log: Any = None, tools: list[dict[str, Any]] | None = None
) -> RunData:
    """Tokenizer, renderer and rows of ``cfg`` (a :class:`~sapo_megatron.config.RunConfig`). Prints the report
    on rank 0 (``log``, default ``print``): rows kept, filtered and truncated, each file's format; ``verbose`` (the
    dry run) adds rows per source and the time taken. ``tools``: the schemas the prompts show (multi-turn)."""
    data = cfg.data
    tokenizer = build_tokenizer(cfg)
    vision = build_vision(cfg, tokenizer)
    renderer = PromptRenderer(tokenizer, data, vision, tools=tools)
    if tools and renderer.chat and os.environ.get("RANK", "0") == "0":
        _warn_if_tools_ignored(renderer, data.tokenizer)
    out = RunData(tokenizer, renderer, [], vision=vision)
    limit, reason = _context_limit(cfg)
    sources: tuple[tuple[Split, str | None, int], ...] = (("train", data.train, data.train_size),)
    for split, source, size in sources:
        if source is None:
            continue
        started = time.perf_counter()
        rows, dataset = _rows(cfg, source, split, size, vision)
        check_model_takes_images(cfg, rows, f"data.{split}")
        check_encodable(rows, tokenizer, source, template=data.prompt_template)
        read_s = time.perf_counter() - started
        rows, counts = apply_length_policy(rows, renderer, data, source, limit=limit, limit_reason=reason)
        lengths_s = time.perf_counter() - started - read_s
        setattr(out, f"{split}_rows", rows)
        out.length_counts[split] = counts
        out.report.extend(_report(f"data.{split}", source, dataset, counts, read_s, lengths_s, verbose))
    if os.environ.get("RANK", "0") == "0":
        for line in out.report:
            (log or _print)(line)
    return out


def _warn_if_tools_ignored(renderer: PromptRenderer, tokenizer: str) -> str | None:
    """One warning when the chat template renders a prompt the same with and without ``tools=`` (the shipped
    ``chat`` template does): the model then never sees the tool schemas its episodes are meant to call."""
    probe = [{"role": "user", "content": "?"}]
    with_tools = renderer._render(probe, add_generation_prompt=True)
    tools, renderer.tools = renderer.tools, None
    try:
        without = renderer._render(probe, add_generation_prompt=True)
    finally:
        renderer.tools = tools
    if with_tools != without:
        return None
    line = (
        f"the chat template of data.tokenizer={tokenizer!r} ignores tools=: the prompts do not show the tool "
        "schemas (and tool results render as the template's own 'tool' turn); use data.tokenizer: qwen3 (Qwen3's "
        "template) or a tokenizer whose template renders tools (docs/multi_turn.md)"
    )
    import logging

    logging.getLogger(__name__).warning(line)
    return line


def _print(line: str) -> None:
    print(line, flush=True)


def build_tokenizer(cfg: Any) -> Tokenizer:
    """``data.tokenizer``, refused when it has more tokens than the model's vocabulary."""
    from sapo_megatron.errors import ConfigError

    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if tokenizer.vocab_size > cfg.model.arch.vocab_size:
        raise ConfigError(
            f"data.tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
            f"{cfg.model.arch.vocab_size}; use a matching tokenizer or model"
        )
    return tokenizer


def build_vision(cfg: Any, tokenizer: Any) -> VisionSpec | None:
    """The image tokens and processor geometry when ``data.tokenizer`` is a VL model's directory (it has a
    ``preprocessor_config.json``), else None (a dataset with images is then refused, naming its first image)."""
    directory = getattr(tokenizer, "directory", None)
    processor = None if directory is None else load_image_processor(directory)
    return None if processor is None else vision_spec(tokenizer, processor, str(directory))


def check_model_takes_images(cfg: Any, rows: list[PromptRow], field_name: str) -> None:
    """Prompts with images need a VL model: a text model would train on image pads without their pixels."""
    from sapo_megatron.errors import ConfigError

    with_images = sum(1 for row in rows if row.images)
    if with_images and getattr(cfg.model.arch, "vision", None) is None:
        images = sum(len(row.images) for row in rows)
        raise ConfigError(
            f"{field_name}: {with_images} prompts have images ({images} images, all read and checked), but "
            "model.hf_config is a text model, which cannot see them",
            hint="set model.hf_config to a Qwen3-VL model's config, or use a dataset without images",
        )


def _context_limit(cfg: Any) -> tuple[int, str | None]:
    """The longest prompt the rollout engine takes, and where the limit comes from (None: data.max_prompt_tokens)."""
    from sapo_megatron.errors import ConfigError

    context = cfg.model.arch.max_position_embeddings
    new_tokens = cfg.rollout.max_new_tokens
    limit = context - new_tokens
    if limit < 1:
        raise ConfigError(
            f"rollout.max_new_tokens={new_tokens} leaves no room for a prompt in the model's context "
            f"(max_position_embeddings={context})",
            hint="lower rollout.max_new_tokens",
        )
    asked = cfg.data.max_prompt_tokens
    if asked is not None and asked > limit:
        raise ConfigError(
            f"data.max_prompt_tokens={asked} + rollout.max_new_tokens={new_tokens} exceeds the model's context "
            f"(max_position_embeddings={context})",
            hint=f"set data.max_prompt_tokens to at most {limit} or lower rollout.max_new_tokens",
        )
    reason = f"the model's context for a prompt: max_position_embeddings={context} - rollout.max_new_tokens={new_tokens}"
    return limit, None if asked is not None else reason


def _rows(
    cfg: Any, source: str, split: Split, size: int, vision: VisionSpec | None
) -> tuple[list[PromptRow], Dataset | None]:
    if not source.startswith("synthetic:"):
        policy = None
        if vision is not None:
            policy = cfg.data.image_policy(vision.factor, vision.min_pixels, vision.max_pixels)
        dataset = read_dataset(source, cfg.data, policy)
        return dataset.rows, dataset
    from sapo_megatron.errors import ConfigError

    tasks = source.removeprefix("synthetic:").split("+")
    unknown = [task for task in tasks if task not in TASKS]
    if unknown:
        raise ConfigError(
            f"data source {source!r}: unknown synthetic task {unknown[0]!r}; the tasks are "
            f"{', '.join(TASKS)}, mixed with '+' (e.g. 'synthetic:addition+multiplication')"
        )
    return make_mixed_rows(tasks, size, digits=cfg.data.digits, split=split, seed=cfg.seed), None


def _report(
    field_name: str,
    source: str,
    dataset: Dataset | None,
    counts: dict[str, int],
    read_s: float,
    lengths_s: float,
    verbose: bool,
) -> list[str]:
    dropped = f", {counts['filtered']} filtered" if counts["filtered"] else ""
    cut = f", {counts['truncated']} truncated on the left" if counts["truncated"] else ""
    lines = [
        f"{field_name} {source}: {counts['kept']} prompts{dropped}{cut}, longest prompt {counts['longest']} "
        f"tokens"
    ]
    if dataset is not None:  # which format each file was read as (auto says why)
        lines.extend(dataset.describe() if verbose else dataset.describe()[:-1])
    if verbose:
        lines.append(
            f"  read and checked every row's schema in {read_s:.2f} s, prompt lengths in {lengths_s:.2f} s"
        )
    return lines
