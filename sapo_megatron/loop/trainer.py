"""The RL loop: prompts → rollouts → rewards → advantages → old-log-prob pass → k mini-batch updates with the
configured policy loss → weight sync → logging → checkpoint. Preceded by an optional supervised warm start and
followed by an HF export and ``summary.json``.

``trainer.rollout_mode`` decides where each step's rollouts come from: generated now (sync), in the background
during the step before (one_step_off, :mod:`sapo_megatron.loop.pipeline`), or from a bounded buffer that a
producer keeps filling, within ``trainer.max_staleness`` (fully_async, :mod:`sapo_megatron.loop.fully_async`). After every step of either phase, :func:`end_of_step` logs it,
checkpoints when due, and stops the run cleanly (checkpoint first) when a signal asked for it.
"""

from __future__ import annotations

import time
from typing import Any

from sapo_megatron.config import sequence_length_multiple
from sapo_megatron.data.prompts import PromptIterator, PromptRow
from sapo_megatron.data.render import PromptRenderer
from sapo_megatron.distill.teachers import TeacherScoring
from sapo_megatron.errors import RunInterrupted
from sapo_megatron.eval.metrics import headline_name
from sapo_megatron.loop import passes
from sapo_megatron.loop.checkpointing import LoopState
from sapo_megatron.loop.evaluation import evaluate, summary_fields
from sapo_megatron.loop.fully_async import FullyAsyncPipeline, open_rollouts
from sapo_megatron.loop.learning_signal import NoSignalWatch, check_sft_targets
from sapo_megatron.loop.passes import PassFactory, StepContext
from sapo_megatron.loop.pipeline import RolloutPipeline
from sapo_megatron.loop.replay import RoutingStep, route_layout
from sapo_megatron.loop.session import Session, open_session
from sapo_megatron.loop.step_metrics import StepMetrics
from sapo_megatron.megatron.loss_hook import PolicyLossHook, add_global_normalisers
from sapo_megatron.megatron.sft import sft_loss
from sapo_megatron.megatron.train_step import ReferenceModel, StepResult
from sapo_megatron.model.batching import RouteLayout, TrainSequence, build_micro_batches, padding_fraction
from sapo_megatron.model.step_batch import MicroBatch, StepBatch
from sapo_megatron.rewards.samples import score_sample_groups
from sapo_megatron.rollout.collect import CollectSettings, RolloutBatch, collect
from sapo_megatron.rollout.episodes.warm_start import check_sft_lengths, sft_sequences, sft_settings
from sapo_megatron.rollout.types import SamplingParams
from sapo_megatron.runtime.tracking import write_json_atomic
from sapo_megatron.weight_sync import export_hf


def run(cfg: Any, *, mode: str = "new") -> dict[str, Any]:
    """Run a whole job into ``cfg.output_dir``; ``mode`` is the output-directory policy (new / resume / auto /
    overwrite, see :mod:`sapo_megatron.runtime.run_dir`). Returns the summary written to ``summary.json``."""
    started = time.perf_counter()
    with open_session(cfg, mode=mode, started=started) as session:
        checkpoint = session.start.checkpoint  # None: a fresh start
        state = session.checkpointer.restore(checkpoint) if checkpoint is not None else LoopState()
        if state.bad_steps:
            session.bad_steps.load_state_dict(state.bad_steps)
        session.distill.load_state_dict(state.distill)
        prompts = PromptIterator(session.train_rows, batch_size=cfg.trainer.prompts_per_step, seed=cfg.seed)
        if state.prompts:
            prompts.load_state_dict(state.prompts)
        if state.sft_step < cfg.sft.steps:  # before the warm start teaches it (every rank: the same verdict)
            check_sft_lengths(session.renderer, session.train_rows, **sft_settings(cfg))
            if session.info.is_main:
                check_sft_targets(session.reward, session.train_rows, response_key=cfg.data.response_key)
        run_sft(session, state)
        session.sync.push(session.engine.module)
        evaluate(session, state, "before")  # the eval section's datasets (a resumed run keeps its value)
        run_rl(session, state, prompts)
        evaluate(session, state, "after")  # unless the last RL step evaluated
        state.wall_seconds += time.perf_counter() - started
        return _finish(session, state)


