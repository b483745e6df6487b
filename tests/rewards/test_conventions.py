"""Rewards as verl and TRL users have them (issue 29, friction 1): verl's ``compute_score`` and TRL's batched
``(prompts, completions, **kwargs)`` are recognised by signature and called as their frameworks call them; a
signature of no accepted shape is refused with the shapes listed; docs/rewards.md's examples run as written."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from sapo_megatron.config import ConfigError
from sapo_megatron.data.datasets import DatasetKeys, read_dataset
from sapo_megatron.rewards.runner import build_reward_runner, check_reward_available
from sapo_megatron.rewards.samples import score_sample_groups
from sapo_megatron.rewards.types import RewardInput

DOCS = Path(__file__).resolve().parents[2] / "docs" / "rewards.md"
EXAMPLE = re.compile(r"```python\n# (\S+\.py)\s+algorithm: \{reward: (\S+?)\}\n(.*?)```", re.S)

RECORDING = """
def verl_recorder(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
    return {"score": scale * float(solution_str.endswith(ground_truth)),
            "seen": [data_source, solution_str, ground_truth, extra_info]}

def verl_no_extra(data_source, solution_str, ground_truth):
    return float(solution_str == ground_truth)

def trl_recorder(prompts, completions, **kwargs):
    return [{"score": float(i), "seen": [prompts[i], completions[i], {k: v[i] for k, v in sorted(kwargs.items())}]}
            for i in range(len(completions))]

def trl_needs_ids(prompts, completions, completion_ids):
    return [0.0] * len(completions)

def neither(text, gt):
    return 1.0
"""


def doc_examples() -> dict[str, tuple[str, str]]:
    """``{file name: (function, code)}`` of docs/rewards.md's runnable examples."""
    return {
        Path(f).name: (spec.rpartition(":")[2], code) for f, spec, code in EXAMPLE.findall(DOCS.read_text())
    }


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("conventions")
    (d / "recording.py").write_text(RECORDING)
    for name, (_, code) in doc_examples().items():
        (d / name).write_text(code)
    return d


def test_docs_show_a_verl_and_a_trl_example():
    assert set(doc_examples()) == {"gsm8k_verl.py", "trl_format.py"}


@pytest.mark.parametrize("workers", [0, 1])
def test_verl_compute_score_is_called_with_verl_names(folder, workers):
    """Friction 1: verl's compute_score(data_source, solution_str, ground_truth, extra_info) is accepted."""
    item = RewardInput(response="so #### 72", label="72", source="openai/gsm8k", metadata={"index": 3})
    with build_reward_runner(
        f"{folder}/recording.py:verl_recorder", workers=workers, kwargs={"scale": 2.0}
    ) as r:
        out = r.score([item, RewardInput(response="#### 7", label="72")])
    assert [o.score for o in out] == [2.0, 0.0]
    assert out[0].fields["seen"] == ["openai/gsm8k", "so #### 72", "72", {"index": 3}]
    with build_reward_runner(f"{folder}/recording.py:verl_no_extra", workers=0) as r:
        assert [o.score for o in r.score([RewardInput(response="5", label="5", metadata={"x": 1})])] == [1.0]


def test_docs_verl_example_scores_gsm8k_answers(folder):
    fn, _ = doc_examples()["gsm8k_verl.py"]
    with build_reward_runner(f"{folder}/gsm8k_verl.py:{fn}", workers=0) as runner:
        out = runner.score(
            [RewardInput(response=r, label="1234") for r in ("x #### 1,234", "#### 12", "1234")]
        )
    assert [o.score for o in out] == [1.0, 0.0, 0.0] and out[0].fields == {"answer": "1234"}
    assert all(o.error is None for o in out)


@dataclass
class _Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    reward_fields: dict | None = None


def _rows(tmp: Path) -> list:
    path = tmp / "trl.jsonl"
    rows = [
        {"prompt": [{"role": "user", "content": "3+4?"}], "ground_truth": "7", "level": 1},
        {"prompt": [{"role": "user", "content": "5+5?"}], "ground_truth": "10", "level": 2},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return read_dataset(path, DatasetKeys()).rows


@pytest.mark.parametrize("workers", [0, 1])
def test_trl_reward_gets_lists_messages_and_columns(folder, tmp_path, workers):
    """Friction 1: TRL's (prompts, completions, **kwargs) gets one call per group, chat messages for a message
    dataset and the dataset's other columns as lists, one entry per completion."""
    rows = _rows(tmp_path)
    texts = {1: "it is 7", 2: "ten", 3: "10"}
    groups = [[_Sample([0], [1]), _Sample([0], [2])], [_Sample([0], [3])]]
    with build_reward_runner(f"{folder}/recording.py:trl_recorder", workers=workers) as runner:
        scores = score_sample_groups(runner, groups, rows, lambda ids: texts.get(ids[0], "P"))
    assert scores == [[0.0, 1.0], [0.0]]  # the index within its call: one call per group
    prompt, completion, columns = groups[0][1].reward_fields["seen"]
    assert prompt == [{"role": "user", "content": "3+4?"}]
    assert completion == [{"role": "assistant", "content": "ten"}]
    assert columns == {"ground_truth": "7", "level": 1}
    assert groups[1][0].reward_fields["seen"][2] == {"ground_truth": "10", "level": 2}


def test_docs_trl_example_runs_on_strings_and_messages(folder, tmp_path):
    fn, _ = doc_examples()["trl_format.py"]
    rows = _rows(tmp_path)
    groups = [[_Sample([0], [1]), _Sample([0], [2])]]
    texts = {1: "it is 7", 2: "ten"}
    with build_reward_runner(f"{folder}/trl_format.py:{fn}", workers=0) as runner:
        scores = score_sample_groups(runner, groups, rows[:1], lambda ids: texts.get(ids[0], "P"))
        plain = runner.score([RewardInput(response="so 10", label="10", columns={"ground_truth": "10"})])
    assert scores[0] == pytest.approx([1 - 0.007, -0.003])
    assert plain[0].score == pytest.approx(1 - 0.005) and plain[0].error is None


def test_a_signature_of_no_accepted_shape_lists_the_shapes(folder):
    """Friction 1: the refusal names verl's and TRL's shapes next to this project's."""
    with pytest.raises(ConfigError) as err:
        check_reward_available(f"{folder}/recording.py:neither")
    message = str(err.value)
    assert "matches none of the accepted reward shapes" in message and "\n" not in message
    for shape in (
        "fn(response, label",
        "compute_score(data_source, solution_str, ground_truth",
        "(TRL, batched)",
    ):
        assert shape in message
    with pytest.raises(ConfigError, match="'completion_ids' \\(TRL\\) has no value here"):
        check_reward_available(f"{folder}/recording.py:trl_needs_ids")
    with pytest.raises(ConfigError, match="reward_kwargs has 'mode', which the reward does not accept"):
        check_reward_available(f"{folder}/recording.py:verl_no_extra", kwargs={"mode": 1})


def test_remote_protocol_keeps_its_fields():
    item = RewardInput(response="a", label="b", messages=[{"role": "user", "content": "q"}], columns={"x": 1})
    assert set(item.as_dict()) == {"response", "label", "prompt", "source", "metadata", "group_id"}
