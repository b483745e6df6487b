"""Hostile run configs and ``--set`` overrides (issue 30, area "configs"): YAML that would eat memory or recurse
is refused within fixed limits, no tag runs code, and ``--set`` on a section merges instead of resetting it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sapo_megatron.config import load_config, parse_overrides
from sapo_megatron.defaults import embedded_default_dict
from tests.security.hostile import case, expect

AREA = "configs"
LAUGHS = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [" + ",".join([f"*{chr(97 + i)}"] * 9) + "]\n" for i in range(8)
)
MODEL = yaml.safe_dump({"model": embedded_default_dict()["model"]})
EVIL = "/tmp/sapo-hostile-python-tag-ran"


@pytest.mark.parametrize(
    ("cls", "text", "words"),
    [
        case(AREA, "billion laughs", "CLEAR", LAUGHS, "expands to more than 100000 values"),
        case(
            AREA,
            "merge key <<",
            "OK",
            "trainer:\n  <<: {steps: 3, save_every: 7}\n  steps: 5\n",
            "",
        ),
        case(
            AREA,
            "homoglyph key",
            "CLEAR",
            "tr\u0430iner:\n  steps: 3\n",
            "tr\u0430iner: unknown key; did you mean 'trainer'",
        ),
        case(
            AREA,
            "!!python/object tag",
            "CLEAR",
            f"seed: !!python/object/apply:os.system ['touch {EVIL}']\n",
            "could not determine a constructor",
        ),
        case(
            AREA,
            "duplicate nested key",
            "CLEAR",
            "trainer:\n  steps: 3\n  steps: 4\n",
            "key 'steps' appears twice (lines 2 and 3)",
        ),
        case(AREA, "top-level list", "CLEAR", "- trainer\n- steps\n", "must hold a mapping of sections"),
        case(
            AREA,
            "empty file",
            "CLEAR",
            "",
            "must hold a mapping of sections (model, parallel, ...), got NoneType",
        ),
        case(
            AREA,
            "5000-digit int",
            "CLEAR",
            "seed: " + "9" * 5000 + "\n",
            "a value YAML cannot convert (Exceeds the limit (4300 digits)",
        ),
        case(AREA, "BOM", "OK", "\ufefftrainer:\n  steps: 3\n", ""),
        case(
            AREA,
            "null sections",
            "CLEAR",
            "trainer:\nrollout:\n",
            "trainer: Input should be a valid dictionary",
        ),
        case(
            AREA, "5000-deep YAML", "CLEAR", "trainer: " + "[" * 5000 + "]" * 5000 + "\n", "nested too deeply"
        ),
    ],
)
def test_hostile_config_files(tmp_path, cls, text, words):
    path = tmp_path / "run.yaml"
    bom = "\ufeff" if text.startswith("\ufeff") else ""
    model = MODEL if cls == "OK" else ""  # a valid config needs the model; a refusal must not depend on it
    path.write_text(bom + model + text.removeprefix(bom), encoding="utf-8")
    cfg = expect(cls, lambda: load_config(path), words)
    assert not Path(EVIL).exists()
    if cls == "OK":
        assert cfg.trainer.steps in (3, 5)
        if "<<" in text:
            assert (cfg.trainer.steps, cfg.trainer.save_every) == (5, 7)  # merged, then its own key wins


def test_config_files_over_the_size_limit_are_refused_unread(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("# " + "x" * (1 << 20) + "\n")
    expect("CLEAR", lambda: load_config(path), "bytes; a run config is a few kB")


def override(*pairs: str):
    return load_config(None, parse_overrides(list(pairs)))


@pytest.mark.parametrize(
    ("cls", "pairs", "words"),
    [
        case(
            AREA,
            "--set trainer.steps=[1,2]",
            "CLEAR",
            ["trainer.steps=[1,2]"],
            "trainer.steps: Input should be a valid integer",
        ),
        case(AREA, "--set trainer={steps: 1}", "OK", ["trainer={steps: 1}"], ""),
        case(
            AREA,
            "--set trainer=null / trainer.steps=null / model=null",
            "CLEAR",
            ["trainer=null", "trainer.steps=null", "model=null"],
            "Input should be a valid",
        ),
        case(
            AREA,
            "--set eval.datasets=null",
            "CLEAR",
            ["eval.datasets=null"],
            "eval.datasets: Input should be a valid list",
        ),
        case(
            AREA,
            "--set eval.datasets.5.n=3 / .-1.n",
            "CLEAR",
            ["eval.datasets.5.n=3", "eval.datasets.-1.n=3"],
            "is not an entry of eval.datasets, a list of 1 (indices: 0 to 0)",
        ),
        case(
            AREA,
            "--set algorithm.loss=sapo / name=[sapo]",
            "CLEAR",
            ["algorithm.loss=sapo", "algorithm.loss.name=[sapo]"],
            "choose one of",
        ),
        case(
            AREA,
            "--set malformed (no =, =5, a..b, a.b.c on scalar)",
            "CLEAR",
            ["trainer.steps", "=5", "trainer..steps=1", "seed.a.b=1"],
            "",
        ),
        case(
            AREA,
            "--set seed=1e400 / lr=.nan / data.train={a:1} / reward_kwargs=[1,2] / cpu_threads=-1",
            "CLEAR",
            [
                "seed=1e400",
                "optimizer.lr=.nan",
                "data.train={a: 1}",
                "rollout.reward_kwargs=[1,2]",
                "rollout.threads=-1",
            ],
            "",
        ),
        case(AREA, "--set name=../../../tmp/evil", "OK", ["name=../../../tmp/evil"], ""),
    ],
)
def test_hostile_overrides(cls, pairs, words):
    for pair in pairs:  # each a case of its own
        cfg = expect(cls, lambda pair=pair: override(pair), words)
    if pairs == ["trainer={steps: 1}"]:
        default = load_config(None)
        assert cfg.trainer.steps == 1 and cfg.trainer.save_every == default.trainer.save_every > 0
    if cls == "OK" and "name=" in pairs[0]:
        assert cfg.output_dir == load_config(None).output_dir  # the name labels the run; it is no path


def test_setting_a_section_merges_and_a_name_switches_the_variant():
    cfg = override("algorithm.loss={name: grpo}")
    assert (
        cfg.algorithm.loss.name == "grpo"
    )  # sapo's own keys dropped, as with --set algorithm.loss.name=grpo
    assert override("algorithm={loss: {tau_pos: 2.0}}").algorithm.loss.tau_pos == 2.0
