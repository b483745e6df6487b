"""Sizes of a tiny model that follow its data: ``"auto"`` in an inline ``model.hf_config`` for ``vocab_size``,
``max_position_embeddings`` or the special token ids takes them from the run's tokenizer and prompts.

- ``vocab_size``: the tokenizer's size (the char tokenizer 52, the shipped chat tokenizer 512), padded as the real
  checkpoints are (the real Qwen3 tokenizer, ``data.tokenizer: qwen3``: 151,669 tokens, 151,936 rows);
- ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id``: the tokenizer's (a tokenizer without a bos token, as
  Qwen's, leaves ``bos_token_id`` out);
- ``max_position_embeddings``: the longest prompt of ``data.train`` and of the eval datasets, as the engine
  receives it (with the tool schemas of multi-turn episodes, and each image's tokens when ``data.tokenizer`` is a VL
  tokenizer folder) (``max_prompt_tokens`` where set), plus the longest
  response (``rollout.max_new_tokens``, or an eval dataset's own), and with a warm start (``sft.steps`` > 0) at least
  the longest SFT sequence of ``data.train``, rounded up to a multiple of :data:`CONTEXT_MULTIPLE` (the embedded
  demo's 64 stays 64).

The materialised ``config.yaml`` holds the numbers, so an evaluation or a resume reads them back unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

AUTO = "auto"
TOKEN_FIELDS = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")
CONTEXT_FIELD = "max_position_embeddings"
CONTEXT_MULTIPLE = 64
SYNTHETIC_ROWS = 256


def auto_fields(hf_config: Any) -> list[str]:
    """The fields of an inline HF config that are ``"auto"``."""
    if not isinstance(hf_config, dict):
        return []
    return [key for key in (*TOKEN_FIELDS, CONTEXT_FIELD) if hf_config.get(key) == AUTO]


def token_sizes(tokenizer: Any, fields: Iterable[str]) -> dict[str, int | None]:
    """``fields`` (of :data:`TOKEN_FIELDS`) as the tokenizer has them (``None``: the tokenizer has no such token)."""
    values = {
        "vocab_size": getattr(tokenizer, "padded_vocab_size", tokenizer.vocab_size),
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": tokenizer.eos_id,
        "pad_token_id": tokenizer.pad_id,
    }
    return {key: values[key] for key in fields if key in values}


def context_size(longest_prompt: int, longest_response: int) -> int:
    """The context a model needs for these, rounded up to :data:`CONTEXT_MULTIPLE`."""
    needed = longest_prompt + longest_response
    return max(CONTEXT_MULTIPLE, -(-needed // CONTEXT_MULTIPLE) * CONTEXT_MULTIPLE)


def longest_prompt(rows: list[Any], renderer: Any) -> int:
    """The longest prompt of ``rows`` in tokens, as the engine receives it."""
    return max((len(ids) for ids in renderer.encode_many(rows)), default=0)


SFT_ROWS = 4096
"""Rows whose SFT sequences auto sizing measures (as the start-up check does)."""
THINK_BLOCK_TOKENS = 4
"""Qwen3's empty ``<think>\n\n</think>\n\n``: what the policy writes in a turn the whole rendering leaves bare."""


def longest_sft_sequence(rows: list[Any], renderer: Any) -> int:
    """The longest SFT sequence (prompt + target) of ``rows`` in tokens. A messages-form target is measured as the
    whole conversation rendered, plus :data:`THINK_BLOCK_TOKENS` per assistant turn (an upper bound of the ids
    :mod:`sapo_megatron.rollout.episodes.warm_start` builds; the start-up check measures those exactly)."""
    from sapo_megatron.data.conversation import is_conversation

    longest = 0
    for row in rows:
        if is_conversation(row.response) and renderer.hf is not None:
            text = renderer.render([*renderer.messages(row), *row.response], add_generation_prompt=False)
            turns = sum(m["role"] == "assistant" for m in row.response)
            length = len(renderer.encode_text(text)) + THINK_BLOCK_TOKENS * turns
        else:
            length = sum(map(len, renderer.sft_ids(row)))
        longest = max(longest, length)
    return longest


def measured_context(
    sources: Iterable[tuple[str, Any, int | None, int]],
    tokenizer: Any,
    *,
    digits: int,
    seed: int,
    tools: list[dict[str, Any]] | None = None,
    sft: bool = False,
) -> int:
    """:func:`context_size` over ``sources``: ``(path, keys, rows to read or None for all, max_new_tokens)``
    each (``data.train`` and each eval dataset, with its own keys); ``tools``: the schemas the prompts show
    (multi-turn episodes: the template writes them into the system turn); ``sft``: the first source's rows are
    also SFT targets (``sft.steps`` > 0), whose sequences must fit too (:func:`longest_sft_sequence`)."""
    from sapo_megatron.data.datasets import read_dataset
    from sapo_megatron.data.prompts import DatasetError
    from sapo_megatron.data.render import PromptRenderer
    from sapo_megatron.data.synthetic import TASKS, make_mixed_rows

    vision = _vision(tokenizer)  # a VL tokenizer folder: prompts are measured with their images' tokens
    needed = 0
    for position, (path, keys, size, new_tokens) in enumerate(sources):
        if keys.max_prompt_tokens is not None:  # longer prompts are the length policy's to filter or cut
            needed = max(needed, context_size(keys.max_prompt_tokens, new_tokens))
            continue
        if path.startswith("synthetic:"):
            tasks = path.removeprefix("synthetic:").split("+")
            if any(task not in TASKS for task in tasks):
                continue  # loading the data names the unknown task
            # their lengths depend on the digits only: a few hundred rows hold the longest
            rows = make_mixed_rows(
                tasks, min(size or SYNTHETIC_ROWS, SYNTHETIC_ROWS), digits=digits, seed=seed
            )
        else:
            policy = (
                None
                if vision is None
                else keys.image_policy(vision.factor, vision.min_pixels, vision.max_pixels)
            )
            try:
                rows = read_dataset(path, keys, policy).rows[:size]
            except DatasetError:
                continue  # a missing or bad dataset is named by the input checks and the data load, in train.log
        renderer = PromptRenderer(tokenizer, keys, vision, tools=tools)
        needed = max(needed, context_size(longest_prompt(rows, renderer), new_tokens))
        if sft and position == 0:
            needed = max(needed, context_size(longest_sft_sequence(rows[:SFT_ROWS], renderer), 0))
    return max(needed, CONTEXT_MULTIPLE)


def _vision(tokenizer: Any) -> Any:
    """The tokenizer folder's image tokens and processor (None: a text tokenizer, or no images to size)."""
    from sapo_megatron.data.vision import load_image_processor, vision_spec

    directory = getattr(tokenizer, "directory", None)
    processor = None if directory is None else load_image_processor(directory)
    return None if processor is None else vision_spec(tokenizer, processor, str(directory))
