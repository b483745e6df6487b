"""The model architecture as Hugging Face describes it: the subset of a Qwen3 / Qwen3-MoE ``config.json`` that
decides the network, normalised across transformers versions (``num_experts`` vs ``num_local_experts``,
``rope_theta`` vs ``rope_parameters``). Pure data: no torch, no megatron."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sapo_megatron.errors import UserError

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe")


class ArchError(UserError, ValueError):
    """An HF config that this project cannot build faithfully."""


class QwenArch(BaseModel):
    """Architecture fields of Qwen3 (dense) and Qwen3-MoE. Unknown HF keys are kept in ``extra_hf`` only."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_type: Literal["qwen3", "qwen3_moe"]
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    rms_norm_eps: float = Field(gt=0)
    rope_theta: float = Field(gt=0)
    max_position_embeddings: int = Field(gt=0)
    tie_word_embeddings: bool = False
    num_experts: int = Field(default=0, ge=0)
    num_experts_per_tok: int = Field(default=0, ge=0)
    moe_intermediate_size: int = Field(default=0, ge=0)
    norm_topk_prob: bool = True
    decoder_sparse_step: int = Field(default=1, ge=1)
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    @model_validator(mode="after")
    def _check_moe_fields(self) -> QwenArch:
        if self.model_type == "qwen3_moe":
            if self.num_experts < 1 or self.num_experts_per_tok < 1 or self.moe_intermediate_size < 1:
                raise ArchError(
                    "qwen3_moe needs num_experts, num_experts_per_tok and moe_intermediate_size > 0 "
                    f"(got {self.num_experts}, {self.num_experts_per_tok}, {self.moe_intermediate_size})"
                )
            if self.num_experts_per_tok > self.num_experts:
                raise ArchError(
                    f"num_experts_per_tok={self.num_experts_per_tok} exceeds num_experts={self.num_experts}"
                )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ArchError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        return self

    @property
    def is_moe(self) -> bool:
        return self.model_type == "qwen3_moe"

    def moe_layer_pattern(self) -> list[int]:
        """1 for each layer whose MLP is a sparse MoE block, 0 for a dense MLP (HF's rule)."""
        if not self.is_moe:
            return [0] * self.num_hidden_layers
        return [
            int(i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0)
            for i in range(self.num_hidden_layers)
        ]

    def num_parameters(self) -> int:
        """Total parameter count (embeddings and output layer included)."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + 2 * self.head_dim + 2 * h
        dense_mlp = 3 * h * self.intermediate_size
        moe_mlp = self.num_experts * 3 * h * self.moe_intermediate_size + self.num_experts * h
        per_layer = [attn + (moe_mlp if is_moe else dense_mlp) for is_moe in self.moe_layer_pattern()]
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return sum(per_layer) + embeddings + h

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> QwenArch:
        """Read an HF ``config.json`` dict; unsupported features raise :class:`ArchError` naming the key."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ArchError(
                f"model_type={model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        _reject_unsupported_features(raw)
        fields = {k: raw[k] for k in cls.model_fields if k in raw}
        if "num_experts" not in raw and "num_local_experts" in raw:
            fields["num_experts"] = raw["num_local_experts"]
        fields.setdefault("head_dim", raw["hidden_size"] // raw["num_attention_heads"])
        fields["rope_theta"] = _rope_theta(raw)
        fields.setdefault("num_key_value_heads", raw.get("num_attention_heads"))
        return cls(**fields)

    @classmethod
    def from_path(cls, path: str | Path) -> QwenArch:
        """Load from a ``config.json`` file or from a directory that holds one."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ArchError(f"no HF config.json at {path}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ArchError(f"{path} is not valid JSON: {err}") from err
        return cls.from_hf_dict(raw)

    def to_hf_dict(self) -> dict[str, Any]:
        """A complete HF ``config.json`` dict that transformers loads into the same architecture."""
        out: dict[str, Any] = {
            "architectures": ["Qwen3MoeForCausalLM" if self.is_moe else "Qwen3ForCausalLM"],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.is_moe:
            out.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
                router_aux_loss_coef=self.router_aux_loss_coef,
                output_router_logits=False,
            )
        return out


def _rope_theta(raw: dict[str, Any]) -> float:
    params = raw.get("rope_parameters") or {}
    theta = raw.get("rope_theta", params.get("rope_theta"))
    if theta is None:
        raise ArchError("the HF config has neither rope_theta nor rope_parameters.rope_theta")
    return float(theta)


def _reject_unsupported_features(raw: dict[str, Any]) -> None:
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ("default", None):
        raise ArchError(f"rope scaling type {rope_type!r} is not supported (only default RoPE)")
    if raw.get("attention_bias"):
        raise ArchError("attention_bias=true is not supported for Qwen3 (Qwen3 has no QKV bias)")
    if raw.get("use_sliding_window"):
        raise ArchError("use_sliding_window=true is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise ArchError(f"hidden_act={raw['hidden_act']!r} is not supported (Qwen3 uses silu)")
    shared = raw.get("shared_expert_intermediate_size", 0)
    if shared:
        raise ArchError("shared experts (shared_expert_intermediate_size) are not part of Qwen3-MoE")
