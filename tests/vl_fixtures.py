"""A tiny Qwen3-VL-MoE for the multimodal data and rollout tests: the chat tokenizer of tests/data/chat_fixtures.py
with Qwen-VL's three image tokens added, a ``preprocessor_config.json`` (patch 8, merge 2: 16-pixel merged patches,
images of 16x16 to 64x64 pixels), and a random ``Qwen3VLMoeForConditionalGeneration`` built by transformers.

``build_tiny_vl_checkpoint`` is this branch's stand-in for the VL builder of the model issue (``tiny_vl_hf_config``
in ``sapo_megatron.model.tiny``), whose sizes it copies: replace it with that builder once the model is merged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.data.chat_fixtures import make_chat_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
PROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessorFast",  # the real Qwen3-VL's; built as the PIL one here
    "patch_size": 8,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 16 * 16, "longest_edge": 64 * 64},
}


def make_vl_tokenizer(directory: str | Path, *, vocab_multiple: int = 1) -> Path:
    """The chat tokenizer with ``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>`` as special tokens, and
    the image processor's config beside it (as in a VL model's directory). ``vocab_multiple``: unused special
    tokens appended until the vocabulary is a multiple of it (tensor parallelism splits the vocabulary evenly;
    padding the model's vocabulary instead would let the engine sample ids the tokenizer cannot decode)."""
    from transformers import AutoTokenizer

    directory = make_chat_tokenizer(directory)
    tok = AutoTokenizer.from_pretrained(str(directory))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *VISION_TOKENS]})
    tok.add_tokens([f"<|spare_{i}|>" for i in range(-len(tok) % vocab_multiple)], special_tokens=True)
    tok.save_pretrained(str(directory))
    (directory / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return directory


def tiny_vl_config(tokenizer_dir: str | Path, *, lm_layers: int = 3) -> dict[str, Any]:
    """Sizes of the model issue's tiny VL-MoE (ViT depth 3 with DeepStack after every block, LM of 3 MoE
    layers with 4 experts top-2, interleaved MRoPE [4, 2, 2]) with this tokenizer's vocabulary and image ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    start, pad, end = tok.convert_tokens_to_ids(VISION_TOKENS)
    text = {
        "vocab_size": len(tok),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": lm_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 24,
        "decoder_sparse_step": 1,
        "norm_topk_prob": True,
        "eos_token_id": tok.eos_token_id,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [4, 2, 2],
            "mrope_interleaved": True,
        },
    }
    vision = {
        "depth": 3,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 4,
        "patch_size": PROCESSOR["patch_size"],
        "temporal_patch_size": PROCESSOR["temporal_patch_size"],
        "spatial_merge_size": PROCESSOR["merge_size"],
        "out_hidden_size": 32,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [0, 1, 2],
    }
    return {
        "model_type": "qwen3_vl_moe",
        "architectures": ["Qwen3VLMoeForConditionalGeneration"],
        "text_config": text,
        "vision_config": vision,
        "tie_word_embeddings": False,
        "vision_start_token_id": start,
        "image_token_id": pad,
        "vision_end_token_id": end,
        "video_token_id": pad + 100_000,  # no video in these tests; an id no text can produce
        "eos_token_id": tok.eos_token_id,
    }


def build_tiny_vl_checkpoint(
    directory: str | Path, *, seed: int = 0, lm_layers: int = 3, vocab_multiple: int = 1
) -> Path:
    """An HF checkpoint directory: the tiny VL-MoE's seeded random weights, its tokenizer and image processor
    (``lm_layers`` / ``vocab_multiple``: what pipeline and tensor parallel layouts need, see above)."""
    import torch
    import transformers

    directory = make_vl_tokenizer(directory, vocab_multiple=vocab_multiple)
    config = transformers.AutoConfig.for_model(**tiny_vl_config(directory, lm_layers=lm_layers))
    torch.manual_seed(seed)
    model = transformers.Qwen3VLMoeForConditionalGeneration(config).float().eval()
    model.save_pretrained(str(directory))
    return directory


VIDEO_PROCESSOR = {
    "video_processor_type": "Qwen3VLVideoProcessor",
    "patch_size": PROCESSOR["patch_size"],
    "temporal_patch_size": PROCESSOR["temporal_patch_size"],
    "merge_size": PROCESSOR["merge_size"],
    "image_mean": PROCESSOR["image_mean"],
    "image_std": PROCESSOR["image_std"],
    "size": {"shortest_edge": 16 * 16, "longest_edge": 64 * 64 * 2},
}


def to_hub_layout(directory: str | Path) -> Path:
    """Rewrite a transformers-5 save of the tiny VL-MoE as the hub's checkpoints are and SGLang 0.5.23 loads them:
    fused experts ``gate_up_proj [E, H, 2I]`` / ``down_proj [E, I, H]`` (transformers 5 writes its in-memory
    ``[E, 2I, H]`` / ``[E, H, I]``, which SGLang's ``qwen3_vl_moe.load_weights`` transposes into the wrong shape),
    and the processor files of :func:`with_qwen3_vl_processor`. transformers reads the result back to the same
    weights when the expert sizes tell the layouts apart (H != I, H != 2I; else the CPU engine's loader transposes
    what transformers left: tests/checkpoint/test_square_fused_experts.py). ``megatron-to-hf`` writes the hub layout itself (the real-SGLang tier serves its export)."""
    from safetensors.torch import load_file, save_file

    directory = Path(directory)
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    for name in list(tensors):
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})
    return with_qwen3_vl_processor(directory)


def with_qwen3_vl_processor(directory: str | Path) -> Path:
    """The processor files a Qwen3-VL repository has (``processor_class``, a video processor), from which SGLang
    builds ``Qwen3VLProcessor``."""
    directory = Path(directory)
    processor = json.loads((directory / "preprocessor_config.json").read_text())
    processor["processor_class"] = "Qwen3VLProcessor"
    (directory / "preprocessor_config.json").write_text(json.dumps(processor))
    (directory / "video_preprocessor_config.json").write_text(
        json.dumps({**VIDEO_PROCESSOR, "processor_class": "Qwen3VLProcessor"})
    )
    return directory


def vl_prompts(directory: str | Path) -> tuple[Any, list[Any], Any]:
    """The VL checkpoint's renderer (chat template, its image processor) and three prompt rows: one image, two images
    of other sizes, text only; with the vision spec. Shared by the CPU-engine, trainer and real-SGLang VL tests."""
    from sapo_megatron.data.datasets import DatasetKeys, read_dataset
    from sapo_megatron.data.render import PromptRenderer
    from sapo_megatron.data.tokenizer import load_tokenizer
    from sapo_megatron.data.vision import load_image_processor, vision_spec
    from tests.data.test_images import png, uri

    directory = Path(directory)
    tok = load_tokenizer(str(directory))
    spec = vision_spec(tok, load_image_processor(directory), str(directory))
    records = [
        {"prompt": "What is in <image>?", "ground_truth": "a", "images": [uri(png(40, 40, (250, 0, 0)))]},
        {
            "prompt": "Compare <image> and <image>.",
            "ground_truth": "b",
            "images": [uri(png(48, 32, (0, 200, 0))), uri(png(16, 64, (0, 0, 90)))],
        },
        {"prompt": "Say something.", "ground_truth": "c"},
    ]
    path = directory / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    keys = DatasetKeys(apply_chat_template=True)
    rows = read_dataset(path, keys, keys.image_policy(spec.factor, spec.min_pixels, spec.max_pixels)).rows
    return PromptRenderer(tok, keys, spec), rows, spec


COLOURS = [(250, 0, 0), (0, 200, 0), (0, 0, 90), (120, 120, 0)]


def image_prompt_records(colours: int = 4) -> list[dict[str, Any]]:
    """``colours`` one-image prompts ("Which colour is <image>? i", answer i, 32x48 images) and a two-image one
    (images of two other sizes, answer ``colours``), as training rows in the plain jsonl layout."""
    from tests.data.test_images import png, uri

    records = [
        {"prompt": f"Which colour is <image>? {i}", "ground_truth": str(i), "images": [uri(png(32, 48, c))]}
        for i, c in enumerate(COLOURS[:colours])
    ]
    pair = [uri(png(16, 64, COLOURS[0])), uri(png(40, 40, COLOURS[1]))]
    records.append({"prompt": "Compare <image> and <image>.", "ground_truth": str(colours), "images": pair})
    return records


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def vl_run_config(model: Path, train_file: Path, output_dir: Path, **top: Any) -> dict[str, Any]:
    """The embedded default run on a tiny VL checkpoint: its weights, tokenizer and chat template, ``train_file``,
    no evaluation and no SFT; ``top`` adds top-level sections (e.g. ``teachers``)."""
    from sapo_megatron.defaults import embedded_default_dict

    cfg = embedded_default_dict()
    cfg.update(
        output_dir=str(output_dir),
        model={"hf_config": str(model), "init": "hf", "init_path": str(model)},
        data={"train": str(train_file), "tokenizer": str(model), "apply_chat_template": True},
        eval={"datasets": []},
        **top,
    )
    cfg["sft"]["steps"] = 0
    return cfg
