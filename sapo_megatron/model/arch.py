"""The model architecture as Hugging Face describes it: the subset of a Qwen3 / Qwen3-MoE / Qwen3-VL-MoE
``config.json`` that decides the network, normalised across transformers versions (``num_experts`` vs
``num_local_experts``, ``rope_theta`` vs ``rope_parameters``). Pure data: no torch, no megatron.

A Qwen3-VL-MoE config is read as its language model (``text_config``: the same fields as Qwen3-MoE) plus a
:class:`VisionArch` (``vision_config``), the multimodal RoPE sections and the special token ids."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from sapo_megatron.errors import UserError

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen3_vl", "qwen3_vl_moe")
VL_MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe")
_VL_CLASSES = {
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
}


class ArchError(UserError, ValueError):
    """An HF config that this project cannot build faithfully."""


class VisionArch(BaseModel):
    """The Qwen3-VL vision tower (``vision_config``): a ViT over ``temporal × patch × patch`` patches, a merger of
    ``spatial_merge_size²`` neighbouring patches into one LM token, and one DeepStack merger per index."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    depth: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    in_channels: int = Field(default=3, gt=0)
    patch_size: int = Field(gt=0)
    temporal_patch_size: int = Field(default=2, gt=0)
    spatial_merge_size: int = Field(default=2, gt=0)
    out_hidden_size: int = Field(gt=0)
    num_position_embeddings: int = Field(gt=0)
    deepstack_visual_indexes: tuple[int, ...] = ()
    hidden_act: str = "gelu_pytorch_tanh"

    @model_validator(mode="after")
    def _check(self) -> VisionArch:
        if self.hidden_size % self.num_heads:
            raise ArchError(
                f"vision_config.hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}"
            )
        side = round(self.num_position_embeddings**0.5)
        if side * side != self.num_position_embeddings:
            raise ArchError(
                f"vision_config.num_position_embeddings={self.num_position_embeddings} is not a square number"
            )
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.depth]
        if bad:
            raise ArchError(
                f"vision_config.deepstack_visual_indexes {bad} lie outside the {self.depth} ViT blocks"
            )
        return self

    @property
    def merged_hidden_size(self) -> int:
        """Width of the merger's input: ``spatial_merge_size²`` patches side by side."""
        return self.hidden_size * self.spatial_merge_size**2

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the tower, by its name under ``visual.`` (transformers' ``Qwen3VLMoeVisionModel``)."""
        h, i, m = self.hidden_size, self.intermediate_size, self.merged_hidden_size
        p, t = self.patch_size, self.temporal_patch_size
        shapes: dict[str, tuple[int, ...]] = {
            "patch_embed.proj.weight": (h, self.in_channels, t, p, p),
            "patch_embed.proj.bias": (h,),
            "pos_embed.weight": (self.num_position_embeddings, h),
        }
        for b in range(self.depth):
            for name, shape in (
                ("norm1.weight", (h,)),
                ("norm1.bias", (h,)),
                ("norm2.weight", (h,)),
                ("norm2.bias", (h,)),
                ("attn.qkv.weight", (3 * h, h)),
                ("attn.qkv.bias", (3 * h,)),
                ("attn.proj.weight", (h, h)),
                ("attn.proj.bias", (h,)),
                ("mlp.linear_fc1.weight", (i, h)),
                ("mlp.linear_fc1.bias", (i,)),
                ("mlp.linear_fc2.weight", (h, i)),
                ("mlp.linear_fc2.bias", (h,)),
            ):
                shapes[f"blocks.{b}.{name}"] = shape
        mergers = [("merger", h)] + [
            (f"deepstack_merger_list.{k}", m) for k in range(len(self.deepstack_visual_indexes))
        ]
        for (
            prefix,
            norm,
        ) in mergers:  # the final merger normalises each patch, the DeepStack ones the merged row
            shapes.update(
                {
                    f"{prefix}.norm.weight": (norm,),
                    f"{prefix}.norm.bias": (norm,),
                    f"{prefix}.linear_fc1.weight": (m, m),
                    f"{prefix}.linear_fc1.bias": (m,),
                    f"{prefix}.linear_fc2.weight": (self.out_hidden_size, m),
                    f"{prefix}.linear_fc2.bias": (self.out_hidden_size,),
                }
            )
        return shapes

    def num_parameters(self) -> int:
        total = 0
        for shape in self.tensor_shapes().values():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total


@dataclass(frozen=True)
class VLParts:
    """What a vision-language :class:`QwenArch` adds to its language model, with every field set."""

    vision: VisionArch
    mrope_section: tuple[int, int, int]
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int


class QwenArch(BaseModel):
    """Architecture fields of Qwen3 (dense) and Qwen3-MoE. Unknown HF keys are kept in ``extra_hf`` only."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_type: Literal["qwen3", "qwen3_moe", "qwen3_vl", "qwen3_vl_moe"]
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
    # Qwen3-VL-MoE only
    vision: VisionArch | None = None
    mrope_section: tuple[int, int, int] | None = None
    image_token_id: int | None = None
    video_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None

    @model_validator(mode="after")
    def _check_moe_fields(self) -> QwenArch:
        if self.is_vl:
            _check_vl(self)
        if self.is_moe:
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
        return self.model_type in ("qwen3_moe", "qwen3_vl_moe")

    @property
    def is_vl(self) -> bool:
        """A vision-language model: a vision tower feeds the LM (image tokens, MRoPE, DeepStack)."""
        return self.model_type in VL_MODEL_TYPES

    @property
    def vl(self) -> VLParts:
        """The parts only a vision-language model has, all set (the validator checked them); raises
        :class:`ArchError` for a text-only model."""
        if (
            self.vision is None
            or self.mrope_section is None
            or self.image_token_id is None
            or self.video_token_id is None
            or self.vision_start_token_id is None
            or self.vision_end_token_id is None
        ):
            raise ArchError(f"model_type={self.model_type!r} is not a vision-language model")
        return VLParts(
            self.vision,
            self.mrope_section,
            self.image_token_id,
            self.video_token_id,
            self.vision_start_token_id,
            self.vision_end_token_id,
        )

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
        vision = self.vision.num_parameters() if self.vision is not None else 0
        return sum(per_layer) + embeddings + h + vision

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> QwenArch:
        """Read an HF ``config.json`` dict; unsupported features raise :class:`ArchError` naming the key."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ArchError(
                f"model_type={model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if model_type in VL_MODEL_TYPES:
            return cls(**_vl_fields(raw))
        _reject_unsupported_features(raw)
        return cls(**_text_fields(raw))

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
        if self.is_vl:
            return self._vl_hf_dict()
        return self._text_hf_dict()

    def _vl_hf_dict(self) -> dict[str, Any]:
        text = self._text_hf_dict()
        for key in ("architectures", "tie_word_embeddings", "rope_theta", "rope_scaling"):
            text.pop(key)
        text.update(
            model_type=f"{self.model_type}_text",
            rope_parameters={
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "mrope_section": list(self.mrope_section or ()),
                "mrope_interleaved": True,
            },
        )
        vision = {**self.vl.vision.model_dump(), "model_type": f"{self.model_type}_vision"}
        vision["deepstack_visual_indexes"] = list(vision["deepstack_visual_indexes"])
        return {
            "architectures": [_VL_CLASSES[self.model_type]],
            "model_type": self.model_type,
            "text_config": text,
            "vision_config": vision,
            "tie_word_embeddings": self.tie_word_embeddings,
            "image_token_id": self.image_token_id,
            "video_token_id": self.video_token_id,
            "vision_start_token_id": self.vision_start_token_id,
            "vision_end_token_id": self.vision_end_token_id,
        }

    def _text_hf_dict(self) -> dict[str, Any]:
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


def _text_fields(raw: dict[str, Any]) -> dict[str, Any]:
    fields = {k: raw[k] for k in QwenArch.model_fields if k in raw}
    if "num_experts" not in raw and "num_local_experts" in raw:
        fields["num_experts"] = raw["num_local_experts"]
    fields.setdefault("head_dim", raw["hidden_size"] // raw["num_attention_heads"])
    fields["rope_theta"] = _rope_theta(raw)
    fields.setdefault("num_key_value_heads", raw.get("num_attention_heads"))
    return fields


_VL_TOKEN_IDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
_VL_TOKEN_DEFAULTS = (151655, 151656, 151652, 151653)  # transformers' Qwen3VLMoeConfig defaults


def _vl_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """A Qwen3-VL-MoE config: the LM from ``text_config``, the tower from ``vision_config``."""
    text, vision = raw.get("text_config"), raw.get("vision_config")
    if not isinstance(text, dict) or not isinstance(vision, dict):
        raise ArchError(f"model_type={raw['model_type']!r} needs text_config and vision_config mappings")
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if not rope.get("mrope_interleaved", False):
        raise ArchError(
            "text_config.rope_parameters.mrope_interleaved must be true: Qwen3-VL interleaves the MRoPE "
            "frequencies (the chunked Qwen2-VL layout is not supported)"
        )
    section = rope.get("mrope_section")
    if not section or len(section) != 3:
        raise ArchError(
            f"text_config.rope_parameters.mrope_section must list 3 sizes (t, h, w); got {section}"
        )
    stripped = {k: v for k, v in rope.items() if k not in ("mrope_section", "mrope_interleaved")}
    _reject_unsupported_features({**text, "rope_parameters": stripped, "rope_scaling": None})
    fields = _text_fields({**text, "rope_parameters": stripped, "model_type": raw["model_type"]})
    fields["tie_word_embeddings"] = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    fields["mrope_section"] = tuple(section)
    vision_fields = {k: vision[k] for k in VisionArch.model_fields if k in vision}
    vision_fields.setdefault("depth", vision.get("num_hidden_layers"))
    vision_fields.setdefault("num_heads", vision.get("num_attention_heads"))
    fields["vision"] = VisionArch(**vision_fields)
    for key, default in zip(_VL_TOKEN_IDS, _VL_TOKEN_DEFAULTS):
        fields[key] = raw.get(key, default)
    return fields


def _check_vl(arch: QwenArch) -> None:
    if arch.vision is None or arch.mrope_section is None:
        raise ArchError(f"model_type={arch.model_type!r} needs a vision config and mrope_section")
    if sum(arch.mrope_section) != arch.head_dim // 2:
        raise ArchError(
            f"mrope_section {list(arch.mrope_section)} sums to {sum(arch.mrope_section)}; the rotary "
            f"frequencies number head_dim/2 = {arch.head_dim // 2}"
        )
    if arch.vision.out_hidden_size != arch.hidden_size:
        raise ArchError(
            f"vision_config.out_hidden_size={arch.vision.out_hidden_size} must equal the LM's "
            f"hidden_size={arch.hidden_size}"
        )
    if len(arch.vision.deepstack_visual_indexes) > arch.num_hidden_layers:
        raise ArchError(
            f"{len(arch.vision.deepstack_visual_indexes)} DeepStack levels need as many LM layers "
            f"(the model has {arch.num_hidden_layers})"
        )
    if any(getattr(arch, key) is None for key in _VL_TOKEN_IDS):
        raise ArchError(f"a vision-language config needs {', '.join(_VL_TOKEN_IDS)}")


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
