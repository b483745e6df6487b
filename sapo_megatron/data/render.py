"""From a :class:`~sapo_megatron.data.prompts.PromptRow` to the exact token ids the rollout engine receives, shared
by training, evaluation and teacher scoring; and the prompt-length policy applied when the data is loaded.

Text prompts (``data.apply_chat_template: false``): ``data.prompt_template`` with ``{prompt}`` replaced (every
other brace is literal), encoded with ``<bos>`` first when the tokenizer has one – the embedded demo's ids.

Chat templates (``data.apply_chat_template: true``): the messages (a string prompt becomes one user message,
through ``prompt_template``; ``data.system_prompt`` goes first unless the row has a system message; a trailing
assistant message is the SFT target, not part of the prompt) rendered by the HF tokenizer's own template,
``apply_chat_template(messages, add_generation_prompt=True, **data.chat_template_kwargs)``, and encoded as
transformers encodes them there (``add_special_tokens=False``: the template writes its special tokens itself).
Refused, with the reason, for the char tokenizer and for an HF tokenizer without a chat template.

Prompts with images (:mod:`sapo_megatron.data.vision`): each ``<image>`` is written as the VL chat templates
write an image, ``<|vision_start|><|image_pad|><|vision_end|>``, and after encoding each image pad is expanded to
the image's token count, so that the ids are the ones the model is trained on; the engines receive these ids and
the images (the SGLang client collapses the pads again: SGLang expands them itself).

:func:`apply_length_policy` measures every prompt: over the limit, ``error`` stops naming the row and its length,
``filter`` drops the row, ``truncate_left`` keeps the prompt's last tokens (verl's ``truncation='left'``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from sapo_megatron.data.conversation import final_answer, is_conversation
from sapo_megatron.data.datasets import IMAGE_PLACEHOLDER, DatasetKeys, row_location
from sapo_megatron.data.prompts import DatasetError, PromptRow, fill_template
from sapo_megatron.data.vision import IMAGE_MARKUP, VisionSpec, pixel_inputs

Messages = list[dict[str, str]]


class ChatTemplateError(DatasetError):
    """A chat template was asked for and this tokenizer cannot apply one."""

    exit_code = 2


class PromptRenderer:
    """``encode(row)``: the prompt ids the engine receives; ``text(row)``: the rendered prompt text;
    ``sft_ids(row)``: ``(prompt ids, target ids)`` of a supervised example (loss on the target only).
    ``tools``: OpenAI function schemas the chat template shows the model (multi-turn episodes with tools)."""

    def __init__(
        self,
        tokenizer: Any,
        keys: DatasetKeys,
        vision: VisionSpec | None = None,
        *,
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.keys = keys
        self.vision = vision
        self.tools = tools or None
        self.chat = keys.apply_chat_template
        self._hf = _chat_tokenizer(tokenizer) if self.chat else None

    @property
    def hf(self) -> Any:
        """The transformers tokenizer whose chat template renders the prompts (None: no chat template)."""
        return self._hf

    def messages(self, row: PromptRow) -> Messages:
        """The prompt as chat messages (system prompt first when set; a trailing assistant turn left out)."""
        messages = _context(row)
        if isinstance(messages, str):
            messages = [{"role": "user", "content": fill_template(self.keys.prompt_template, messages)}]
        if row.images:
            messages = [{**m, "content": _image_markup(m["content"])} for m in messages]
        if self.keys.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.keys.system_prompt}, *messages]
        return messages

    def text(self, row: PromptRow) -> str:
        """The rendered prompt text; an image is one ``<|image_pad|>`` here (:meth:`encode` expands it)."""
        if self._hf is not None:
            return self._render(self.messages(row), add_generation_prompt=True)
        if not isinstance(row.prompt, str):
            raise DatasetError(
                "a prompt of chat messages needs a chat template",
                hint="set data.apply_chat_template: true (with an HF tokenizer that has one)",
            )
        text = fill_template(self.keys.prompt_template, row.prompt)
        return _image_markup(text) if row.images else text

    def encode(self, row: PromptRow) -> list[int]:
        """The prompt ids the model sees (image pads expanded)."""
        if row.prompt_ids is not None:  # truncated by the length policy
            return list(row.prompt_ids)
        return self._expanded(row, self.encode_text(self.text(row)))

    def _expanded(self, row: PromptRow, ids: list[int]) -> list[int]:
        if not row.images:
            if self.vision is not None and self.vision.pad_id in ids:
                raise DatasetError(
                    "a prompt without images holds the image-pad token (its text spells <|image_pad|>): the "
                    "model would read an image that is not there",
                    hint="remove <|image_pad|> from the row's text (images are written as <image>)",
                )
            return ids
        if self.vision is None:
            raise DatasetError(
                "the prompt has images, and the renderer has no image processor",
                hint="set data.tokenizer to the VL model's directory (with its preprocessor_config.json)",
            )
        return self.vision.expand(ids, [image.size for image in row.images])

    def image_inputs(self, row: PromptRow) -> dict[str, Any] | None:
        """The row's ``pixel_values`` / ``image_grid_thw`` from its resized images by the model's own image
        processor, as the engine computes them from the PNGs it receives (None: no images)."""
        if not row.images:
            return None
        if self.vision is None or self.vision.processor is None:
            raise ValueError("a prompt with images needs the VL model's image processor (data.tokenizer)")
        return pixel_inputs(self.vision.processor, [image.load() for image in row.images])

    def encode_text(self, text: str) -> list[int]:
        """Ids of an already rendered prompt text (see :meth:`text`)."""
        if self._hf is not None:
            return self._hf(text, add_special_tokens=False)["input_ids"]
        tok = self.tokenizer
        return tok.encode(text, add_bos=tok.bos_id is not None)

    def encode_many(self, rows: Sequence[PromptRow]) -> list[list[int]]:
        """:meth:`encode` of each row (HF tokenizers encode the batch at once)."""
        if self._hf is None or not rows:
            return [self.encode(row) for row in rows]
        conversations = [self.messages(row) for row in rows]
        # one call renders the batch (a third faster than one by one), with the tools :meth:`encode` shows
        texts = render_chat(self._hf, conversations, True, self._template_kwargs())
        ids = self._hf(texts, add_special_tokens=False)["input_ids"]
        return [
            list(row.prompt_ids) if row.prompt_ids is not None else self._expanded(row, i)
            for row, i in zip(rows, ids)
        ]

    def sft_ids(self, row: PromptRow) -> tuple[list[int], list[int]]:
        """``(prompt ids, target ids)``. The target is the trailing assistant message, else ``response``, else
        the label. With a chat template the target is what the template writes after the generation prompt for
        that assistant turn (its end-of-turn tokens included), so only the assistant turn is trained."""
        prompt_ids = self.encode(row)
        target = _target(row)
        if self._hf is not None:
            # an image row is compared before its pads are expanded: the full render holds one pad per image
            short = self.encode_text(self.text(row)) if row.images and row.prompt_ids is None else prompt_ids
            conversation = [*self.messages(row), {"role": "assistant", "content": target}]
            full = self._hf(self._render(conversation, add_generation_prompt=False), add_special_tokens=False)
            full_ids = full["input_ids"]
            if full_ids[: len(short)] == short and len(full_ids) > len(short):
                return prompt_ids, full_ids[len(short) :]
        return prompt_ids, self.tokenizer.encode(target, add_eos=True)

    def render(self, messages: Messages, *, add_generation_prompt: bool) -> str:
        """``messages`` rendered by the chat template with the run's tools and template arguments."""
        return self._render(messages, add_generation_prompt=add_generation_prompt)

    def _render(self, messages: Messages, *, add_generation_prompt: bool) -> str:
        return render_chat(self._hf, [messages], add_generation_prompt, self._template_kwargs())[0]

    def _template_kwargs(self) -> dict[str, Any]:
        return {**({"tools": self.tools} if self.tools else {}), **self.keys.chat_template_kwargs}


