"""Datasets as users have them (verl parquet, slime jsonl with own keys, plain jsonl; shards; dotted labels; bad
rows named), prompt rendering with a real BPE tokenizer's chat template (ids compared with transformers'
``apply_chat_template``), the refusals, the prompt-length policy and SFT targets."""

from __future__ import annotations

import json

import pytest

from sapo_megatron.config import ConfigError, load_config
from sapo_megatron.data.datasets import DatasetKeys, load_dataset, read_dataset
from sapo_megatron.data.prompts import DatasetError, PromptRow
from sapo_megatron.data.render import ChatTemplateError, PromptRenderer, apply_length_policy
from sapo_megatron.data.tokenizer import CharTokenizer, load_tokenizer
from tests.data.chat_fixtures import (
    make_chat_tokenizer,
    plain_records,
    slime_records,
    verl_records,
    write_jsonl,
    write_verl_parquet,
)

pytest.importorskip("pyarrow")
CHAT = DatasetKeys(apply_chat_template=True, chat_template_kwargs={"enable_thinking": False})


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(str(make_chat_tokenizer(tmp_path_factory.mktemp("tok"))))


def reference_ids(tok, messages, **kwargs) -> list[int]:
    """What transformers itself gives for the messages (the ids the engine must receive)."""
    out = tok.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_verl_parquet_shards_and_auto_format(tmp_path):
    write_verl_parquet(tmp_path / "train-00000.parquet", 5)
    write_verl_parquet(tmp_path / "train-00001.parquet", 3, sources=("code",))
    (tmp_path / "notes.txt").write_text("not data")
    dataset = read_dataset(tmp_path, DatasetKeys())
    assert [(f.path.name, f.format, f.rows) for f in dataset.files] == [
        ("train-00000.parquet", "verl", 5),
        ("train-00001.parquet", "verl", 3),
    ]
    assert "auto: it has reward_model.ground_truth and data_source" in dataset.describe()[0]
    first = dataset.rows[0]
    assert first.prompt == verl_records(1)[0]["prompt"] and first.ground_truth == "1"
    assert first.domain == "deepmath" and first.metadata == {"split": "train", "index": 0}
    assert dataset.counts_by_source() == {"aime": 2, "code": 3, "deepmath": 3}
    assert "per source: aime: 2, code: 3, deepmath: 3" in dataset.describe()[-1]
    assert load_dataset(str(tmp_path / "train-*.parquet"), DatasetKeys()) == dataset.rows  # a glob
    for shard in range(2, 5):
        write_verl_parquet(tmp_path / f"train-{shard:05d}.parquet", 1)
    many = read_dataset(tmp_path, DatasetKeys()).describe()  # one line per format, not per shard
    assert many[0] == "  5 files, format verl (auto: it has reward_model.ground_truth and data_source)"


def test_slime_and_plain_jsonl_with_keys(tmp_path):
    slime = write_jsonl(tmp_path / "slime.jsonl", slime_records(3))
    rows = load_dataset(slime, DatasetKeys(format="slime", prompt_key="question", label_key="answer"))
    assert rows[2] == PromptRow(prompt="Compute 2 plus 2.", ground_truth="4", metadata={"id": 2})
    # auto, given the keys, reads it too (the plain preset's other keys stay optional)
    assert load_dataset(slime, DatasetKeys(prompt_key="question", label_key="answer"))[2].ground_truth == "4"
    plain = read_dataset(write_jsonl(tmp_path / "plain.jsonl", plain_records(2)), DatasetKeys())
    assert plain.files[0].format == "plain" and plain.rows[1].domain == "addition"
    nested = write_jsonl(tmp_path / "n.jsonl", [{"q": "x", "meta": {"gt": {"value": 7}}}])
    assert load_dataset(nested, DatasetKeys(prompt_key="q", label_key="meta.gt.value"))[0].ground_truth == "7"


