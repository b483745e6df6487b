"""Tasks for the paper's mix: the seeded visual generator (its answers checked against the pixels it drew), the
easy-VQA loader, knights-and-knaves puzzles with exactly one solution, their verifier, and the mixed reward that
picks each row's reward by its source; all read through the ordinary dataset reader."""

from __future__ import annotations

import numpy as np
import pytest

from sapo_megatron.data.datasets import DatasetKeys, read_dataset
from sapo_megatron.data.images import ImagePolicy
from sapo_megatron.data.logic_puzzles import make_puzzle, puzzle_text, solutions, write_logic_dataset
from sapo_megatron.data.visual_tasks import COLOURS, TASKS, write_easy_vqa_dataset, write_visual_dataset
from sapo_megatron.rewards import get_reward
from sapo_megatron.rewards.logic import knights_knaves, mixed_tasks

POLICY = ImagePolicy(factor=16, min_pixels=256, max_pixels=64 * 64)


def components(mask: np.ndarray) -> int:
    """Connected regions (4-neighbour) of a boolean image."""
    seen = np.zeros_like(mask)
    count = 0
    for y, x in zip(*np.nonzero(mask)):
        if seen[y, x]:
            continue
        count += 1
        stack = [(y, x)]
        while stack:
            cy, cx = stack.pop()
            if 0 <= cy < mask.shape[0] and 0 <= cx < mask.shape[1] and mask[cy, cx] and not seen[cy, cx]:
                seen[cy, cx] = True
                stack += [(cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)]
    return count


def test_visual_generator_is_seeded_and_its_answers_match_the_pixels(tmp_path):
    path = write_visual_dataset(tmp_path / "a", 24, seed=3)
    again = write_visual_dataset(tmp_path / "b", 24, seed=3)
    assert path.read_text() == again.read_text()
    assert (tmp_path / "a/images/train-000005.png").read_bytes() == (
        tmp_path / "b/images/train-000005.png"
    ).read_bytes()
    dataset = read_dataset(path, DatasetKeys(), POLICY)
    assert dataset.counts_by_source() == {task: 6 for task in sorted(TASKS)}
    for row in dataset.rows:
        pixels = np.asarray(row.images[0].load())
        assert row.images[0].size == (64, 64)
        drawn = (pixels != 255).any(axis=-1)
        if row.domain == "name_colour":  # every drawn pixel has the answer's colour
            assert {tuple(p) for p in pixels[drawn]} == {COLOURS[row.ground_truth]}
        elif row.domain == "count_shapes":  # circles and squares never touch: regions = shapes
            circles = int(row.ground_truth)
            assert 1 <= circles <= components(drawn) <= circles + 3
        else:
            assert row.ground_truth.isdigit() and drawn.any()
    geometry = [r for r in dataset.rows if r.domain == "geometry"]
    assert all(int(r.ground_truth) >= 4 for r in geometry)


def test_easy_vqa_loader(tmp_path):
    easy_vqa = pytest.importorskip("easy_vqa")
    path = write_easy_vqa_dataset(tmp_path, split="test", limit=60)
    rows = read_dataset(path, DatasetKeys(), POLICY).rows
    assert len(rows) == 60 and all(r.images[0].size == (64, 64) for r in rows)
    assert {r.ground_truth for r in rows} <= set(easy_vqa.get_answers())
    assert {r.domain for r in rows} <= {"easy_vqa_yes_no", "easy_vqa_shape", "easy_vqa_colour"}
    questions, answers, _ = easy_vqa.get_test_questions()
    assert rows[0].prompt.startswith("<image>" + questions[0][:1].upper() + questions[0][1:])
    assert rows[0].ground_truth == answers[0]


def test_a_hand_checked_puzzle_and_generated_ones_have_one_solution(tmp_path):
    # Alice: "Bob is a knave." Bob: "Alice and I are the same kind." If Alice lied, Bob would be a knight saying
    # something false; so Alice is a knight, Bob a knave (who lies: they differ).
    statements = {"Alice": ("knave", "Bob"), "Bob": ("same", "Alice")}
    assert solutions(statements) == [{"Alice": True, "Bob": False}]
    import random

    rng = random.Random(0)
    for people in (2, 3, 4):
        statements, knights = make_puzzle(rng, people)
        assert solutions(statements) == [knights] and len(knights) == people
        assert puzzle_text(statements).count(" says: ") == people
    path = write_logic_dataset(tmp_path, 20, seed=1)
    rows = read_dataset(path, DatasetKeys(), None).rows
    assert len(rows) == 20 and {r.domain for r in rows} == {"knights_knaves"}


def test_knights_knaves_verifier():
    label = "Alice: knight, Bob: knave, Cara: knight"
    assert knights_knaves("So \\boxed{Alice: knight, Bob: knave, Cara: knight}", label) == 1.0
    assert knights_knaves("Thinking...\nAlice is a knight, Bob is a knave, Cara is a knight.", label) == 1.0
    assert knights_knaves("\\boxed{Alice: knight, Bob: knight, Cara: knight}", label) == 0.0
    assert knights_knaves("\\boxed{Alice: knight, Bob: knave}", label) == 0.0  # Cara missing
    assert knights_knaves("\\boxed{Alice: knight, Bob: knave, Cara: knight, Dan: knave}", label) == 0.0
    assert knights_knaves("", label) == 0.0
    assert get_reward("knights_knaves") is knights_knaves


def test_mixed_reward_by_source():
    assert mixed_tasks("\\boxed{3}", "3", source="count_shapes") == 1.0
    assert mixed_tasks("\\boxed{3.0}", "3", source="geometry") == 1.0
    assert mixed_tasks("\\boxed{red}", "red", source="name_colour") == 1.0
    assert mixed_tasks("\\boxed{Red}", "red", source="easy_vqa_colour") == 0.0  # exact, case-sensitive
    assert (
        mixed_tasks(
            "\\boxed{Alice: knave, Bob: knight}", "Alice: knave, Bob: knight", source="knights_knaves"
        )
        == 1.0
    )
    math = mixed_tasks("\\boxed{\\frac{1}{2}}", "0.5", source="math")
    assert (math["score"] if isinstance(math, dict) else math) in (0.0, 1.0)
    assert get_reward("mixed_tasks") is mixed_tasks
