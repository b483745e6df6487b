"""Answer extraction and exact / numeric answer rewards for synthetic and short-answer tasks.

Extraction rule (:func:`extract_final_answer`), applied to the response and to the ground truth alike:

1. if the text contains a complete ``\\boxed{...}`` (balanced braces), the answer is the content of the *last*
   one, and nothing after it counts (``\\boxed{3} ... wait, 4`` -> "3": the boxed answer is the one the response
   committed to, as in verl's and slime's math rewards);
2. else if it contains ``####``, the answer is what follows the last ``####`` (GSM8K style);
3. else if it contains ``=``, the answer is what follows the last ``=`` ("12+34=46" -> "46");
4. else the answer is the whole text.

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


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` of ``text`` with balanced braces (``\\boxed {x}`` too), or None
    when there is none or it is not closed. verl's ``math_dapo.last_boxed_only_string`` finds the same one."""
    start = text.rfind("\\boxed")
    while start >= 0:
        brace = start + len("\\boxed")
        while brace < len(text) and text[brace] == " ":
            brace += 1
        if brace < len(text) and text[brace] == "{":
            depth = 0
            for end in range(brace, len(text)):
                depth += {"{": 1, "}": -1}.get(text[end], 0)
                if depth == 0:
                    return text[brace + 1 : end]
            return None
        start = text.rfind("\\boxed", 0, start)
    return None


def extract_final_answer(text: str) -> str | None:
    """The final answer of ``text`` by the rule in the module docstring, or None if there is none."""
    boxed = last_boxed(text)
    if boxed is not None:
        candidate = boxed
    elif "####" in text:
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


def exact_match(response: str, label: str) -> float:
    """1.0 when the extracted answers are equal as strings (case-sensitive), else 0.0."""
    predicted = extract_final_answer(response)
    expected = extract_final_answer(label)
    return 1.0 if predicted is not None and predicted == expected else 0.0


def numeric_match(response: str, label: str, *, rel_tol: float = 0.0, abs_tol: float = 1e-6) -> float:
    """1.0 when the last numbers of the extracted answers agree within ``rel_tol`` / ``abs_tol``, else 0.0."""
    predicted_text = extract_final_answer(response)
    expected_text = extract_final_answer(label)
    if predicted_text is None or expected_text is None:
        return 0.0
    predicted = extract_last_number(predicted_text)
    expected = extract_last_number(expected_text)
    if predicted is None or expected is None:
        return 0.0
    return 1.0 if math.isclose(predicted, expected, rel_tol=rel_tol, abs_tol=abs_tol) else 0.0