@pytest.mark.parametrize(
    ("record", "keys", "problem"),
    [
        ({"question": "q"}, {}, "cannot tell the file's format (first row's fields: question)"),
        (
            {"question": "q"},
            {"format": "slime", "prompt_key": "question"},
            "missing field 'label' (data.label_key",
        ),
        (
            {"data_source": "a", "prompt": "p", "reward_model": {"style": "rule"}},
            {"format": "verl"},
            "missing field 'reward_model.ground_truth' (data.label_key; the row has: data_source, prompt, "
            "reward_model)",
        ),
        (
            {"prompt": [{"role": "user"}], "ground_truth": "1"},
            {},
            "field 'prompt' message 0 must be an object",
        ),
        (
            {"prompt": 3, "ground_truth": "1"},
            {},
            "field 'prompt' (the prompt) must be a string or a non-empty",
        ),
        ({"prompt": "p", "ground_truth": None}, {}, "field 'ground_truth' (the label) must be a string"),
        (
            {"prompt": "p", "ground_truth": "1", "domain": 4},
            {},
            "field 'domain' (the source) must be a string",
        ),
    ],
)
def test_a_bad_row_names_file_line_and_field(tmp_path, record, keys, problem):
    good = {"prompt": "p", "ground_truth": "1"} if "format" not in keys else None
    lines = [good, record] if good and "question" not in record else [record]
    path = write_jsonl(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DatasetError) as err:
        load_dataset(path, DatasetKeys(**keys))
    assert str(err.value).startswith(f"{path}:{len(lines)}") and problem in str(err.value)


def test_missing_sources_are_named(tmp_path):
    with pytest.raises(DatasetError, match="no such file"):
        load_dataset(tmp_path / "missing.parquet", DatasetKeys())
    with pytest.raises(DatasetError, match="the pattern matches no file"):
        load_dataset(str(tmp_path / "*.parquet"), DatasetKeys())
    with pytest.raises(DatasetError, match=r"a directory without \.parquet or \.jsonl files"):
        load_dataset(tmp_path, DatasetKeys())


def test_chat_template_ids_are_transformers_own(tok):
    rows = [
        PromptRow(prompt="What is 12 plus 30?", ground_truth="42"),
        PromptRow(prompt=verl_records(2)[1]["prompt"], ground_truth="3"),
        PromptRow(
            prompt=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Solve 3x = 9."}],
            ground_truth="3",
        ),
    ]
    renderer = PromptRenderer(tok, CHAT)
    expected = [
        reference_ids(tok, [{"role": "user", "content": rows[0].prompt}], enable_thinking=False),
        reference_ids(tok, rows[1].prompt, enable_thinking=False),
        reference_ids(tok, rows[2].prompt, enable_thinking=False),
    ]
    assert [renderer.encode(row) for row in rows] == expected == renderer.encode_many(rows)
    think = tok.hf.convert_tokens_to_ids("<think>")
    assert think in expected[0]  # the template kwargs reached the template ...
    plain_chat = PromptRenderer(tok, DatasetKeys(apply_chat_template=True)).encode(rows[0])
    assert think not in plain_chat and plain_chat == expected[0][: len(plain_chat)]  # ... and only with them
    system = DatasetKeys(apply_chat_template=True, system_prompt="You are a helpful assistant.")
    with_system = PromptRenderer(tok, system)
    assert with_system.messages(rows[0])[0] == {"role": "system", "content": "You are a helpful assistant."}
    assert with_system.messages(rows[2])[0]["content"] == "Be brief."  # a row's own system message wins
    assert with_system.text(rows[0]).startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>")


def test_plain_template_substitutes_prompt_only(tok):
    keys = DatasetKeys(prompt_template="{prompt} Put the answer in \\boxed{}. {0} {x}")
    row = PromptRow(prompt="1+1=", ground_truth="2")
    assert PromptRenderer(tok, keys).text(row) == "1+1= Put the answer in \\boxed{}. {0} {x}"
    char = CharTokenizer()
    assert PromptRenderer(char, DatasetKeys()).encode(row) == char.encode(
        "1+1=", add_bos=True
    )  # the demo's ids


