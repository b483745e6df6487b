"""Prompt datasets as users have them: jsonl, parquet, a directory or glob of parquet / jsonl shards, with the
column names of this project, of verl or of slime, or the user's own.

:class:`DatasetKeys` says where each field of a :class:`~sapo_megatron.data.prompts.PromptRow` is found. A key is
a column name or a dotted path into nested columns (``reward_model.ground_truth``). ``format`` presets the keys:

=======  ========  ==========================  ===============  ============
format   prompt    label                       source (domain)  metadata
=======  ========  ==========================  ===============  ============
plain    prompt    ground_truth                domain           –
verl     prompt    reward_model.ground_truth   data_source      extra_info
slime    input     label                       –                metadata
=======  ========  ==========================  ===============  ============

(``response_key``, an SFT target, has no preset.)

verl's layout is its RL dataset's (``verl/utils/dataset/rl_dataset.py``: ``prompt`` is a list of chat messages,
``reward_model: {ground_truth, style}``, ``data_source``, ``extra_info``); slime's are the defaults of its
``--input-key`` (``input``) and ``--metadata-key`` (``metadata``) in ``slime/utils/arguments.py``, and the
``label`` its examples pass as ``--label-key`` (which has no default there). ``auto`` (the default)
picks ``verl`` for a file whose first row has ``reward_model.ground_truth`` and ``data_source``, else ``plain``;
:func:`read_dataset` reports the choice per file. A key set explicitly wins over the preset's.

A prompt is a string, or a list of ``{role, content}`` messages (rendered by the tokenizer's chat template, see
:mod:`sapo_megatron.data.render`). A label that is a number is read as its decimal text; a list or object (code
tests, say) as its JSON text. A bad row names the file, the row (jsonl: ``file:line``; parquet: ``file row i``)
and the field.
"""

from __future__ import annotations

import errno
import glob
import json
import math
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sapo_megatron.data.conversation import check_conversation, is_conversation
from sapo_megatron.data.images import ImagePolicy, check_image, image_values
from sapo_megatron.data.prompts import DatasetError, PromptRow, _jsonl_lines, _relative_hint

Format = Literal["auto", "plain", "verl", "slime"]
KEY_FIELDS = ("prompt_key", "label_key", "source_key", "metadata_key", "response_key", "image_key")
IMAGE_PLACEHOLDER = "<image>"
"""Where each image of a row goes in its prompt (verl's and slime's convention), in the images' order."""

PRESETS: dict[str, dict[str, str | None]] = {
    "plain": {
        "image_key": "images",
        "prompt_key": "prompt",
        "label_key": "ground_truth",
        "source_key": "domain",
        "metadata_key": None,
        "response_key": None,
    },
    "verl": {
        "image_key": "images",
        "prompt_key": "prompt",
        "label_key": "reward_model.ground_truth",
        "source_key": "data_source",
        "metadata_key": "extra_info",
        "response_key": None,
    },
    "slime": {
        "image_key": None,
        "prompt_key": "input",
        "label_key": "label",
        "source_key": None,
        "metadata_key": "metadata",
        "response_key": None,
    },
}
"""The keys each ``format`` stands for (a key set in the config replaces its preset's)."""

SUFFIXES = (".jsonl", ".json", ".parquet")
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".zip")
ROLES = ("system", "user", "assistant", "tool")
"""The message roles a prompt may hold (those of the OpenAI chat format that chat templates know)."""


