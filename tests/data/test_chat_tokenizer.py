"""The chat tokenizer that ships with the package and model sizes that follow the data (issue 29, frictions 2
and 3): ``data.tokenizer: chat`` alone makes a verl message dataset work on the embedded model, whose vocabulary,
context and special ids then come from the tokenizer and the prompts; an export fills ``eos_token_id``."""

from __future__ import annotations

import hashlib

import pytest

from sapo_megatron.config import config_from_dict
from sapo_megatron.data import chat_tokenizer
from sapo_megatron.data.loading import build_run_data
from sapo_megatron.data.prompts import DatasetError
from sapo_megatron.data.sizing import context_size
from sapo_megatron.data.tokenizer import load_tokenizer
from sapo_megatron.defaults import DEMO_MODEL, embedded_default_dict
from sapo_megatron.weight_sync.hf_export import hf_config_with_tokens
from tests.data.chat_fixtures import verl_records, write_jsonl


def _digests(directory) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_shipped_files_are_what_the_build_writes(tmp_path):
    """Friction 2: the tokenizer is in the package, small, and rebuilt bit for bit from its recipe."""
    shipped = chat_tokenizer.CHAT_TOKENIZER_DIR
    assert sum(p.stat().st_size for p in shipped.iterdir()) < 1024**2
    assert _digests(chat_tokenizer.build(tmp_path / "again")) == _digests(shipped)


def test_it_is_a_byte_level_bpe_with_a_qwen_style_template():
    tok = chat_tokenizer.load_chat_tokenizer()
    assert len(tok) == chat_tokenizer.VOCAB_SIZE == 512
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    text = "Janet’s ducks lay 16 eggs. 日本 #### 72"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text  # every byte passes (no unknown token)
    assert [tok.decode([i]) for i in tok(" 1234", add_special_tokens=False)["input_ids"]] == [
        " ",
        "1",
        "2",
        "3",
        "4",
    ]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+4?"}]
    rendered = tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n3+4?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<think>"]) == [1, 2, 510]


def _verl_run(tmp_path, **data) -> dict:
    raw = embedded_default_dict()
    raw["data"].update(train=str(write_jsonl(tmp_path / "verl.jsonl", verl_records(6))), **data)
    return raw


def test_one_setting_reads_a_message_dataset_on_the_embedded_model(tmp_path):
    """Friction 2: ``data.tokenizer: chat`` turns the template on and sizes the embedded model for it."""
    cfg = config_from_dict(_verl_run(tmp_path, tokenizer="chat"))
    assert cfg.data.apply_chat_template is True
    data = build_run_data(cfg)
    ids = data.renderer.encode(data.train_rows[0])
    assert data.tokenizer.hf.decode(ids).startswith("<|im_start|>user\nWhat is 0 plus 1?")
    arch = cfg.model.arch
    assert (arch.vocab_size, arch.eos_token_id, arch.pad_token_id, arch.bos_token_id) == (512, 2, 0, None)
    with pytest.raises(DatasetError, match="a prompt of chat messages needs a chat template"):
        config_from_dict(_verl_run(tmp_path, tokenizer="chat", apply_chat_template=False))  # set off: off


def test_sizes_follow_the_prompts_unless_set(tmp_path):
    """Friction 3: the context is the longest prompt plus max_new_tokens (rounded up to 64), not the demo's 64."""
    long = [
        {
            "prompt": [{"role": "user", "content": "Tom has 3 apples and buys 5 more. " * 12}],
            "ground_truth": "8",
        }
    ]
    raw = embedded_default_dict()
    raw["data"].update(train=str(write_jsonl(tmp_path / "long.jsonl", long)), tokenizer="chat")
    raw["rollout"]["max_new_tokens"] = 40
    cfg = config_from_dict(raw)
    tokenizer = load_tokenizer("chat")
    prompt = len(build_run_data(cfg).renderer.encode(build_run_data(cfg).train_rows[0]))
    assert prompt > 64
    assert cfg.model.arch.max_position_embeddings == context_size(prompt, 40) == -(-(prompt + 40) // 64) * 64
    assert cfg.model.arch.vocab_size == tokenizer.vocab_size
    raw["model"]["hf_config"]["max_position_embeddings"] = 1024  # set: kept
    assert config_from_dict(raw).model.arch.max_position_embeddings == 1024
    # the embedded demo's sizes, measured from its char tokenizer and addition prompts, are DEMO_MODEL's
    demo = config_from_dict(embedded_default_dict()).model.arch.to_hf_dict()
    assert {k: demo[k] for k in DEMO_MODEL if k != "model_type"} == {
        k: v for k, v in DEMO_MODEL.items() if k != "model_type"
    }


@pytest.mark.parametrize("tokenizer", ["chat", "char"])
def test_export_takes_eos_from_the_tokenizer(tokenizer):
    """Friction 3: an HF export never says ``eos_token_id: null`` when the tokenizer has one."""
    raw = embedded_default_dict()
    raw["model"]["hf_config"] = {**DEMO_MODEL, "eos_token_id": None, "pad_token_id": None}
    arch = config_from_dict(raw).model.arch
    assert arch.to_hf_dict()["eos_token_id"] is None
    tok = load_tokenizer(tokenizer)
    config = hf_config_with_tokens(arch, tok)
    assert (config["eos_token_id"], config["pad_token_id"]) == (tok.eos_id, tok.pad_id)


def test_tiny_is_the_demo_architecture_sized_to_the_data(tmp_path):
    """Friction 3: ``model.hf_config: tiny`` needs no architecture edits for a chat dataset."""
    raw = _verl_run(tmp_path, tokenizer="chat")
    raw["model"]["hf_config"] = "tiny"
    arch = config_from_dict(raw).model.arch
    assert arch == config_from_dict(_verl_run(tmp_path, tokenizer="chat")).model.arch
    assert (arch.vocab_size, arch.hidden_size, arch.num_experts) == (512, DEMO_MODEL["hidden_size"], 8)


def test_a_resolved_config_read_back_keeps_the_chat_template(tmp_path):
    """Friction 6: config.yaml (and compare's per-arm compare.yaml) no longer spells out the eval datasets'
    ``apply_chat_template: false``: read back, evaluation renders with the run's template, as training did."""
    from sapo_megatron.config import load_config
    from sapo_megatron.eval.config import resolve_datasets

    raw = _verl_run(tmp_path, tokenizer="chat")
    raw["eval"] = {"datasets": [{"name": "v", "path": raw["data"]["train"]}]}
    cfg = config_from_dict(raw)
    again = load_config(cfg.save_resolved(tmp_path / "config.yaml"))
    assert resolve_datasets(again)[0].keys == resolve_datasets(cfg)[0].keys
    assert resolve_datasets(again)[0].keys.apply_chat_template is True
    assert again.model.arch == cfg.model.arch