def run_sft(session: Session, state: LoopState) -> None:
    """Supervised warm start on (prompt, ground truth) pairs; skipped once done (also after a resume)."""
    cfg = session.cfg
    if state.sft_step >= cfg.sft.steps:
        return
    rows = PromptIterator(session.train_rows, batch_size=cfg.sft.global_batch, seed=cfg.seed + 1)
    if state.sft_prompts:
        rows.load_state_dict(state.sft_prompts)
    session.engine.reset_schedule(
        lr=cfg.sft.lr or cfg.optimizer.lr, total_steps=cfg.sft.steps, done=state.sft_step
    )
    session.tracker.start_phase("sft", cfg.sft.steps, initial=state.sft_step)
    while state.sft_step < cfg.sft.steps:
        micro = _sft_micro_batches(session, next(rows))
        result = session.engine.train_step(micro, sft_loss)
        state.sft_step += 1
        state.sft_prompts = rows.state_dict()
        metrics = {**result.metrics, "grad_norm": result.grad_norm, "lr": result.lr}
        metrics.update(_check_update(session, result, "sft", state.sft_step))
        logged = state.sft_step % cfg.sft.log_every == 0 or state.sft_step == cfg.sft.steps
        end_of_step(session, state, "sft", metrics if logged else None)
    session.tracker.close_phase()
    session.engine.reset_schedule(
        lr=cfg.optimizer.lr, total_steps=cfg.trainer.steps * cfg.trainer.mini_batches
    )


def _sft_micro_batches(session: Session, rows: list[PromptRow]) -> list[MicroBatch]:
    settings = sft_settings(session.cfg)
    del settings["context"]
    # loss on the target (a conversation's assistant turns) only, images as in RL
    sequences = sft_sequences(session.renderer, rows, **settings)
    return add_global_normalisers(_micro_batches(session, sequences))


def run_rl(session: Session, state: LoopState, prompts: PromptIterator) -> None:
    cfg = session.cfg
    correction = session.distill.correction(cfg.algorithm.correction)  # MOPD brings its own IS weight
    hook = PolicyLossHook(
        cfg.algorithm.loss,
        correction,
        temperature=cfg.rollout.temperature,
        proximal_logp=cfg.algorithm.proximal_logp,  # loglinear: no old-policy pass (docs/async.md)
    )
    reference = _reference_policy(session, state)
    session.tracker.start_phase("rl", cfg.trainer.steps, initial=state.step)
    with open_rollouts(  # trainer.rollout_mode: each batch now, one step ahead, or continuously (fully_async)
        session,
        prompts,
        lambda index, groups: _rollout(session, prompts, index, groups),
        start_step=state.step,
    ) as rollouts:
        # equal rewards in every group, step after step: say once why nothing is learnt
        no_signal = NoSignalWatch(cfg)
        while state.step < cfg.trainer.steps:
            metrics = rl_step(session, hook, rollouts, state.step, reference)
            state.step += 1
            if session.info.is_main:
                no_signal.observe(state.step, metrics)
            state.prompts = prompts.state_dict()  # past the batch in flight, which a checkpoint holds
            metrics.update(evaluate(session, state, "step"))  # every eval.every steps and after the last
            end_of_step(session, state, "rl", metrics)
    session.tracker.close_phase()


