"""Declarative HF ⇄ Megatron mapping for Qwen3 and Qwen3-MoE: one table, name patterns plus typed transforms.

A :class:`Rule` ties one Megatron parameter name pattern to the HF tensor name(s) it is made from, and a
transform that knows how the *full* (unsharded) tensor is laid out and how tensor parallelism splits it:

- ``Replicated``: norms, the router – identical on every rank.
- ``Sharded(dim)``: a plain TP split (``linear_proj`` / ``linear_fc2`` along the input dim, embeddings and the
  output layer along the vocabulary).
- ``QKV``: HF ``q_proj``, ``k_proj``, ``v_proj`` → Megatron's ``linear_qkv``, grouped per query group as
  ``[q heads of the group, k, v]``; TP takes contiguous groups.
- ``GatedMLP``: HF ``gate_proj`` + ``up_proj`` → Megatron's ``linear_fc1`` with each rank holding
  ``[gate_r; up_r]`` (SwiGLU chunks its local output in two).

Placeholders: ``{L}`` the global layer index, ``{E}`` the global expert index, ``{V}`` the rest of a vision
tower name. The same table serves in-memory loading (any TP/PP/EP layout), online export for weight sync, and
offline conversion.

Qwen3-VL-MoE (:data:`VL_RULES`) is the same table with the language model under ``model.language_model.`` plus
one rule for the vision tower, which Megatron holds as transformers' own module (``visual.*`` ⇄
``model.visual.*``, replicated). Its fused expert tensors are a storage layout, read and written by
:mod:`sapo_megatron.checkpoint.fused_experts`; the table speaks per-expert names.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from sapo_megatron.errors import UserError
from sapo_megatron.model.arch import QwenArch

GatherFn = Callable[[torch.Tensor, int], torch.Tensor]
"""``gather(local, dim) -> full``: concatenates the shards of all ranks of the relevant TP group along ``dim``."""


@dataclass(frozen=True)
class ShardInfo:
    """Which slice of a full tensor this rank holds."""

    size: int  # tensor- (or expert-tensor-) parallel size
    rank: int


class Transform:
    """How HF tensors become one Megatron tensor (full layout), and how TP shards it."""

    def full(self, hf: Sequence[torch.Tensor], arch: QwenArch) -> torch.Tensor:
        raise NotImplementedError

    def split_full(self, full: torch.Tensor, arch: QwenArch, n_hf: int) -> list[torch.Tensor]:
        raise NotImplementedError

    def shard(self, full: torch.Tensor, shard: ShardInfo, arch: QwenArch) -> torch.Tensor:
        raise NotImplementedError

    def unshard(
        self, local: torch.Tensor, gather: GatherFn, shard: ShardInfo, arch: QwenArch
    ) -> torch.Tensor:
        raise NotImplementedError

    def to_local(self, hf: Sequence[torch.Tensor], shard: ShardInfo, arch: QwenArch) -> torch.Tensor:
        return self.shard(self.full(hf, arch), shard, arch)

    def to_hf(
        self, local: torch.Tensor, gather: GatherFn, shard: ShardInfo, arch: QwenArch, n_hf: int
    ) -> list[torch.Tensor]:
        return self.split_full(self.unshard(local, gather, shard, arch), arch, n_hf)


class Replicated(Transform):
    def full(self, hf, arch):
        return hf[0]

    def split_full(self, full, arch, n_hf):
        return [full]

    def shard(self, full, shard, arch):
        return full

    def unshard(self, local, gather, shard, arch):
        return local


@dataclass(frozen=True)
class Sharded(Transform):
    dim: int

    def full(self, hf, arch):
        return hf[0]

    def split_full(self, full, arch, n_hf):
        return [full]

    def shard(self, full, shard, arch):
        return full.chunk(shard.size, dim=self.dim)[shard.rank]

    def unshard(self, local, gather, shard, arch):
        return local if shard.size == 1 else gather(local, self.dim)


class QKV(Sharded):
    """``[q; k; v]`` (HF) ⇄ per-query-group ``[q_g; k_g; v_g]`` (Megatron), TP over whole groups."""

    def __init__(self) -> None:
        super().__init__(dim=0)

    def full(self, hf, arch):
        q, k, v = hf
        groups, head_dim = arch.num_key_value_heads, arch.head_dim
        heads_per_group = arch.num_attention_heads // groups
        hidden = q.shape[-1]
        q = q.reshape(groups, heads_per_group * head_dim, hidden)
        k = k.reshape(groups, head_dim, hidden)
        v = v.reshape(groups, head_dim, hidden)
        return torch.cat([q, k, v], dim=1).reshape(-1, hidden)

    def split_full(self, full, arch, n_hf):
        groups, head_dim = arch.num_key_value_heads, arch.head_dim
        heads_per_group = arch.num_attention_heads // groups
        hidden = full.shape[-1]
        grouped = full.reshape(groups, (heads_per_group + 2) * head_dim, hidden)
        q, k, v = grouped.split([heads_per_group * head_dim, head_dim, head_dim], dim=1)
        return [q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)]


class GatedMLP(Transform):
    """``gate_proj`` + ``up_proj`` (HF) ⇄ ``linear_fc1`` whose rank-local rows are ``[gate_r; up_r]``."""

    def full(self, hf, arch):
        return torch.cat([hf[0], hf[1]], dim=0)

    def split_full(self, full, arch, n_hf):
        return list(full.chunk(2, dim=0))

    def shard(self, full, shard, arch):
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(shard.size)[shard.rank], up.chunk(shard.size)[shard.rank]], dim=0)

    def unshard(self, local, gather, shard, arch):
        if shard.size == 1:
            return local
        rows = gather(local, 0).chunk(shard.size, dim=0)
        gates = [r.chunk(2, dim=0)[0] for r in rows]
        ups = [r.chunk(2, dim=0)[1] for r in rows]
        return torch.cat(gates + ups, dim=0)


@dataclass(frozen=True)
class Rule:
    """Megatron name pattern → HF name patterns, with the transform between them."""

    megatron: str
    hf: tuple[str, ...]
    transform: Transform
    expert: bool = False  # expert weights shard over the expert-tensor-parallel group

    def regex(self) -> re.Pattern[str]:
        pattern = (
            re.escape(self.megatron)
            .replace(r"\{L\}", r"(?P<L>\d+)")
            .replace(r"\{E\}", r"(?P<E>\d+)")
            .replace(r"\{V\}", r"(?P<V>.+)")
        )
        return re.compile(f"^{pattern}$")


_ATTN = "decoder.layers.{L}.self_attention"
_HF_ATTN = "model.layers.{L}.self_attn"
_HF_MLP = "model.layers.{L}.mlp"

RULES: tuple[Rule, ...] = (
    Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), Sharded(0)),
    Rule("output_layer.weight", ("lm_head.weight",), Sharded(0)),
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",), Replicated()),
    Rule(
        "decoder.layers.{L}.input_layernorm.weight",
        ("model.layers.{L}.input_layernorm.weight",),
        Replicated(),
    ),
    Rule(f"{_ATTN}.linear_qkv.layer_norm_weight", ("model.layers.{L}.input_layernorm.weight",), Replicated()),
    Rule(
        f"{_ATTN}.linear_qkv.weight",
        (f"{_HF_ATTN}.q_proj.weight", f"{_HF_ATTN}.k_proj.weight", f"{_HF_ATTN}.v_proj.weight"),
        QKV(),
    ),
    Rule(f"{_ATTN}.q_layernorm.weight", (f"{_HF_ATTN}.q_norm.weight",), Replicated()),
    Rule(f"{_ATTN}.k_layernorm.weight", (f"{_HF_ATTN}.k_norm.weight",), Replicated()),
    Rule(f"{_ATTN}.linear_proj.weight", (f"{_HF_ATTN}.o_proj.weight",), Sharded(1)),
    Rule(
        "decoder.layers.{L}.pre_mlp_layernorm.weight",
        ("model.layers.{L}.post_attention_layernorm.weight",),
        Replicated(),
    ),
    Rule(
        "decoder.layers.{L}.mlp.linear_fc1.layer_norm_weight",
        ("model.layers.{L}.post_attention_layernorm.weight",),
        Replicated(),
    ),
    Rule(
        "decoder.layers.{L}.mlp.linear_fc1.weight",
        (f"{_HF_MLP}.gate_proj.weight", f"{_HF_MLP}.up_proj.weight"),
        GatedMLP(),
    ),
    Rule("decoder.layers.{L}.mlp.linear_fc2.weight", (f"{_HF_MLP}.down_proj.weight",), Sharded(1)),
    Rule("decoder.layers.{L}.mlp.router.weight", (f"{_HF_MLP}.gate.weight",), Replicated()),
    Rule(
        "decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc1.weight",
        (f"{_HF_MLP}.experts.{{E}}.gate_proj.weight", f"{_HF_MLP}.experts.{{E}}.up_proj.weight"),
        GatedMLP(),
        expert=True,
    ),
    Rule(
        "decoder.layers.{L}.mlp.experts.local_experts.{E}.linear_fc2.weight",
        (f"{_HF_MLP}.experts.{{E}}.down_proj.weight",),
        Sharded(1),
        expert=True,
    ),
    Rule(
        "decoder.layers.{L}.mlp.experts.linear_fc1.weight{E}",
        (f"{_HF_MLP}.experts.{{E}}.gate_proj.weight", f"{_HF_MLP}.experts.{{E}}.up_proj.weight"),
        GatedMLP(),
        expert=True,
    ),
    Rule(
        "decoder.layers.{L}.mlp.experts.linear_fc2.weight{E}",
        (f"{_HF_MLP}.experts.{{E}}.down_proj.weight",),
        Sharded(1),
        expert=True,
    ),
)


def _vl_hf_name(name: str) -> str:
    """A text model's HF name as Qwen3-VL-MoE stores it (the LM under ``model.language_model``)."""
    return name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name


