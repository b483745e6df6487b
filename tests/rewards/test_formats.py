"""Answer formats of the built-in rewards, checked on tables against the public implementations.

The expected values were produced by running the public code on the same cases:
- ``dapo_math``: verl, ``verl/utils/reward_score/math_dapo.py`` (volcengine/verl, ``compute_score``);
- ``math_verify``: verl, ``verl/utils/reward_score/math_verify.py`` (volcengine/verl, ``compute_score``), which
  slime's ``slime/rollout/rm_hub`` math rewards follow (the label wrapped in ``\\boxed{}``).
"""

from __future__ import annotations

import pytest

from sapo_megatron.rewards import exact_match, numeric_match
from sapo_megatron.rewards.answers import extract_final_answer, last_boxed
from sapo_megatron.rewards.dapo import dapo_math
from sapo_megatron.rewards.math_verify_reward import math_verify_available, math_verify_reward

# (response, label, verl compute_score's score, verl's pred)
DAPO_CASES = [
    ("The sum is 5.\nAnswer: 5", "5", 1.0, "5"),
    ("answer : $\\frac{1}{2}$", "\\frac12", 1.0, "\\frac{1}{2}"),
    ("Answer: 1,000 dollars", "1000", 1.0, "1000"),
    ("Answer: 3\n... wait\nAnswer: 4", "4", 1.0, "4"),  # the last Answer: wins
    ("Answer: 3\n... wait\nAnswer: 4", "3", -1.0, "4"),
    ("no marker, just 7", "7", -1.0, "[INVALID]"),
    ("Answer: x = 12", "12", 1.0, "12"),
    ("Answer: \\boxed{42}", "42", 1.0, "42"),
    ("Answer: 90^\\circ", "90", 1.0, "90"),
    ("Answer: \\text{(B)}", "(B)", 1.0, "(B)"),
    ("x" * 400 + "Answer: 9", "9", 1.0, "9"),
    ("Answer: 9" + "x" * 400, "9", -1.0, "[INVALID]"),  # only the last 300 characters are read
]


@pytest.mark.parametrize(("response", "label", "score", "pred"), DAPO_CASES)
def test_dapo_math_matches_verl(response, label, score, pred):
    out = dapo_math(response, label)
    assert (out["score"], out["answer"], out["acc"]) == (score, pred, score == 1.0)


# (response, label, verl math_verify compute_score, ours)
MATH_VERIFY_CASES = [
    ("so the answer is $\\boxed{\\frac{1}{2}}$", "0.5", 1.0, 1.0),
    ("\\boxed{3} ... wait, 4", "3", 1.0, 1.0),
    ("\\boxed{3} ... wait, 4", "4", 0.0, 0.0),
    # two boxed answers: verl's math_verify scores both labels 0; ours takes the last boxed (as verl's
    # math_dapo.last_boxed_only_string and slime's boxed extraction do)
    ("First \\boxed{2}, finally \\boxed{5}", "5", 0.0, 1.0),
    ("First \\boxed{2}, finally \\boxed{5}", "2", 0.0, 0.0),
    ("The answer is 1/2", "\\frac{1}{2}", 1.0, 1.0),
    ("x = 3", "3", 1.0, 1.0),
    ("$x^2+2x+1$", "(x+1)^2", 1.0, 1.0),
    ("\\boxed{(1, 2]}", "(1,2]", 1.0, 1.0),
    ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", 1.0, 1.0),
    ("I do not know", "7", 0.0, 0.0),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0, 1.0),
    ("the result is 12 apples, so \\boxed{12}", "\\boxed{12}", 1.0, 1.0),
    ("\\boxed{0.333}", "\\frac{1}{3}", 0.0, 0.0),
    ("$\\frac{\\pi}{2}$", "\\frac{\\pi}{2}", 1.0, 1.0),
]


@pytest.mark.skipif(not math_verify_available(), reason="math-verify not installed (extra 'math')")
def test_math_verify_matches_verl_except_the_last_boxed_rule():
    got = [math_verify_reward(response, label)["score"] for response, label, _, _ in MATH_VERIFY_CASES]
    assert got == [ours for *_, ours in MATH_VERIFY_CASES]
    differs = [case[:2] for case in MATH_VERIFY_CASES if case[2] != case[3]]
    assert differs == [("First \\boxed{2}, finally \\boxed{5}", "5")]  # the one documented difference
    assert math_verify_reward("so \\boxed{\\frac{1}{2}} done", "0.5")["answer"] == "\\frac{1}{2}"


def test_boxed_answers_win_in_numeric_and_exact_match():
    assert last_boxed("a \\boxed{\\frac{1}{2}} b") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{1} then \\boxed {7}") == "7"
    assert last_boxed("\\boxed{2") is None and last_boxed("no box") is None
    # the case: the committed (boxed) answer counts, the afterthought does not
    assert numeric_match("\\boxed{3} ... wait, 4", "3") == 1.0
    assert numeric_match("\\boxed{3} ... wait, 4", "4") == 0.0
    assert numeric_match("x \\boxed{1} y \\boxed{12}\nmore text 99", "12") == 1.0
    assert numeric_match("12+34=46", "\\boxed{46}") == 1.0  # a boxed label too
    assert exact_match("so \\boxed{x+1}", "x+1") == 1.0
    # the synthetic addition task never boxes: scored exactly as before (last '=', then the last number)
    assert extract_final_answer("12+34=46") == "46"
    assert numeric_match("12+34=46", "12+34=46") == 1.0
    assert numeric_match("12+34=47", "12+34=46") == 0.0
    assert numeric_match("#### 1,234", "1234") == 1.0
