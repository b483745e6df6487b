"""Qwen3-VL-MoE on Megatron-Core: the MoE GPT of :mod:`.model` plus the vision tower, interleaved MRoPE and DeepStack.

What transformers' ``Qwen3VLMoeForConditionalGeneration`` (5.x, ``models/qwen3_vl_moe``) computes, and how it is
built here:

- **Vision tower + mergers**: transformers' own ``Qwen3VLMoeVisionModel`` kept as ``visual`` under the Megatron
  model, on the first pipeline stage only (HF parameter names, so conversion and weight sync move it as it is).
  It returns the merged image tokens ``[n, H]`` and one DeepStack feature ``[n, H]`` per
  ``deepstack_visual_indexes`` entry. Replicated over tensor parallelism (every TP rank runs it; its
  gradients are identical there, or partial under sequence parallelism, where its parameters are marked for
  Megatron's sequence-parallel gradient all-reduce like the norms).
- **Image tokens**: the word embedding of each ``<|image_pad|>`` is replaced by the image token in reading
  order (``masked_scatter`` in HF), on this rank's sequence slice (sequence parallelism splits ``s``).
- **Interleaved MRoPE** (:class:`InterleavedMRoPE`): frequency ``j`` of ``head_dim/2`` rotates by the height
  position when ``j % 3 == 1`` and ``j < 3·section[1]``, by the width position when ``j % 3 == 2`` and
  ``j < 3·section[2]``, else by the temporal one (HF's ``recomposition_frequencies``). Megatron-Core's own
  ``MultimodalRotaryEmbedding`` chunks the sections (Qwen2-VL) and is wrong for this model.
- **3-D positions** (:func:`mrope_positions`): ``get_rope_index`` semantics, computed from the token ids and
  image grids on every pipeline stage, segment by segment for packed rows (a segment starts where the 1-D
  ``position_ids`` restart at 0).
- **DeepStack**: after LM layer ``k`` (``k < len(deepstack_visual_indexes)``), DeepStack feature ``k`` is added
  at the image positions (a forward hook on that decoder layer). All DeepStack layers must sit on the first
  pipeline stage, where the tower runs.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from torch import Tensor, nn

from sapo_megatron.errors import ConfigError, UserError
from sapo_megatron.model.arch import QwenArch, VisionArch


class VisionInputError(UserError, ValueError):
    """Image inputs that do not fit the token ids (count of image tokens vs the image grids)."""


class InterleavedMRoPE(nn.Module):
    """Qwen3-VL's multimodal RoPE: ``[3, b, s]`` positions (t, h, w) → Megatron's ``[s, b, 1, head_dim]`` table
    (the half-split layout of ``_apply_rotary_pos_emb_bshd``, which HF's ``rotate_half`` also uses)."""

    def __init__(self, head_dim: int, rotary_base: float, mrope_section: tuple[int, int, int]) -> None:
        super().__init__()
        # HF's arithmetic, so that the angles are bitwise the same; a plain attribute, not a buffer, so that
        # casting the model to bf16 leaves the frequencies in fp32.
        self.inv_freq = 1.0 / (
            rotary_base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim)
        )
        self.axis = interleaved_axes(head_dim // 2, mrope_section)

    def forward(self, position_ids: Tensor, mrope_section: Any = None, cp_group: Any = None) -> Tensor:
        """``position_ids`` ``[3, b, s]`` → ``[s, b, 1, head_dim]`` (the other arguments: Megatron's call)."""
        device = position_ids.device
        freqs = position_ids[..., None].float() * self.inv_freq.to(device)  # [3, b, s, d/2]
        axis = self.axis.to(device)[None, None, None, :]
        chosen = freqs.gather(0, axis.expand(1, *freqs.shape[1:]))[0]  # [b, s, d/2]
        emb = torch.cat((chosen, chosen), dim=-1)
        return emb.transpose(0, 1)[:, :, None, :].contiguous()


def interleaved_axes(num_freqs: int, mrope_section: tuple[int, int, int]) -> Tensor:
    """long ``[num_freqs]``: which position (0 = t, 1 = h, 2 = w) rotates each frequency."""
    axis = torch.zeros(num_freqs, dtype=torch.long)
    for dim in (1, 2):
        axis[dim : mrope_section[dim] * 3 : 3] = dim
    return axis


def mrope_positions(
    input_ids: Tensor,
    position_ids: Tensor | None,
    image_grid_thw: Tensor | None,
    *,
    image_token_id: int,
    spatial_merge_size: int,
    image_mask: Tensor | None = None,
) -> Tensor:
    """long ``[3, b, s]``: Qwen3-VL's (t, h, w) positions (transformers' ``get_rope_index``).

    Text tokens get ``t = h = w = p``; an image of merged grid ``gh × gw`` starting at ``p`` gets ``t = p``,
    ``h = p + row``, ``w = p + col``, and text resumes at ``p + max(gh, gw)``. A run of consecutive image
    tokens is one image; ``image_grid_thw`` lists the images in reading order (row by row). A packed row
    restarts at every segment (where ``position_ids`` is 0).
    """
    batch, seq = input_ids.shape
    ids = _image_tokens(input_ids, image_token_id, image_mask).tolist()
    restarts = position_ids.tolist() if position_ids is not None else [[1] * seq for _ in range(batch)]
    grids = [tuple(g) for g in image_grid_thw.tolist()] if image_grid_thw is not None else []
    merge = spatial_merge_size
    out = torch.empty(3, batch, seq, dtype=torch.long)
    image = 0
    for row in range(batch):
        thw: list[tuple[int, int, int]] = []
        current, i = 0, 0
        while i < seq:
            if restarts[row][i] == 0:
                current = 0
            if not ids[row][i]:
                thw.append((current, current, current))
                current, i = current + 1, i + 1
                continue
            end = i + 1
            while end < seq and ids[row][end] and restarts[row][end] != 0:
                end += 1
            if image >= len(grids):
                raise VisionInputError(f"row {row} has more images than image_grid_thw lists ({len(grids)})")
            t, h, w = grids[image]
            gh, gw = h // merge, w // merge
            if end - i != t * gh * gw:
                raise VisionInputError(
                    f"image {image} (row {row}, token {i}) has {end - i} image tokens; its grid {[t, h, w]} "
                    f"needs {t * gh * gw} (t·h·w / merge²)"
                )
            thw += [
                (current + a, current + b, current + c)
                for a in range(t)
                for b in range(gh)
                for c in range(gw)
            ]
            current += max(gh, gw)
            image, i = image + 1, end
        out[:, row] = torch.tensor(thw, dtype=torch.long).t()
    if image != len(grids):
        raise VisionInputError(f"image_grid_thw lists {len(grids)} images; the token ids hold {image}")
    return out.to(input_ids.device)


def _image_tokens(input_ids: Tensor, image_token_id: int, image_mask: Tensor | None) -> Tensor:
    """bool ``[b, s]``: the image positions – image pads, but only where ``image_mask`` (a pad the policy sampled
    in a response is text to the engines, and so to the trainer)."""
    is_image = input_ids == image_token_id
    return is_image if image_mask is None else is_image & image_mask.to(is_image.device).bool()


def build_vision_tower(vision: VisionArch, model_type: str = "qwen3_vl_moe") -> nn.Module:
    """transformers' ``Qwen3VLMoeVisionModel`` (``Qwen3VLVisionModel`` for the dense ``qwen3_vl``) for
    ``vision`` (random init; weights are loaded after)."""
    fields = vision.model_dump()
    fields["deepstack_visual_indexes"] = list(fields["deepstack_visual_indexes"])
    if model_type == "qwen3_vl":
        from transformers import Qwen3VLVisionConfig
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        return Qwen3VLVisionModel(Qwen3VLVisionConfig(**fields))
    from transformers import Qwen3VLMoeVisionConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

    return Qwen3VLMoeVisionModel(Qwen3VLMoeVisionConfig(**fields))


def vision_layout(vision: VisionArch) -> nn.Module:
    """Parameters of the tower's names and shapes and nothing else: what the checkpoint layout of the meta model
    needs (offline conversion), without importing transformers' modelling code (seconds)."""
    root = nn.Module()
    for name, shape in vision.tensor_shapes().items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, nn.Parameter(torch.empty(shape)))
    return root


