"""Per-rank bodies of the weight-sync layout tests (imported by spawned workers): a Megatron trainer under a
parallel layout pushes its weights to a CPU server in another process, recording what each rank sent."""

from __future__ import annotations

from typing import Any

from sapo_megatron.config import config_from_dict
from sapo_megatron.megatron.parallel import init_parallel
from sapo_megatron.megatron.train_step import TrainEngine
from sapo_megatron.rollout.sglang.client import SGLangClient
from sapo_megatron.weight_sync import TensorSync, distributed


class RecordingEngine:
    """A stand-in engine that records the buckets handed to it (tensor mode)."""

    def __init__(self) -> None:
        self.buckets: list[list[tuple[str, int]]] = []
        self.finished = 0

    def update_weights_from_tensors(self, named):
        self.buckets.append([(name, t.numel() * t.element_size()) for name, t in named])

    def finish_weight_update(self, *, flush_cache: bool = True) -> None:
        self.finished += 1


def _engine(payload: dict[str, Any]):
    hf_dir = payload["hf_dir"]
    cfg = config_from_dict(
        {
            "model": {"hf_config": hf_dir, "init": "hf", "init_path": hf_dir},
            "parallel": payload["parallel"],
            "launch": {"procs_per_node": payload["world"]},
        }
    )
    info = init_parallel(cfg.parallel, seed=0, cfg=cfg)
    return cfg, info, TrainEngine(cfg)


def distributed_push(payload: dict[str, Any]) -> dict[str, Any]:
    """Push twice (the second reuses the group) over ``distributed``; returns the names and bucket sizes this
    rank broadcast."""
    cfg, info, engine = _engine(payload)
    sent: list[list[tuple[str, int]]] = []
    buckets = distributed.hf_buckets

    def recording_buckets(*args, **kwargs):
        for bucket in buckets(*args, **kwargs):
            if bucket:
                sent.append([(name, t.numel() * t.element_size()) for name, t in bucket])
            yield bucket

    distributed.hf_buckets = recording_buckets
    client = SGLangClient([payload["url"]]) if info.is_main else None
    sync = distributed.DistributedSync(
        client,
        cfg.model.arch,
        stage=info.pp_rank,
        make_client=lambda: SGLangClient([payload["url"]]),
        bucket_bytes=payload["bucket_bytes"],
        timeout_s=120,
    )
    first = sync.push(engine.module)
    second = sync.push(engine.module)
    sync.close()
    if client is not None:
        client.close()
    return {"rank": info.rank, "pp_rank": info.pp_rank, "sent": sent, "metrics": (first, second)}


def tensor_push(payload: dict[str, Any]) -> dict[str, Any]:
    """Push once over ``tensor`` to a recording engine on the main rank."""
    cfg, info, engine = _engine(payload)
    recorder = RecordingEngine() if info.is_main else None
    TensorSync(recorder, cfg.model.arch, bucket_bytes=payload["bucket_bytes"]).push(engine.module)
    return {
        "buckets": recorder.buckets if recorder else None,
        "finished": recorder.finished if recorder else 0,
    }
