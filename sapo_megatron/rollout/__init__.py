"""Rollout engines behind one interface, :class:`RolloutEngine` (``base``), with the sample types (``types``) and
what every engine shares: collecting and scoring a step's groups (``collect``), the engine's precision
(``precision``), SGLang's HTTP request/reply shapes (``protocol``) and the weight-update wire formats
(``tensor_transport``, ``weight_group``). Implementations live in subpackages:

- :mod:`sapo_megatron.rollout.sglang`: the client of real SGLang servers (and a router): HTTP, topology;
- :mod:`sapo_megatron.rollout.cpu`: the CPU stand-in, transformers on CPU in process (``engine``) or served over
  SGLang's HTTP API (``server``); nothing outside it needs it, so the SGLang path works without it.
"""

from typing import Any

__all__ = ["GenerationRequest", "RolloutEngine", "RolloutError", "Sample", "SamplingParams"]

_EXPORTS = {
    "RolloutEngine": "sapo_megatron.rollout.base",
    "RolloutError": "sapo_megatron.rollout.base",
    "GenerationRequest": "sapo_megatron.rollout.types",
    "Sample": "sapo_megatron.rollout.types",
    "SamplingParams": "sapo_megatron.rollout.types",
    "CPUEngine": "sapo_megatron.rollout.cpu.engine",  # from before the engines had subpackages
    "SGLangClient": "sapo_megatron.rollout.sglang.client",
}


def __getattr__(name: str) -> Any:
    """The names above, imported when first asked for: the package itself imports nothing, so that
    ``rollout.cpu.flags`` (``sapo-megatron serve --help``) stays free of torch."""
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'sapo_megatron.rollout' has no attribute {name!r}")