class DatasetKeys(BaseModel):
    """Where a dataset's fields are and how its prompts become token ids (``data.*``; evaluation datasets reuse
    these keys). ``None`` keys take the value of the ``format`` preset."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    format: Format = Field(
        default="auto",
        description="key preset: plain (prompt / ground_truth / domain), verl (prompt messages, "
        "reward_model.ground_truth, data_source, extra_info), slime (input / label / metadata), or auto: verl "
        "when a file has reward_model.ground_truth and data_source, else plain",
    )
    prompt_key: str | None = Field(
        default=None, description="the prompt: a string or a list of chat messages"
    )
    label_key: str | None = Field(
        default=None, description="the reward's label, a dotted path into nested columns allowed"
    )
    source_key: str | None = Field(
        default=None, description="the source (MOPD domain, per-source metrics), e.g. data_source"
    )
    metadata_key: str | None = Field(default=None, description="handed to rewards as is (e.g. test cases)")
    response_key: str | None = Field(default=None, description="an SFT target (default: the label)")
    image_key: str | None = Field(
        default=None,
        description="the row's images (a path, data URI or {bytes, path}, or a list of them; plain and verl: "
        "'images'); each goes where the prompt says <image>",
    )
    multimodal_keys: dict[str, str] | None = Field(
        default=None,
        description="slime's --multimodal-keys, e.g. {image: images}: the column of each modality (image only)",
    )
    image_min_pixels: int | None = Field(
        default=None, ge=1, description="resize smaller images up to this area (default: the processor's)"
    )
    image_max_pixels: int | None = Field(
        default=None, ge=1, description="resize larger images down to this area (default: the processor's)"
    )
    image_max_source_pixels: int = Field(
        default=40_000_000, ge=1, description="refuse an image file larger than this before decoding it"
    )
    image_max_file_bytes: int = Field(default=32 << 20, ge=1, description="refuse a larger image file")
    allow_image_paths_outside: bool = Field(
        default=False,
        description="let image paths leave the dataset file's folder (a dataset is otherwise kept from reading "
        "arbitrary files)",
    )
    apply_chat_template: bool = Field(
        default=False,
        description="render prompts with the HF tokenizer's chat template (add_generation_prompt=True); a "
        "string prompt becomes one user message",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="extra variables of the chat template, e.g. {enable_thinking: false} for Qwen3",
    )
    system_prompt: str | None = Field(
        default=None,
        description="with apply_chat_template: a system message put first (unless a row has one)",
    )
    prompt_template: str = Field(
        default="{prompt}",
        description="text prompts (and chat-template user messages): '{prompt}' is replaced by the prompt, "
        "every other character is literal",
    )
    max_prompt_tokens: int | None = Field(
        default=None, ge=1, description="longest prompt in tokens, as the engine receives it"
    )
    overlong_prompts: Literal["error", "filter", "truncate_left"] = Field(
        default="error",
        description="a prompt over max_prompt_tokens: stop with its row named (error), drop it (filter) or keep "
        "its last max_prompt_tokens tokens (truncate_left)",
    )

    @model_validator(mode="after")
    def _check_multimodal_keys(self) -> DatasetKeys:
        if self.multimodal_keys:
            other = sorted(set(self.multimodal_keys) - {"image"})
            if other:
                raise ValueError(f"data.multimodal_keys: only 'image' is supported, not {other}")
            if self.image_key is not None and self.image_key != self.multimodal_keys.get("image"):
                raise ValueError("data.image_key and data.multimodal_keys.image name different columns")
        return self

    @model_validator(mode="after")
    def _check_chat_settings(self) -> DatasetKeys:
        if not self.apply_chat_template:
            for name in ("system_prompt", "chat_template_kwargs"):
                if getattr(self, name):
                    raise ValueError(
                        f"data.{name} is used by the chat template only: set data.apply_chat_template: true "
                        f"or drop data.{name}"
                    )
        return self

    def resolved(self, fmt: str) -> dict[str, str | None]:
        """The keys for one file read as ``fmt`` (not ``auto``): the preset's, replaced by the ones set here."""
        keys = dict(PRESETS[fmt])
        if self.multimodal_keys and "image" in self.multimodal_keys:
            keys["image_key"] = self.multimodal_keys["image"]
        for name in KEY_FIELDS:
            value = getattr(self, name)
            if value is not None:
                keys[name] = value
        return keys

    def image_policy(self, factor: int, min_pixels: int, max_pixels: int) -> ImagePolicy:
        """The sizing and reading rules of this dataset's images, for an image processor whose merged patch is
        ``factor`` pixels and that itself resizes into ``[min_pixels, max_pixels]``: ``data.image_min_pixels``
        / ``max_pixels`` default to the processor's and must lie within them, so that the processor never
        resizes an image a second time (trainer and engine would then disagree about nothing, but the policy
        would silently not be the one asked for)."""
        low = self.image_min_pixels if self.image_min_pixels is not None else min_pixels
        high = self.image_max_pixels if self.image_max_pixels is not None else max_pixels
        if low < min_pixels or high > max_pixels:
            raise DatasetError(
                f"data.image_min_pixels / image_max_pixels [{low}, {high}] must lie within the image "
                f"processor's [{min_pixels}, {max_pixels}] (its preprocessor_config.json), else it resizes again"
            )
        return ImagePolicy(
            factor=factor,
            min_pixels=low,
            max_pixels=high,
            max_source_pixels=self.image_max_source_pixels,
            max_file_bytes=self.image_max_file_bytes,
            allow_paths_outside=self.allow_image_paths_outside,
        )


