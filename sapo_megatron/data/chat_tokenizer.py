"""The chat tokenizer that ships with the package: a small byte-level BPE with a Qwen-style chat template, for the
embedded and tiny models (``data.tokenizer: chat``), so message datasets work without downloading a tokenizer.

It is trained offline, deterministically, by :func:`build` on :func:`corpus` (``python -m
sapo_megatron.data.chat_tokenizer`` rewrites the shipped files; ``tests/data/test_chat_tokenizer.py`` checks that
a rebuild gives the same files). Like Qwen2/3's tokenizers it splits digits one by one and lets any byte through
(no unknown token), has no bos token, ends a turn with ``<|im_end|>`` (its eos) and pads with ``<|endoftext|>``.
Its template writes ``<|im_start|>role\\ncontent<|im_end|>\\n`` per message, the assistant header as generation
prompt, and Qwen3's empty think block when ``enable_thinking`` is false.

Stable import path for other modules and tests: ``sapo_megatron.data.chat_tokenizer.CHAT_TOKENIZER_DIR`` (a
folder ``transformers.AutoTokenizer`` loads) and :func:`load_chat_tokenizer`.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

NAME = "chat"
"""The ``data.tokenizer`` value that selects it."""

CHAT_TOKENIZER_DIR = Path(__file__).resolve().parent / "chat_tokenizer_files"
VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ADDED_TOKENS = ("<think>", "</think>")  # ordinary added tokens, as in Qwen3

QWEN_STYLE_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

# Qwen2's pre-tokenizer pattern (the GPT-4 style split, with single digits): contractions, letter runs with one
# leading non-letter, single digits, punctuation runs, newlines, spaces.
SPLIT_PATTERN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

_WORDS = (
    "what is the sum of plus minus times divided by how many much does do did each total left more less than "
    "has have had a an and or if then so answer final put in you are helpful assistant think step by solve for "
    "compute find number numbers value let be there were was will cost costs dollars apples books students "
    "day days week hours minutes per every half twice three four five ten hundred thousand first second last "
    "which who when where why it its his her their they she he we our buys sells gives gets makes pays spent "
    "return def print import from class self true false none while else elif not with as at on to of is"
)


def corpus() -> list[str]:
    """The training text: chat-formatted arithmetic, GSM8K-style sentences, answer markers and a little Python."""
    words = _WORDS.split()
    lines = []
    for a, b in itertools.product(range(0, 100, 7), range(0, 100, 11)):
        lines.append(f"What is {a} plus {b}? Put the final answer in \\boxed{{}}.")
        lines.append(f"{a}+{b}={a + b} #### {a + b} The answer is \\boxed{{{a + b}}}.")
    for i in range(len(words)):
        window = words[i : i + 12] + words[: max(0, i + 12 - len(words))]
        lines.append(" ".join(window).capitalize() + ".")
    lines += [
        "You are a helpful assistant. Think step by step.",
        "def add(a, b):\n    return a + b\n",
        "for i in range(10):\n    print(i * 2)\n",
        "Answer: 42\nFinal answer: \\boxed{42}",
    ] * 5
    return lines


def build(directory: str | Path) -> Path:
    """Train the BPE on :func:`corpus` and save it with the template as an HF tokenizer folder."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(ADDED_TOKENS),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus(), trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.add_tokens(list(ADDED_TOKENS))
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.backend_tokenizer.save(str(directory / "tokenizer.json"))
    # Written by hand rather than by save_pretrained, whose output differs between transformers versions: the
    # classic keys that transformers 4.x and 5.x both read, with the template inline.
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "additional_special_tokens": ["<|im_start|>"],
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": False,
        "chat_template": QWEN_STYLE_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def load_chat_tokenizer() -> Any:
    """The shipped tokenizer as ``transformers.PreTrainedTokenizerFast``."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(CHAT_TOKENIZER_DIR))


if __name__ == "__main__":
    print(build(CHAT_TOKENIZER_DIR))
