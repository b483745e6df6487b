"""The reward signatures users already have, recognised by their parameter names and called as their own
framework calls them – no wrapper (stdlib only: reward workers import it).

| convention | recognised by | called as |
|---|---|---|
| ``native`` | ``response`` and ``label`` | ``fn(response=, label=, [prompt=, source=, metadata=], **reward_kwargs)`` |
| ``verl`` | ``solution_str`` and ``ground_truth`` | ``fn(data_source=, solution_str=, ground_truth=, extra_info=, **reward_kwargs)`` |
| ``trl`` | ``completions`` | ``fn(prompts=[...], completions=[...], **columns, **reward_kwargs)`` on a group |
| ``group`` | ``fn.reward_group = True`` | ``fn(samples, **reward_kwargs)`` |

verl's call is its ``NaiveRewardManager``'s (``verl/workers/reward_manager/naive.py``: the row's ``data_source``,
the decoded response, ``reward_model.ground_truth`` and ``extra_info``; ``custom_reward_function.reward_kwargs``
bound with ``functools.partial``). TRL's is ``GRPOTrainer._calculate_rewards`` (``trl/trainer/grpo_trainer.py``):
lists of prompts and completions – chat messages (``[{"role": "assistant", "content": ...}]`` per completion)
when the dataset's prompts are messages, else strings – and every other dataset column as a list, one entry per
completion. TRL also passes ``completion_ids`` and ``trainer_state``; here neither exists, so a TRL reward that
requires them is refused.

What each returns, and the one line a wrong shape gets (naming the convention and the fix): verl's
``compute_score`` a number or a dict with ``score`` (``None`` and a ``(score, info)`` tuple are refused); TRL's a
list with one float per completion – a ``None`` entry is TRL's "not applicable to this sample" and scores 0.0
with the field ``not_applicable`` (TRL sums its reward functions with ``nansum``, so with one function that
sample's reward is 0 too), never an error; a scalar or a ``{"score": [...]}`` dict is refused. A dataset column
named like a ``reward_kwargs`` key is refused (the call would get the name twice). When a reward fails on a
label that is the JSON text of a dict or list (verl keeps a dict ``ground_truth``; here labels are text), the
error says so.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from sapo_megatron.rewards.types import RewardInput, is_group_reward


class ConventionError(TypeError):
    """A reward's call or return value does not fit its convention; the message names it and the fix."""


NATIVE, VERL, TRL, GROUP = "native", "verl", "trl", "group"

ACCEPTED_SHAPES = (
    "fn(response, label, [prompt, source, metadata]) (this project); "
    "compute_score(data_source, solution_str, ground_truth, extra_info=None) (verl); "
    "fn(prompts, completions, **kwargs) -> list[float] (TRL, batched); "
    "@group_reward fn(samples) (a group)"
)

VERL_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")
TRL_ARGUMENTS = ("prompts", "completions")


def parameters(fn: Callable[..., Any]) -> Mapping[str, inspect.Parameter] | None:
    """``fn``'s parameters, ``None`` for callables without a signature (some builtins)."""
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None


def takes_var_keyword(params: Mapping[str, inspect.Parameter]) -> bool:
    return any(p.kind is p.VAR_KEYWORD for p in params.values())


def detect_convention(fn: Callable[..., Any]) -> str | None:
    """The convention ``fn`` follows (module docstring), ``None`` when its signature matches none."""
    if is_group_reward(fn):
        return GROUP
    params = parameters(fn)
    if params is None:
        return NATIVE  # no signature to read: the call will tell
    names = set(params)
    if {"solution_str", "ground_truth"} <= names:
        return VERL
    if "completions" in names:
        return TRL
    if {"response", "label"} <= names or takes_var_keyword(params):
        return NATIVE
    return None


def unmatched_message(fn: Callable[..., Any]) -> str:
    """The one-line refusal for a signature of no known convention."""
    try:
        signature = str(inspect.signature(fn))
    except (TypeError, ValueError):
        signature = "(?)"
    return f"its signature {signature} matches none of the accepted reward shapes: {ACCEPTED_SHAPES}"


