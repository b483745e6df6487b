"""Answer extraction and exact / numeric answer rewards for synthetic and short-answer tasks.

Extraction rule (:func:`extract_final_answer`), applied to the response and to the ground truth alike:

1. if the text contains ``####``, the answer is what follows the last ``####`` (GSM8K style);
2. else if it contains ``=``, the answer is what follows the last ``=`` ("12+34=46" -> "46");
3. else the answer is the whole text.

The candidate is cut at its first line break and stripped; runs of whitespace become one space and one trailing
period is dropped. An empty answer counts as no answer (reward 0).

:func:`numeric_match` then reads the *last number* of each extracted answer (``-1,234.5e3`` style: sign, thousands
commas, decimals, exponent) and compares them with ``math.isclose(rel_tol, abs_tol)``.
"""

from __future__ import annotations

import math
import re

_NUMBER = re.compile(
    r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+(?:[eE][-+]?\d+)?"
)


def extract_final_answer(text: str) -> str | None:
    """The final answer of ``text`` by the rule in the module docstring, or None if there is none."""
    if "####" in text:
        candidate = text.rsplit("####", 1)[1]
    elif "=" in text:
        candidate = text.rsplit("=", 1)[1]
    else:
        candidate = text
    candidate = candidate.strip().split("\n", 1)[0]
    candidate = " ".join(candidate.split())
    if candidate.endswith("."):
        candidate = candidate[:-1].rstrip()
    return candidate or None


def extract_last_number(text: str) -> float | None:
    """The last number in ``text`` as a float, or None."""
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    try:
        return float(matches[-1].replace(",", ""))
    except ValueError:
        return None


def exact_match(response: str, ground_truth: str) -> float:
    """1.0 when the extracted answers are equal as strings (case-sensitive), else 0.0."""
    predicted = extract_final_answer(response)
    expected = extract_final_answer(ground_truth)
    return 1.0 if predicted is not None and predicted == expected else 0.0


def numeric_match(response: str, ground_truth: str, *, rel_tol: float = 0.0, abs_tol: float = 1e-6) -> float:
    """1.0 when the last numbers of the extracted answers agree within ``rel_tol`` / ``abs_tol``, else 0.0."""
    predicted_text = extract_final_answer(response)
    expected_text = extract_final_answer(ground_truth)
    if predicted_text is None or expected_text is None:
        return 0.0
    predicted = extract_last_number(predicted_text)
    expected = extract_last_number(expected_text)
    if predicted is None or expected is None:
        return 0.0
    return 1.0 if math.isclose(predicted, expected, rel_tol=rel_tol, abs_tol=abs_tol) else 0.0