class VLGPTModel(GPTModel):
    """Megatron's ``GPTModel`` with Qwen3-VL's vision tower (first stage), interleaved MRoPE and DeepStack.

    ``forward(input_ids [b, s], position_ids [b, s] | [3, b, s] | None, attention_mask, *, pixel_values
    [patches, C·T·P·P], image_grid_thw [images, 3], ...)``: ``position_ids`` 1-D only mark packed segments
    (they restart at 0); the 3-D MRoPE positions are computed here from the ids and grids on every stage.
    """

    def __init__(
        self, *, arch: QwenArch, freeze_vision: bool = False, layout_only: bool = False, **gpt_kwargs: Any
    ) -> None:
        # Built as "rope", then switched: Megatron's own MultimodalRotaryEmbedding (the chunked layout) is never
        # built; with "mrope" set, GPTModel calls rotary_pos_emb(position_ids [3, b, s], mrope_section).
        super().__init__(position_embedding_type="rope", **gpt_kwargs)
        self.arch = arch
        vl = arch.vl
        self.position_embedding_type = "mrope"
        self.mrope_section = list(vl.mrope_section)
        self.rotary_pos_emb = InterleavedMRoPE(arch.head_dim, arch.rope_theta, vl.mrope_section)
        self.visual: nn.Module | None
        if not self.pre_process:
            self.visual = None
        elif layout_only:  # names and shapes only (the meta model of offline conversion)
            self.visual = vision_layout(vl.vision)
        else:
            self.visual = build_vision_tower(vl.vision, arch.model_type)
        self.freeze_vision = freeze_vision
        if self.visual is not None:
            for param in self.visual.parameters():
                param.requires_grad_(not freeze_vision)
                # gradients from a sequence-parallel slice are partial: Megatron all-reduces these over TP
                param.sequence_parallel = self.config.sequence_parallel  # type: ignore[attr-defined]  # Megatron reads flags set on the parameter
        self._visual_rows: tuple[Tensor, list[Tensor]] | None = None
        levels = len(vl.vision.deepstack_visual_indexes)
        for layer in self.decoder.layers:
            if layer.layer_number - 1 < levels:
                layer.register_forward_hook(self._deepstack_hook(layer.layer_number - 1))

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None,
        attention_mask: Tensor | None,
        decoder_input: Tensor | None = None,
        labels: Tensor | None = None,
        *,
        pixel_values: Tensor | None = None,
        image_grid_thw: Tensor | None = None,
        image_mask: Tensor | None = None,
        cp_local: Tensor | None = None,
        **kwargs: Any,
    ) -> Tensor:
        """``image_mask`` bool ``[b, s]``: which image pads are images (None: all of them). ``cp_local``
        (context parallelism): the positions ``[s/cp]`` of this CP rank's tokens; ``input_ids`` (and 1-D
        ``position_ids``) are then the whole sequences, from which the 3-D positions and the image rows are
        taken before the model runs on this rank's tokens."""
        if position_ids is None or position_ids.dim() == 2:
            position_ids = mrope_positions(
                input_ids,
                position_ids,
                image_grid_thw,
                image_token_id=self.arch.vl.image_token_id,
                spatial_merge_size=self.arch.vl.vision.spatial_merge_size,
                image_mask=image_mask,
            )
        self._visual_rows = None
        if self.pre_process and decoder_input is None:
            decoder_input = self._embed(input_ids, pixel_values, image_grid_thw, image_mask, cp_local)
        if cp_local is not None:
            input_ids, position_ids = input_ids[:, cp_local], position_ids[:, :, cp_local]
        try:
            return super().forward(
                input_ids, position_ids, attention_mask, decoder_input=decoder_input, labels=labels, **kwargs
            )
        finally:
            self._visual_rows = None

    def _embed(
        self,
        input_ids: Tensor,
        pixel_values: Tensor | None,
        image_grid_thw: Tensor | None,
        image_mask: Tensor | None = None,
        cp_local: Tensor | None = None,
    ) -> Tensor:
        """Word embeddings ``[s_local, b, H]`` with the image tokens in place; keeps this slice's image index
        and the DeepStack features for the hooks. ``cp_local``: this CP rank's positions of ``input_ids``."""
        local_ids = input_ids if cp_local is None else input_ids[:, cp_local]
        embeddings = self.embedding(input_ids=local_ids, position_ids=None)
        is_image = _image_tokens(input_ids, self.arch.vl.image_token_id, image_mask)
        if pixel_values is None:
            if bool(is_image.any()):
                raise VisionInputError("the token ids hold image tokens but no pixel_values were given")
            return embeddings
        visual = self.visual
        if visual is None:
            raise VisionInputError(
                "pixel_values go to the first pipeline stage, which holds the vision tower"
            )
        dtype = cast(torch.dtype, visual.dtype)  # a transformers model: its parameters' dtype
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.freeze_vision):
            vision = visual(pixel_values.to(dtype), grid_thw=image_grid_thw, return_dict=True)
        image_embeds, deepstack = vision.pooler_output, list(vision.deepstack_features)
        if image_embeds.shape[0] != int(is_image.sum()):
            raise VisionInputError(
                f"the token ids hold {int(is_image.sum())} image tokens; the images give {image_embeds.shape[0]}"
            )
        index = torch.full(is_image.shape, -1, dtype=torch.long, device=input_ids.device)
        index[is_image] = torch.arange(image_embeds.shape[0], device=input_ids.device)  # reading order
        if cp_local is not None:  # context parallelism: this rank's tokens (the tower ran on every image)
            index = index[:, cp_local]
        index = _sequence_slice(index.t().contiguous(), self.config.sequence_parallel)  # [s_local, b]
        self._visual_rows = (index, deepstack)
        return _put_rows(embeddings, index, image_embeds)

    def _deepstack_hook(self, level: int):
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if self._visual_rows is None:
                return output
            index, deepstack = self._visual_rows
            hidden, context = output
            return _add_rows(hidden, index, deepstack[level]), context

        return hook


