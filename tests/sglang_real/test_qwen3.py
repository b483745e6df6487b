"""The real Qwen3 tokenizer and chat template on real SGLang (issue 38, item 2): a tiny random Qwen3-MoE whose
folder holds Qwen3's own tokenizer files (``make qwen3-tokenizer``), vocabulary padded to 151,936 as the real
checkpoints. The server renders and tokenizes prompts (``POST /tokenize``: tools, thinking on and off) as this
project's renderer does; its ``qwen3`` reasoning parser and ``qwen25`` tool parser split responses as
:func:`~sapo_megatron.data.thinking.split_thinking` and :func:`~sapo_megatron.rollout.episodes.parse_tool_calls`
do; and a multi-turn episode with Qwen3's ``<tool_response>`` deltas runs through the real engine, ids in and out.
Its own server (about as long to start as the tier's)."""

from __future__ import annotations

import json
import shutil

import httpx
import numpy as np
import pytest
import torch
import transformers

from sapo_megatron.data import qwen3_tokenizer
from sapo_megatron.data.thinking import split_thinking
from sapo_megatron.model.tiny import tiny_hf_config
from sapo_megatron.rollout.episodes import (
    EpisodeEngine,
    EpisodeLimits,
    ObservationDeltas,
    ToolSet,
    parse_tool_calls,
)
from sapo_megatron.rollout.episodes.tools import PYTHON_SCHEMA
from sapo_megatron.rollout.sglang.client import SGLangClient
from sapo_megatron.rollout.types import EpisodeInfo, GenerationRequest, SamplingParams
from tests.data.qwen3_fixtures import qwen3_hf
from tests.sglang_real.conftest import API_KEY, real_server_flags, sglang_process

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 6 times 7?"}]


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_model")
    config = tiny_hf_config(
        "moe",
        vocab_size=qwen3_tokenizer.PADDED_VOCAB_SIZE,
        max_position_embeddings=2048,
        eos_token_id=151645,
        pad_token_id=151643,
    )
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**config)).save_pretrained(path)
    for name in qwen3_tokenizer.FILES:
        shutil.copyfile(qwen3_tokenizer.tokenizer_dir() / name, path / name)
    return path


@pytest.fixture(scope="module")
def qwen3_url(qwen3_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("qwen3_log") / "server.log"
    with sglang_process(qwen3_model, log, *real_server_flags()) as url:
        yield url


def post(url: str, path: str, body: dict) -> dict:
    reply = httpx.post(url + path, json=body, headers=HEADERS, timeout=120)
    assert reply.status_code == 200, reply.text[:500]
    return reply.json()


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}], ids=["thinking", "no-thinking"])
def test_the_server_renders_and_tokenizes_prompts_as_we_do(qwen3_url, kwargs):
    """The server's template (the model folder's Qwen3 template) and tokenizer give our ids; with tools, the
    server serialises its own ``Tool`` objects (extra keys), so there our rendered text is tokenized by both."""
    hf = qwen3_hf()
    ours = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **kwargs)
    served = post(qwen3_url, "/tokenize", {"messages": MESSAGES, "chat_template_kwargs": kwargs})
    assert served["tokens"] == hf(ours, add_special_tokens=False)["input_ids"]
    with_tools = hf.apply_chat_template(
        MESSAGES, tools=[PYTHON_SCHEMA], tokenize=False, add_generation_prompt=True, **kwargs
    )
    served = post(qwen3_url, "/tokenize", {"prompt": with_tools, "add_special_tokens": False})
    ids = hf(with_tools, add_special_tokens=False)["input_ids"]
    assert served["tokens"] == ids and ids.count(151657) == 2  # <tool_call> twice in the tool instructions


