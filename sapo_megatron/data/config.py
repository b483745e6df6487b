"""The ``data`` section: the prompt data and how prompts become ids (read by :mod:`sapo_megatron.data.loading`;
evaluation datasets reuse its keys, :class:`~sapo_megatron.data.datasets.DatasetKeys`)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from sapo_megatron.data.datasets import DatasetKeys


class DataConfig(DatasetKeys):
    """Prompt data: jsonl / parquet files (a directory or glob of shards; verl, slime or own keys, see
    docs/data.md), or the built-in synthetic addition task (``synthetic:addition``); how prompts become ids."""

    train: str = "synthetic:addition"
    tokenizer: str = Field(
        default="char",
        description="'char' (the demo's characters), 'chat' (the shipped byte-level BPE with a Qwen-style chat "
        "template), 'qwen3' (the real Qwen3 tokenizer and template, `make qwen3-tokenizer`; apply_chat_template "
        "defaults to true with both) or an HF tokenizer directory",
    )
    digits: int = Field(default=2, ge=1, description="operand digits of the synthetic task")
    train_size: int = Field(default=4000, ge=1, description="synthetic training prompts")

    @model_validator(mode="before")
    @classmethod
    def _chat_tokenizer_renders_chat(cls, data: Any) -> Any:
        """``tokenizer: chat`` / ``qwen3`` exist to read message datasets: the template is on unless set off."""
        chat = isinstance(data, dict) and data.get("tokenizer") in ("chat", "qwen3")
        if chat and "apply_chat_template" not in data:
            return {**data, "apply_chat_template": True}
        return data

    @model_validator(mode="after")
    def _check_chat_tokenizer(self) -> DataConfig:
        if self.apply_chat_template and self.tokenizer == "char":
            raise ValueError(
                "data.apply_chat_template needs an HF tokenizer with a chat template; the char tokenizer has none "
                "(set data.tokenizer to the model's tokenizer directory, or to 'chat' for the tiny models)"
            )
        return self
