"""Lazy reading of HF safetensors checkpoints, checked against the architecture before any weight is used."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from sapo_megatron.arch import QwenArch
from sapo_megatron.checkpoint.mapping import MappingError, hf_expected_shapes

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that does not match what it claims to be."""


class HFCheckpointReader:
    """Reads tensors by HF name from ``model.safetensors`` or a sharded ``model-0000x-of-0000y`` set.

    Nothing is loaded until :meth:`get`; :meth:`validate` compares names, shapes and dtypes with the
    architecture using only the safetensors headers.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.weight_map = _weight_map(self.directory)
        self._handles: dict[str, object] = {}

    def names(self) -> list[str]:
        return list(self.weight_map)

    def _handle(self, filename: str):
        if filename not in self._handles:
            self._handles[filename] = safe_open(str(self.directory / filename), framework="pt")
        return self._handles[filename]

    def get(self, name: str) -> torch.Tensor:
        """The tensor stored under ``name``; :class:`MappingError` if there is none."""
        filename = self.weight_map.get(name)
        if filename is None:
            raise MappingError(f"tensor {name!r} is missing from the HF checkpoint {self.directory}")
        return self._handle(filename).get_tensor(name)

    def shape_and_dtype(self, name: str) -> tuple[tuple[int, ...], str]:
        piece = self._handle(self.weight_map[name]).get_slice(name)
        return tuple(piece.get_shape()), piece.get_dtype()

    def validate(self, arch: QwenArch, dtype: str | None = None) -> None:
        """Raise :class:`CheckpointError` naming every missing / unexpected / misshapen tensor."""
        expected = hf_expected_shapes(arch)
        present = set(self.weight_map)
        problems = [
            f"missing tensor {n} (expected shape {expected[n]})" for n in sorted(set(expected) - present)
        ]
        problems += [
            f"unexpected tensor {n} (not part of this architecture)" for n in sorted(present - set(expected))
        ]
        for name in sorted(present & set(expected)):
            shape, stored = self.shape_and_dtype(name)
            if shape != expected[name]:
                problems.append(f"tensor {name} has shape {shape}, the config implies {expected[name]}")
            if dtype is not None and stored != dtype:
                problems.append(f"tensor {name} has dtype {stored}, expected {dtype}")
        if problems:
            head = f"HF checkpoint {self.directory} does not match its config ({len(problems)} problems):\n"
            raise CheckpointError(head + "\n".join(f"  - {p}" for p in problems[:20]))


def _weight_map(directory: Path) -> dict[str, str]:
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            return dict(json.loads(index.read_text())["weight_map"])
        except (json.JSONDecodeError, KeyError) as err:
            raise CheckpointError(f"{index} is not a valid safetensors index: {err}") from err
    single = directory / SINGLE_FILE
    if not single.is_file():
        raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {directory}")
    with safe_open(str(single), framework="pt") as handle:
        return {name: SINGLE_FILE for name in handle.keys()}  # noqa: SIM118 - safe_open has no __iter__
