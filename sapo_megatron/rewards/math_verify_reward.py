"""Math answers checked with Hugging Face's ``math-verify`` (optional extra ``math``)."""

from __future__ import annotations

import threading

INSTALL_HINT = "the math_verify reward needs the math-verify package: pip install 'sapo-megatron[math]'"


def math_verify_available() -> bool:
    try:
        import math_verify  # noqa: F401
    except ImportError:
        return False
    return True


def math_verify_reward(response: str, ground_truth: str) -> float:
    """1.0 when math-verify finds the response's answer (``\\boxed{}``, LaTeX or plain) equal to the ground truth.

    math-verify's timeouts use ``signal.alarm``, which only works in the main thread; elsewhere they are switched
    off (run the reward in a process pool if a pathological answer could hang).
    """
    try:
        from math_verify import parse, verify
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(ground_truth, parsing_timeout=timeout)
    predicted = parse(response, parsing_timeout=timeout)
    if not gold or not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=timeout) else 0.0
