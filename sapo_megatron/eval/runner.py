"""Run an eval suite on a rollout engine: generate ``n`` samples per prompt, score them, aggregate.

Determinism: sample ``j`` of prompt ``i`` of dataset ``NAME`` is drawn with the sampling seed
``eval_seed(seed, NAME) + i * n + j`` (SGLang's ``sampling_seed``; the CPU engine always honours it), so the same
model, data and seed give the same samples on any engine that honours seeds, however requests are batched, and
evaluation never draws from the engine's own seed stream, which training relies on. Requests go in chunks of about
:data:`ROWS_PER_CHUNK` samples (a multiple of the CPU engine's batch of 64) for the progress bar.

Outputs (:func:`write_outputs`): ``eval.json`` = ``{"model", "seed", "datasets": {NAME: metrics}}`` with the
metrics of :func:`~sapo_megatron.eval.metrics.dataset_metrics`, and ``samples.jsonl``, one row per sample:
``dataset``, ``index`` (prompt index within the dataset), ``sample`` (0 .. n-1), ``source``, ``prompt``,
``response``, ``score``, ``answer``, ``finish_reason``, ``response_tokens`` (and ``thinking_tokens`` when the reward
scores after thinking).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sapo_megatron import jsonio
from sapo_megatron.algo.config import reward_label
from sapo_megatron.data.loading import build_vision, check_model_takes_images
from sapo_megatron.data.prompts import PromptRow
from sapo_megatron.data.thinking import reward_after_thinking, thinking_tokens
from sapo_megatron.eval.config import EvalDataset, resolve_datasets
from sapo_megatron.eval.inputs import EvalPrompts, EvalReward, load_eval_rows
from sapo_megatron.eval.metrics import ScoredSample, dataset_metrics, flat_metrics, headline
from sapo_megatron.rollout.episodes import tool_schemas
from sapo_megatron.rollout.types import GenerationRequest, SamplingParams

ROWS_PER_CHUNK = 256
EVAL_FILE = "eval.json"
SAMPLES_FILE = "samples.jsonl"

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class EvalSuite:
    """The datasets of one evaluation with their rows and rewards, loaded and checked before any model."""

    datasets: list[EvalDataset]
    rows: dict[str, list[PromptRow]]
    prompts: dict[str, EvalPrompts]
    rewards: dict[str, EvalReward]
    max_reward_error_frac: float = 0.1
    """A dataset whose reward raised on more than this share of its samples stops the evaluation."""

    @property
    def num_samples(self) -> int:
        return sum(len(self.rows[d.name]) * d.n for d in self.datasets)

    def close(self) -> None:
        """Stop the reward runners (worker pools)."""
        for reward in {id(r): r for r in self.rewards.values()}.values():
            reward.close()


@dataclasses.dataclass
class EvalResult:
    metrics: dict[str, dict[str, Any]]
    """Dataset name → its metrics (the ``eval.json`` shape)."""
    samples: list[dict[str, Any]]
    seconds: float

    def flat(self) -> dict[str, float]:
        """The scalars to log: ``eval/{name}/...`` of every dataset."""
        out: dict[str, float] = {}
        for name, metrics in self.metrics.items():
            out.update(flat_metrics(name, metrics))
        return out

    @property
    def headline(self) -> float | None:
        """The first dataset's avg@n (the run's "accuracy")."""
        return headline(next(iter(self.metrics.values()))) if self.metrics else None

    @property
    def samples_per_s(self) -> float:
        return len(self.samples) / max(self.seconds, 1e-9)


def build_suite(cfg: Any, tokenizer: Any, *, seed: int | None = None) -> EvalSuite:
    """The eval suite of a :class:`~sapo_megatron.config.RunConfig`: every dataset's rows (checked against the
    tokenizer, the length policy applied within the model's context) and its reward (one runner per distinct
    reward); ``seed`` (default ``cfg.seed``) draws the synthetic held-out sets."""
    rows, prompts, rewards, runners = {}, {}, {}, {}
    seed = cfg.seed if seed is None else seed
    vision = build_vision(cfg, tokenizer)  # a VL model's tokenizer: the rows' images go to the engine
    for index, dataset in enumerate(resolve_datasets(cfg)):
        tools = tool_schemas(cfg.rollout.multi_turn)
        prompts[dataset.name] = EvalPrompts(tokenizer, dataset, tools=tools, vision=vision)
        loaded = load_eval_rows(dataset, digits=cfg.data.digits, seed=seed, vision=vision)
        check_model_takes_images(cfg, loaded, f"eval dataset {dataset.name}")
        rows[dataset.name] = prompts[dataset.name].check(
            loaded, context=cfg.model.arch.max_position_embeddings
        )
        after = reward_after_thinking(
            cfg.algorithm.reward_after_thinking, cfg.data.tokenizer, dataset.keys.chat_template_kwargs
        )
        key = repr((dataset.reward, after))
        if key not in runners:
            field = f"eval.datasets[{index}].reward"
            runners[key] = EvalReward(
                dataset.reward, field=field, algorithm=cfg.algorithm, after_thinking=after
            )
        rewards[dataset.name] = runners[key]
    return EvalSuite(resolve_datasets(cfg), rows, prompts, rewards, cfg.algorithm.max_reward_error_frac)


def eval_seed(seed: int, name: str) -> int:
    """The first sampling seed of dataset ``name`` (a different stream per dataset, fixed by run seed and name)."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**48 * 2**12