def test_chat_template_refusals(tmp_path, tok):
    with pytest.raises(ChatTemplateError, match="the char tokenizer has no chat template"):
        PromptRenderer(CharTokenizer(), CHAT)
    bare = tmp_path / "bare"
    tok.hf.save_pretrained(str(bare))
    (bare / "chat_template.jinja").unlink()
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError, match=f"the tokenizer in {bare} has no chat template"):
        PromptRenderer(load_tokenizer(str(bare)), CHAT)
    with pytest.raises(ConfigError, match="the char tokenizer has none"):
        load_config(None, {"data.apply_chat_template": True})
    with pytest.raises(ConfigError, match=r"data\.system_prompt is used by the chat template only"):
        load_config(None, {"data.system_prompt": "hi"})
    messages = [
        PromptRow(prompt="p", ground_truth="1"),
        PromptRow(prompt=[{"role": "user", "content": "q"}], ground_truth="1"),
    ]
    with pytest.raises(DatasetError, match=r"src row 1: a prompt of chat messages needs a chat template"):
        apply_length_policy(messages, PromptRenderer(tok, DatasetKeys()), DatasetKeys(), "src")


def test_length_policy(tmp_path, tok):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x" * n, "ground_truth": "1"} for n in (5, 40, 9)])
    rows = load_dataset(path, DatasetKeys())
    renderer = PromptRenderer(tok, DatasetKeys())
    lengths = [len(renderer.encode(row)) for row in rows]
    limit = sorted(lengths)[1]  # the middle one fits, the longest does not
    keys = DatasetKeys(max_prompt_tokens=limit)
    with pytest.raises(DatasetError) as err:
        apply_length_policy(rows, renderer, keys, str(path))
    assert (
        str(err.value)
        == f"{path}:2: the prompt is {max(lengths)} tokens, over data.max_prompt_tokens={limit}"
    )
    kept, counts = apply_length_policy(
        rows, renderer, keys.model_copy(update={"overlong_prompts": "filter"}), "p"
    )
    assert kept == [rows[0], rows[2]]
    assert counts == {"kept": 2, "filtered": 1, "truncated": 0, "longest": max(lengths)}
    cut, counts = apply_length_policy(
        rows, renderer, keys.model_copy(update={"overlong_prompts": "truncate_left"}), "p"
    )
    assert counts["truncated"] == 1 and renderer.encode(cut[1]) == renderer.encode(rows[1])[-limit:]
    # without data.max_prompt_tokens the model's context is the limit, named as such
    with pytest.raises(DatasetError, match="over the model's context"):
        apply_length_policy(
            rows, renderer, DatasetKeys(), "p", limit=limit, limit_reason="the model's context"
        )


def test_sft_trains_the_assistant_turn_only(tok):
    conversation = [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "5"}]
    row = PromptRow(prompt=conversation, ground_truth="5")
    renderer = PromptRenderer(tok, DatasetKeys(apply_chat_template=True))
    prompt_ids, target_ids = renderer.sft_ids(row)
    full = tok.hf.apply_chat_template(conversation, tokenize=True, return_dict=False)
    assert prompt_ids == reference_ids(tok, conversation[:1]) == renderer.encode(row)  # no assistant turn
    assert prompt_ids + target_ids == list(full)
    assert tok.decode(target_ids, skip_special_tokens=False) == "5<|im_end|>\n"
    # a template whose generation prompt is not a prefix of the conversation: the content and eos
    _, target = PromptRenderer(tok, CHAT).sft_ids(row)
    assert target == tok.encode("5", add_eos=True)
    response_row = PromptRow(prompt="What is 2 plus 3?", ground_truth="5", response="It is 5.")
    assert PromptRenderer(tok, DatasetKeys()).sft_ids(response_row)[1] == tok.encode("It is 5.", add_eos=True)
