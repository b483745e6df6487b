"""Answer extraction, exact / numeric rewards, math-verify, the registry and the safety wrapper."""

from __future__ import annotations

import logging

import pytest

from sapo_megatron.config import ConfigError
from sapo_megatron.errors import UserError
from sapo_megatron.rewards import (
    RewardError,
    available_rewards,
    check_reward_available,
    exact_match,
    extract_final_answer,
    extract_last_number,
    get_reward,
    math_verify_available,
    numeric_match,
    register_reward,
    safe_reward,
)


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("46", "46"),
        ("  46 \n", "46"),
        ("12+34=46", "46"),
        ("so 2 = 1 + 1 = 2.", "2"),
        ("work... #### 72\nextra", "72"),
        ("a = b #### 1,234", "1,234"),  # '####' wins over '='
        ("The answer is Paris", "The answer is Paris"),
        ("x =   forty  two  ", "forty two"),
        ("", None),
        ("12+34=", None),
    ],
)
def test_extract_final_answer(text, answer):
    assert extract_final_answer(text) == answer


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("46", 46.0),
        ("I got -3.5 then 7", 7.0),
        ("1,234,567", 1234567.0),
        ("1e-3", 0.001),
        (".5", 0.5),
        ("none", None),
    ],
)
def test_extract_last_number(text, number):
    assert extract_last_number(text) == number


def test_exact_match():
    assert exact_match("12+34=46", "46") == 1.0
    assert exact_match("46", "#### 46") == 1.0
    assert exact_match("46.", "46") == 1.0
    assert exact_match("47", "46") == 0.0
    assert exact_match("paris", "Paris") == 0.0  # case-sensitive
    assert exact_match("", "46") == 0.0


def test_numeric_match_tolerance():
    assert numeric_match("the sum is 46", "46") == 1.0
    assert numeric_match("= 46.0000001", "46") == 1.0  # default abs_tol 1e-6
    assert numeric_match("= 46.001", "46") == 0.0
    assert numeric_match("= 46.001", "46", abs_tol=1e-2) == 1.0
    assert numeric_match("= 101", "100", rel_tol=0.02, abs_tol=0.0) == 1.0
    assert numeric_match("= 1,000", "1000") == 1.0
    assert numeric_match("no number", "46") == 0.0
    assert numeric_match("46", "unknown") == 0.0


def test_registry():
    assert {"exact_match", "numeric_match", "math_verify"} <= set(available_rewards())
    assert get_reward("numeric_match") is numeric_match
    with pytest.raises(KeyError, match="unknown reward 'nope'"):
        get_reward("nope")

    @register_reward("test_always_one")
    def always_one(response: str, ground_truth: str) -> float:
        return 1.0

    assert get_reward("test_always_one")("a", "b") == 1.0
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_always_one")(exact_match)


def test_safe_reward_turns_errors_into_zero_and_counts_them(caplog):
    def flaky(response: str, ground_truth: str) -> float:
        if response == "boom":
            raise RuntimeError("parser exploded")
        if response == "nan":
            return float("nan")
        return 1.0

    reward = safe_reward(flaky)
    with caplog.at_level(logging.ERROR, logger="sapo_megatron.rewards.registry"):
        assert reward("ok", "x") == 1.0
        assert reward("boom", "x") == 0.0
        assert reward("boom", "x") == 0.0
        assert reward("nan", "x") == 0.0
    assert reward.metrics() == {"reward/errors": 3.0, "reward/calls": 4.0}
    logged = [r for r in caplog.records if "flaky raised" in r.getMessage()]
    assert len(logged) == 1 and "parser exploded" in caplog.text and "Traceback" in caplog.text


@pytest.mark.skipif(not math_verify_available(), reason="math-verify not installed (extra 'math')")
def test_math_verify_reward():
    import threading

    assert get_reward("math_verify")("so the answer is $\\boxed{\\frac{1}{2}}$", "0.5")["score"] == 1.0
    assert get_reward("math_verify")("\\boxed{3}", "$\\frac{1}{2}$")["score"] == 0.0
    results = []
    thread = threading.Thread(
        target=lambda: results.append(get_reward("math_verify")("\\boxed{46}", "46")["score"])
    )
    thread.start()
    thread.join()
    assert results == [1.0]  # works off the main thread (timeouts switched off there)


@pytest.fixture
def without_math_verify(monkeypatch):
    """Imports of math_verify fail, as on a machine without the package."""
    import builtins

    real_import = builtins.__import__

    def no_math_verify(name, *args, **kwargs):
        if name.startswith("math_verify"):
            raise ImportError("no math_verify")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_math_verify)


def test_math_verify_missing_names_the_extra(without_math_verify):
    with pytest.raises(ImportError, match=r"pip install 'sapo-megatron\[math\]'"):
        get_reward("math_verify")("1", "1")


def test_unusable_reward_is_a_config_error_before_training(without_math_verify):
    with pytest.raises(ConfigError) as err:
        check_reward_available("math_verify")
    assert str(err.value) == (
        "algorithm.reward='math_verify' cannot run here: the math_verify reward needs the math-verify package: "
        "pip install 'sapo-megatron[math]'"
    )
    check_reward_available("numeric_match")  # no dependency
    with pytest.raises(
        ConfigError, match=r"'numeric_macth' is not a registered reward .*; registered: .*numeric_match"
    ):
        check_reward_available("numeric_macth")


def test_math_verify_passes_the_check_where_installed():
    if not math_verify_available():
        with pytest.raises(ConfigError):
            check_reward_available("math_verify")
    else:
        check_reward_available("math_verify")


def failing_reward(failures: set[str]):
    """A reward that raises on the responses in ``failures`` (naming them) and scores 1.0 otherwise."""

    def reward(response: str, ground_truth: str) -> float:
        if response in failures:
            raise RuntimeError(f"cannot parse {response}")
        return 1.0

    return reward


def test_error_budget_per_step():
    reward = safe_reward(
        failing_reward({"r3", "s0", "s2", "s4", "s6", "s8", "s10", "s12", "s14", "s16", "s18"})
    )
    step1 = [reward(f"r{i}", "x") for i in range(20)]  # 1 of 20 raises: 5%
    assert step1.count(0.0) == 1
    reward.check_error_budget(0.1)
    assert reward.take_step_metrics() == {"reward/error_frac": 0.05, "reward/errors": 1.0}
    step2 = [reward(f"s{i}", "x") for i in range(20)]  # 10 of 20 raise: 50%
    assert step2.count(0.0) == 10
    with pytest.raises(RewardError) as err:
        reward.check_error_budget(0.1)
    assert isinstance(err.value, UserError)
    assert str(err.value) == (
        "reward 'reward' raised on 10 of 20 samples this step (50%), more than "
        "algorithm.max_reward_error_frac=0.1; first error: RuntimeError: cannot parse s0"
    )  # the first error of this step, not of the run
    reward.check_error_budget(0.5)  # exactly at the budget is allowed
    assert reward.take_step_metrics() == {"reward/error_frac": 0.5, "reward/errors": 10.0}
    assert reward.take_step_metrics() == {"reward/error_frac": 0.0, "reward/errors": 0.0}
    reward.check_error_budget(0.0)  # a step without calls passes
    assert reward.metrics() == {"reward/errors": 11.0, "reward/calls": 40.0}  # the run's totals stay
    assert reward.errors == 11
