"""Images in the CPU engine: a Qwen3-VL(-MoE) model of transformers takes a prompt's images as SGLang does.

The engine receives a prompt's ids with one image pad per image (the SGLang wire format) or already expanded (in
process, from the trainer), and the images as PNG bytes. Like SGLang's multimodal processor it runs the model's
own image processor over the images and expands each pad to ``grid.prod() / merge²`` tokens; the trainer's ids,
expanded from the image sizes at load, must come out equal, else the request is refused naming the difference.
The 3-D MRoPE positions of a left-padded batch come from the model's own ``get_rope_index`` (text t = h = w; an
image's h / w run over its merged grid); decoding continues from the largest position + 1.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from sapo_megatron.data.vision import collapse_image_pads, expand_image_pads, pixel_inputs

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class _RopeIndexModel(Protocol):
    """The inner model of a transformers Qwen-VL model: it computes the 3-D MRoPE positions."""

    def get_rope_index(
        self,
        input_ids: torch.Tensor,
        mm_token_type_ids: torch.Tensor,
        *,
        image_grid_thw: torch.Tensor | None,
        attention_mask: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def is_vision_model(model: PreTrainedModel) -> bool:
    """A transformers VL model whose inner model computes MRoPE indexes (Qwen2/2.5/3-VL and their MoE)."""
    return getattr(model.config, "vision_config", None) is not None and hasattr(
        getattr(model, "model", None), "get_rope_index"
    )


class EngineVision:
    """The image side of a VL model in the CPU engine."""

    def __init__(self, model: PreTrainedModel, processor: Any | None) -> None:
        self.model = model
        self.inner = cast(_RopeIndexModel, model.model)  # is_vision_model checked it
        self.processor = processor
        self.pad_id = int(model.config.image_token_id)
        self.merge = int(model.config.vision_config.spatial_merge_size)

    def prepare(
        self, prompt_ids: Sequence[int], png: Sequence[bytes]
    ) -> tuple[list[int], dict[str, torch.Tensor]]:
        """The prompt's ids with each image pad expanded by this engine's image processor, and the images'
        ``pixel_values`` / ``image_grid_thw``. Raises ValueError when the pads and images do not pair up."""
        if self.processor is None:
            raise ValueError(
                "this model has no image processor (no preprocessor_config.json in its directory): it takes no images"
            )
        images = [_decode(data, i) for i, data in enumerate(png)]
        pixels = pixel_inputs(self.processor, images)
        counts = [int(grid.prod()) // self.merge**2 for grid in pixels["image_grid_thw"]]
        try:
            ids = expand_image_pads(collapse_image_pads(prompt_ids, self.pad_id), self.pad_id, counts)
        except ValueError as exc:
            raise ValueError(f"input_ids and image_data do not match: {exc}") from None
        return ids, pixels

    def positions(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, grids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(position_ids [3, b, s], next_position [b])`` of a left-padded batch (pad positions 0)."""
        mm_token_type_ids = self.mm_token_type_ids(input_ids, attention_mask)
        position_ids, _ = self.inner.get_rope_index(
            input_ids, mm_token_type_ids, image_grid_thw=grids, attention_mask=attention_mask
        )
        return position_ids, position_ids[:, :, -1].max(dim=0).values

    def mm_token_type_ids(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return ((input_ids == self.pad_id) & attention_mask.bool()).long()


MAX_IMAGE_PIXELS = 1 << 26
"""A larger image is refused from its header, before decoding (a 64-Mpixel image is 4x the real Qwen3-VL
processor's longest_edge, 16,777,216 pixels; a small file can claim a huge size)."""


def _decode(data: bytes, index: int) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise ValueError(f"image_data[{index}] is {width}x{height} pixels, over {MAX_IMAGE_PIXELS}")
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise ValueError(f"image_data[{index}] is not a readable image: {exc}") from None
