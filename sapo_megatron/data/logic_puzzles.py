"""Knights and knaves: logic puzzles with exactly one solution, made by a seeded generator, and their verifier.

On the island, knights always tell the truth and knaves always lie. Each of 2-4 people makes one statement
about the others or themselves ("X is a knave", "X and Y are both knights", "X or Y is a knave", "X and I are
the same kind", "X and I are of different kinds"). The generator draws statements until exactly one assignment
of knight / knave is consistent (every knight's statement true, every knave's false), found by trying all 2^n.
The label names everyone's kind, ``Alice: knight, Bob: knave``; the reward ``knights_knaves``
(:mod:`sapo_megatron.rewards.logic`) gives 1.0 when the response's final answer (``\\boxed{...}``, else its last line) names every
person with the right kind, else 0.0.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from pathlib import Path

from sapo_megatron.data.prompts import DatasetError

NAMES = ("Alice", "Bob", "Cara", "Dan")
SOURCE = "knights_knaves"
Statement = tuple[str, ...]


def truth(statement: Statement, speaker: str, knights: dict[str, bool]) -> bool:
    """Whether ``speaker``'s ``statement`` is true when ``knights[name]`` says who is a knight."""
    kind, *names = statement
    if kind == "knight":
        return knights[names[0]]
    if kind == "knave":
        return not knights[names[0]]
    if kind == "both_knights":
        return knights[names[0]] and knights[names[1]]
    if kind == "one_knave":
        return not knights[names[0]] or not knights[names[1]]
    if kind == "same":
        return knights[names[0]] == knights[speaker]
    if kind == "different":
        return knights[names[0]] != knights[speaker]
    raise ValueError(f"unknown statement kind {kind!r}")


def solutions(statements: dict[str, Statement]) -> list[dict[str, bool]]:
    """Every consistent assignment: a knight's statement is true, a knave's false."""
    people = list(statements)
    found = []
    for values in itertools.product((True, False), repeat=len(people)):
        knights = dict(zip(people, values))
        if all(truth(statements[p], p, knights) == knights[p] for p in people):
            found.append(knights)
    return found


def make_puzzle(rng: random.Random, people: int) -> tuple[dict[str, Statement], dict[str, bool]]:
    """Statements of ``people`` people with exactly one solution, and that solution."""
    names = list(NAMES[:people])
    while True:
        statements = {speaker: _statement(rng, speaker, names) for speaker in names}
        found = solutions(statements)
        if len(found) == 1:
            return statements, found[0]


def _statement(rng: random.Random, speaker: str, names: list[str]) -> Statement:
    others = [n for n in names if n != speaker]
    kind = rng.choice(["knight", "knave", "both_knights", "one_knave", "same", "different"])
    if kind in ("both_knights", "one_knave"):
        return (kind, *rng.sample(names, 2))
    return (kind, rng.choice(others))


def say(statement: Statement) -> str:
    kind, *names = statement
    return {
        "knight": "{0} is a knight.",
        "knave": "{0} is a knave.",
        "both_knights": "{0} and {1} are both knights.",
        "one_knave": "{0} or {1} is a knave.",
        "same": "{0} and I are the same kind.",
        "different": "{0} and I are of different kinds.",
    }[kind].format(*names)


def label(knights: dict[str, bool]) -> str:
    return ", ".join(f"{name}: {'knight' if k else 'knave'}" for name, k in knights.items())


def puzzle_text(statements: dict[str, Statement]) -> str:
    said = " ".join(f'{speaker} says: "{say(s)}"' for speaker, s in statements.items())
    example = ", ".join(f"{name}: knight" for name in list(statements)[:2])
    return (
        "On an island, knights always tell the truth and knaves always lie. "
        f"{said} Who is a knight and who is a knave? Give everyone's kind as \\boxed{{{example}, ...}}."
    )


def write_logic_dataset(directory: str | Path, n: int, *, seed: int = 0, split: str = "train") -> Path:
    """``n`` puzzles of 2-4 people into ``directory/{split}.jsonl`` (plain layout, source knights_knaves)."""
    if n < 1:
        raise DatasetError(f"write_logic_dataset: n must be >= 1, got {n}")
    rng = random.Random(f"{seed}-{split}-knights")
    lines = []
    for _ in range(n):
        statements, knights = make_puzzle(rng, rng.randint(2, 4))
        record = {"prompt": puzzle_text(statements), "ground_truth": label(knights), "domain": SOURCE}
        lines.append(json.dumps(record) + "\n")
    path = Path(directory) / f"{split}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines))
    return path


_ASSIGNMENT = re.compile(r"\b([A-Z][a-z]+)\b\s*(?::|=|is|-)?\s*(?:a\s+)?\b(knight|knave)s?\b", re.IGNORECASE)


def parse_assignment(text: str) -> dict[str, str]:
    """``{name: knight|knave}`` of every "Name: kind" / "Name is a kind" of a puzzle's people in ``text`` (the
    last one per name)."""
    found = {m[1].capitalize(): m[2].lower() for m in _ASSIGNMENT.finditer(text)}
    return {name: kind for name, kind in found.items() if name in NAMES}
