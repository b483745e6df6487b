"""Math answers checked with Hugging Face's ``math-verify`` (optional extra ``math``), as the field uses it.

What is compared (verl ``verl/utils/reward_score/math_verify.py`` and slime ``slime/rollout/rm_hub`` do the same):

- the label: the content of its last ``\\boxed{}`` if it has one, else the whole label; wrapped as
  ``\\boxed{label}`` and parsed as LaTeX (``LatexExtractionConfig``), as verl does;
- the response: the content of its *last* complete ``\\boxed{}`` when there is one (text after it is ignored),
  parsed as LaTeX; without a ``\\boxed{}``, the whole response is handed to math-verify, which takes the last
  plain expression or LaTeX span it can parse (``ExprExtractionConfig``, then ``LatexExtractionConfig``);
- ``verify(gold, predicted)`` decides: equal numbers (``0.5`` = ``\\frac{1}{2}`` = ``1/2``), equal symbolic
  expressions, sets and intervals. Score 1.0 or 0.0; the field ``answer`` is the response's extracted answer.

math-verify's own parse / verify timeouts (5 s each) use ``signal.alarm`` and so work only in a process's main
thread: in the reward pool's workers they always do; called inline outside the main thread they are off (the pool
then is the only guard, so ``reward_workers: auto`` uses it for this reward).
"""

from __future__ import annotations

import threading
from typing import Any

from sapo_megatron.rewards.answers import last_boxed

INSTALL_HINT = "the math_verify reward needs the math-verify package: pip install 'sapo-megatron[math]'"
TIMEOUT_S = 5


def math_verify_available() -> bool:
    try:
        import math_verify  # noqa: F401
    except ImportError:
        return False
    return True


def math_verify_reward(response: str, label: str) -> dict[str, Any]:
    """``{"score": 1.0 | 0.0, "answer": str}`` by the rules in the module docstring."""
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    timeout = TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold_text = last_boxed(label)
    gold = parse(
        "\\boxed{" + (label if gold_text is None else gold_text) + "}",
        extraction_config=(LatexExtractionConfig(),),
        parsing_timeout=timeout,
    )
    boxed = last_boxed(response)
    if boxed is not None:
        predicted = parse("\\boxed{" + boxed + "}", (LatexExtractionConfig(),), parsing_timeout=timeout)
    else:
        predicted = parse(
            response, (ExprExtractionConfig(), LatexExtractionConfig()), parsing_timeout=timeout
        )
    answer = boxed if boxed is not None else (str(predicted[-1]) if predicted else "")
    if not gold or not predicted:
        return {"score": 0.0, "answer": answer}
    correct = verify(gold, predicted, timeout_seconds=timeout)
    return {"score": 1.0 if correct else 0.0, "answer": answer}
