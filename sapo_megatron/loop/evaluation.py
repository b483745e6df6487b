"""Evaluation inside a training run: the trainer's one call, :func:`evaluate`.

When: ``"before"`` (after SFT, before the first RL step, if ``eval.before_training``; a resumed run keeps the
value measured then), ``"step"`` (after RL steps that are multiples of ``eval.every``, and after the last one)
and ``"after"`` (the end of a run whose last RL step did not evaluate: an SFT-only run). The main rank
generates and scores; every rank gets the metrics.

Where: ``metrics.jsonl`` / TensorBoard rows of phase ``eval`` at the RL step (``eval/{name}/avg@{n}``, ...),
``accuracy`` (the first dataset's avg@n; ``eval_score`` when its reward gave other scores than 0 and 1) in the RL
row of that step, and ``RUN_DIR/eval/step_NNNNNN/``
with that evaluation's ``eval.json`` and ``samples.jsonl``. The trainer's RNG streams are untouched: evaluation
passes its own sampling seeds (:func:`~sapo_megatron.eval.runner.eval_seed`) and its own reward counters.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from sapo_megatron.algo.config import reward_label
from sapo_megatron.eval.runner import EvalResult, EvalSuite, build_suite, run_suite, write_outputs
from sapo_megatron.loop.checkpointing import LoopState
from sapo_megatron.runtime.ranks import on_main_rank

if TYPE_CHECKING:
    from sapo_megatron.config import RunConfig
    from sapo_megatron.data.tokenizer import Tokenizer
    from sapo_megatron.megatron.parallel import RankInfo
    from sapo_megatron.rollout.base import RolloutEngine
    from sapo_megatron.runtime.tracking import Tracker

When = Literal["before", "step", "after"]


class EvaluatedRun(Protocol):
    """What evaluation reads of a run (a :class:`~sapo_megatron.loop.session.Session` is one)."""

    @property
    def cfg(self) -> RunConfig: ...
    @property
    def info(self) -> RankInfo: ...
    @property
    def eval_suite(self) -> EvalSuite: ...
    @property
    def rollout(self) -> RolloutEngine | None: ...
    @property
    def tokenizer(self) -> Tokenizer: ...
    @property
    def tracker(self) -> Tracker: ...
    @property
    def run_dir(self) -> Path: ...


def build_training_suite(cfg: RunConfig, tokenizer: Tokenizer) -> EvalSuite:
    """The run's eval suite (rows loaded and checked, rewards found): built with the session, before the model."""
    return build_suite(cfg, tokenizer)


def describe_training_suite(cfg: RunConfig, tokenizer: Tokenizer) -> list[str]:
    """The dry run's lines about the eval datasets (read, checked and length-filtered as the run will)."""
    from collections import Counter

    suite = build_training_suite(cfg, tokenizer)
    lines = []
    for dataset in suite.datasets:
        rows = suite.rows[dataset.name]
        sources = Counter(row.domain or "-" for row in rows)
        lines.append(
            f"eval {dataset.name} {dataset.path}: {len(rows)} prompts × n {dataset.n} at temperature "
            f"{dataset.temperature:g}, reward {reward_label(dataset.reward)}; per source: "
            + ", ".join(f"{source}: {count}" for source, count in sorted(sources.items()))
        )
    return lines


def evaluate(session: EvaluatedRun, state: LoopState, when: When) -> dict[str, float]:
    """Evaluate now if ``when`` calls for it (see the module docstring); records the result in ``state`` and
    the logs, and returns what goes into the RL step's metrics (``accuracy`` or ``eval_score``; empty when nothing
    ran)."""
    cfg, suite = session.cfg, session.eval_suite
    if not suite.datasets or not _due(cfg, state, when):
        return {}

    metrics = on_main_rank(session.info, lambda: _run_on_main(session, state.step))
    result = EvalResult(metrics, [], 0.0)
    session.tracker.log(state.step, result.flat(), phase="eval")
    state.eval_last = {"step": state.step, "datasets": metrics}
    if when == "before":
        state.eval_before = state.eval_last
        state.accuracy_before = result.headline
    session.tracker.message(f"eval at RL step {state.step}: {_line(metrics)}")
    accuracy = result.headline  # None only without datasets, which returned above
    if when != "step" or not metrics or accuracy is None:
        return {}
    from sapo_megatron.eval.metrics import headline_name

    return {headline_name(next(iter(metrics.values()))): accuracy}


def _due(cfg: RunConfig, state: LoopState, when: When) -> bool:
    if when == "before":
        return cfg.eval.before_training and state.eval_before is None
    if when == "step":
        every = cfg.eval.every
        return (bool(every) and state.step % every == 0) or state.step == cfg.trainer.steps
    last = state.eval_last
    return last is None or last["step"] != state.step


def _run_on_main(session: EvaluatedRun, step: int) -> dict[str, dict[str, Any]]:
    result = run_suite(session.rollout, session.tokenizer, session.eval_suite, seed=session.cfg.seed)
    write_outputs(session.run_dir / "eval" / f"step_{step:06d}", "policy", session.cfg.seed, result)
    return result.metrics


def _line(metrics: dict[str, dict[str, Any]]) -> str:
    from sapo_megatron.eval.metrics import headline

    return ", ".join(f"{name} avg@{m['n']} {headline(m):.3f}" for name, m in metrics.items())


def summary_fields(state: LoopState) -> dict[str, Any]:
    """What ``summary.json`` records of evaluation: the first and the last evaluation (``eval_before``,
    ``eval``), and their first dataset's avg@n as ``accuracy_before`` / ``accuracy_after``."""
    from sapo_megatron.eval.metrics import headline

    last = state.eval_last
    after = headline(next(iter(last["datasets"].values()))) if last and last["datasets"] else None
    return {
        "accuracy_before": state.accuracy_before,
        "accuracy_after": after,
        "eval_before": state.eval_before,
        "eval": last,
    }
