"""Everything a run needs before its first step, built in order: parallel state, output directory, tokenizer,
prompt data, the Megatron training engine, the rollout engine and its servers, weight sync and logging.

The rollout engine lives on the main rank only; other ranks receive samples by broadcast. The server topology
(workers, router) is resolved on the main rank and broadcast, because weight sync involves other ranks too.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from sapo_megatron.config import RunConfig
from sapo_megatron.data.loading import RunData, build_run_data
from sapo_megatron.data.prompts import PromptRow
from sapo_megatron.data.render import PromptRenderer
from sapo_megatron.data.samples import SampleLog, resume_point
from sapo_megatron.data.thinking import reward_after_thinking
from sapo_megatron.data.tokenizer import Tokenizer
from sapo_megatron.distill.config import check_domains_served, prompt_domains
from sapo_megatron.distill.step import DistillStep
from sapo_megatron.errors import UserError
from sapo_megatron.eval.runner import EvalSuite
from sapo_megatron.loop.colocation import SERVED_DTYPES, ColocatedSync, Colocation, NoColocation
from sapo_megatron.loop.evaluation import build_training_suite
from sapo_megatron.loop.in_flight import holds_batch_in_flight
from sapo_megatron.loop.inputs import check_input_files
from sapo_megatron.loop.replay import needs_route_capture
from sapo_megatron.megatron.offload import TrainerOffload
from sapo_megatron.megatron.parallel import RankInfo, init_parallel
from sapo_megatron.megatron.train_step import TrainEngine
from sapo_megatron.rewards.registry import check_labels
from sapo_megatron.rewards.runner import RewardRunner, build_reward_runner, check_reward_available
from sapo_megatron.rollout.base import LocalServer, RolloutEngine
from sapo_megatron.rollout.episodes import tool_schemas, with_run_episodes
from sapo_megatron.rollout.sglang.topology import Topology, resolve_topology
from sapo_megatron.runtime.interrupts import InterruptGuard, print_line
from sapo_megatron.runtime.ranks import broadcast_object, on_main_rank
from sapo_megatron.runtime.run_dir import RunStart, cleanup_failed_start, start_run
from sapo_megatron.runtime.step_health import BadStepGuard
from sapo_megatron.runtime.tracking import Tracker
from sapo_megatron.runtime.wandb_tracking import build_wandb_sink
from sapo_megatron.weight_sync import DiskSync, TensorSync, WeightSync, export_hf
from sapo_megatron.weight_sync.distributed import DistributedSync

T = TypeVar("T")


@dataclass
class Session:
    """The built pieces of a run (see :func:`build_session`)."""

    cfg: RunConfig
    info: RankInfo
    start: RunStart
    tokenizer: Tokenizer
    train_rows: list[PromptRow]
    eval_suite: EvalSuite
    engine: TrainEngine
    rollout: RolloutEngine | None
    sync: WeightSync
    reward: RewardRunner
    tracker: Tracker
    guard: InterruptGuard
    bad_steps: BadStepGuard
    distill: DistillStep
    renderer: PromptRenderer  # prompt rows -> the ids the engine receives (data/render.py)
    samples: SampleLog  # samples.jsonl (data/samples.py)
    checkpointer: Any = None  # set by the trainer (it needs the loop's start time)
    _server: LocalServer | None = None
    teachers: Any = None  # distill.teachers.Teachers on the main rank of a run with teachers, else None
    colocation: Any = field(default_factory=NoColocation)  # rollout.colocate (colocation.py)

    @property
    def run_dir(self) -> Path:
        return self.start.run_dir

    def close(self) -> None:
        self.reward.close()
        self.eval_suite.close()
        self.tracker.close()
        self.sync.close()
        if self.rollout is not None:
            self.rollout.close()
        if self.teachers is not None:
            self.teachers.close()
        if self._server is not None:
            self._server.stop()


@contextlib.contextmanager
def open_session(cfg: RunConfig, *, mode: str) -> Iterator[Session]:
    """Check the inputs, form the process groups, apply the output-directory policy (``mode``), build the
    session, and close it at the end. A fresh start that fails before its first step leaves nothing behind; a
    first SIGINT/SIGTERM/SIGUSR1 makes the loop stop after its current step (``session.guard``)."""
    check_input_files(cfg)
    check_reward_available(cfg.algorithm.reward, kwargs=cfg.algorithm.reward_kwargs)
    data, data_error = None, None
    try:  # every row checked, the length policy applied: before any process group forms
        data = build_run_data(cfg, tools=tool_schemas(cfg.rollout.multi_turn))
        check_labels(cfg.algorithm.reward, data.train_rows, cfg.data.train)
    except UserError as exc:  # raised once the run's train.log is open (below), so the log records it
        data_error = exc
    info = init_parallel(
        cfg.parallel,
        seed=cfg.seed,
        cfg=cfg,
        cpu_threads=cfg.launch.cpu_threads,
        timeout_minutes=cfg.launch.timeout_minutes,
    )
    start = start_run(cfg.output_dir, mode=mode, is_main=info.is_main)
    with (
        cleanup_failed_start(start, enabled=info.is_main),
        InterruptGuard(announce=print_line if info.is_main else None, exit_until_started=True) as guard,
    ):
        if data_error is not None:
            raise data_error
        assert data is not None  # built, or data_error was raised above
        session = build_session(cfg, info, start, guard, data)
        guard.started()  # the first signal now asks for a checkpoint (before: it exits at once)
        try:
            yield session
        finally:
            session.close()


def build_session(
    cfg: RunConfig, info: RankInfo, start: RunStart, guard: InterruptGuard, data: RunData
) -> Session:
    """The pieces of a run, in order (the run directory exists: :func:`start_run` made it)."""
    run_dir = start.run_dir
    if info.is_main:
        cfg.save_resolved(run_dir / "config.yaml")
    tokenizer, train_rows = data.tokenizer, data.train_rows
    eval_suite = build_training_suite(cfg, tokenizer)  # eval datasets read and checked, their rewards found
    check_domains_served(cfg.teachers, train_rows, cfg.data.train)
    teachers = build_teachers_on_main(cfg, info, tokenizer)  # before the model: a bad teacher fails fast
    engine = TrainEngine(
        cfg,
        routing_replay=needs_route_capture(cfg),
        total_steps=max(cfg.trainer.steps * cfg.trainer.mini_batches, 1),
    )
    rollout, server, topology = build_rollout(cfg, info, engine, tokenizer, run_dir)
    sync = build_weight_sync(cfg, info, rollout, topology, tokenizer, run_dir)
    colocation, sync = build_colocation(cfg, info, engine, rollout, sync)  # with the engine itself
    in_process = cfg.rollout.engine == "cpu" and not cfg.rollout.cpu_http
    rollout = with_run_episodes(
        rollout, cfg, tokenizer, in_process=in_process
    )  # when rollout.multi_turn is set
    reward = build_reward_runner(
        cfg.algorithm.reward,
        workers=cfg.algorithm.reward_workers if info.is_main else 0,  # only the main rank scores
        timeout_s=cfg.algorithm.reward_timeout_s,
        kwargs=cfg.algorithm.reward_kwargs,
        after_thinking=reward_after_thinking(
            cfg.algorithm.reward_after_thinking, cfg.data.tokenizer, cfg.data.chat_template_kwargs
        ),
    )
    wandb = build_wandb_sink(cfg, run_dir, resume=start.resume, enabled=info.is_main)  # tracking.wandb
    tracker = Tracker(run_dir, enabled=info.is_main, resume_at=start.resume_at, sink=wandb)
    samples = SampleLog(
        run_dir,
        every=cfg.trainer.log_samples_every,
        last_step=cfg.trainer.steps,
        tokenizer=tokenizer,
        enabled=info.is_main,
        tracker=tracker,
        resume_at=resume_point(start.checkpoint, batch_in_flight=holds_batch_in_flight(start.checkpoint)),
    )
    return Session(
        cfg,
        info,
        start,
        tokenizer,
        train_rows,
        eval_suite,
        engine,
        rollout,
        sync,
        reward,
        tracker,
        guard,
        BadStepGuard(cfg.trainer.max_bad_steps),
        _server=server,
        distill=DistillStep(cfg, prompt_domains(train_rows)),
        teachers=teachers,
        renderer=data.renderer,
        samples=samples,
        colocation=colocation,
    )


def build_teachers_on_main(cfg: RunConfig, info: RankInfo, tokenizer):
    """The teachers (main rank; None elsewhere or without teachers). A failure there stops every rank."""
    built = []

    def build() -> None:
        from sapo_megatron.distill.teachers import build_teachers

        log = lambda line: print(line, flush=True)  # noqa: E731
        built.append(build_teachers(cfg.teachers, tokenizer, seed=cfg.seed, log=log))

    on_main_rank(info, build)
    return built[0] if built else None


def build_rollout(cfg: RunConfig, info: RankInfo, engine: TrainEngine, tokenizer, run_dir: Path):
    """The rollout engine on the main rank (``None`` elsewhere), the in-process CPU server (``cpu_http``) and
    the server topology (every rank; ``None`` for the in-process engine)."""
    if cfg.rollout.engine == "sglang":
        topology = on_main_rank(info, lambda: _resolve_servers(cfg, tokenizer))
        client = _sglang_client(cfg, topology, rollout_api_key(cfg)) if info.is_main else None
        return client, None, topology
    initial = _initial_export(cfg, engine, tokenizer if info.is_main else None, run_dir)  # collective
    if not info.is_main:
        return None, None, broadcast_object(None) if cfg.rollout.cpu_http else None
    from sapo_megatron.rollout.cpu.engine import CPUEngine

    cpu = CPUEngine.from_pretrained(
        initial, seed=cfg.seed, num_threads=cfg.rollout.threads, precision=cfg.rollout.precision
    )
    if not cfg.rollout.cpu_http:
        return cpu, None, None
    from sapo_megatron.rollout.cpu.server import CPUServer
    from sapo_megatron.rollout.cpu.weights import WeightGuard

    # what disk sync writes (its version folders), besides the initial export
    staging = Path(cfg.rollout.weight_sync_dir or run_dir / "rollout_weights").absolute()
    server = CPUServer(cpu, guard=WeightGuard(allowed_weight_dirs=[initial.parent, staging])).start()
    topology = broadcast_object(Topology(workers=(server.url,), tp_sizes=(1,)))
    return _sglang_client(cfg, topology, None), server, topology


def _resolve_servers(cfg: RunConfig, tokenizer) -> Topology:
    r = cfg.rollout
    return resolve_topology(
        urls=r.urls,
        router_url=r.router_url,
        endpoints_file=r.endpoints_file,
        api_key=rollout_api_key(cfg),
        need_routes=r.routed_experts,
        precision=r.precision,
        probe_prompt=[tokenizer.bos_id if tokenizer.bos_id is not None else 0],
        timeout_s=r.startup_timeout_s,
        log=lambda line: print(line, flush=True),
    )


def rollout_api_key(cfg: RunConfig) -> str | None:
    """The servers' API key from the environment variable named by ``rollout.api_key_env`` (never the config)."""
    return os.environ.get(cfg.rollout.api_key_env) or None


