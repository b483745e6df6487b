"""A real BPE tokenizer with a Qwen-style chat template, trained offline here (no downloads), and small datasets in
this project's, verl's and slime's layouts, for the data tests and the recipe's dry run."""

from __future__ import annotations

import json
from pathlib import Path

from sapo_megatron.data.chat_tokenizer import QWEN_STYLE_TEMPLATE  # Qwen3's template, reduced (re-exported)

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "What is 12 plus 30? Put the final answer in \\boxed{}.",
    "Solve for x: 3x + 5 = 20. The answer is \\boxed{5}.",
    "You are a helpful assistant. Think step by step.",
    "def add(a, b):\n    return a + b",
    "Compute the sum of the first ten positive integers.",
] * 20


def make_chat_tokenizer(directory: str | Path, vocab_size: int = 320) -> Path:
    """Train a byte-level BPE on :data:`CORPUS`, wrap it as ``PreTrainedTokenizerFast`` with the template and
    ``<|im_end|>`` as eos (as Qwen's instruct tokenizers), save it into ``directory`` and return it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.add_tokens(["<think>", "</think>"])  # ordinary added tokens, as in Qwen3
    tokenizer.chat_template = QWEN_STYLE_TEMPLATE
    tokenizer.save_pretrained(str(directory))
    return Path(directory)


def verl_records(n: int, sources: tuple[str, ...] = ("deepmath", "aime")) -> list[dict]:
    """Rows as verl's RL parquet holds them (``verl/utils/dataset/rl_dataset.py``, ``examples/data_preprocess``)."""
    return [
        {
            "data_source": sources[i % len(sources)],
            "prompt": [
                {"role": "user", "content": f"What is {i} plus {i + 1}? Put the answer in \\boxed{{}}."}
            ],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(2 * i + 1)},
            "extra_info": {"split": "train", "index": i},
        }
        for i in range(n)
    ]


def write_verl_parquet(path: str | Path, n: int, **kwargs) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    pq.write_table(pa.Table.from_pylist(verl_records(n, **kwargs)), path)
    return path


def write_jsonl(path: str | Path, records: list[dict]) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def slime_records(n: int) -> list[dict]:
    """A slime-style jsonl row with the user's own keys (``--input-key question --label-key answer``)."""
    return [
        {"question": f"Compute {i} plus {i}.", "answer": str(2 * i), "metadata": {"id": i}} for i in range(n)
    ]


def plain_records(n: int) -> list[dict]:
    return [
        {"prompt": f"What is {i} plus 30?", "ground_truth": str(i + 30), "domain": "addition"}
        for i in range(n)
    ]
