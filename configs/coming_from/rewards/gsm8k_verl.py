"""A GSM8K reward exactly as a verl user has it: verl's ``compute_score`` signature, used here unchanged
(docs/coming_from.md, docs/rewards.md)."""

import re


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    pattern = r"#### (\-?[0-9\.\,]+)" if method == "strict" else r"(\-?[0-9\.\,]+)"
    found = re.findall(pattern, solution_str)
    return found[-1].replace(",", "").replace("$", "") if found else None


def compute_score(
    data_source, solution_str, ground_truth, extra_info=None, method="strict", format_score=0.0, score=1.0
):
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return score if answer == ground_truth else format_score
