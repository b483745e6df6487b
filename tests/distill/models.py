"""Teacher checkpoints made by code for the distillation tests: tiny HF models that share the demo's char
tokenizer (vocabulary 52), with a sharpened output layer so that the teacher is far from a fresh student."""

from __future__ import annotations

from pathlib import Path

import torch

from sapo_megatron.data.tokenizer import CharTokenizer
from sapo_megatron.model.tiny import build_hf_model, tiny_hf_config

DEMO_VOCAB = CharTokenizer().vocab_size


def make_teacher(path: Path, *, seed: int = 7, sharpen: float = 1.0, kind: str = "dense") -> Path:
    """An HF checkpoint + char tokenizer in ``path``; ``sharpen`` multiplies the output layer (peaked
    next-token distributions: a teacher the student must move to)."""
    model = build_hf_model(tiny_hf_config(kind, vocab_size=DEMO_VOCAB), seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    model.save_pretrained(path)
    CharTokenizer().save(path)
    return path
