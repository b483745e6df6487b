"""Rollout engines behind one interface: SGLang over HTTP (:class:`SGLangClient`) and transformers on CPU
(:class:`CPUEngine`, also served over the same HTTP protocol by :mod:`sapo_megatron.rollout.cpu_server`)."""

from sapo_megatron.rollout.base import RolloutEngine, RolloutError
from sapo_megatron.rollout.cpu_engine import CPUEngine
from sapo_megatron.rollout.sglang_client import SGLangClient
from sapo_megatron.rollout.types import GenerationRequest, Sample, SamplingParams

__all__ = [
    "CPUEngine",
    "GenerationRequest",
    "RolloutEngine",
    "RolloutError",
    "SGLangClient",
    "Sample",
    "SamplingParams",
]
