"""Lazy reading of HF safetensors checkpoints, checked against the architecture before any weight is used."""

from __future__ import annotations

import json
import os
import struct
import threading
from pathlib import Path

import torch
from safetensors import safe_open

from sapo_megatron.checkpoint.fused_experts import FUSED_NAME, ExpertSlice, FusedExpertsError, per_expert_view
from sapo_megatron.checkpoint.mapping import MappingError, hf_expected_shapes
from sapo_megatron.errors import UserError
from sapo_megatron.model.arch import QwenArch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class CheckpointError(UserError, ValueError):
    """A checkpoint that does not match what it claims to be."""


class HFCheckpointReader:
    """Reads tensors by HF name from ``model.safetensors`` or a sharded ``model-0000x-of-0000y`` set.

    Nothing is loaded until :meth:`get`; :meth:`validate` compares names, shapes and dtypes with the
    architecture using only the safetensors headers.

    Fused expert tensors (Qwen3-VL-MoE, either layout: :mod:`~sapo_megatron.checkpoint.fused_experts`) are
    presented under the mapping table's per-expert names; reading one reads that expert's slab of the fused
    tensor (one ``pread``), not the whole tensor.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        check_safetensors_complete(self.directory)
        self.weight_map = _weight_map(self.directory)
        self._handles: dict[str, object] = {}
        self._raw: dict[str, tuple[int, dict, int]] = {}
        self._raw_lock = threading.Lock()
        fused = {n: self._stored_shape_and_dtype(n)[0] for n in self.weight_map if FUSED_NAME.match(n)}
        try:
            self.experts: dict[str, ExpertSlice] = per_expert_view(
                {**dict.fromkeys(self.weight_map, ()), **fused}
            )
        except FusedExpertsError as err:
            raise CheckpointError(f"{self.directory}: {err}") from None
        self._fused = {s.fused for s in self.experts.values()}
        self._last_slab = threading.local()

    def names(self) -> list[str]:
        """Tensor names, fused experts as their per-expert names."""
        return [n for n in self.weight_map if n not in self._fused] + list(self.experts)

    def _expert(self, name: str) -> torch.Tensor:
        piece = self.experts[name]
        key = (piece.fused, piece.expert)
        cached = getattr(self._last_slab, "value", None)
        if (
            cached is None or cached[0] != key
        ):  # gate and up of one expert share a slab: read it once per thread
            info = self._raw_file(self.weight_map[piece.fused])[1][piece.fused]  # pread header: thread-safe
            slab = torch.empty(info["shape"][1:], dtype=_SAFETENSORS_DTYPES[info["dtype"]])
            self.read_rows_into(piece.fused, piece.expert, slab)
            self._last_slab.value = cached = (key, slab)
        return piece.take(cached[1])

    def _handle(self, filename: str):
        if filename not in self._handles:
            self._handles[filename] = safe_open(str(self.directory / filename), framework="pt")
        return self._handles[filename]

    def get(self, name: str) -> torch.Tensor:
        """The tensor stored under ``name``; :class:`MappingError` if there is none."""
        if name in self.experts:
            return self._expert(name)
        filename = self.weight_map.get(name)
        if filename is None:
            raise MappingError(f"tensor {name!r} is missing from the HF checkpoint {self.directory}")
        return self._handle(filename).get_tensor(name)

    def get_unmapped(self, name: str) -> torch.Tensor:
        """Like :meth:`get`, but read with ``pread`` instead of through a memory map.

        Pages read through ``safe_open``'s map stay mapped into this process and count in its resident memory
        (up to the whole checkpoint after a full pass); bytes read here do not. Safe to call from several
        threads at once.
        """
        if name in self.experts:
            return self._expert(name)
        filename = self.weight_map.get(name)
        if filename is None:
            raise MappingError(f"tensor {name!r} is missing from the HF checkpoint {self.directory}")
        fd, header, data_start = self._raw_file(filename)
        info = header[name]
        begin, end = info["data_offsets"]
        dtype, shape = _SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"])
        raw = torch.empty(end - begin, dtype=torch.uint8)
        # numpy's stubs declare ndarray's buffer protocol (__buffer__) for Python >= 3.12 only
        view, done = memoryview(raw.numpy()), 0  # type: ignore[arg-type]
        while done < len(view):
            got = os.preadv(fd, [view[done:]], data_start + begin + done)
            if got == 0:
                raise CheckpointError(f"{self.directory / filename} ends inside tensor {name}")
            done += got
        return raw.view(dtype).reshape(shape) if raw.numel() else torch.empty(shape, dtype=dtype)

    def read_rows_into(self, name: str, first_row: int, out: torch.Tensor) -> None:
        """Read rows ``first_row …`` of tensor ``name`` (rows along dim 0) into the contiguous ``out``, which
        sets how many; one ``pread`` straight into ``out``, no intermediate copy. Thread-safe."""
        if name in self.experts:  # a slice of a fused tensor: read the expert, then copy the rows
            full = self._expert(name)
            out.view(-1).copy_(
                full[first_row : first_row + out.numel() // max(full[0].numel(), 1)].reshape(-1)
            )
            return
        filename = self.weight_map.get(name)
        if filename is None:
            raise MappingError(f"tensor {name!r} is missing from the HF checkpoint {self.directory}")
        fd, header, data_start = self._raw_file(filename)
        info = header[name]
        dtype, shape = _SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"])
        row_numel = 1
        for dim in shape[1:]:
            row_numel *= dim
        if out.dtype != dtype or not out.is_contiguous() or out.numel() % max(row_numel, 1):
            raise ValueError(
                f"{name}: cannot read {dtype} rows of {row_numel} into {out.dtype} {tuple(out.shape)}"
            )
        rows = out.numel() // max(row_numel, 1)
        if first_row < 0 or first_row + rows > (shape[0] if shape else 1):
            raise ValueError(f"{name}: rows {first_row}..{first_row + rows} out of range for shape {shape}")
        offset = data_start + info["data_offsets"][0] + first_row * row_numel * out.element_size()
        # numpy's stubs declare ndarray's buffer protocol (__buffer__) for Python >= 3.12 only
        view, done = memoryview(out.view(-1).view(torch.uint8).numpy()), 0  # type: ignore[arg-type]
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                raise CheckpointError(f"{self.directory / filename} ends inside tensor {name}")
            done += got

    def _raw_file(self, filename: str) -> tuple[int, dict, int]:
        with self._raw_lock:
            if filename not in self._raw:
                fd = os.open(self.directory / filename, os.O_RDONLY)
                (length,) = struct.unpack("<Q", os.pread(fd, 8, 0))
                header = json.loads(os.pread(fd, length, 8))
                self._raw[filename] = (fd, header, 8 + length)
            return self._raw[filename]

    def close(self) -> None:
        """Close the files opened by :meth:`get_unmapped` (memory maps close with the reader)."""
        with self._raw_lock:
            for fd, _, _ in self._raw.values():
                os.close(fd)
            self._raw.clear()

    def open_all(self) -> None:
        """Open every file now (in this thread), so that later :meth:`get` calls from worker threads only read."""
        for filename in sorted(set(self.weight_map.values())):
            self._handle(filename)

    def shape_and_dtype(self, name: str) -> tuple[tuple[int, ...], str]:
        if name in self.experts:
            return self.experts[name].shape, self._stored_shape_and_dtype(self.experts[name].fused)[1]
        return self._stored_shape_and_dtype(name)

    def _stored_shape_and_dtype(self, name: str) -> tuple[tuple[int, ...], str]:
        piece = self._handle(self.weight_map[name]).get_slice(name)
        return tuple(piece.get_shape()), piece.get_dtype()

    def validate(self, arch: QwenArch, dtype: str | None = None) -> None:
        """Raise :class:`CheckpointError` naming every missing / unexpected / misshapen tensor."""
        expected = hf_expected_shapes(arch)
        present = set(self.names())
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


def check_safetensors_complete(directory: str | Path) -> None:
    """Raise :class:`CheckpointError` naming the first safetensors file of ``directory`` whose header is unreadable
    or whose tensor bytes end beyond the file (a truncated copy or download); reads only the headers."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{index} is not a valid safetensors index: {err}") from err
    else:
        names = [SINGLE_FILE] if (directory / SINGLE_FILE).is_file() else []
    for name in names:
        _check_safetensors_file(directory / name)


def _check_safetensors_file(path: Path) -> None:
    hint = "copy or convert the checkpoint again"
    try:
        size = path.stat().st_size
        with open(path, "rb") as file:
            head = file.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
            if length is None or length > size - 8:
                raise CheckpointError(
                    f"{path} is truncated ({size} bytes; its header alone needs more): {hint}"
                )
            header = json.loads(file.read(length))
    except OSError as err:
        raise CheckpointError(f"{path} cannot be read: {err}") from err
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} has a damaged safetensors header ({err}): {hint}") from err
    ends = [
        entry["data_offsets"][1]
        for key, entry in header.items()
        if key != "__metadata__" and isinstance(entry, dict) and len(entry.get("data_offsets", ())) == 2
    ]
    needed = 8 + length + max(ends, default=0)
    if needed > size:
        raise CheckpointError(
            f"{path} is truncated: its header describes {needed} bytes, the file has {size}: {hint}"
        )


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
