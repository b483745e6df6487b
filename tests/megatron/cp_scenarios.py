"""Per-rank bodies of the context-parallel tests (imported by spawned workers): per layout, the full-vocabulary
logits of fixed token ids (``forward_logits``) and the padded and packed RL updates of
:mod:`tests.megatron.packing_scenarios` (old-log-prob pass with recorded routes, SAPO with R3, GSPO, ...)."""

from __future__ import annotations

# megatron-core 0.19 imports triton at import time unless sapo_megatron's stand-ins are registered first
import sapo_megatron.megatron  # noqa: F401  # isort: skip

from typing import Any

from sapo_megatron.megatron.forward import forward_logits
from sapo_megatron.megatron.model import BuildOptions, build_gpt_model
from sapo_megatron.megatron.train_step import init_weights
from tests.megatron.packing_scenarios import packing_layout
from tests.megatron.scenarios import layout_config


def cp_cases(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Each of ``payload["cases"]`` in turn (one spawn serves several layouts of one world size)."""
    return [cp_layout({**payload, **case}) for case in payload["cases"]]


def cp_layout(payload: dict[str, Any]) -> dict[str, Any]:
    out = packing_layout(payload)  # builds the layout's parallel state
    cfg = layout_config(payload)
    module = build_gpt_model(BuildOptions(cfg.model, cfg.parallel, cfg.precision))
    init_weights(module, cfg)
    out["logits"] = forward_logits(module, payload["ids"])
    return out
