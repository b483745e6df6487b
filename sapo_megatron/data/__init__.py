"""Prompt datasets (jsonl / parquet, verl and slime layouts by key mapping) with a resumable iterator, prompt
rendering (chat templates) and the prompt-length policy, tokenizers, the samples file and synthetic tasks."""

from sapo_megatron.data.datasets import DatasetKeys, load_dataset, read_dataset
from sapo_megatron.data.prompts import (
    DatasetError,
    PromptIterator,
    PromptRow,
    check_encodable,
    fill_template,
    save_jsonl,
)
from sapo_megatron.data.render import PromptRenderer, apply_length_policy
from sapo_megatron.data.synthetic import addition_problem, make_addition_rows, pair_split
from sapo_megatron.data.tokenizer import CharTokenizer, TokenizerError

__all__ = [
    "CharTokenizer",
    "DatasetError",
    "DatasetKeys",
    "PromptIterator",
    "PromptRenderer",
    "PromptRow",
    "TokenizerError",
    "addition_problem",
    "apply_length_policy",
    "check_encodable",
    "fill_template",
    "load_dataset",
    "make_addition_rows",
    "pair_split",
    "read_dataset",
    "save_jsonl",
]