def sampling_params(dataset: EvalDataset, stop_token_ids: Sequence[int]) -> SamplingParams:
    greedy = dataset.temperature == 0
    return SamplingParams(
        temperature=dataset.temperature,
        top_p=1.0 if greedy else dataset.top_p,
        top_k=-1 if greedy else dataset.top_k,
        max_new_tokens=dataset.max_new_tokens,
        stop_token_ids=tuple(stop_token_ids),
    )


def run_suite(
    engine: Any,
    tokenizer: Any,
    suite: EvalSuite,
    *,
    seed: int,
    progress: Callable[[int], None] | None = None,
) -> EvalResult:
    """Evaluate every dataset of ``suite`` on ``engine`` (a :class:`~sapo_megatron.rollout.base.RolloutEngine`);
    ``progress(k)`` is called after every chunk of ``k`` samples."""
    start = time.perf_counter()
    metrics, samples = {}, []
    for dataset in suite.datasets:
        dataset_samples = _run_dataset(engine, tokenizer, suite, dataset, seed, progress)
        samples += dataset_samples
        metrics[dataset.name] = _aggregate(dataset, suite.rows[dataset.name], dataset_samples)
        note_missing_majority(dataset, metrics[dataset.name])
        note_truncation(dataset, metrics[dataset.name])
    return EvalResult(metrics, samples, time.perf_counter() - start)


_NOTED_MAJORITY: set[tuple[str, str]] = set()


def note_missing_majority(dataset: EvalDataset, metrics: dict[str, Any]) -> str | None:
    """Say once per dataset and reward why ``maj@n`` is missing (n > 1 and no sample had an answer to vote on);
    the line, or None."""
    key = (dataset.name, str(dataset.reward))
    if dataset.n < 2 or f"maj@{dataset.n}" in metrics or key in _NOTED_MAJORITY:
        return None
    _NOTED_MAJORITY.add(key)
    line = (
        f"eval dataset {dataset.name}: no maj@{dataset.n}: the reward {reward_label(dataset.reward)} gave no answer to vote on "
        "(return {'score': s, 'answer': a} from it, or use numeric_match / exact_match / math_verify / dapo_math)"
    )
    logger.warning(line)
    return line


TRUNCATED_WARNING_FRAC = 0.5
"""More than this share of a dataset's responses cut by ``max_new_tokens`` is worth a warning."""


def note_truncation(dataset: EvalDataset, metrics: dict[str, Any]) -> str | None:
    """Warn when most responses hit the token limit (their scores then measure the limit, not the model); the
    line, or None."""
    frac = metrics.get("truncated_frac", 0.0)
    if frac <= TRUNCATED_WARNING_FRAC:
        return None
    line = (
        f"eval dataset {dataset.name}: {frac:.0%} of the responses hit max_new_tokens={dataset.max_new_tokens} and "
        "were scored as cut; raise the dataset's max_new_tokens (or eval.defaults.max_new_tokens) to measure the model"
    )
    logger.warning(line)
    return line