def end_of_step(session: Session, state: LoopState, phase: str, metrics: dict[str, float] | None) -> None:
    """Every rank, after every optimizer step of ``phase``: log (``None``: not this step), checkpoint when due
    (``sft.save_every`` / ``trainer.save_every``, and at the end of SFT) or when a signal asked the run to stop,
    then stop. The stop decision is collective, so every rank stops after the same step."""
    cfg = session.cfg
    step, total, every = (
        (state.sft_step, cfg.sft.steps, cfg.sft.save_every)
        if phase == "sft"
        else (state.step, cfg.trainer.steps, cfg.trainer.save_every)
    )
    state.bad_steps = session.bad_steps.state_dict()
    state.distill = session.distill.state_dict()
    if metrics is not None:
        session.tracker.log(step, metrics, phase=phase)
    stopping = session.guard.should_stop()
    due = (bool(every) and step % every == 0) or (phase == "sft" and step == total)
    if due or stopping:
        session.checkpointer.save(state, phase=phase)
    if stopping:
        raise RunInterrupted(
            f"interrupted at {phase.upper()} step {step} of {total} ({session.guard.reason}); checkpoint written"
        )


def _check_update(session: Session, result: StepResult, phase: str, step: int) -> dict[str, float]:
    """Count an update skipped for a non-finite loss or gradient (stop after too many in a row)."""
    return session.bad_steps.check(
        updated=result.update_successful, loss=result.loss, grad_norm=result.grad_norm, phase=phase, step=step
    )


def _reference_policy(session: Session, state: LoopState) -> ReferenceModel | None:
    """For ``kl_coef > 0`` or ``trainer.log_ref_kl``: the policy as RL starts, frozen; saved once so that a
    resumed run reuses it."""
    if session.cfg.algorithm.loss.kl_coef == 0 and not session.cfg.trainer.log_ref_kl:
        return None
    from sapo_megatron.megatron.dist_ckpt import load_model_weights, save_model_weights

    path = session.run_dir / "reference_policy"
    reference = session.engine.snapshot()
    if state.step == 0:
        save_model_weights(reference.module, path)
    else:
        load_model_weights(reference.module, path)
    return reference


STEP_PASSES: list[PassFactory] = [
    passes.staleness,  # loop/versions.py: each token's versions behind the trainer (asynchronous rollouts)
    passes.old_policy,  # loop/old_policy.py: old_logp under the arm's routing (R2 records the routes to replay)
    passes.routing_agreement,  # loop/replay.py: the live routing against the engine's routes, image-token masks
    passes.reference,  # loop/reference.py: ref_logp of the frozen reference policy
    passes.teacher_fusion,  # distill/step.py: teacher advantages fused into the RL advantages (OPD, SAF, MOPD)
    passes.rollout_corr_norm,  # loop/passes.py: the batch mean of rollout_corr's IS weights (is_batch_normalize)
]
"""The passes of an RL step, in order, between building its batch and the policy updates (see
:mod:`sapo_megatron.loop.passes`; docs/architecture.md, "Life of a step")."""


def rl_step(
    session: Session,
    hook: PolicyLossHook,
    rollouts: RolloutPipeline | FullyAsyncPipeline,
    step: int,
    reference: ReferenceModel | None,
) -> dict[str, float]:
    """One rollout batch and its ``mini_batches`` policy updates; returns the step's metrics."""
    cfg, engine = session.cfg, session.engine
    sequences, metrics = rollouts.next_batch(step)  # the samples on every rank, from the main rank
    start = time.perf_counter()
    layout = route_layout(cfg)
    batch = StepBatch(  # this rank's micro-batches per update, each with the update's loss normalisers
        [
            add_global_normalisers(_micro_batches(session, update, layout))
            for update in _split(sequences, cfg.trainer.mini_batches)
        ]
    )
    with session.colocation.training(metrics):  # colocated: engine released, trainer onloaded
        _train_updates(session, hook, batch, step, reference, metrics)
    train_s = time.perf_counter() - start
    metrics.update(rollouts.push_weights(engine.module))  # waits for a batch in flight first
    metrics["time/train_s"] = train_s
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in sequences)
    metrics["throughput/train_tokens_per_s"] = tokens / max(train_s, 1e-9)
    metrics["train/padding_frac"] = padding_fraction(sequences, batch, session.info.dp_size)
    return metrics