@dataclass
class FileReport:
    """What :func:`read_dataset` did with one file."""

    path: Path
    format: str
    why: str
    rows: int


@dataclass
class Dataset:
    """The rows of a dataset source (one path, directory or glob) and how each file was read."""

    source: str
    rows: list[PromptRow]
    files: list[FileReport] = field(default_factory=list)
    seconds: float = 0.0

    def counts_by_source(self) -> dict[str, int]:
        """Rows per source (``data.source_key``); rows without one count under ``"-"``."""
        return dict(sorted(Counter(row.domain or "-" for row in self.rows).items()))

    def describe(self) -> list[str]:
        """Lines for the console: each file's format (and why), rows per source, the time taken."""
        if len(self.files) <= 4:
            lines = [f"  {r.path}: {r.rows} rows, format {r.format} ({r.why})" for r in self.files]
        else:  # many shards: one line per format
            kinds = Counter((r.format, r.why) for r in self.files)
            lines = [f"  {n} files, format {fmt} ({why})" for (fmt, why), n in kinds.items()]
        counts = ", ".join(f"{name}: {n}" for name, n in self.counts_by_source().items())
        images = sum(len(row.images) for row in self.rows)
        checked = f" ({images} images decoded and checked)" if images else ""
        lines.append(f"  {len(self.rows)} rows{checked} in {self.seconds:.2f} s; per source: {counts}")
        return lines


def load_dataset(path: str | Path, keys: DatasetKeys, images: ImagePolicy | None = None) -> list[PromptRow]:
    """The rows of ``path`` (a .jsonl / .parquet file, a directory of them, or a glob), read with ``keys``;
    ``images`` sizes and checks the rows' images (a row with images and no policy is refused)."""
    return read_dataset(path, keys, images).rows


def read_dataset(path: str | Path, keys: DatasetKeys, images: ImagePolicy | None = None) -> Dataset:
    """:func:`load_dataset` with the report of what was read (per-file format, rows, images, time)."""
    started = time.perf_counter()
    rows: list[PromptRow] = []
    reports = []
    for file in dataset_files(path):
        records = list(_records(file))
        if not records:
            raise DatasetError(f"{file}: no rows (the file is empty or holds only blank lines)")
        fmt, why = _choose_format(keys, *records[0])
        resolved = keys.resolved(fmt)
        rows.extend(_row(record, where, resolved, file.parent, images) for where, record in records)
        reports.append(FileReport(file, fmt, why, len(records)))
    return Dataset(str(path), rows, reports, time.perf_counter() - started)


def dataset_files(path: str | Path) -> list[Path]:
    """The files of a dataset source: the file itself, a directory's ``*.parquet`` / ``*.jsonl`` files, or the
    files a glob matches, in sorted order."""
    text = str(path)
    if any(char in text for char in "*?["):
        files = sorted(Path(p) for p in glob.glob(text, recursive=True) if Path(p).is_file())
        if not files:
            raise DatasetError(f"{text}: the pattern matches no file" + _relative_hint(Path(text)))
    elif Path(text).is_dir():
        files = sorted(p for p in Path(text).iterdir() if p.is_file() and p.suffix.lower() in SUFFIXES)
        if not files:
            raise DatasetError(
                f"{text} is a directory without .parquet or .jsonl files" + _compressed_hint(text)
            )
    elif Path(text).is_file():
        files = [Path(text)]
    else:
        raise _missing_source(Path(text))
    for file in files:
        if file.suffix.lower() not in SUFFIXES:
            raise DatasetError(
                f"{file}: unknown prompt file type {file.suffix!r} (expected .jsonl or .parquet)"
            )
    return files


