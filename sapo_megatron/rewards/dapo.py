"""DAPO's math reward (``Answer: ...`` format), scored as verl ``verl/utils/reward_score/math_dapo.py`` does.

- only the last 300 characters of the response are read;
- the answer is what follows the *last* ``Answer:`` (case-insensitive, spaces allowed before and after the colon)
  up to the end of its line; without one the answer is ``[INVALID]``;
- the answer and the label are both normalised in the Minerva way (the text after the last ``=``; units, ``\\text``,
  ``\\$``, spaces and a few words removed; ``\\boxed{x}`` -> ``x``; ``\\fracab`` -> ``\\frac{a}{b}``; ``1,000`` ->
  ``1000``) and compared as strings;
- the score is **+1.0 when equal, -1.0 otherwise** (DAPO's own scale), with fields ``acc`` (bool) and ``answer``.
"""

from __future__ import annotations

import re
from typing import Any

_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_TAIL_CHARS = 300

_REPLACE = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    (r"\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_DROP = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3",
    "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"', "\\dots",
)  # fmt: skip


def normalize_answer(answer: str) -> str:
    """Minerva-style normalisation of a final answer (the same steps, in the same order, as verl's
    ``normalize_final_answer``)."""
    answer = answer.split("=")[-1]
    for before, after in _REPLACE:
        answer = answer.replace(before, after)
    for word in _DROP:
        answer = answer.replace(word, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)
    for command in ("text", "textbf", "overline"):
        answer = re.sub(r"(\\" + command + r"\{)(.*?)(\})", "\\2", answer)
    answer = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", answer)
    answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)
    answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def dapo_math(response: str, label: str) -> dict[str, Any]:
    """``{"score": +1.0 | -1.0, "acc": bool, "answer": str}`` by the rules in the module docstring."""
    matches = _ANSWER.findall(response[-_TAIL_CHARS:])
    predicted = normalize_answer(matches[-1] if matches else "[INVALID]")
    correct = predicted == normalize_answer(label)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "answer": predicted}
