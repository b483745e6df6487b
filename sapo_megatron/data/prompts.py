"""Prompt datasets (jsonl or parquet) and a resumable, deterministically shuffled iterator over them.

A row has ``prompt`` (str), ``ground_truth`` (str) and optionally ``domain`` (str or null); other keys are ignored.
A bad row is an error that names the file and the line (jsonl, 1-based) or the row index (parquet, 0-based).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sapo_megatron.errors import UserError


class DatasetError(UserError, ValueError):
    """A prompt file or row that cannot be used."""


@dataclasses.dataclass(frozen=True)
class PromptRow:
    prompt: str
    ground_truth: str
    domain: str | None = None


def load_prompts(path: str | Path) -> list[PromptRow]:
    """Read ``.jsonl`` (one JSON object per line; blank lines are skipped) or ``.parquet``."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        rows = _load_jsonl(path)
    elif suffix == ".parquet":
        rows = _load_parquet(path)
    else:
        raise DatasetError(f"{path}: unknown prompt file type {suffix!r} (expected .jsonl or .parquet)")
    if not rows:
        raise DatasetError(f"{path}: no rows")
    return rows


def save_jsonl(rows: Sequence[PromptRow], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(dataclasses.asdict(row)) + "\n")
    return path


def _row(record: Any, where: str) -> PromptRow:
    if not isinstance(record, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for key in ("prompt", "ground_truth"):
        if key not in record:
            raise DatasetError(f"{where}: missing field {key!r}")
        if not isinstance(record[key], str):
            raise DatasetError(f"{where}: field {key!r} must be a string, got {type(record[key]).__name__}")
    domain = record.get("domain")
    if domain is not None and not isinstance(domain, str):
        raise DatasetError(f"{where}: field 'domain' must be a string or null, got {type(domain).__name__}")
    return PromptRow(prompt=record["prompt"], ground_truth=record["ground_truth"], domain=domain)


def _load_jsonl(path: Path) -> list[PromptRow]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from exc
            rows.append(_row(record, where))
    return rows


def _load_parquet(path: Path) -> list[PromptRow]:
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
    for key in ("prompt", "ground_truth"):
        if key not in table.column_names:
            raise DatasetError(f"{path}: missing column {key!r} (columns: {table.column_names})")
    return [_row(record, f"{path} row {index}") for index, record in enumerate(table.to_pylist())]


def _fingerprint(rows: Sequence[PromptRow]) -> str:
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps([row.prompt, row.ground_truth, row.domain]).encode())
    return digest.hexdigest()[:16]


class PromptIterator:
    """Batches of prompt rows, epoch after epoch, in a shuffled order fixed by ``(seed, epoch)``.

    Batches run across epoch boundaries (no row is dropped). ``state_dict()`` records where the next batch starts;
    an iterator given that state with ``load_state_dict`` yields exactly the batches the original would have.
    ``num_epochs=None`` iterates forever.
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

    def order(self, epoch: int) -> np.ndarray:
        """Row indices of ``epoch`` in iteration order."""
        if not self.shuffle:
            return np.arange(len(self.rows))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))

    def __iter__(self) -> Iterator[list[PromptRow]]:
        return self

    def __next__(self) -> list[PromptRow]:
        batch: list[PromptRow] = []
        while len(batch) < self.batch_size:
            if self.position >= len(self.rows):
                self.epoch += 1
                self.position = 0
            if self.num_epochs is not None and self.epoch >= self.num_epochs:
                break
            if self._order_epoch != self.epoch:
                self._order, self._order_epoch = self.order(self.epoch), self.epoch
            take = min(self.batch_size - len(batch), len(self.rows) - self.position)
            batch.extend(self.rows[i] for i in self._order[self.position : self.position + take])
            self.position += take
        if not batch:
            raise StopIteration
        return batch

    def state_dict(self) -> dict[str, Any]:
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
                raise ValueError(
                    f"PromptIterator.load_state_dict: saved {key}={state.get(key)!r} but this iterator has {value!r}; "
                    "resuming would not continue the same sequence"
                )
        if not 0 <= int(state["position"]) <= len(self.rows):
            raise ValueError(f"PromptIterator.load_state_dict: position {state['position']} out of range")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