def _sequence_slice(index_sb: Tensor, sequence_parallel: bool) -> Tensor:
    """This rank's rows of an ``[s, b]`` tensor under sequence parallelism (Megatron splits ``s`` evenly)."""
    if not sequence_parallel:
        return index_sb
    size = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    return index_sb.chunk(size, dim=0)[rank]


def _put_rows(hidden: Tensor, index: Tensor, rows: Tensor) -> Tensor:
    """``hidden`` ``[s, b, H]`` with ``rows[index]`` where ``index >= 0`` (differentiable in both)."""
    chosen = index >= 0
    return torch.where(chosen[..., None], rows.to(hidden.dtype)[index.clamp(min=0)], hidden)


def _add_rows(hidden: Tensor, index: Tensor, rows: Tensor) -> Tensor:
    chosen = index >= 0
    return torch.where(chosen[..., None], hidden + rows.to(hidden.dtype)[index.clamp(min=0)], hidden)


def check_vl_layout(arch: QwenArch, *, pp: int, recompute: str) -> None:
    """Refuse layouts this model cannot run faithfully, before any weight exists."""
    levels = len(arch.vl.vision.deepstack_visual_indexes)
    first_stage = arch.num_hidden_layers // pp
    if levels > first_stage:
        raise ConfigError(
            f"parallel.pp={pp} puts {first_stage} LM layers on the first pipeline stage; the {levels} DeepStack "
            "levels must all sit there (next to the vision tower): lower pp"
        )
    if recompute == "full":
        raise ConfigError(
            "model.recompute=full is not supported for vision-language models (DeepStack adds image features "
            "inside the recomputed layers); use selective"
        )