def _compressed_hint(directory: str) -> str:
    packed = [p.name for p in Path(directory).iterdir() if p.suffix.lower() in COMPRESSED_SUFFIXES]
    if not packed:
        return ""
    return f" (it holds {len(packed)} compressed file(s), such as {packed[0]}: decompress them first)"


def _missing_source(path: Path) -> DatasetError:
    """ "no such file", or what else is wrong with a path that exists as a name (a dangling or looping link)."""
    if path.is_symlink():
        try:
            path.resolve(strict=True)
        except RuntimeError:  # Python < 3.13 reports a loop this way
            return DatasetError(f"{path}: a symbolic link that loops (it points back at itself)")
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return DatasetError(f"{path}: a symbolic link that loops (it points back at itself)")
            return DatasetError(f"{path}: a symbolic link to {os.readlink(path)}, which does not exist")
    return DatasetError(f"{path}: no such file" + _relative_hint(path))


def row_location(source: str | Path, index: int) -> str:
    """Where row ``index`` of a dataset source is: ``file:line`` (jsonl) or ``file row i`` (parquet); a source
    that is no file (``synthetic:...``) gives ``source row index``. Reads the files again: for error messages."""
    try:
        files = dataset_files(source)
    except DatasetError:
        return f"{source} row {index}"
    for file in files:
        for where, _ in _records(file):
            if index == 0:
                return where
            index -= 1
    return f"{source} row {index}"


def _records(path: Path) -> Iterator[tuple[str, Any]]:
    """``(where, record)`` of each row: ``where`` is ``file:line`` (jsonl) or ``file row i`` (parquet)."""
    if path.suffix.lower() == ".parquet":
        for index, record in enumerate(_parquet_records(path)):
            yield f"{path} row {index}", record
        return
    _check_not_compressed(path)
    if path.suffix.lower() == ".json" and _starts_with(path, b"["):
        yield from _json_array_records(path)
        return
    for line_no, line in _jsonl_lines(path):
        where = f"{path}:{line_no}"
        yield where, _parse_json(line, where)


def _parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:  # json's C reader recurses once per level
        raise DatasetError(f"{where}: the JSON is nested too deeply to read (thousands of levels)") from None


def _starts_with(path: Path, prefix: bytes) -> bool:
    with path.open("rb") as handle:
        head = handle.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(prefix)


def _check_not_compressed(path: Path) -> None:
    with path.open("rb") as handle:
        magic = handle.read(4)
    for prefix, kind in (
        (b"\x1f\x8b", "gzip"),
        (b"BZh", "bzip2"),
        (b"\xfd7zX", "xz"),
        (b"\x28\xb5\x2f\xfd", "zstd"),
    ):
        if magic.startswith(prefix):
            raise DatasetError(
                f"{path}: the file is {kind}-compressed, though its name ends in {path.suffix}",
                hint=f"decompress it first (e.g. {'gunzip -c' if kind == 'gzip' else kind + ' -dc'} FILE > rows.jsonl)",
            )


def _json_array_records(path: Path) -> Iterator[tuple[str, Any]]:
    """A ``.json`` file holding one array of rows (what ``json.dump(rows)`` writes): row ``i`` is ``file item i``."""
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{path}: not UTF-8 text (byte at offset {exc.start})") from None
    records = _parse_json(text, str(path))
    if not isinstance(records, list):
        raise DatasetError(f"{path}: expected a JSON array of rows or one JSON object per line")
    for index, record in enumerate(records):
        yield f"{path} item {index}", record


