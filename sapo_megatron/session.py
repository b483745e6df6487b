"""Everything a run needs before its first step, built in order: parallel state, output directory, tokenizer,
prompt data, the Megatron training engine, the rollout engine, weight sync and logging.

The rollout engine lives on the main rank only; other ranks receive samples by broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from sapo_megatron.config import ConfigError, RunConfig
from sapo_megatron.data.prompts import PromptRow, load_prompts
from sapo_megatron.data.synthetic import make_addition_rows
from sapo_megatron.data.tokenizer import load_tokenizer
from sapo_megatron.megatron.parallel import RankInfo, init_parallel
from sapo_megatron.megatron.train_step import TrainEngine
from sapo_megatron.rewards.registry import SafeReward, get_reward
from sapo_megatron.rollout.base import RolloutEngine
from sapo_megatron.tracking import Tracker
from sapo_megatron.weight_sync import WeightSync, export_hf


@dataclass
class Session:
    """The built pieces of a run (see :func:`build_session`)."""

    cfg: RunConfig
    info: RankInfo
    run_dir: Path
    tokenizer: object
    train_rows: list[PromptRow]
    heldout_rows: list[PromptRow]
    engine: TrainEngine
    rollout: RolloutEngine | None
    sync: WeightSync
    reward: SafeReward
    tracker: Tracker
    _server: object | None = None

    def close(self) -> None:
        self.tracker.close()
        if self.rollout is not None:
            self.rollout.close()
        if self._server is not None:
            self._server.stop()


def build_session(cfg: RunConfig) -> Session:
    info = init_parallel(cfg.parallel, seed=cfg.seed, cfg=cfg, cpu_threads=cfg.launch.cpu_threads)
    run_dir = Path(cfg.output_dir)
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg.save_resolved(run_dir / "config.yaml")
    tokenizer = build_tokenizer(cfg)
    train_rows, heldout_rows = build_prompts(cfg)
    engine = TrainEngine(cfg, total_steps=max(cfg.trainer.steps * cfg.trainer.mini_batches, 1))
    rollout, server = build_rollout(cfg, info, engine, tokenizer, run_dir)
    sync = WeightSync(
        rollout,
        cfg.model.arch,
        mode=cfg.rollout.weight_sync,
        staging_dir=run_dir / "rollout_weights",
        tokenizer=tokenizer,
    )
    reward = SafeReward(get_reward(cfg.algorithm.reward), cfg.algorithm.reward)
    tracker = Tracker(run_dir, enabled=info.is_main)
    return Session(
        cfg,
        info,
        run_dir,
        tokenizer,
        train_rows,
        heldout_rows,
        engine,
        rollout,
        sync,
        reward,
        tracker,
        server,
    )


def build_tokenizer(cfg: RunConfig):
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if tokenizer.vocab_size > cfg.model.arch.vocab_size:
        raise ConfigError(
            f"data.tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
            f"{cfg.model.arch.vocab_size}; use a matching tokenizer or model"
        )
    return tokenizer


def build_prompts(cfg: RunConfig) -> tuple[list[PromptRow], list[PromptRow]]:
    data = cfg.data

    def rows(source: str | None, split: str, size: int) -> list[PromptRow]:
        if source is None:
            return []
        if source == "synthetic:addition":
            return make_addition_rows(size, digits=data.digits, split=split, seed=cfg.seed)
        if source.startswith("synthetic:"):
            raise ConfigError(f"data source {source!r}: the only synthetic task is 'synthetic:addition'")
        return load_prompts(source)

    return rows(data.train, "train", data.train_size), rows(data.heldout, "heldout", data.heldout_size)


def build_rollout(cfg: RunConfig, info: RankInfo, engine: TrainEngine, tokenizer, run_dir: Path):
    """The rollout engine on the main rank (``None`` elsewhere) and, for ``cpu_http``, its server."""
    if not info.is_main:
        _initial_export(cfg, engine, None, run_dir)
        return None, None
    if cfg.rollout.engine == "sglang":
        return _sglang_client(cfg, cfg.rollout.urls), None
    from sapo_megatron.rollout.cpu_engine import CPUEngine

    initial = _initial_export(cfg, engine, tokenizer, run_dir)
    cpu = CPUEngine.from_pretrained(initial, seed=cfg.seed, num_threads=cfg.rollout.threads)
    if not cfg.rollout.cpu_http:
        return cpu, None
    from sapo_megatron.rollout.cpu_server import CPUServer

    server = CPUServer(cpu).start()
    return _sglang_client(cfg, [server.url]), server


def _initial_export(cfg: RunConfig, engine: TrainEngine, tokenizer, run_dir: Path) -> Path:
    """Write the starting weights as an HF checkpoint for the CPU engine to load (collective)."""
    path = run_dir / "rollout_weights"
    return export_hf(engine.module, cfg.model.arch, path, tokenizer=tokenizer, is_main=tokenizer is not None)


def _sglang_client(cfg: RunConfig, urls: list[str]):
    from sapo_megatron.rollout.sglang_client import SGLangClient

    arch = cfg.model.arch
    return SGLangClient(
        urls,
        num_layers=arch.num_hidden_layers if arch.is_moe else None,
        top_k=arch.num_experts_per_tok if arch.is_moe else None,
        max_concurrency=cfg.rollout.concurrency,
        timeout_s=cfg.rollout.timeout_s,
        max_retries=cfg.rollout.max_retries,
    )


def broadcast_object(obj, *, src: int = 0):
    """Send a picklable object from ``src`` to every rank (identity on a single process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