def _run_dataset(engine, tokenizer, suite: EvalSuite, dataset: EvalDataset, seed: int, progress):
    rows, reward, n = suite.rows[dataset.name], suite.rewards[dataset.name], dataset.n
    prompts = suite.prompts[dataset.name]
    think = _think_ids(tokenizer) if reward.runner.after_thinking else None
    sampling = sampling_params(dataset, [tokenizer.eos_id])
    first_seed = eval_seed(seed, dataset.name)
    requests = [
        GenerationRequest(
            prompt_ids=prompts.encode(row),
            images=prompts.images(row),
            n=n,
            sampling=dataclasses.replace(sampling, seed=first_seed + index * n),
            group_id=index,
        )
        for index, row in enumerate(rows)
    ]
    per_chunk = max(1, ROWS_PER_CHUNK // n)
    out = []
    for start in range(0, len(requests), per_chunk):
        groups = engine.generate(requests[start : start + per_chunk])
        scored = reward.score_groups(groups, rows[start : start + len(groups)], tokenizer.decode)
        for index, (group, group_scored) in enumerate(zip(groups, scored), start=start):
            out += [
                _sample_row(tokenizer, prompts, rows[index], index, s, r, think)
                for s, r in zip(group, group_scored)
            ]
        if progress is not None:
            progress(sum(len(g) for g in groups))
    reward.check_errors(suite.max_reward_error_frac, dataset.name)
    return out


def _think_ids(tokenizer) -> tuple[int, int] | None:
    """``<think>`` and ``</think>``'s ids, when the tokenizer has both as tokens."""
    hf = getattr(tokenizer, "hf", None)
    if hf is None:
        return None
    ids = hf.convert_tokens_to_ids(["<think>", "</think>"])
    return None if None in ids or hf.unk_token_id in ids else (ids[0], ids[1])


def _sample_row(
    tokenizer,
    prompts: EvalPrompts,
    row: PromptRow,
    index: int,
    sample,
    scored,
    think: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """``think``: ``<think>`` / ``</think>`` ids when the reward scores after thinking (the row then counts the
    response's ``thinking_tokens``)."""
    response = tokenizer.decode(sample.response_ids)
    thinking = (
        {}
        if think is None
        else {"thinking_tokens": thinking_tokens(sample.response_ids, *think, sample.loss_mask)}
    )
    return {
        "dataset": prompts.dataset.name,
        "index": index,
        "sample": sample.sample_index,
        "source": row.domain,
        "prompt": prompts.text(row),
        "response": response,
        "score": scored.score,
        "answer": scored.answer,
        "finish_reason": sample.finish_reason,
        "response_tokens": sample.generated_tokens,  # episodes: the policy's tokens, not the observations
        **thinking,
        **_episode_fields(sample),
    }


def _episode_fields(sample) -> dict[str, Any]:
    episode = sample.episode
    if episode is None:
        return {}
    return {"status": episode.status, "turns": episode.turns, "tool_calls": episode.tool_calls}


def _aggregate(dataset: EvalDataset, rows: Sequence[PromptRow], samples: Sequence[dict]) -> dict[str, Any]:
    per_prompt: list[list[ScoredSample]] = [[] for _ in rows]
    for s in samples:
        per_prompt[s["index"]].append(
            ScoredSample(
                s["score"],
                s["answer"],
                s["response_tokens"],
                s["finish_reason"] == "length",
                turns=s.get("turns"),
                tool_calls=s.get("tool_calls"),
                thinking_tokens=s.get("thinking_tokens"),
            )
        )
    return dataset_metrics(per_prompt, [row.domain for row in rows])


def eval_json(model: str, seed: int, result: EvalResult) -> dict[str, Any]:
    return {"model": model, "seed": seed, "datasets": result.metrics}


def write_outputs(out_dir: str | Path, model: str, seed: int, result: EvalResult) -> tuple[Path, Path]:
    """Write ``eval.json`` and ``samples.jsonl`` into ``out_dir``; returns both paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = _write_atomic(out_dir / EVAL_FILE, [jsonio.dumps(eval_json(model, seed, result), indent=2)])
    samples = _write_atomic(out_dir / SAMPLES_FILE, (jsonio.dumps(row) for row in result.samples))
    return summary, samples


def _write_atomic(path: Path, lines) -> Path:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as handle:
        for line in lines:
            handle.write(line + "\n")
    tmp.replace(path)
    return path