def _parquet_records(path: Path) -> list[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise DatasetError(
            f"{path}: reading parquet needs pyarrow: pip install 'sapo-megatron[parquet]'"
        ) from exc
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for corrupt files
        raise DatasetError(f"{path}: cannot read parquet: {exc}") from exc
    return _restore_int_columns(table).to_pylist()


def _restore_int_columns(table: Any) -> Any:
    """Integer columns that pandas stored as floats because of a missing value (``[1, None]`` → ``[1.0, NaN]``)
    back to integers with nulls: labels stay as the user gave them ("3", not "3.0"; missing, not "nan")."""
    import pyarrow as pa
    import pyarrow.compute as pc

    for index, column_field in enumerate(table.schema):
        if not pa.types.is_floating(column_field.type):
            continue
        column = table.column(index)
        nan = pc.is_nan(column)
        if not pc.any(nan).as_py():
            continue
        values = pc.if_else(nan, pa.scalar(None, column.type), column)
        if pc.all(pc.equal(pc.floor(values), values)).as_py() is not False:
            table = table.set_column(index, column_field.name, values.cast(pa.int64()))
        else:
            table = table.set_column(index, column_field.name, values)
    return table


def _choose_format(keys: DatasetKeys, where: str, first: Any) -> tuple[str, str]:
    """The format of a file and why (``auto`` looks at its first row)."""
    if keys.format != "auto":
        return keys.format, "data.format"
    if isinstance(first, dict):
        if _has(first, "reward_model.ground_truth") and "data_source" in first:
            return "verl", "auto: it has reward_model.ground_truth and data_source"
        if "prompt" in first and "ground_truth" in first:
            return "plain", "auto: it has prompt and ground_truth"
    if keys.prompt_key is not None and keys.label_key is not None:
        return "plain", "auto: data.prompt_key and data.label_key given"
    columns = (
        ", ".join(sorted(first)) if isinstance(first, dict) else f"a {type(first).__name__}, not an object"
    )
    raise DatasetError(
        f"{where}: cannot tell the file's format (first row's fields: {columns or 'none'}); auto knows verl "
        "(reward_model.ground_truth, data_source) and plain (prompt, ground_truth)",
        hint="set data.format (plain, verl, slime) or the keys data.prompt_key and data.label_key",
    )


_MISSING = object()


def _has(record: dict[str, Any], dotted: str) -> bool:
    return _lookup(record, dotted) is not _MISSING


def _lookup(record: Any, dotted: str) -> Any:
    if isinstance(record, dict) and "." in dotted and dotted in record:
        return record[dotted]  # a flat column named by the dotted path (pandas' json_normalize writes these)
    value = record
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _row(
    record: Any, where: str, keys: dict[str, str | None], folder: Path, policy: ImagePolicy | None
) -> PromptRow:
    if not isinstance(record, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(record).__name__}")
    prompt = _prompt(record, where, keys["prompt_key"])
    label = _label(_required(record, where, keys["label_key"], "label_key"), where, keys["label_key"])
    domain = _optional(record, keys["source_key"])
    if domain is not None and not isinstance(domain, str):
        raise DatasetError(
            f"{where}: field {keys['source_key']!r} (the source) must be a string or null, got "
            f"{type(domain).__name__}"
        )
    response = _optional(record, keys["response_key"])
    if is_conversation(response):  # a messages-form target: assistant turns and tool results
        response = check_conversation(response, where, str(keys["response_key"]))
    elif response is not None and not isinstance(response, str):
        raise DatasetError(
            f"{where}: field {keys['response_key']!r} (the response) must be a string or a list of assistant "
            f"and tool messages, got {type(response).__name__}"
        )
    return PromptRow(
        prompt=prompt,
        ground_truth=label,
        domain=domain,
        metadata=_optional(record, keys["metadata_key"]),
        response=response,
        images=_images(record, where, keys["image_key"], prompt, folder, policy),
        columns=_columns(record, keys["prompt_key"], keys["image_key"]),
    )


def _columns(record: dict[str, Any], prompt_key: str | None, image_key: str | None) -> dict[str, Any]:
    """The row's top-level columns but the prompt's and the images': TRL hands these to its rewards as keyword
    lists (images, possibly megabytes of bytes, are not sent to reward workers)."""
    skip = {(key or "").split(".")[0] for key in (prompt_key, image_key)}
    return {name: value for name, value in record.items() if name not in skip}


def _images(
    record: dict[str, Any],
    where: str,
    key: str | None,
    prompt: str | list[dict[str, str]],
    folder: Path,
    policy: ImagePolicy | None,
) -> tuple:
    """The row's checked images; their number must equal the prompt's ``<image>`` placeholders."""
    values = image_values(_optional(record, key))
    texts = [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt]
    placeholders = sum(text.count(IMAGE_PLACEHOLDER) for text in texts)
    if placeholders != len(values):
        raise DatasetError(
            f"{where}: the prompt has {placeholders} {IMAGE_PLACEHOLDER} placeholders but field {key!r} holds "
            f"{len(values)} images",
            hint=f"put one {IMAGE_PLACEHOLDER} in the prompt where each image goes, in the images' order",
        )
    if not values:
        return ()
    if policy is None:
        raise DatasetError(
            f"{where}: the row has images, and this model has no image processor",
            hint="set data.tokenizer to the VL model's directory (with its preprocessor_config.json)",
        )
    return tuple(check_image(v, f"{where} field {key}[{i}]", folder, policy) for i, v in enumerate(values))


def _required(record: dict[str, Any], where: str, key: str | None, setting: str) -> Any:
    if key is None:
        raise DatasetError(f"{where}: no data.{setting} set for this format")
    value = _lookup(record, key)
    if value is _MISSING:
        fields = ", ".join(sorted(record)) or "none"
        raise DatasetError(
            f"{where}: missing field {key!r} (data.{setting}; the row has: {fields})",
            hint=f"set data.{setting} to the field that holds it, or data.format to the dataset's layout",
        )
    return value


def _optional(record: dict[str, Any], key: str | None) -> Any:
    if key is None:
        return None
    value = _lookup(record, key)
    return None if value is _MISSING else value


def _prompt(record: dict[str, Any], where: str, key: str | None) -> str | list[dict[str, str]]:
    value = _required(record, where, key, "prompt_key")
    value = _messages_in_json_text(value, where, key)
    if isinstance(value, str):
        if not value.strip():
            raise DatasetError(
                f"{where}: field {key!r} (the prompt) is empty",
                hint="drop the row or fill in its prompt: an empty prompt gives the policy nothing to answer",
            )
        return value
    if isinstance(value, list) and value:
        for index, message in enumerate(value):
            if not (
                isinstance(message, dict)
                and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)
            ):
                raise DatasetError(
                    f"{where}: field {key!r} message {index} must be an object with string 'role' and "
                    f"'content', got {message!r:.80}"
                )
        messages = [{"role": m["role"], "content": m["content"]} for m in value]
        _check_roles(messages, where, key)
        return messages
    raise DatasetError(
        f"{where}: field {key!r} (the prompt) must be a string or a non-empty list of {{role, content}} "
        f"messages, got {type(value).__name__}"
    )


