"""What every conversion direction shares: the input checks and the plan of Megatron parameters ⇄ HF tensors.

Every input problem (missing / unexpected / misshapen tensor, mixed dtypes, a config that disagrees with
the weights) raises :class:`ConversionError` naming the tensor before anything is written. The plan matches
each parameter of Megatron's reference layout (:func:`sapo_megatron.megatron.dist_ckpt.reference_layout`)
with the HF tensors it is made of, through the mapping table (:mod:`sapo_megatron.checkpoint.mapping`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from sapo_megatron.checkpoint import atomic
from sapo_megatron.checkpoint.hf_io import HFCheckpointReader
from sapo_megatron.checkpoint.mapping import MappingError, Transform, hf_expected_shapes, resolve
from sapo_megatron.data.tokenizer import HF_TOKENIZER_FILES, TOKENIZER_FILE
from sapo_megatron.errors import UserError
from sapo_megatron.model.arch import ArchError, QwenArch

if TYPE_CHECKING:
    from tqdm import tqdm

    from sapo_megatron.megatron.dist_ckpt import ParamLayout, ReferenceLayout

PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")
TOKENIZER_FILES = (
    *HF_TOKENIZER_FILES,
    "generation_config.json",
    TOKENIZER_FILE,  # the embedded demo's character tokenizer (sapo_megatron.data.tokenizer)
    *PROCESSOR_FILES,  # a vision-language model's image / video processor (SGLang builds its processor from them)
)
SAFETENSORS_DTYPE_NAMES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


class ConversionError(UserError, ValueError):
    """Input that cannot be converted faithfully; the message names the tensor and what was expected."""


# --------------------------------------------------------------------------------------------------------
# Input validation (headers only, before anything is written)
# --------------------------------------------------------------------------------------------------------


def read_hf_config(hf_dir: Path) -> tuple[dict[str, Any], QwenArch]:
    path = hf_dir / "config.json"
    if not path.is_file():
        raise ConversionError(f"{hf_dir} has no config.json")
    raw = json.loads(path.read_text())
    try:
        return raw, QwenArch.from_hf_dict(raw)
    except (ArchError, ValueError) as err:
        raise ConversionError(f"{path}: {err}") from err


def validate_hf_checkpoint(reader: HFCheckpointReader, arch: QwenArch) -> torch.dtype:
    """Names, shapes and dtypes of every tensor against the architecture (safetensors headers only).

    Returns the checkpoint's dtype. Raises :class:`ConversionError` listing wrong shapes first, then missing
    and unexpected tensors, with a hint when a config field visibly disagrees with the weights.
    """
    expected = hf_expected_shapes(arch)
    present = set(reader.names())
    header = {name: reader.shape_and_dtype(name) for name in sorted(present)}
    shapes = [
        f"tensor {n} has shape {header[n][0]}, the config implies {expected[n]}"
        for n in sorted(present & set(expected))
        if header[n][0] != expected[n]
    ]
    missing = [f"missing tensor {n} (expected shape {expected[n]})" for n in sorted(set(expected) - present)]
    unexpected = [
        f"unexpected tensor {n} (not part of this architecture)" for n in sorted(present - set(expected))
    ]
    problems = shapes[:10] + missing[:10] + unexpected[:10]
    if problems:
        hints = _config_hints(reader, arch)
        counts = f"{len(shapes)} wrong shapes, {len(missing)} missing, {len(unexpected)} unexpected"
        raise ConversionError(
            f"HF checkpoint {reader.directory} does not match its config.json ({counts}):\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "".join(f"\n  hint: {h}" for h in hints)
        )
    by_dtype: dict[str, list[str]] = {}
    for name, (_, dtype) in header.items():
        by_dtype.setdefault(dtype, []).append(name)
    main = max(by_dtype, key=lambda d: len(by_dtype[d]))
    problems = [
        f"tensor {n} has dtype {d}, expected {main} like the other {len(by_dtype[main])} tensors"
        for d, names in sorted(by_dtype.items())
        if d != main
        for n in names
    ]
    if main not in SAFETENSORS_DTYPE_NAMES:
        problems.insert(
            0, f"tensors are stored as {main}; expected one of {', '.join(SAFETENSORS_DTYPE_NAMES)}"
        )
    if problems:
        raise ConversionError(
            f"HF checkpoint {reader.directory} has inconsistent dtypes ({len(problems)} problems):\n"
            + "\n".join(f"  - {p}" for p in problems[:20])
        )
    return SAFETENSORS_DTYPE_NAMES[main]


_EXPERT_NAME = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")


def _config_hints(reader: HFCheckpointReader, arch: QwenArch) -> list[str]:
    """Say which config field disagrees with the weights, when the tensor names make it clear."""
    names = reader.names()
    hints: list[str] = []
    layers = {int(m.group(1)) for n in names if (m := _LAYER_NAME.match(n))}
    if layers and max(layers) + 1 != arch.num_hidden_layers:
        hints.append(
            f"config.json says num_hidden_layers={arch.num_hidden_layers}, the weights hold {max(layers) + 1} layers"
        )
    experts = {int(m.group(2)) for n in names if (m := _EXPERT_NAME.match(n))}
    if experts and max(experts) + 1 != arch.num_experts:
        hints.append(
            f"config.json says num_experts={arch.num_experts}, the weights hold {max(experts) + 1} experts per "
            "MoE layer"
        )
    if "model.embed_tokens.weight" in reader.weight_map:
        vocab, hidden = reader.shape_and_dtype("model.embed_tokens.weight")[0]
        if vocab != arch.vocab_size:
            hints.append(f"config.json says vocab_size={arch.vocab_size}, the embedding has {vocab} rows")
        if hidden != arch.hidden_size:
            hints.append(
                f"config.json says hidden_size={arch.hidden_size}, the embedding has {hidden} columns"
            )
    if arch.tie_word_embeddings and "lm_head.weight" in reader.weight_map:
        hints.append(
            "config.json says tie_word_embeddings=true but the weights hold a separate lm_head.weight"
        )
    if not arch.tie_word_embeddings and "lm_head.weight" not in reader.weight_map:
        hints.append("lm_head.weight is missing: is tie_word_embeddings=true missing from config.json?")
    return hints


# --------------------------------------------------------------------------------------------------------
# Plan: Megatron parameters (reference layout) ⇄ HF tensors
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamPlan:
    """One Megatron parameter of the reference layout, with the HF tensors it is made of."""

    layout: ParamLayout
    hf_names: tuple[str, ...]
    transform: Transform

    @property
    def name(self) -> str:
        return self.layout.name


def plan_params(layout: ReferenceLayout, arch: QwenArch) -> list[ParamPlan]:
    """Match every reference-layout parameter with the table; shapes are checked on the meta device."""
    expected = hf_expected_shapes(arch)
    plans: list[ParamPlan] = []
    problems: list[str] = []
    for param in layout.params:
        try:
            resolved = resolve(param.name, arch)
        except MappingError as err:
            problems.append(str(err))
            continue
        transform = resolved.rule.transform
        hf_meta = [torch.empty(expected.get(n, (0,)), device="meta") for n in resolved.hf_names]
        missing = [n for n in resolved.hf_names if n not in expected]
        if missing:
            problems.append(f"{param.name} needs {', '.join(missing)}, which this architecture does not have")
            continue
        try:
            full_shape = tuple(transform.full(hf_meta, arch).shape)
        except RuntimeError as err:
            problems.append(f"{param.name} cannot be built from {', '.join(resolved.hf_names)}: {err}")
            continue
        if full_shape != param.shape:
            problems.append(
                f"{param.name} (from {', '.join(resolved.hf_names)}) would have shape {full_shape}, "
                f"Megatron expects {param.shape}"
            )
        plans.append(ParamPlan(param, resolved.hf_names, transform))
    used = {n for p in plans for n in p.hf_names}
    problems += [f"HF tensor {n} is not used by any Megatron parameter" for n in sorted(set(expected) - used)]
    if problems:
        raise ConversionError(
            "the mapping table and the Megatron model disagree:\n"
            + "\n".join(f"  - {p}" for p in problems[:20])
        )
    return plans


def checkpoint_hf_config(path: Path, hf_reference: str | Path | None) -> dict[str, Any]:
    """The HF config a Megatron checkpoint was saved with, else ``hf_reference``'s config.json."""
    stored = path / atomic.HF_CONFIG
    if stored.is_file():
        return json.loads(stored.read_text())
    if hf_reference is not None and (Path(hf_reference) / "config.json").is_file():
        return json.loads((Path(hf_reference) / "config.json").read_text())
    raise ConversionError(
        f"{path} holds no {atomic.HF_CONFIG} (it was saved without an architecture); pass --hf-reference "
        "with a directory holding the model's config.json"
    )


def numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def progress_bar(total: int, desc: str, enabled: bool) -> tqdm:
    """A byte-counting progress bar (disabled: counts silently)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, disable=not enabled)