RENDER_TIME_LIMIT_S = 10.0
"""Wall-clock limit of one chat-template call (a batch gets this plus :data:`RENDER_TIME_PER_ROW_S` per row)."""
RENDER_TIME_PER_ROW_S = 0.05
MAX_RENDERED_CHARS = 4_000_000
"""The longest rendered prompt accepted (a 128k-token context is about 500k characters)."""


class _RenderTimeout(Exception):
    pass


def render_chat(
    hf: Any, conversations: list[Messages], add_generation_prompt: bool, kwargs: dict
) -> list[str]:
    """``hf.apply_chat_template`` on each conversation, bounded and checked.

    The template runs in transformers' Jinja sandbox (no file access, no attribute tricks); on top of that a
    template that runs too long (on the main thread: SIGALRM cuts it short), renders an absurd amount of text,
    raises (``raise_exception``, a syntax error, a blocked attribute, a recursive macro), or leaves out the
    user's own text (a template that ignores ``messages`` makes every prompt the same) stops with one line
    saying "the chat template failed" or what it did wrong.
    """
    limit = RENDER_TIME_LIMIT_S + RENDER_TIME_PER_ROW_S * len(conversations)
    try:
        with _time_limit(limit):
            texts = hf.apply_chat_template(
                conversations, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            )
    except _RenderTimeout:
        raise ChatTemplateError(
            f"the chat template ran longer than {limit:g} s for {len(conversations)} prompt(s)",
            hint="fix the template's loops (a chat template renders in milliseconds)",
        ) from None
    except ChatTemplateError:
        raise
    except (
        Exception,
        RecursionError,
    ) as exc:  # Jinja's syntax / security / undefined errors, raise_exception
        reason = " ".join(str(exc).split())[:300] or "no message"
        raise ChatTemplateError(f"the chat template failed: {type(exc).__name__}: {reason}") from None
    for messages, text in zip(conversations, texts):
        _check_rendered(messages, text)
    return list(texts)


