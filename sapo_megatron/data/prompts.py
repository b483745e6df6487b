"""Prompt datasets (jsonl or parquet) and a resumable, deterministically shuffled iterator over them.

A row has ``prompt`` (str), ``ground_truth`` (str) and optionally ``domain`` (str or null); other keys are ignored.
A bad row is an error that names the file and the line (jsonl, 1-based) or the row index (parquet, 0-based).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sapo_megatron.errors import UserError


class DatasetError(UserError, ValueError):
    """A prompt file or row that cannot be used."""


@dataclasses.dataclass(frozen=True)
class PromptRow:
    """One prompt: ``prompt`` is text or a list of chat messages ``{role, content}``; ``domain`` is its source
    (MOPD domain, per-source metrics); ``metadata`` goes to rewards as is; ``response`` is an SFT target;
    ``prompt_ids`` are set when the length policy truncated the prompt (the ids the engine then receives);
    ``images`` are :class:`~sapo_megatron.data.images.ImageRef`, one per ``<image>`` of the prompt, in order."""

    prompt: str | list[dict[str, str]]
    ground_truth: str
    domain: str | None = None
    metadata: Any = None
    response: str | list[dict[str, Any]] | None = None
    """An SFT target: a string, or a messages-form conversation (:mod:`sapo_megatron.data.conversation`)."""
    prompt_ids: tuple[int, ...] | None = None
    images: tuple[Any, ...] = ()
    columns: dict[str, Any] | None = dataclasses.field(default=None, compare=False, repr=False)
    """The dataset row's top-level columns other than the prompt (TRL-style rewards get them)."""


