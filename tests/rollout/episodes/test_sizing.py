"""Multi-turn sizing (issue 38, item 5): the auto-sized context counts the tool schemas the prompts show, an
explicit ``max_context_tokens`` grows it, and one above a fixed model context is refused before anything runs."""

from __future__ import annotations

import pytest

from sapo_megatron.config import ConfigError, config_from_dict
from sapo_megatron.data.loading import build_run_data
from sapo_megatron.data.tool_schemas import prompt_tool_schemas
from sapo_megatron.defaults import embedded_default_dict
from tests.data.chat_fixtures import verl_records, write_jsonl


def _raw(tmp_path, tokenizer: str = "chat", **multi_turn) -> dict:
    raw = embedded_default_dict()
    raw["data"].update(train=str(write_jsonl(tmp_path / "v.jsonl", verl_records(4))), tokenizer=tokenizer)
    raw["model"]["hf_config"] = "tiny"
    raw["rollout"].update(max_new_tokens=40, multi_turn={"python_tool": True, **multi_turn})
    raw["eval"] = {"datasets": []}
    return raw


@pytest.mark.slow  # the real Qwen3 tokenizer, loaded a few times
def test_the_auto_context_counts_the_tool_schemas(tmp_path):
    """Fails on 3855bb6: the prompts were measured without the schemas – ``PromptRenderer.encode_many`` (the dry
    run's "longest prompt", the length policy, auto sizing) dropped ``tools=`` that ``encode`` passed, and auto
    sizing passed none – so the tool user's dry run said "longest prompt 25 tokens" and sized the context 128,
    while a template that renders them (Qwen3's) gives the engine several hundred."""
    cfg = config_from_dict(_raw(tmp_path, "qwen3"))
    data = build_run_data(cfg, tools=prompt_tool_schemas(cfg.rollout.multi_turn))
    longest = max(len(data.renderer.encode(row)) for row in data.train_rows)
    assert [len(ids) for ids in data.renderer.encode_many(data.train_rows)] == [
        len(data.renderer.encode(row)) for row in data.train_rows
    ]
    assert longest > 150  # the python tool's schema in the system turn (the bare prompt: ~25)
    assert cfg.model.arch.max_position_embeddings == -(-(longest + 40) // 64) * 64


def test_max_context_tokens_sizes_an_auto_context_and_is_checked_against_a_fixed_one(tmp_path):
    """Fails on 3855bb6: ``max_context_tokens: 640`` above the model's context was not flagged; the first
    evaluation died in the engine."""
    assert config_from_dict(_raw(tmp_path, max_context_tokens=900)).model.arch.max_position_embeddings == 960
    raw = _raw(tmp_path, max_context_tokens=900)
    raw["model"]["hf_config"] = {
        **embedded_default_dict()["model"]["hf_config"],
        "max_position_embeddings": 512,
    }
    with pytest.raises(ConfigError, match=r"max_context_tokens=900 is above the model's context \(model "):
        config_from_dict(raw)


def test_a_template_that_ignores_tools_is_named(tmp_path, caplog):
    """Fails on 3855bb6: the shipped ``chat`` template drops ``tools=`` without a word."""
    import logging

    cfg = config_from_dict(_raw(tmp_path))
    with caplog.at_level(logging.WARNING, logger="sapo_megatron.data.loading"):
        build_run_data(cfg, tools=prompt_tool_schemas(cfg.rollout.multi_turn))
    assert "the chat template of data.tokenizer='chat' ignores tools=" in caplog.text


def test_a_request_past_the_context_is_one_line_with_the_fix(tmp_path):
    """Fails on 3855bb6: a plain ``ValueError`` (the first eval died with a raw traceback); now a
    :class:`~sapo_megatron.errors.UserError` the command line prints as one line and its hint."""
    from sapo_megatron.errors import UserError
    from sapo_megatron.rollout.cpu.engine import ContextLengthError, CPUEngine
    from sapo_megatron.rollout.types import GenerationRequest, SamplingParams
    from tests.servers import save_demo_model

    engine = CPUEngine.from_pretrained(save_demo_model(tmp_path / "m"), seed=0, num_threads=1)
    context = engine.max_context
    request = GenerationRequest(
        prompt_ids=[1] * (context - 4), n=1, sampling=SamplingParams(max_new_tokens=40), group_id=0
    )
    with pytest.raises(ContextLengthError) as error:
        engine.generate([request])
    assert isinstance(error.value, UserError) and isinstance(
        error.value, ValueError
    )  # the server's 400 still
    assert str(error.value) == (
        f"requested {context - 4} prompt + 40 new tokens exceeds the model's maximum context length {context}"
    )
    assert "max_position_embeddings" in error.value.hint


def test_the_dry_run_says_when_max_new_tokens_cuts_the_first_tool_call(tmp_path, capsys):
    """Fails on 3855bb6: a 68-token tool call with ``max_new_tokens: 40`` was cut every time, and the warning
    came only after 3 RL steps."""
    import json

    from sapo_megatron.cli import main

    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(sum(range(1, 101)) * 37 + 12345 - 678)"}}\n</tool_call>'
    rows = [
        {"prompt": [{"role": "user", "content": f"Q{i}?"}], "ground_truth": "1", "response": call}
        for i in range(4)
    ]
    raw = _raw(tmp_path)
    raw["data"].update(train=str(write_jsonl(tmp_path / "t.jsonl", rows)), response_key="response")
    raw["rollout"]["max_new_tokens"] = 40
    (tmp_path / "run.yaml").write_text(json.dumps(raw))
    assert main(["train", str(tmp_path / "run.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert (
        "warning: the SFT targets' first turn takes up to " in out and "rollout.max_new_tokens=40 cuts" in out
    )
    raw["rollout"]["max_new_tokens"] = 400
    (tmp_path / "run.yaml").write_text(json.dumps(raw))
    assert main(["train", str(tmp_path / "run.yaml"), "--dry-run"]) == 0
    assert "tool calls OK" in capsys.readouterr().out


def test_the_auto_context_holds_the_sft_sequences_and_a_fixed_one_is_checked(tmp_path, capsys):
    """Fails on 3855bb6 and before this test: the auto context counted prompts + max_new_tokens only (64 here)
    while SFT trained 117-token sequences past it without a word. Now auto sizing holds the longest SFT sequence
    (a messages-form target too), and a fixed context below it stops the dry run (and train, before SFT) in one
    line."""
    import json

    from sapo_megatron.cli import main

    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(sum(range(1, 101)) * 37 + 12345 - 678)"}}\n</tool_call>'
    conversation = [
        {"role": "assistant", "content": call},
        {"role": "tool", "content": "5050"},
        {"role": "assistant", "content": "\\boxed{5050}"},
    ]
    rows = [
        {"prompt": [{"role": "user", "content": f"Q{i}?"}], "ground_truth": "1", "response": conversation}
        for i in range(4)
    ]
    raw = _raw(tmp_path)
    raw["data"].update(train=str(write_jsonl(tmp_path / "t.jsonl", rows)), response_key="response")
    cfg = config_from_dict(raw)
    data = build_run_data(cfg, tools=prompt_tool_schemas(cfg.rollout.multi_turn))
    from sapo_megatron.rollout.episodes.warm_start import ConversationTargets

    targets = ConversationTargets(data.renderer, None, {})
    longest = max(sum(map(len, targets.ids(row)[:2])) for row in data.train_rows)
    assert longest > 64 + 40  # the prompts (+ max_new_tokens) alone gave a 64-token context
    assert cfg.model.arch.max_position_embeddings == -(-longest // 64) * 64
    raw["model"]["hf_config"] = {**cfg.model.hf_config, "max_position_embeddings": 128}
    (tmp_path / "run.yaml").write_text(json.dumps(raw))
    assert main(["train", str(tmp_path / "run.yaml"), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"the SFT sequences run to {longest} tokens" in err and "max_position_embeddings=128" in err