def _initial_export(cfg: RunConfig, engine: TrainEngine, tokenizer, run_dir: Path) -> Path:
    """Write the starting weights as an HF checkpoint for the CPU engine to load (collective)."""
    path = run_dir / "rollout_weights" / "initial"
    return export_hf(engine.module, cfg.model.arch, path, tokenizer=tokenizer, is_main=tokenizer is not None)


def _sglang_client(cfg: RunConfig, topology: Topology, api_key: str | None):
    from sapo_megatron.rollout.sglang.client import SGLangClient

    arch = cfg.model.arch
    return SGLangClient(
        list(topology.workers),
        router_url=topology.router if topology.generate_via_router else None,
        api_key=api_key,
        tp_size=list(topology.tp_sizes) or 1,
        num_layers=arch.num_hidden_layers if arch.is_moe else None,
        top_k=arch.num_experts_per_tok if arch.is_moe else None,
        vocab_size=arch.vocab_size,
        max_concurrency=cfg.rollout.concurrency,
        timeout_s=cfg.rollout.timeout_s,
        weight_sync_timeout_s=cfg.rollout.weight_sync_timeout_s,
        max_retries=cfg.rollout.max_retries,
        serializer=_cpu_serializer()
        if (cfg.rollout.engine, cfg.rollout.weight_sync) == ("cpu", "tensor")
        else None,
        flatten_buckets=cfg.rollout.colocate
        is not None,  # one flattened bucket per dtype, as slime sends them
    )


