"""Prompt datasets (jsonl / parquet) with a resumable iterator, the demo's char tokenizer and synthetic tasks."""

from sapo_megatron.data.prompts import (
    DatasetError,
    PromptIterator,
    PromptRow,
    check_encodable,
    load_prompts,
    save_jsonl,
)
from sapo_megatron.data.synthetic import addition_problem, make_addition_rows, pair_split
from sapo_megatron.data.tokenizer import CharTokenizer, TokenizerError

__all__ = [
    "CharTokenizer",
    "DatasetError",
    "PromptIterator",
    "PromptRow",
    "TokenizerError",
    "addition_problem",
    "check_encodable",
    "load_prompts",
    "make_addition_rows",
    "pair_split",
    "save_jsonl",
]
