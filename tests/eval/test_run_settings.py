"""``eval`` and ``compare`` keep a run's settings (issue 29, frictions 6 and 7): a run trained with a chat
template is evaluated from its folder exactly as its own evaluation rendered it (string and message prompts);
``eval --max-new-tokens`` and a default that fits an HF folder's context; ``model.init: hf`` takes the config
from ``init_path``; ``compare --runs`` reports finished runs without training; the report says n and T."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from sapo_megatron.cli import main
from sapo_megatron.config import ConfigError, config_from_dict
from tests.data.chat_fixtures import write_jsonl
from tests.rl.test_trainer import train
from tests.security.hostile import case  # hostile cases of issue 30 (docs/hardening.md)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory) -> Path:
    """The embedded model with the shipped chat tokenizer: message prompts for training, string prompts for its
    evaluation (n 2 at T 1), 4 SFT steps and 1 RL step."""
    from sapo_megatron.defaults import embedded_default_dict

    root = tmp_path_factory.mktemp("chatrun")
    messages = [
        {"prompt": [{"role": "user", "content": f"What is {a} plus {a}?"}], "ground_truth": str(2 * a)}
        for a in range(8)
    ]
    strings = [{"prompt": f"What is {a} plus 3?", "ground_truth": str(a + 3)} for a in range(3)]
    raw = embedded_default_dict()
    raw["output_dir"] = str(root / "run")
    raw["data"].update(train=str(write_jsonl(root / "train.jsonl", messages)), tokenizer="chat")
    raw["sft"].update(steps=4, global_batch=8)
    raw["rollout"].update(max_new_tokens=4, n_samples=2)
    raw["trainer"].update(steps=1, prompts_per_step=4, save_every=0)
    sums = str(write_jsonl(root / "sums.jsonl", strings))
    raw["eval"] = {"every": 1, "datasets": [{"name": "sums", "path": sums, "n": 2, "temperature": 1.0}]}
    (root / "run.yaml").write_text(yaml.safe_dump(raw))
    train(root / "run.yaml")
    return root / "run"


def read_samples(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(("cls",), [case("eval/report", "eval --model RUN, chat run, string prompts", "OK")])
def test_eval_of_a_chat_template_run_gives_its_training_time_samples(chat_run, tmp_path, cls):
    """Friction 6: ``eval --model RUN`` keeps the run's template; its samples are the run's own evaluation's."""
    assert (
        "apply_chat_template"
        not in yaml.safe_load((chat_run / "config.yaml").read_text())["eval"]["defaults"]
    )
    assert main(["eval", "--model", str(chat_run), "--output-dir", str(tmp_path / "e")]) == 0
    training = read_samples(chat_run / "eval" / "step_000001")
    again = read_samples(tmp_path / "e")
    assert training[0]["prompt"].startswith(
        "<|im_start|>user\nWhat is 0 plus 3?<|im_end|>\n<|im_start|>assistant"
    )
    keys = ("prompt", "response", "score", "index", "sample")
    assert [{k: s[k] for k in keys} for s in again] == [{k: s[k] for k in keys} for s in training]


@pytest.mark.parametrize(("cls",), [case("eval/report", "eval --model RUN, chat run, message prompts", "OK")])
def test_eval_of_message_prompts_from_the_run_folder(chat_run, tmp_path, cls):
    """Friction 6: message prompts no longer fail with 'set data.apply_chat_template: true'."""
    train_file = chat_run.parent / "train.jsonl"
    out = tmp_path / "m"
    assert (
        main(["eval", "--model", str(chat_run), "--data", f"msgs={train_file}", "--output-dir", str(out)])
        == 0
    )
    assert read_samples(out)[0]["prompt"].startswith("<|im_start|>user\nWhat is 0 plus 0?")


def test_max_new_tokens_flag_and_a_default_that_fits_the_context(chat_run, tmp_path):
    """Friction 7: ``--max-new-tokens``; an HF folder alone gets half its context, not 512."""
    sums = chat_run.parent / "sums.jsonl"
    out = tmp_path / "short"
    args = ["eval", "--model", str(chat_run), "--max-new-tokens", "1", "--output-dir", str(out)]
    assert main(args) == 0
    assert {s["response_tokens"] for s in read_samples(out)} == {1}
    context = json.loads((chat_run / "hf" / "config.json").read_text())["max_position_embeddings"]
    assert context < 512
    hf = tmp_path / "hf"
    assert (
        main(["eval", "--model", str(chat_run / "hf"), "--data", f"s={sums}", "--output-dir", str(hf)]) == 0
    )
    assert json.loads((hf / "eval.json").read_text())["datasets"]["s"]["num_prompts"] == 3


def test_init_hf_takes_the_config_from_init_path(chat_run):
    """Friction 7: ``model.init: hf`` with ``init_path`` needs no ``hf_config``."""
    hf = str(chat_run / "hf")
    cfg = config_from_dict({"model": {"init": "hf", "init_path": hf}, "data": {"tokenizer": hf}})
    assert cfg.model.arch.to_hf_dict() == json.loads((chat_run / "hf" / "config.json").read_text())
    with pytest.raises(ConfigError, match=r"model\.hf_config is missing"):
        config_from_dict({"model": {"init": "random"}})


def test_compare_runs_reports_finished_runs_and_says_n_and_t(chat_run, tmp_path, capsys):
    """Friction 7: ``compare --runs`` reports without training; the accuracy label names avg@n, n and T."""
    other = tmp_path / "again" / "run"
    shutil.copytree(chat_run, other)
    before = (chat_run / "metrics.jsonl").read_text()
    out = tmp_path / "cmp"
    assert main(["compare", "--runs", f"{chat_run},{other}", "--output-dir", str(out)]) == 0
    report = (out / "report.md").read_text()
    assert "held-out accuracy: avg@2 of sums (n 2, T 1), before" in report and "greedy" not in report
    arms = json.loads((out / "report.json").read_text())["arms"]
    # both paths end in "run": each arm is labelled by its parent folder too (tests/security, compare labels)
    assert [(a["name"], a["steps"]) for a in arms] == [
        (f"{chat_run.parent.name}-run-s0", 1),
        ("again-run-s0", 1),
    ]
    assert (chat_run / "metrics.jsonl").read_text() == before  # nothing ran
    assert main(["compare", "--runs", str(tmp_path), "--output-dir", str(out)]) == 2
    assert "not a run directory (no metrics.jsonl)" in capsys.readouterr().err