def _messages_in_json_text(value: Any, where: str, key: str | None) -> Any:
    """A prompt stored as the JSON text of a message list (a parquet written with ``json.dumps(messages)``) is
    that list: trained as the literal JSON it would teach the policy nothing it is asked."""
    if not (isinstance(value, str) and value.lstrip().startswith("[{")):
        return value
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError):
        return value  # a text prompt that merely starts like JSON
    if isinstance(parsed, list) and parsed and all(isinstance(m, dict) and "role" in m for m in parsed):
        return parsed
    return value


def _check_roles(messages: list[dict[str, str]], where: str, key: str | None) -> None:
    for index, message in enumerate(messages):
        if message["role"] not in ROLES:
            raise DatasetError(
                f"{where}: field {key!r} message {index} has role {message['role']!r}; a role is one of "
                f"{', '.join(ROLES)}"
            )
    if not any(message["role"] == "user" for message in messages):
        roles = ", ".join(message["role"] for message in messages)
        raise DatasetError(
            f"{where}: field {key!r} has no user message (roles: {roles}); the policy would answer nothing",
            hint="a prompt needs at least one user message (a system message alone or an assistant turn "
            "alone is no question)",
        )


def _label(value: Any, where: str, key: str | None) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or value is None:
        raise DatasetError(
            f"{where}: field {key!r} (the label) must be a string, a number, a list or an object, got "
            f"{type(value).__name__}"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise DatasetError(
            f"{where}: field {key!r} (the label) is {value}, not an answer (a missing value in a float column?)",
            hint="drop the row or give its answer",
        )
    if isinstance(value, int | float):
        return str(value)
    try:
        return json.dumps(value, allow_nan=False)
    except ValueError:
        raise DatasetError(
            f"{where}: field {key!r} (the label) holds NaN or Infinity, not standard JSON"
        ) from None
