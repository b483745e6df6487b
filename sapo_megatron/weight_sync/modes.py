"""The ``tensor`` and ``disk`` weight-sync modes (``distributed`` lives in :mod:`.distributed`)."""

from __future__ import annotations

import abc
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from sapo_megatron.model.arch import QwenArch
from sapo_megatron.rollout.base import RolloutEngine
from sapo_megatron.weight_sync.hf_export import DEFAULT_BUCKET_BYTES, bucket_bytes_of, export_hf, hf_buckets


class WeightSync(abc.ABC):
    """Pushes the trainer's weights to the rollout engine. The engine object lives on the main rank only
    (``None`` elsewhere); :meth:`push` is a collective that every rank calls."""

    def __init__(self, engine: RolloutEngine | None, arch: QwenArch) -> None:
        self.engine, self.arch = engine, arch
        self.version = 0
        self.on_bucket: Callable[[list[tuple[str, torch.Tensor]]], None] | None = (
            None  # sees each bucket sent
        )

    @property
    def is_main(self) -> bool:
        return self.engine is not None

    def push(self, module: torch.nn.Module) -> dict[str, float]:
        """Collective: send the current weights; returns metrics on the main rank (``{}`` elsewhere)."""
        start = time.perf_counter()
        self.version += 1
        sent_bytes = self._push(module)
        if not self.is_main:
            return {}
        return {
            "time/weight_sync_s": time.perf_counter() - start,
            "weight_sync/bytes": float(sent_bytes),
            "weight_sync/version": float(self.version),
        }

    @abc.abstractmethod
    def _push(self, module: torch.nn.Module) -> int:
        """Send the weights; return the bytes sent from this rank."""

    def close(self) -> None:  # noqa: B027 - modes without resources need no close
        """Release groups and files."""


class TensorSync(WeightSync):
    """Buckets of HF-named tensors handed to a colocated engine (``update_weights_from_tensors``)."""

    def __init__(
        self, engine: RolloutEngine | None, arch: QwenArch, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> None:
        super().__init__(engine, arch)
        self.bucket_bytes = bucket_bytes

    def _push(self, module: torch.nn.Module) -> int:
        sent = 0
        for bucket in hf_buckets(module, self.arch, self.bucket_bytes):
            if self.engine is not None and bucket:
                if self.on_bucket is not None:
                    self.on_bucket(bucket)
                self.engine.update_weights_from_tensors(bucket)
                sent += bucket_bytes_of(bucket)
        if self.engine is not None:
            self.engine.finish_weight_update()
        return sent


class DiskSync(WeightSync):
    """An HF checkpoint per version under ``staging_dir`` (absolute, on a filesystem every worker reads),
    published atomically, loaded by every worker (``update_weights_from_disk``); older versions are removed."""

    def __init__(
        self, engine: RolloutEngine | None, arch: QwenArch, *, staging_dir: str | Path, tokenizer=None
    ) -> None:
        super().__init__(engine, arch)
        self.staging_dir = Path(staging_dir).absolute()
        self.tokenizer = tokenizer

    def version_dir(self, version: int) -> Path:
        return self.staging_dir / f"v{version:06d}"

    def _push(self, module: torch.nn.Module) -> int:
        path = self.version_dir(self.version)
        export_hf(module, self.arch, path, tokenizer=self.tokenizer, is_main=self.is_main)
        if self.engine is None:
            return 0
        self.engine.update_weights_from_disk(str(path))
        self._remove_older_versions(keep=path)
        return sum(f.stat().st_size for f in path.iterdir() if f.is_file())

    def _remove_older_versions(self, keep: Path) -> None:
        for old in self.staging_dir.glob("v[0-9]*"):
            if old != keep and old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