def save_jsonl(rows: Sequence[PromptRow], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            record = {"prompt": row.prompt, "ground_truth": row.ground_truth, "domain": row.domain}
            record.update({k: v for k in ("metadata", "response") if (v := getattr(row, k)) is not None})
            f.write(json.dumps(record) + "\n")
    return path


def _relative_hint(path: Path) -> str:
    return "" if path.is_absolute() else f" (relative to the current directory {Path.cwd()})"


def _jsonl_lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of the non-blank lines of a jsonl file, 1-based: the lines that hold rows."""
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DatasetError(
                    f"{path}:{line_no}: not UTF-8 text (byte {raw[exc.start]:#04x} at column {exc.start + 1})"
                ) from None
            if line.strip():
                yield line_no, line


def _fingerprint(rows: Sequence[PromptRow]) -> str:
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps([row.prompt, row.ground_truth, row.domain]).encode())
        if row.images:  # text rows keep the fingerprints of checkpoints written before images existed
            digest.update(" ".join(image.digest for image in row.images).encode())
    return digest.hexdigest()[:16]


class PromptIterator:
    """Batches of prompt rows, epoch after epoch, in a shuffled order fixed by ``(seed, epoch)``.

    ``next(it)`` gives ``batch_size`` rows, ``it.take(n)`` the next ``n`` (dynamic sampling's refills); both
    run across epoch boundaries and consume rows in the same single order, so no row is skipped.
    ``state_dict()`` records where the next row is; an iterator given that state with ``load_state_dict``
    yields exactly the rows the original would have.
    ``num_epochs=None`` iterates forever.

    Thread-safe: the fully-async producer's chunks in flight draw their prompts and refills concurrently; each
    ``take`` is one atomic draw, and ``state_dict`` / ``load_state_dict`` see no draw half done.
    """

    def __init__(
        self,
        rows: Sequence[PromptRow],
        *,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        num_epochs: int | None = None,
    ) -> None:
        if not rows:
            raise ValueError("PromptIterator: no rows")
        if batch_size < 1:
            raise ValueError(f"PromptIterator: batch_size must be >= 1, got {batch_size}")
        self.rows = list(rows)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.num_epochs = num_epochs
        self.epoch = 0
        self.position = 0  # index into this epoch's order of the next row
        self._fingerprint = _fingerprint(self.rows)
        self._order_epoch = -1
        self._order: np.ndarray = np.arange(len(self.rows))
        self._lock = threading.Lock()

    def order(self, epoch: int) -> np.ndarray:
        """Row indices of ``epoch`` in iteration order."""
        if not self.shuffle:
            return np.arange(len(self.rows))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))

    def __iter__(self) -> Iterator[list[PromptRow]]:
        return self

    def __next__(self) -> list[PromptRow]:
        batch = self.take(self.batch_size)
        if not batch:
            raise StopIteration
        return batch

    def take(self, n: int) -> list[PromptRow]:
        """The next ``n`` rows, continuing the epoch (and the next ones); fewer only when ``num_epochs`` runs
        out. ``state_dict()`` afterwards points just past them, so a resumed iterator continues exactly."""
        if n < 0:
            raise ValueError(f"PromptIterator.take: n must be >= 0, got {n}")
        with self._lock:
            return self._take(n)

    def _take(self, n: int) -> list[PromptRow]:
        rows: list[PromptRow] = []
        while len(rows) < n:
            if self.position >= len(self.rows):
                self.epoch += 1
                self.position = 0
            if self.num_epochs is not None and self.epoch >= self.num_epochs:
                break
            if self._order_epoch != self.epoch:
                self._order, self._order_epoch = self.order(self.epoch), self.epoch
            count = min(n - len(rows), len(self.rows) - self.position)
            rows.extend(self.rows[i] for i in self._order[self.position : self.position + count])
            self.position += count
        return rows

    def state_dict(self) -> dict[str, Any]:
        with self._lock:
            return self._state()

    def _state(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "batch_size": self.batch_size,
            "num_rows": len(self.rows),
            "fingerprint": self._fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; refuses a state saved for other rows, seed or shuffling."""
        expected = {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_rows": len(self.rows),
            "fingerprint": self._fingerprint,
        }
        for key, value in expected.items():
            if state.get(key) != value:
                raise DatasetError(
                    f"cannot resume the prompt order: the checkpoint was saved with {key}={state.get(key)!r}, this "
                    f"run has {value!r} (different prompt data, seed or shuffling); resuming would not continue "
                    "the same sequence",
                    hint="resume with the data files and seed the checkpoint was written with, or start a new run",
                )
        if not 0 <= int(state["position"]) <= len(self.rows):
            raise ValueError(f"PromptIterator.load_state_dict: position {state['position']} out of range")
        with self._lock:
            self.epoch = int(state["epoch"])
            self.position = int(state["position"])


def fill_template(template: str, prompt: str) -> str:
    """``template`` with each ``{prompt}`` replaced by ``prompt``; every other brace is literal (``\\boxed{}``)."""
    return template.replace("{prompt}", prompt)


def check_encodable(
    rows: Sequence[PromptRow], tokenizer: Any, source: str, *, template: str = "{prompt}"
) -> None:
    """Raise :class:`~sapo_megatron.data.tokenizer.TokenizerError` naming the first row whose prompt (as
    formatted by ``template``) or ground truth (the SFT target) the tokenizer cannot encode.

    ``source`` is where ``rows`` came from: a jsonl file (the error then gives ``file:line``), a parquet file
    (``file row i``) or another name (``name row i``). Only tokenizers that can refuse text (the char
    tokenizer: ``first_unknown``) are checked; an HF tokenizer maps anything to some ids.
    """
    from sapo_megatron.data.tokenizer import TokenizerError

    first_unknown = getattr(tokenizer, "first_unknown", None)
    if first_unknown is None:
        return
    for index, row in enumerate(rows):
        for field, text in (
            ("prompt", fill_template(template, row.prompt) if isinstance(row.prompt, str) else ""),
            ("ground_truth", row.ground_truth),
        ):
            unknown = first_unknown(text)
            if unknown is None:
                continue
            position, char = unknown
            raise TokenizerError(
                f"{_row_location(source, index)}: {field} {text!r} has the character {char!r} (position "
                f"{position}), which the char tokenizer cannot encode",
                hint=f"it knows only {tokenizer.chars!r}; remove such rows or set data.tokenizer to a "
                "tokenizer that covers them",
            )


def _row_location(source: str, index: int) -> str:
    """``file:line`` of row ``index`` of a jsonl file (blank lines hold no row), else ``source row index``."""
    path = Path(source)
    if path.suffix.lower() in (".jsonl", ".json") and path.is_file():
        for row_index, (line_no, _) in enumerate(_jsonl_lines(path)):
            if row_index == index:
                return f"{path}:{line_no}"
    return f"{source} row {index}"
