"""Offline HF ⇄ Megatron conversion for Qwen3 / Qwen3-MoE: the public names in one place.

The tools live in one module each (docs/conversion.md): :mod:`.params` (input checks, the parameter plan and
:class:`ConversionError`), :mod:`.to_megatron` (``hf_to_megatron``), :mod:`.to_hf` (``megatron_to_hf``) and
:mod:`.verify` (the logit-parity check). This module re-exports their public names, so
``from sapo_megatron.conversion.convert import hf_to_megatron`` keeps working.
"""

from __future__ import annotations

from sapo_megatron.conversion.params import (
    TOKENIZER_FILES,
    ConversionError,
    ParamPlan,
    plan_params,
    read_hf_config,
    validate_hf_checkpoint,
)
from sapo_megatron.conversion.to_hf import DEFAULT_MAX_SHARD_BYTES, DEFAULT_READ_BATCH_BYTES, megatron_to_hf
from sapo_megatron.conversion.to_megatron import hf_to_megatron, row_runs
from sapo_megatron.conversion.verify import DEFAULT_TOLERANCE, ParityReport, verify

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "DEFAULT_READ_BATCH_BYTES",
    "DEFAULT_TOLERANCE",
    "TOKENIZER_FILES",
    "ConversionError",
    "ParamPlan",
    "ParityReport",
    "hf_to_megatron",
    "megatron_to_hf",
    "plan_params",
    "read_hf_config",
    "row_runs",
    "validate_hf_checkpoint",
    "verify",
]
