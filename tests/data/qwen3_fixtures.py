"""The real Qwen3 tokenizer for the tests (``make qwen3-tokenizer`` fetched it; ``make test`` does that first).

A test that needs it fails, with the fetch command in the message, when it is not there: a skip would let the
suite pass without ever seeing the real template."""

from __future__ import annotations

import functools
from typing import Any

from sapo_megatron.data import qwen3_tokenizer


@functools.cache
def qwen3_hf() -> Any:
    """Qwen3's tokenizer and chat template as transformers loads them (once per process)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen3_tokenizer.tokenizer_dir()))


def qwen3() -> Any:
    """A fresh copy (tests that change ``chat_template`` or other attributes must not share one)."""
    import copy

    return copy.deepcopy(qwen3_hf())