VL_RULES: tuple[Rule, ...] = (
    *(
        Rule(rule.megatron, tuple(_vl_hf_name(n) for n in rule.hf), rule.transform, rule.expert)
        for rule in RULES
    ),
    Rule("visual.{V}", ("model.visual.{V}",), Replicated()),
)
_COMPILED = tuple((rule, rule.regex()) for rule in RULES)
_VL_COMPILED = tuple((rule, rule.regex()) for rule in VL_RULES)


class MappingError(UserError, KeyError):
    """A name the table does not know, or tensors that do not fit it."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class Resolved:
    """A Megatron name matched against the table, with its global layer / expert indices filled in."""

    rule: Rule
    megatron_name: str  # global indices
    hf_names: tuple[str, ...]


def resolve(global_megatron_name: str, arch: QwenArch | None = None) -> Resolved:
    """Match a Megatron parameter name whose layer/expert indices are global (in ``arch``'s table: the text
    models' unless ``arch`` is a vision-language model)."""
    for rule, regex in _VL_COMPILED if arch is not None and arch.is_vl else _COMPILED:
        match = regex.match(global_megatron_name)
        if match:
            fields = match.groupdict()
            hf_names = tuple(name.format(**fields) for name in rule.hf)
            return Resolved(rule, global_megatron_name, hf_names)
    raise MappingError(f"no mapping rule for Megatron parameter {global_megatron_name!r}")


def hf_expected_shapes(arch: QwenArch) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of this architecture holds, with its shape (the on-disk layout; experts
    per expert, whatever their storage)."""
    text = _text_shapes(arch)
    if not arch.is_vl:
        return text
    shapes = {f"model.visual.{name}": shape for name, shape in arch.vl.vision.tensor_shapes().items()}
    shapes.update({_vl_hf_name(name): shape for name, shape in text.items()})
    return shapes


def _text_shapes(arch: QwenArch) -> dict[str, tuple[int, ...]]:
    h, hd = arch.hidden_size, arch.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (arch.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    for layer, is_moe in enumerate(arch.moe_layer_pattern()):
        p = f"model.layers.{layer}"
        shapes.update(
            {
                f"{p}.input_layernorm.weight": (h,),
                f"{p}.post_attention_layernorm.weight": (h,),
                f"{p}.self_attn.q_proj.weight": (arch.num_attention_heads * hd, h),
                f"{p}.self_attn.k_proj.weight": (arch.num_key_value_heads * hd, h),
                f"{p}.self_attn.v_proj.weight": (arch.num_key_value_heads * hd, h),
                f"{p}.self_attn.o_proj.weight": (h, arch.num_attention_heads * hd),
                f"{p}.self_attn.q_norm.weight": (hd,),
                f"{p}.self_attn.k_norm.weight": (hd,),
            }
        )
        shapes.update(_mlp_shapes(p, arch, bool(is_moe)))
    return shapes


def _mlp_shapes(prefix: str, arch: QwenArch, is_moe: bool) -> dict[str, tuple[int, ...]]:
    h = arch.hidden_size
    if not is_moe:
        f = arch.intermediate_size
        return {
            f"{prefix}.mlp.gate_proj.weight": (f, h),
            f"{prefix}.mlp.up_proj.weight": (f, h),
            f"{prefix}.mlp.down_proj.weight": (h, f),
        }
    f = arch.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {f"{prefix}.mlp.gate.weight": (arch.num_experts, h)}
    for e in range(arch.num_experts):
        shapes[f"{prefix}.mlp.experts.{e}.gate_proj.weight"] = (f, h)
        shapes[f"{prefix}.mlp.experts.{e}.up_proj.weight"] = (f, h)
        shapes[f"{prefix}.mlp.experts.{e}.down_proj.weight"] = (h, f)
    return shapes