TEXTS = [
    "<think>\nSix sevens.\n</think>\n\nThe answer is 42.",
    "<think>\nRun it.\n</think>\n\n<tool_call>\n"
    + json.dumps({"name": "python", "arguments": {"code": "print(6 * 7)"}})
    + "\n</tool_call>",
    "<think>\nMaybe <tool_call>\n"
    + json.dumps({"name": "python", "arguments": {"code": "1"}})
    + "\n</tool_call> no.\n</think>\n\nNo call.",
    "<think>\nCut while thinking about 42",
    "<think>\nplan\n<tool_call>\n"
    + json.dumps({"name": "python", "arguments": {"code": "2"}})
    + "\n</tool_call>",
    "No thinking at all: 42.",
]


@pytest.mark.parametrize("text", TEXTS)
def test_reasoning_and_tool_calls_split_as_sglang_qwen3_and_qwen25(qwen3_url, text):
    served = post(qwen3_url, "/separate_reasoning", {"text": text, "reasoning_parser": "qwen3"})
    reasoning, answer = split_thinking(text)
    assert (reasoning, answer) == (served["reasoning_text"], served["text"])
    calls = post(
        qwen3_url,
        "/parse_function_call",
        {"text": answer, "tool_call_parser": "qwen25", "tools": [PYTHON_SCHEMA]},
    )
    normal, ours = parse_tool_calls(text)
    assert normal == calls["normal_text"]
    assert [(c.name, c.arguments) for c in ours] == [
        (c["name"], json.loads(c["parameters"])) for c in calls["calls"]
    ]


def test_a_multi_turn_episode_with_qwen3_deltas_on_the_real_engine(qwen3_url):
    """Three engine turns with Qwen3's ``<tool_response>`` user turns between them: each turn's input is the
    episode's ids so far (the ledger checks it), only the engine's tokens carry mask 1, and the whole sequence
    decodes to the template's turn structure."""
    hf = qwen3_hf()
    deltas = ObservationDeltas(hf, "<|im_end|>", {"enable_thinking": False})
    end = hf.convert_tokens_to_ids("<|im_end|>")

    async def three_turns(ctx, ledger) -> EpisodeInfo:
        for turn in range(3):
            sample = await ctx.generate(list(ledger.tokens), 5)
            ledger.add_turn(sample)
            if turn == 2:
                break
            if sample.response_ids[-1] != end:  # a turn cut by the limit: close it as the engine's stop would
                ledger.add_observation([end])
            ledger.add_observation(ctx.deltas.ids([{"role": "tool", "content": str(42 + turn)}]))
        return EpisodeInfo(status="completed", turns=ledger.turns)

    client = SGLangClient([qwen3_url], api_key=API_KEY, num_layers=2, top_k=2, timeout_s=120.0, max_retries=0)
    tools = ToolSet([], timeout_s=1, max_concurrent=1, max_output_chars=10)
    limits = EpisodeLimits(max_turns=3, max_tool_calls=0, max_context_tokens=1024, max_new_tokens=5)
    episodes = EpisodeEngine(
        client,
        three_turns,
        tools=tools,
        deltas=deltas,
        limits=limits,
        decode=str,
        parallel_calls=2,
        user_function=True,
    )
    prompt = hf(
        hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, enable_thinking=False),
        add_special_tokens=False,
    )["input_ids"]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=5, seed=3)
    try:
        [group] = episodes.generate(
            [GenerationRequest(prompt_ids=prompt, n=2, sampling=sampling, group_id=0)]
        )
    finally:
        client.close()
    for sample in group:
        assert sample.episode.turns == 3
        mask = np.array(sample.loss_mask)
        assert mask.sum() == sample.generated_tokens <= 15
        assert (np.array(sample.rollout_logp)[mask == 0] == 0).all()
        observed = hf.decode([t for t, m in zip(sample.response_ids, mask) if m == 0])
        assert observed.count("<|im_start|>user\n<tool_response>\n") == 2
        assert observed.count("<|im_start|>assistant\n<think>\n\n</think>\n\n") == 2
        assert all(t < qwen3_tokenizer.PADDED_VOCAB_SIZE for t in sample.response_ids)
