"""A chat tokenizer with a Qwen3-style tool template, a scripted engine, and the episode engine built on them."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from sapo_megatron.config import MultiTurnConfig
from sapo_megatron.rollout.base import RolloutEngine
from sapo_megatron.rollout.episodes import ToolSet, with_episodes
from sapo_megatron.rollout.types import GenerationRequest, Sample
from tests.data.chat_fixtures import make_chat_tokenizer

# Qwen3's template as far as tools go (written here, reduced): the tool schemas in the system turn, consecutive
# tool messages grouped into ONE user turn of <tool_response> blocks, <|im_end|>\n after every turn.
QWEN3_TOOL_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def chat_tokenizer(directory: Path | None = None):
    """The tokenizer the package ships (``data.tokenizer: chat``; with ``directory``: the tests' own offline BPE,
    tests/data/chat_fixtures.py) with the Qwen3-style tool template."""
    from transformers import AutoTokenizer

    from sapo_megatron.data.chat_tokenizer import load_chat_tokenizer

    if directory is None:
        hf = load_chat_tokenizer()
    else:
        make_chat_tokenizer(directory)
        hf = AutoTokenizer.from_pretrained(str(directory))
    hf.chat_template = QWEN3_TOOL_TEMPLATE
    return hf


def call(name: str, **arguments) -> str:
    import json

    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


class ScriptedEngine(RolloutEngine):
    """Answers turn ``k`` of an episode with ``scripts[key][k]`` (``key``: the first script key found in the
    decoded prompt; the last reply repeats), then the end-of-turn token, cut at ``max_new_tokens``. Log-probs are
    ``-(k + 1) / 10``; routes (when asked) are ``[[k + 1]]`` on every row, so a test sees which turn each row came
    from. ``delay_s`` per call stands for the forward."""

    def __init__(self, hf, scripts: dict[str, Sequence[str]], delay_s: float = 0.0) -> None:
        self.hf = hf
        self.scripts = scripts
        self.delay_s = delay_s
        self.eos = hf.convert_tokens_to_ids("<|im_end|>")
        self.calls: list[int] = []
        self.route_starts: list[int] = []

    def generate(self, requests: Sequence[GenerationRequest]) -> list[list[Sample]]:
        self.calls.append(len(requests))
        # SGLang refuses a repeated request id, which its client builds from the group id (and sample index)
        assert len({r.group_id for r in requests}) == len(requests), (
            "two requests of one call share a group id"
        )
        time.sleep(self.delay_s)
        return [[self._turn(req, i) for i in range(req.n)] for req in requests]

    def _turn(self, req: GenerationRequest, index: int) -> Sample:
        text = self.hf.decode(list(req.prompt_ids))
        key = next(k for k in self.scripts if k in text)
        turn = text.count("<|im_start|>assistant") - 1
        replies = self.scripts[key]
        ids = [*self.ids(replies[min(turn, len(replies) - 1)]), self.eos]
        limit = req.sampling.max_new_tokens
        finish = "length" if len(ids) > limit else "stop"
        ids = ids[:limit]
        routes = None
        if req.return_routed_experts:  # from routed_experts_start on, as SGLang's routed_experts_start_len
            rows = len(req.prompt_ids) + len(ids) - 1 - req.routed_experts_start
            routes = np.full((rows, 1, 1), turn + 1, dtype=np.int32)
        self.route_starts.append(req.routed_experts_start)
        return Sample(
            group_id=req.group_id,
            sample_index=index,
            prompt_ids=list(req.prompt_ids),
            response_ids=ids,
            rollout_logp=[-(turn + 1) / 10] * len(ids),
            finish_reason=finish,
            routed_experts=routes,
            routed_experts_start=req.routed_experts_start,
        )

    def ids(self, text: str) -> list[int]:
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def score(self, token_ids_list, response_start):
        raise NotImplementedError

    def update_weights_from_disk(self, path: str) -> None:
        raise NotImplementedError

    def update_weights_from_tensors(self, named_tensors) -> None:
        raise NotImplementedError

    def flush_cache(self) -> None:
        pass

    def health(self) -> bool:
        return True


def episode_engine(
    engine: RolloutEngine, hf, tools: ToolSet | None = None, max_new_tokens: int = 256, **settings
):
    mt = MultiTurnConfig(**{"python_tool": False, **settings})
    return with_episodes(
        engine,
        mt,
        hf,
        max_new_tokens=max_new_tokens,
        template_kwargs={},
        parallel_calls=1,
        tools=tools,
    )


def prompt_ids(hf, question: str, tools: list[dict] | None = None) -> list[int]:
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": question},
    ]
    text = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return list(hf(text, add_special_tokens=False)["input_ids"])