def _check_rendered(messages: Messages, text: Any) -> None:
    if not isinstance(text, str):
        raise ChatTemplateError(f"the chat template returned a {type(text).__name__}, not text")
    if len(text) > MAX_RENDERED_CHARS:
        raise ChatTemplateError(
            f"the chat template rendered {len(text)} characters for one prompt (the limit is {MAX_RENDERED_CHARS})",
            hint="check the template for loops that repeat text",
        )
    users = [
        m["content"].strip()
        for m in messages
        if m.get("role") == "user" and isinstance(m.get("content"), str) and m["content"].strip()
    ]
    missing = [content for content in users if content not in text]
    if missing:
        raise ChatTemplateError(
            f"the chat template's output does not contain the user's text {missing[0]!r:.60}: the template "
            f"ignores the messages (it rendered {text!r:.80})",
            hint="use the model's own chat template (tokenizer_config.json chat_template or chat_template.jinja)",
        )


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`_RenderTimeout` in the block after ``seconds`` (main thread only: signals are delivered
    there; elsewhere the block runs unbounded)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise _RenderTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _image_markup(text: str) -> str:
    return text.replace(IMAGE_PLACEHOLDER, IMAGE_MARKUP)


def _context(row: PromptRow) -> str | Messages:
    if isinstance(row.prompt, str):
        return row.prompt
    messages = list(row.prompt)
    if len(messages) > 1 and messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    return messages


def sft_target(row: PromptRow) -> str:
    """The text SFT trains for ``row``: its trailing assistant message, else ``response``, else the label; a
    messages-form ``response`` gives its final answer (the last assistant message: what the reward scores)."""
    if is_conversation(row.response):
        return final_answer(row.response)  # type: ignore[arg-type]
    return _target(row)


def _target(row: PromptRow) -> str:
    if not isinstance(row.prompt, str) and len(row.prompt) > 1 and row.prompt[-1]["role"] == "assistant":
        return row.prompt[-1]["content"]
    if is_conversation(row.response):
        raise DatasetError(
            "a messages-form SFT target is built from its turns (rollout.episodes.warm_start), not as one string"
        )
    return row.response if row.response is not None else row.ground_truth  # type: ignore[return-value]