def _cpu_serializer():
    """Tensors for the CPU server in this process (``cpu_http``): the CPU form of SGLang's serializer."""
    from sapo_megatron.rollout.tensor_transport import serialize_named_tensors

    return serialize_named_tensors


def build_weight_sync(
    cfg: RunConfig,
    info: RankInfo,
    rollout: RolloutEngine | None,
    topology: Topology | None,
    tokenizer,
    run_dir,
) -> WeightSync:
    """The configured weight-sync mode (every rank holds one; only the main rank holds the engine)."""
    mode, arch = cfg.rollout.weight_sync, cfg.model.arch
    if mode == "tensor":
        return TensorSync(rollout, arch)
    if mode == "disk":
        staging = Path(cfg.rollout.weight_sync_dir or run_dir / "rollout_weights").absolute()
        return DiskSync(rollout, arch, staging_dir=staging, tokenizer=tokenizer)
    api_key = None if cfg.rollout.engine == "cpu" else rollout_api_key(cfg)

    def make_client() -> RolloutEngine:
        if topology is None:  # the in-process engine has no workers to broadcast to
            raise UserError("rollout.weight_sync distributed needs rollout workers (SGLang or cpu_http)")
        return _sglang_client(cfg, topology, api_key)

    return DistributedSync(
        rollout,
        arch,
        stage=info.pp_rank,
        make_client=make_client,
        timeout_s=cfg.rollout.weight_sync_timeout_s,
    )


def build_colocation(
    cfg: RunConfig, info: RankInfo, engine: TrainEngine, rollout: RolloutEngine | None, sync: WeightSync
):
    """``(colocation, sync)``: with ``rollout.colocate``, the colocated step and the sync wrapped in its order;
    otherwise a no-op and the sync as it is."""
    colocate = cfg.rollout.colocate
    if colocate is None:
        return NoColocation(), sync
    if isinstance(sync, TensorSync):
        sync.bucket_bytes = colocate.bucket_mb * 1024**2
    colocation = Colocation(
        rollout,
        TrainerOffload(engine.model, engine.optimizer) if colocate.offload_trainer else None,
        on_main=lambda work: on_main_rank(info, work),
        check_dtype=SERVED_DTYPES.get(cfg.rollout.precision) if colocate.check_weights else None,
    )
    return colocation, ColocatedSync(sync, colocation)
