"""Per-rank bodies of the multi-process checkpoint tests (imported by spawned workers)."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sapo_megatron.checkpoint.atomic import IncompleteCheckpointError
from sapo_megatron.config import RunConfig, config_from_dict
from sapo_megatron.conversion.verify import verify
from sapo_megatron.megatron import dist_ckpt
from sapo_megatron.megatron.model import BuildOptions, build_gpt_model
from sapo_megatron.megatron.parallel import init_parallel, parallel_context, rank_info
from sapo_megatron.megatron.sft import sft_loss
from sapo_megatron.megatron.train_step import MicroBatch, TrainEngine
from sapo_megatron.megatron.weights import iter_hf_buckets, iter_hf_weights


def _config(hf_dir: str, parallel: dict, dtype: str = "fp32", **model: Any) -> RunConfig:
    return config_from_dict(
        {
            "model": {"hf_config": hf_dir, **model},
            "parallel": parallel,
            "precision": {"dtype": dtype},
            "launch": {"procs_per_node": int(os.environ["WORLD_SIZE"])},
            "optimizer": {
                "name": "adam",
                "lr": 1e-2,
                "weight_decay": 0.01,
                "use_distributed_optimizer": True,
            },
        }
    )


def _init_group() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo")


def _allow_child_processes() -> None:
    """Megatron's checkpoint writer forks worker processes (as it does under torchrun); the test harness starts
    its ranks as daemonic processes, which multiprocessing forbids to have children."""
    multiprocessing.current_process()._config["daemon"] = False


def layouts(payload: dict[str, Any]) -> dict[str, Any]:
    """Load converted checkpoints under each layout; export them online (per-rank and in buckets) and save
    them again; then logit parity under a few layouts."""
    _allow_child_processes()
    _init_group()
    cases = {}
    for case in payload["cases"]:
        cfg = _config(case["hf_dir"], case["parallel"], case["dtype"])
        arch = cfg.model.arch
        with parallel_context(cfg):
            model = build_gpt_model(BuildOptions(cfg.model, cfg.parallel, cfg.precision))
            dist_ckpt.load_model_weights(model, case["mc_dir"])
            owned = {n: t.clone() for n, t in iter_hf_weights(model, arch, owned_only=True)}
            buckets = list(
                iter_hf_buckets(
                    model, arch, case["bucket_bytes"], dst=case["dst"], all_ranks=case["all_ranks"]
                )
            )
            dist_ckpt.save_model_weights(model, case["save_dir"], arch=arch)
        cases[case["label"]] = {"owned": owned, "buckets": buckets}
    parity = {
        label: dataclasses.asdict(
            verify(p["hf_dir"], p["mc_dir"], parallel=p["parallel"], tolerance=p["tolerance"], log=None)
        )
        for label, p in payload["parity"].items()
    }
    return {"cases": cases, "parity": parity}


def parity_single(payload: dict[str, Any]) -> dict[str, Any]:
    """Logit parity at TP1 (one process) for each checkpoint."""
    return {
        label: dataclasses.asdict(verify(p["hf_dir"], p["mc_dir"], tolerance=p["tolerance"], log=None))
        for label, p in payload.items()
    }


def _micro_batches(ids: torch.Tensor) -> list[MicroBatch]:
    info = rank_info()
    rows = ids.shape[0] // info.dp_size
    ids = ids[info.dp_rank * rows : (info.dp_rank + 1) * rows]
    total = torch.tensor(float(ids.shape[0] * (ids.shape[1] - 1)) * info.dp_size)
    return [
        {
            "input_ids": ids[:, :-1].contiguous(),
            "labels": ids[:, 1:].contiguous(),
            "loss_mask": torch.ones_like(ids[:, 1:]),
            "num_tokens_global": total,
        }
    ]


def _weights(engine: TrainEngine, arch) -> dict[str, torch.Tensor]:
    return {n: t.float().clone() for n, t in iter_hf_weights(engine.module, arch, owned_only=True)}


def train_state(payload: dict[str, Any]) -> dict[str, Any]:
    """Step, save, (crash during a second save), step again; a fresh engine restored from the checkpoint must
    take the identical second step."""
    _allow_child_processes()
    root = Path(payload["root"])
    cfg = _config(payload["hf_dir"], payload["parallel"], init="hf", init_path=payload["hf_dir"])
    arch = cfg.model.arch
    init_parallel(cfg.parallel, seed=0, cfg=cfg)
    first, second = (_micro_batches(ids) for ids in payload["batches"])

    engine = TrainEngine(cfg, total_steps=4)
    step1 = engine.train_step(first, sft_loss)
    dist_ckpt.save_train_state(engine, root / "step_1", {"step": 1, "data_position": 8}, keep=2)
    rng_at_save = torch.get_rng_state().clone()

    real_save = dist_ckpt.dist_checkpointing.save

    def crash_after_writing(state, directory, *args, **kwargs):
        real_save(state, directory, *args, **kwargs)
        raise RuntimeError("simulated crash after the shards were written")

    dist_ckpt.dist_checkpointing.save = crash_after_writing
    try:
        dist_ckpt.save_train_state(engine, root / "step_2", {"step": 2})
        crashed = ""
    except RuntimeError as err:
        crashed = str(err)
    finally:
        dist_ckpt.dist_checkpointing.save = real_save
    dist.barrier()
    latest_after_crash = (root / "latest").read_text().strip()
    try:
        dist_ckpt.load_train_state(engine, root / ".step_2.partial")
        partial_error = ""
    except IncompleteCheckpointError as err:
        partial_error = str(err)

    step2 = engine.train_step(second, sft_loss)
    weights2 = _weights(engine, arch)

    fresh_cfg = _config(payload["hf_dir"], payload["parallel"])  # random init: different weights
    fresh = TrainEngine(fresh_cfg, total_steps=4)
    weights_fresh = _weights(fresh, arch)
    torch.manual_seed(12345)  # the restore must bring the RNG back
    extra = dist_ckpt.load_latest_train_state(fresh, root)
    rng_after_load = torch.get_rng_state().clone()
    step2_restored = fresh.train_step(second, sft_loss)
    weights2_restored = _weights(fresh, arch)

    dist_ckpt.save_train_state(fresh, root / "step_3", {"step": 3}, keep=1)
    return {
        "step1": step1.loss,
        "step2": (step2.loss, step2.grad_norm),
        "step2_restored": (step2_restored.loss, step2_restored.grad_norm),
        "weights2": weights2,
        "weights2_restored": weights2_restored,
        "weights_fresh": weights_fresh,
        "extra": extra,
        "rng_same": torch.equal(rng_at_save, rng_after_load),
        "crashed": crashed,
        "latest_after_crash": latest_after_crash,
        "partial_error": partial_error,
        "dirs_at_end": sorted(p.name for p in root.iterdir()),
    }


def cp_save_or_resume(payload: dict[str, Any]) -> dict[str, Any]:
    """``mode="save"``: step on the first batch, save the training state, step on the second; ``"resume"``: a
    fresh engine (random weights) loads that state and steps on the second batch. Both under
    ``payload["parallel"]``: a state saved at one context-parallel size resumes at another."""
    _allow_child_processes()
    cfg = _config(payload["hf_dir"], payload["parallel"], init="hf", init_path=payload["hf_dir"])
    if payload["mode"] == "resume":
        cfg = _config(payload["hf_dir"], payload["parallel"])
    init_parallel(cfg.parallel, seed=0, cfg=cfg)
    first, second = (_micro_batches(ids) for ids in payload["batches"])
    engine = TrainEngine(cfg, total_steps=4)
    if payload["mode"] == "save":
        engine.train_step(first, sft_loss)
        dist_ckpt.save_train_state(engine, Path(payload["root"]) / "step_1", {"step": 1})
    else:
        dist_ckpt.load_latest_train_state(engine, Path(payload["root"]))
    step = engine.train_step(second, sft_loss)
    return {"step": (step.loss, step.grad_norm), "weights": _weights(engine, cfg.model.arch)}
