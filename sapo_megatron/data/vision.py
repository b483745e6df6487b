"""Prompts with images as a Qwen-VL model sees them: the image processor, the image tokens and their expansion.

An image in a prompt is written as Qwen2/2.5/3-VL's chat templates write an ``{"type": "image"}`` item,
``<|vision_start|><|image_pad|><|vision_end|>``, in place of the dataset's ``<image>``; after tokenisation each
``<|image_pad|>`` becomes ``grid_t * grid_h * grid_w / merge_size²`` copies of itself (what transformers'
``Qwen3VLProcessor`` does to the text before tokenising, and SGLang's ``base_processor`` to the ids). Images
are resized at load to multiples of ``patch_size * merge_size`` within the processor's pixel bounds
(:mod:`sapo_megatron.data.images`), so the processor does not resize them again and the number of tokens of an
image follows from its size alone.

The image processor is the model's, ``AutoImageProcessor.from_pretrained(directory)`` (its
``preprocessor_config.json``); where that cannot be built (transformers' fast processor needs torchvision)
transformers' ``Qwen2VLImageProcessorPil`` with the same settings. ``mm_token_type_ids`` (1 on image pads, 0
elsewhere), which transformers 5 needs for the 3-D MRoPE positions, is made here by hand, as the processor would.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sapo_megatron.data.prompts import DatasetError

VISION_START = "<|vision_start|>"
IMAGE_PAD = "<|image_pad|>"
VISION_END = "<|vision_end|>"
IMAGE_MARKUP = VISION_START + IMAGE_PAD + VISION_END
PROCESSOR_FILE = "preprocessor_config.json"


@dataclasses.dataclass(frozen=True)
class VisionSpec:
    """The image tokens of a tokenizer and the geometry of an image processor: what expansion needs."""

    start_id: int
    pad_id: int
    end_id: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    processor: Any = dataclasses.field(default=None, compare=False, repr=False)
    """The image processor itself (None in specs built by hand): the trainer runs it as the engine does."""

    @property
    def factor(self) -> int:
        """Pixels per side of one merged patch: resized images are multiples of it."""
        return self.patch_size * self.merge_size

    def tokens_for(self, size: tuple[int, int]) -> int:
        """Image-pad tokens of an image resized to ``(height, width)`` (one frame: grid_t = 1)."""
        height, width = size
        return (height // self.patch_size) * (width // self.patch_size) // (self.merge_size**2)

    def expand(
        self, ids: Sequence[int], sizes: Sequence[tuple[int, int]], where: str = "prompt"
    ) -> list[int]:
        """``ids`` with the i-th ``<|image_pad|>`` repeated for image i; their number must equal the images'."""
        try:
            return expand_image_pads(ids, self.pad_id, [self.tokens_for(size) for size in sizes])
        except ValueError as exc:
            raise DatasetError(
                f"{where}: the rendered prompt has {exc}",
                hint=f"write images as <image> in the prompt, never {IMAGE_PAD} itself",
            ) from None

    def collapse(self, ids: Sequence[int]) -> list[int]:
        """Expanded ids back to one ``<|image_pad|>`` per image (:func:`collapse_image_pads`)."""
        return collapse_image_pads(ids, self.pad_id)

    def mm_token_type_ids(self, ids: Sequence[int]) -> list[int]:
        """1 on image-pad positions, 0 elsewhere (transformers' processor output of the same name)."""
        return [1 if t == self.pad_id else 0 for t in ids]


def expand_image_pads(ids: Sequence[int], pad_id: int, counts: Sequence[int]) -> list[int]:
    """``ids`` with the i-th ``pad_id`` repeated ``counts[i]`` times. Raises ValueError when the number of pads
    is not the number of images."""
    pads = sum(1 for t in ids if t == pad_id)
    if pads != len(counts):
        raise ValueError(f"{pads} image-pad tokens for {len(counts)} images")
    remaining = iter(counts)
    out: list[int] = []
    for token in ids:
        out.extend([token] * next(remaining) if token == pad_id else [token])
    return out


def collapse_image_pads(ids: Sequence[int], pad_id: int) -> list[int]:
    """Each run of ``pad_id`` cut to one: the ids SGLang takes with ``image_data`` (it expands them itself; ids
    already expanded make its ``base_processor.build_input_ids`` fail with HTTP 500)."""
    out: list[int] = []
    for token in ids:
        if token == pad_id and out and out[-1] == pad_id:
            continue
        out.append(token)
    return out


def load_image_processor(directory: str | Path) -> Any | None:
    """The image processor of a model or tokenizer directory (None without ``preprocessor_config.json``)."""
    path = Path(directory) / PROCESSOR_FILE
    if not path.is_file():
        return None
    try:
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(str(directory))
    except (ImportError, ValueError, OSError):  # the fast processor without torchvision: the PIL one
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        try:
            return Qwen2VLImageProcessorPil.from_pretrained(str(directory))
        except (ValueError, OSError, json.JSONDecodeError) as exc:
            raise DatasetError(f"{path}: cannot build the image processor: {exc}") from None


def vision_spec(tokenizer: Any, processor: Any, where: str) -> VisionSpec:
    """The :class:`VisionSpec` of an HF tokenizer (its three image tokens must each be one token) and an image
    processor; ``where`` names the directory in errors."""
    hf = getattr(tokenizer, "hf", None)
    if hf is None:
        raise DatasetError(
            "images need the VL model's tokenizer; the char tokenizer has no image tokens",
            hint="set data.tokenizer to the VL model's directory",
        )
    ids = []
    for token in (VISION_START, IMAGE_PAD, VISION_END):
        encoded = hf(token, add_special_tokens=False)["input_ids"]
        if len(encoded) != 1:
            raise DatasetError(
                f"{where}: the tokenizer has no single token {token} (it encodes as {encoded})"
            )
        ids.append(encoded[0])
    size = dict(processor.size) if getattr(processor, "size", None) else {}
    min_pixels = size.get("shortest_edge") or getattr(processor, "min_pixels", None)
    max_pixels = size.get("longest_edge") or getattr(processor, "max_pixels", None)
    if not min_pixels or not max_pixels:
        raise DatasetError(f"{where}/{PROCESSOR_FILE}: no pixel bounds (size.shortest_edge / longest_edge)")
    return VisionSpec(
        start_id=ids[0],
        pad_id=ids[1],
        end_id=ids[2],
        patch_size=int(processor.patch_size),
        merge_size=int(processor.merge_size),
        temporal_patch_size=int(processor.temporal_patch_size),
        min_pixels=int(min_pixels),
        max_pixels=int(max_pixels),
        processor=processor,
    )


def pixel_inputs(processor: Any, images: Sequence[Any]) -> dict[str, Any]:
    """``pixel_values`` [patches, C·T·P·P] and ``image_grid_thw`` [images, 3] of PIL images, in order."""
    out = processor(images=list(images), return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