def _train_updates(
    session: Session,
    hook: PolicyLossHook,
    batch: StepBatch,
    step: int,
    reference: ReferenceModel | None,
    metrics: dict[str, float],
) -> None:
    """The step's passes (``STEP_PASSES``: each adds its part to ``batch``), then the ``mini_batches`` policy
    updates."""
    routing = RoutingStep(session.engine, session.cfg)  # MoE routing: live, R2 or R3 replay, and its metrics
    context = StepContext(session, routing, reference, version=step)
    for make_pass in STEP_PASSES:
        step_pass = make_pass(context)
        if step_pass is not None:
            metrics.update(batch.add(step_pass(batch)))
    pooled = StepMetrics(len(batch.updates))  # token-weighted over the updates; per update; ratio quantiles
    for update in batch.updates:
        result = routing.train_step(update, hook)
        pooled.add(result)
        for name, value in _check_update(session, result, "rl", step + 1).items():
            metrics[name] = metrics.get(name, 0.0) + value if name == "train/update_skipped" else value
        metrics["grad_norm"] = result.grad_norm
        metrics["lr"] = result.lr
    metrics.update(pooled.finish(hook.take_ratios()))
    session.distill.observe(metrics)  # SAF's warm-up reads this update's student–teacher KL next step
    metrics.update(routing.metrics(batch))


def _rollout(session: Session, prompts: PromptIterator, step: int, groups: int):
    """Generate and score ``groups`` prompt groups on the main rank (``step``: the RL step, or the fully-async
    chunk; it seeds the sampling): the training sequences, the rollout metrics (with the reward function's error
    fraction, which stops the run past its budget) and where the prompt data now stands."""
    cfg = session.cfg
    rows = next(prompts) if groups == prompts.batch_size else prompts.take(groups)
    settings = CollectSettings(
        n_samples=cfg.rollout.n_samples,
        sampling=_sampling(session, cfg.rollout.temperature),
        advantage=cfg.algorithm.advantage,
        dynamic_sampling=cfg.algorithm.dynamic_sampling,
        max_refills=cfg.algorithm.max_refills,
        over_sampling=cfg.algorithm.over_sampling,
        overlong_cache_len=cfg.algorithm.overlong_cache_len,
        mask_truncated=cfg.algorithm.mask_truncated_completions,
        return_routed_experts=cfg.rollout.routed_experts,
        image_pad_id=session.renderer.vision.pad_id if session.renderer and session.renderer.vision else None,
    )
    teacher = TeacherScoring(  # no-op without teachers; scores with each prompt's images
        session.teachers, session.distill.domain_names, image_pad_id=settings.image_pad_id
    )
    if session.rollout is None:  # the engine lives on the main rank, which alone calls this
        raise RuntimeError("rollout on a rank without the rollout engine")
    batch = collect(
        session.rollout,
        rows,
        refill=prompts.take,
        encode=session.renderer.encode,
        score_batch=lambda groups, rows: score_sample_groups(
            session.reward, groups, rows, session.tokenizer.decode
        ),
        settings=settings,
        seed=cfg.seed * 7919 + step,
        on_generated=teacher.submit,  # teachers score while the rewards are computed
    )
    session.reward.check_error_budget(cfg.algorithm.max_reward_error_frac)
    batch.metrics.update(session.reward.take_step_metrics())
    session.samples.record(step + 1, batch)  # samples.jsonl every trainer.log_samples_every steps
    sequences = teacher.attach(_train_sequences(batch, session.renderer), batch)
    return sequences, batch.metrics, prompts.state_dict()


def _sampling(session: Session, temperature: float) -> SamplingParams:
    r = session.cfg.rollout
    return SamplingParams(
        temperature=temperature,
        top_p=r.top_p if temperature > 0 else 1.0,
        top_k=r.top_k if temperature > 0 else -1,
        max_new_tokens=r.max_new_tokens,
        stop_token_ids=(session.tokenizer.eos_id,),
    )


