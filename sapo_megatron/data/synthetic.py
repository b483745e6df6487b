"""Synthetic verifiable tasks: multi-digit addition, ``"12+34="`` -> ``"46"`` (domain ``addition``), and
multiplication by a one-digit number, ``"37*6="`` -> ``"222"`` (domain ``multiplication``); both are scored by
the ``numeric_match`` reward. A data source ``synthetic:addition+multiplication`` mixes tasks (equal shares,
interleaved), which gives multi-teacher distillation (MOPD) two domains.

Difficulty is the number of digits of each operand (addition) or of the first operand (multiplication). Train and held-out splits partition the *unordered* operand
pairs by a fixed hash, so ``a+b`` and ``b+a`` always fall in the same split and no held-out problem (in either
order) is ever a training problem, as long as both splits are drawn with the same ``heldout_fraction``. Generation
is deterministic in ``seed``.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from sapo_megatron.data.prompts import DatasetError, PromptRow

DOMAIN = "addition"
MULTIPLICATION = "multiplication"
TASKS: tuple[str, ...] = (DOMAIN, MULTIPLICATION)
"""The synthetic tasks, by their domain names."""
Split = Literal["train", "heldout"]
SIZE_FIELDS = {"train": "data.train_size", "heldout": "the eval dataset's size"}
"""Where a run sets how many problems of each split it draws (named in errors)."""


def _operand_range(digits: int) -> tuple[int, int]:
    if digits < 1:
        raise ValueError(f"digits must be >= 1, got {digits}")
    return (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1


def pair_split(a: int, b: int, heldout_fraction: float) -> Split:
    """Which split the unordered pair {a, b} belongs to (a fixed multiplicative hash, independent of any seed)."""
    lo, hi = min(a, b), max(a, b)
    key = (lo * 1_000_003 + hi) * 2_654_435_761 % 2**32
    return "heldout" if key < heldout_fraction * 2**32 else "train"


def addition_problem(a: int, b: int) -> PromptRow:
    return PromptRow(prompt=f"{a}+{b}=", ground_truth=str(a + b), domain=DOMAIN)


def multiplication_problem(a: int, b: int) -> PromptRow:
    return PromptRow(prompt=f"{a}*{b}=", ground_truth=str(a * b), domain=MULTIPLICATION)


def make_task_rows(
    task: str, n: int, *, digits: int = 2, split: Split = "train", seed: int = 0
) -> list[PromptRow]:
    """``n`` distinct problems of one synthetic ``task`` (a name of :data:`TASKS`) and split."""
    if task == DOMAIN:
        return make_addition_rows(n, digits=digits, split=split, seed=seed)
    if task == MULTIPLICATION:
        return make_multiplication_rows(n, digits=digits, split=split, seed=seed)
    raise ValueError(f"unknown synthetic task {task!r}; choose from {', '.join(TASKS)}")


def make_mixed_rows(
    tasks: list[str], n: int, *, digits: int = 2, split: Split = "train", seed: int = 0
) -> list[PromptRow]:
    """``n`` problems drawn from ``tasks`` in turn (task ``i`` supplies rows ``i, i + len(tasks), ...``)."""
    if not tasks:
        raise ValueError("make_mixed_rows needs at least one task")
    shares = [len(range(i, n, len(tasks))) for i in range(len(tasks))]
    per_task = [
        make_task_rows(task, share, digits=digits, split=split, seed=seed)
        for task, share in zip(tasks, shares)
    ]
    return [per_task[i % len(tasks)][i // len(tasks)] for i in range(n)]


def make_multiplication_rows(
    n: int, *, digits: int = 2, split: Split = "train", seed: int = 0, heldout_fraction: float = 0.1
) -> list[PromptRow]:
    """``n`` distinct problems ``a*b=`` with ``a`` of ``digits`` digits and ``b`` in 2..9, of one split (the
    pair hash of :func:`pair_split`, as for addition). Raises :class:`DatasetError` when the split is too small."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    lo, hi = _operand_range(digits)
    pairs = [
        (a, b) for a in range(lo, hi + 1) for b in range(2, 10) if pair_split(a, b, heldout_fraction) == split
    ]
    if len(pairs) < n:
        raise DatasetError(
            f"only {len(pairs)} distinct {split} multiplication problems with digits={digits}, {n} asked for; "
            f"ask for fewer ({SIZE_FIELDS[split]}) or allow more digits (data.digits)"
        )
    rng = np.random.default_rng([seed, 2 if split == "train" else 3])
    chosen = rng.choice(len(pairs), size=n, replace=False)
    return [multiplication_problem(*pairs[int(i)]) for i in chosen]


def make_addition_rows(
    n: int,
    *,
    digits: int | tuple[int, int] = 2,
    split: Split = "train",
    seed: int = 0,
    heldout_fraction: float = 0.1,
    max_attempts_per_row: int = 1000,
) -> list[PromptRow]:
    """``n`` distinct addition problems of one split.

    ``digits`` is the operand length, or an inclusive range drawn uniformly per problem. Problems are distinct as
    ordered pairs; raises :class:`DatasetError` (a ValueError) when the split has too few problems to draw ``n``.
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    if not 0.0 < heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in (0, 1), got {heldout_fraction}")
    low_digits, high_digits = (digits, digits) if isinstance(digits, int) else digits
    ranges = [_operand_range(d) for d in range(low_digits, high_digits + 1)]
    rng = np.random.default_rng([seed, 0 if split == "train" else 1])
    seen: set[tuple[int, int]] = set()
    rows: list[PromptRow] = []
    attempts = 0
    while len(rows) < n:
        attempts += 1
        if attempts > max_attempts_per_row * max(n, 1):
            raise DatasetError(
                f"could draw only {len(rows)} of {n} distinct {split} addition problems with digits={digits}; "
                f"ask for fewer ({SIZE_FIELDS[split]}) or allow more digits (data.digits)"
            )
        lo, hi = ranges[int(rng.integers(len(ranges)))]
        a, b = (int(x) for x in rng.integers(lo, hi + 1, size=2))
        if (a, b) in seen or pair_split(a, b, heldout_fraction) != split:
            continue
        seen.add((a, b))
        rows.append(addition_problem(a, b))
    return rows