def unfilled_parameters(
    params: Mapping[str, inspect.Parameter], given: set[str], extra_kwargs: Mapping[str, Any]
) -> list[str]:
    """Parameters without a default that neither the convention nor ``reward_kwargs`` fill."""
    known = given | set(extra_kwargs)
    return [
        p.name
        for p in params.values()
        if p.kind is p.POSITIONAL_ONLY
        or (
            p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.default is p.empty
            and p.name not in known
        )
    ]


def call_verl(fn: Callable[..., Any], item: RewardInput, kwargs: Mapping[str, Any]) -> Any:
    """One verl ``compute_score`` call; ``extra_info`` only when the function takes it."""
    params = parameters(fn) or {}
    extra = {"extra_info": item.metadata} if "extra_info" in params or takes_var_keyword(params) else {}
    return fn(
        data_source=item.source,
        solution_str=item.response,
        ground_truth=item.label,
        **extra,
        **kwargs,
    )


def trl_arguments(inputs: list[RewardInput]) -> dict[str, Any]:
    """TRL's keyword arguments for one batch: prompts, completions and each dataset column as a list."""
    chat = all(item.messages is not None for item in inputs)
    prompts = [item.messages if chat else item.prompt for item in inputs]
    completions: list[Any] = [
        [{"role": "assistant", "content": item.response}] if chat else item.response for item in inputs
    ]
    columns: dict[str, list[Any]] = {}
    names = [name for item in inputs for name in (item.columns or {})]
    for name in dict.fromkeys(names):
        if name not in ("prompt", "completion", "completion_ids", *TRL_ARGUMENTS):
            columns[name] = [(item.columns or {}).get(name) for item in inputs]
    return {"prompts": prompts, "completions": completions, **columns}


def call_trl(fn: Callable[..., Any], inputs: list[RewardInput], kwargs: Mapping[str, Any]) -> list[Any]:
    """One TRL batched call; keeps only the columns a function without ``**kwargs`` declares."""
    arguments = trl_arguments(inputs)
    params = parameters(fn) or {}
    if not takes_var_keyword(params):
        arguments = {name: value for name, value in arguments.items() if name in params}
    twice = sorted(set(arguments) & set(kwargs))
    if twice:
        raise ConventionError(
            f"the dataset column(s) {twice} and algorithm.reward_kwargs key(s) of the same name would both be "
            "passed to the TRL reward: rename the column or the reward_kwargs key"
        )
    values = fn(**arguments, **kwargs)
    if isinstance(values, Mapping):
        raise ConventionError(
            f"the TRL reward returned a dict (keys {sorted(map(str, values))[:5]}); TRL's reward functions return a "
            "list with one float per completion"
        )
    if not isinstance(values, (list, tuple)) and not hasattr(values, "tolist"):
        raise ConventionError(
            f"the TRL reward returned a {type(values).__name__}, not a list; TRL's reward functions return one float "
            "per completion (list[float], None where a reward does not apply)"
        )
    return list(values.tolist() if hasattr(values, "tolist") else values)


def check_return(value: Any, convention: str | None) -> str | None:
    """The one-line error for a per-sample return value of a shape no convention accepts (None: fine)."""
    who = "verl's compute_score" if convention == VERL else "the reward"
    if value is None:
        return f"{who} returned None; return a number or a dict with 'score' (verl: {{'score': s, ...}})"
    if isinstance(value, tuple):
        return (
            f"{who} returned a tuple of {len(value)}; return a number, or a dict with 'score' and the other "
            "fields (e.g. {'score': score, **info} for a (score, info) pair)"
        )
    return None


def label_note(label: Any) -> str:
    """A note for an error on a label that is JSON text of a dict or list (a verl ground truth stored as one)."""
    if isinstance(label, str) and label.lstrip()[:1] in ("{", "["):
        import json

        try:
            kind = type(json.loads(label)).__name__
        except ValueError:
            return ""
        return (
            f" (note: the label / ground_truth is the JSON text of a {kind}, not a {kind}: json.loads(ground_truth) "
            "reads it)"
        )
    return ""
