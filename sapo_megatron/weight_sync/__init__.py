"""Trainer → rollout engine weight sync, one interface, three modes (``rollout.weight_sync``):

- ``tensor``: the main rank hands buckets of HF-named tensors to an engine that shares its memory: the in-process
  CPU engine, the CPU server in the trainer's process, or SGLang servers colocated on the trainer's GPUs (CUDA IPC).
- ``disk``: the main rank writes an HF checkpoint into a new version directory under an absolute path on a
  filesystem every worker can read, publishes it atomically, asks every worker to load it, and removes older
  versions.
- ``distributed``: each pipeline stage's source rank broadcasts its stage's tensors, bucket by bucket, over a
  process group it shares with every worker (SGLang's ``init_weights_update_group`` +
  ``update_weights_from_distributed``; NCCL on GPUs, gloo on CPUs). Expert shards travel to their stage's source
  one bucket at a time; no rank ever holds the whole model.

Every mode is a collective: every rank calls :meth:`WeightSync.push` (the gathers of sharded weights need them).
"""

from __future__ import annotations

from sapo_megatron.weight_sync.hf_export import (
    DEFAULT_BUCKET_BYTES,
    export_hf,
    hf_buckets,
    write_hf_checkpoint,
)
from sapo_megatron.weight_sync.modes import DiskSync, TensorSync, WeightSync

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DiskSync",
    "TensorSync",
    "WeightSync",
    "export_hf",
    "hf_buckets",
    "write_hf_checkpoint",
]
