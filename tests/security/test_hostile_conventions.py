"""Reward conventions held to one line (issue 39, area "reward conventions"): a verl ``compute_score`` returning
``None`` or ``(score, info)``, a TRL batched reward returning a scalar or ``{"score": [...]}``, a dataset column
named like a ``reward_kwargs`` key – each the sample's error naming the convention and the fix (CLEAR: the error
budget then stops the run with it); TRL's ``None`` entries are "not applicable", scored 0 without an error, as TRL
does (OK); a reward failing on a dict ground truth stored as JSON text is told so (CLEAR). On 3855bb6 each was a
raw ``TypeError``, and TRL's ``None`` counted as a reward error."""

from __future__ import annotations

import pytest

from sapo_megatron.rewards.runner import build_reward_runner
from sapo_megatron.rewards.types import RewardError, RewardInput
from tests.security.hostile import case, expect

AREA = "reward conventions"
REWARDS = """
def verl_none(data_source, solution_str, ground_truth, extra_info=None):
    return None

def verl_pair(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0, {"acc": True}

def verl_dict_label(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str == ground_truth["answer"])

def trl_scalar(prompts, completions, **kwargs):
    return 1.0

def trl_dict(prompts, completions, **kwargs):
    return {"score": [1.0] * len(completions)}

def trl_none(prompts, completions, **kwargs):
    return [None if c == "skip" else 1.0 for c in completions]

def trl_column(prompts, completions, level, **kwargs):
    return [1.0] * len(completions)
"""


@pytest.fixture(scope="module")
def rewards(tmp_path_factory):
    path = tmp_path_factory.mktemp("conventions") / "conv.py"
    path.write_text(REWARDS)
    return path


def rows(label: str = "4", responses=("4", "5"), columns=None) -> list[RewardInput]:
    return [RewardInput(response=r, label=label, group_id=0, columns=columns) for r in responses]


def scored(rewards, name: str, *, kwargs=None, **row_args):
    """Outputs of the reward on one group; then a zero error budget (a CLEAR case raises there)."""
    with build_reward_runner(f"{rewards}:{name}", workers=0, timeout_s=10.0, kwargs=kwargs) as runner:
        outputs = runner.score(rows(**row_args))
        errors = [out.error for out in outputs]
        runner.check_error_budget(0.0)
        return outputs, errors


@pytest.mark.parametrize(
    ("cls", "name", "words"),
    [
        case(
            AREA,
            "verl compute_score returns None",
            "CLEAR",
            "verl_none",
            "verl's compute_score returned None",
        ),
        case(
            AREA, "verl compute_score returns (score, info)", "CLEAR", "verl_pair", "{'score': score, **info}"
        ),
        case(
            AREA, "TRL batched reward returns a scalar", "CLEAR", "trl_scalar", "TRL reward returned a float"
        ),
        case(
            AREA,
            "TRL batched reward returns {score: [...]}",
            "CLEAR",
            "trl_dict",
            "TRL reward returned a dict",
        ),
    ],
)
def test_a_wrong_return_shape_is_named_with_its_convention(rewards, cls, name, words):
    error = expect(cls, lambda: scored(rewards, name), words)
    assert isinstance(error, RewardError)
    assert "TypeError" not in str(error).split("first error:")[1][:12]


@pytest.mark.parametrize("cls", [case(AREA, "dataset column named like a reward_kwargs key", "CLEAR")])
def test_a_column_shadowing_a_reward_kwargs_key_is_named(rewards, cls):
    expect(
        cls,
        lambda: scored(rewards, "trl_column", kwargs={"level": 2}, columns={"level": 1}),
        "dataset column(s) ['level']",
        "rename the column or the reward_kwargs key",
    )


@pytest.mark.parametrize("cls", [case(AREA, "TRL None entries", "OK")])
def test_trl_none_is_not_applicable_not_an_error(rewards, cls):
    outputs, errors = expect(cls, lambda: scored(rewards, "trl_none", responses=("4", "skip")))
    assert errors == [None, None]
    assert [(o.score, o.fields.get("not_applicable")) for o in outputs] == [(1.0, None), (0.0, True)]


@pytest.mark.parametrize("cls", [case(AREA, "dict ground truth arrives as JSON text", "CLEAR")])
def test_a_dict_ground_truth_as_json_text_is_said(rewards, cls):
    expect(
        cls,
        lambda: scored(rewards, "verl_dict_label", label='{"answer": "4"}'),
        "the label / ground_truth is the JSON text of a dict",
        "json.loads(ground_truth)",
    )