def _chat_tokenizer(tokenizer: Any) -> Any:
    """The transformers tokenizer behind ``tokenizer``, checked to have a chat template."""
    hf = getattr(tokenizer, "hf", None)
    if hf is None:
        raise ChatTemplateError(
            "data.apply_chat_template: the char tokenizer has no chat template",
            hint="set data.tokenizer to an HF tokenizer directory whose tokenizer has one, or "
            "data.apply_chat_template: false",
        )
    if not getattr(hf, "chat_template", None):
        raise ChatTemplateError(
            f"data.apply_chat_template: the tokenizer in {tokenizer.directory} has no chat template "
            "(no chat_template in tokenizer_config.json, no chat_template.jinja)",
            hint="use the chat model's tokenizer, or data.apply_chat_template: false with data.prompt_template",
        )
    return hf


def apply_length_policy(
    rows: list[PromptRow],
    renderer: PromptRenderer,
    keys: DatasetKeys,
    where: str,
    *,
    limit: int | None = None,
    limit_reason: str | None = None,
) -> tuple[list[PromptRow], dict[str, int]]:
    """Apply ``keys.overlong_prompts`` to the prompts over ``keys.max_prompt_tokens`` (or ``limit``, which then
    comes from ``limit_reason``, e.g. the model's context). Returns the rows kept and the counts ``kept`` /
    ``filtered`` / ``truncated`` / ``longest`` (the longest prompt before the policy). ``where`` is the source
    the rows came from (it names the row in errors)."""
    max_tokens = keys.max_prompt_tokens if keys.max_prompt_tokens is not None else limit
    counts = {"kept": 0, "filtered": 0, "truncated": 0, "longest": 0}
    kept: list[PromptRow] = []
    for index, (row, ids) in enumerate(zip(rows, _all_ids(rows, renderer, where))):
        counts["longest"] = max(counts["longest"], len(ids))
        if max_tokens is None or len(ids) <= max_tokens:
            kept.append(row)
            continue
        if keys.overlong_prompts == "error":
            setting = f"data.max_prompt_tokens={max_tokens}" if limit_reason is None else limit_reason
            raise DatasetError(
                f"{row_location(where, index)}: the prompt is {len(ids)} tokens, over {setting}",
                hint="set data.overlong_prompts: filter (drop such rows) or truncate_left (keep their last "
                "tokens), or raise data.max_prompt_tokens",
            )
        if keys.overlong_prompts == "filter":
            counts["filtered"] += 1
            continue
        if row.images:  # cutting a prompt could cut an image's tokens apart from its pixels
            raise DatasetError(
                f"{row_location(where, index)}: the prompt with images is {len(ids)} tokens, over {max_tokens}, "
                "and a prompt with images is never truncated",
                hint="set data.overlong_prompts: filter, lower data.image_max_pixels, or raise "
                "data.max_prompt_tokens",
            )
        counts["truncated"] += 1
        kept.append(dataclasses.replace(row, prompt_ids=tuple(ids[-max_tokens:])))
    counts["kept"] = len(kept)
    if not kept:
        raise DatasetError(
            f"{where}: every prompt is longer than {max_tokens} tokens (the longest: {counts['longest']}); "
            "none is left to train on",
            hint="raise data.max_prompt_tokens or use data.overlong_prompts: truncate_left",
        )
    return kept, counts


def _all_ids(rows: list[PromptRow], renderer: PromptRenderer, where: str, chunk: int = 1024):
    """Each row's prompt ids, encoded in chunks; a row that cannot be rendered is named."""
    for start in range(0, len(rows), chunk):
        part = rows[start : start + chunk]
        try:
            yield from renderer.encode_many(part)
        except DatasetError:
            for offset, row in enumerate(part):  # find the row and name it
                try:
                    renderer.encode(row)
                except DatasetError as err:
                    raise DatasetError(
                        f"{row_location(where, start + offset)}: {err}", hint=err.hint
                    ) from err
            raise