def _train_sequences(batch: RolloutBatch, renderer: PromptRenderer | None) -> list[TrainSequence]:
    images = [
        renderer.image_inputs(row) if renderer else None for row in batch.prompts
    ]  # what the engine saw
    return [
        TrainSequence(
            s.prompt_ids,
            s.response_ids,
            float(batch.advantages[g, i]),
            s.rollout_logp,
            routed_experts=s.routed_experts,
            versions=s.token_versions,  # None: the pipeline gives each token the version the sample started with
            sample_id=f"group {s.group_id} sample {s.sample_index}",
            response_mask=s.loss_mask,  # episodes: tool observations are not trained on
            images=images[g],
        )
        for g, group in enumerate(batch.groups)
        for i, s in enumerate(group)
    ]


def _split(sequences: list[TrainSequence], parts: int) -> list[list[TrainSequence]]:
    """``parts`` equal mini-batches; never drops a sequence."""
    size, rest = divmod(len(sequences), parts)
    if rest:
        raise RuntimeError(f"{len(sequences)} sequences do not split into {parts} equal mini-batches")
    return [sequences[i * size : (i + 1) * size] for i in range(parts)]


def _micro_batches(
    session: Session, sequences: list[TrainSequence], routes: RouteLayout | None = None
) -> list[MicroBatch]:
    """This rank's micro-batches (with the engine's routes laid onto the positions when ``routes`` is given)."""
    info, par = session.info, session.cfg.parallel
    return build_micro_batches(
        sequences,
        dp_rank=info.dp_rank,
        dp_size=info.dp_size,
        micro_batches=par.micro_batches,
        pad_id=session.tokenizer.pad_id,
        length_multiple=sequence_length_multiple(session.cfg),
        route_layout=routes,
        max_tokens_per_micro_batch=par.max_tokens_per_micro_batch,  # None: padded; else packed
    )


def _finish(session: Session, state: LoopState) -> dict[str, Any]:
    cfg = session.cfg
    summary = {
        **summary_fields(state),  # accuracy_before / _after, the first and last evaluations
        "steps": state.step,
        "sft_steps": state.sft_step,
        "wall_seconds": round(state.wall_seconds, 2),
        "reward_errors": session.reward.errors,
        "hf_checkpoint": str(session.run_dir / "hf") if cfg.trainer.export_hf else None,
    }
    with session.colocation.resident():  # colocated: the trainer back on its devices for the save and export
        session.checkpointer.save(
            state, phase="rl" if state.step else "sft"
        )  # the final state, unless just saved
        if cfg.trainer.export_hf:  # collective: every rank takes part in gathering the weights
            out = session.run_dir / "hf"
            export_hf(
                session.engine.module,
                cfg.model.arch,
                out,
                tokenizer=session.tokenizer,
                is_main=session.info.is_main,
            )
    if not session.info.is_main:
        return summary
    write_json_atomic(session.run_dir / "summary.json", summary)
    session.tracker.message(
        f"{_headline_word(summary)} {_fmt(summary['accuracy_before'])} -> {_fmt(summary['accuracy_after'])} in "
        f"{state.step} RL steps, "
        f"{summary['wall_seconds']:.0f} s; summary: {session.run_dir / 'summary.json'}"
    )
    return summary


def _headline_word(summary: dict[str, Any]) -> str:
    """``accuracy`` for a 0/1 reward, else ``eval_score`` (the first eval dataset's, as its eval.json says)."""
    datasets = (summary.get("eval") or summary.get("eval_before") or {}).get("datasets") or {}
    first: dict[str, Any] = next(iter(datasets.values()), {})
    return headline_name(first) if first else "accuracy"


def _fmt(accuracy: float | None) -> str:
    return "n/a (no eval datasets)" if accuracy is None else f"{accuracy:.3f}"
