"""The CPU VL demo's inputs, made here with nothing downloaded: a tokenizer folder for a tiny Qwen3-VL-MoE and a
seeded dataset folder (train + held-out) of visual tasks, optionally mixed with knights-and-knaves puzzles and
text arithmetic (the SAPO paper's mixed data in miniature).

``python -m sapo_megatron.data.vl_demo OUT [--train N] [--heldout N] [--tasks name_colour,...] [--logic N]
[--math N] [--seed S]`` writes ``OUT/tokenizer/`` (the shipped chat tokenizer with Qwen-VL's three image tokens
and a ``preprocessor_config.json``) and ``OUT/{train,heldout}.jsonl`` with ``OUT/images/``; a run config points
``data.tokenizer`` at the first and ``data.train`` / ``eval.datasets`` at the others
(``configs/demo_tiny_vl_moe_cpu.yaml``, ``configs/vl_evidence/``). The same arguments give the same files.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sapo_megatron.data.chat_tokenizer import CHAT_TOKENIZER_DIR
from sapo_megatron.data.logic_puzzles import SOURCE as LOGIC_SOURCE
from sapo_megatron.data.logic_puzzles import label, make_puzzle, puzzle_text
from sapo_megatron.data.prompts import DatasetError
from sapo_megatron.data.vision import IMAGE_PAD, PROCESSOR_FILE, VISION_END, VISION_START
from sapo_megatron.data.visual_tasks import TASKS, write_visual_dataset

VISION_TOKENS = (VISION_START, IMAGE_PAD, VISION_END)
MATH_SOURCE = "math_addition"
IMAGE_SIDE = 32
"""Images are resized at load to at most 32×32 pixels: with patch 8 and merge 2, four image tokens each."""


def processor_config(image_side: int = IMAGE_SIDE) -> dict:
    """Qwen3-VL's image processor settings at the tiny tower's geometry (patch 8, temporal patch 2, merge 2)
    with images of 16×16 to ``image_side``² pixels."""
    return {
        "image_processor_type": "Qwen2VLImageProcessorFast",  # Qwen3-VL's; built as the PIL one without torchvision
        "patch_size": 8,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "size": {"shortest_edge": 16 * 16, "longest_edge": image_side * image_side},
    }


def write_vl_tokenizer(directory: str | Path, *, image_side: int = IMAGE_SIDE, base: str = "chat") -> Path:
    """The shipped chat tokenizer (``data.tokenizer: chat``) with ``<|vision_start|>``, ``<|image_pad|>`` and
    ``<|vision_end|>`` added as special tokens (ids 512, 513, 514), and the image processor's config beside it;
    ``base="qwen3"``: the real Qwen3 tokenizer (``make qwen3-tokenizer``), which has them already (151652,
    151655, 151653)."""
    from transformers import AutoTokenizer

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if base == "qwen3":
        from sapo_megatron.data import qwen3_tokenizer

        for name in qwen3_tokenizer.FILES:
            shutil.copyfile(qwen3_tokenizer.tokenizer_dir() / name, directory / name)
        (directory / PROCESSOR_FILE).write_text(json.dumps(processor_config(image_side), indent=2) + "\n")
        return directory
    tok = AutoTokenizer.from_pretrained(str(CHAT_TOKENIZER_DIR))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", *VISION_TOKENS]})
    tok.save_pretrained(str(directory))
    (directory / PROCESSOR_FILE).write_text(json.dumps(processor_config(image_side), indent=2) + "\n")
    return directory


def vl_model_ids(directory: str | Path) -> dict[str, int]:
    """The ``model.hf_config`` ids a tiny VL model needs for the tokenizer in ``directory``: the three image
    tokens, a video id the tokenizer never produces, and the text vocabulary (Qwen3's padded 151,936 for it)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory))
    start, pad, end = (_token_id(tok, token) for token in VISION_TOKENS)
    found = tok.convert_tokens_to_ids("<|video_pad|>")
    size = len(tok)
    video = found if isinstance(found, int) and found != tok.unk_token_id and found < size else size
    size = max(size, video + 1)
    from sapo_megatron.data.qwen3_tokenizer import PADDED_VOCAB_SIZE

    vocab = PADDED_VOCAB_SIZE if size <= PADDED_VOCAB_SIZE and size > 150_000 else size
    return {
        "vision_start_token_id": start,
        "image_token_id": pad,
        "vision_end_token_id": end,
        "video_token_id": video,
        "vocab_size": vocab,
    }


def _token_id(tok: Any, token: str) -> int:
    found = tok.convert_tokens_to_ids(token)
    if not isinstance(found, int):
        raise DatasetError(f"the tokenizer has no {token} token")
    return found


def write_demo_data(
    directory: str | Path,
    *,
    train: int,
    heldout: int,
    tasks: Sequence[str] = ("name_colour",),
    logic: int = 0,
    math: int = 0,
    seed: int = 0,
) -> Path:
    """``directory/{train,heldout}.jsonl``: ``train`` / ``heldout`` visual rows of ``tasks`` (in turn), plus
    ``logic`` knights-and-knaves puzzles of two people and ``math`` two-digit additions in the training split
    (the held-out split gets them in the same proportion to its visual rows), shuffled."""
    if train < 1 or heldout < 1:
        raise DatasetError(f"the demo data needs train >= 1 and heldout >= 1, got {train} and {heldout}")
    directory = Path(directory)
    for split, n in (("train", train), ("heldout", heldout)):
        path = write_visual_dataset(directory, n, seed=seed, tasks=tasks, split=split)
        rng = random.Random(f"{seed}-{split}-mixed")
        records = [json.loads(line) for line in path.read_text().splitlines()]
        share = n / train  # the held-out split mixes the sources as the training split does
        records += [_logic_record(rng) for _ in range(round(logic * share))]
        records += [_math_record(rng) for _ in range(round(math * share))]
        rng.shuffle(records)
        path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return directory


def _logic_record(rng: random.Random) -> dict:
    statements, knights = make_puzzle(rng, 2)  # two people: prompts a tiny model's context holds
    return {"prompt": puzzle_text(statements), "ground_truth": label(knights), "domain": LOGIC_SOURCE}


def _math_record(rng: random.Random) -> dict:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return {
        "prompt": f"What is {a} plus {b}? Put the final answer in \\boxed{{}}.",
        "ground_truth": str(a + b),
        "domain": MATH_SOURCE,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m sapo_megatron.data.vl_demo", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("out", help="folder to write tokenizer/, train.jsonl, heldout.jsonl and images/ into")
    parser.add_argument("--train", type=int, default=2000, help="visual training rows")
    parser.add_argument("--heldout", type=int, default=200, help="visual held-out rows")
    parser.add_argument("--tasks", default="name_colour", help=f"comma-separated, from {', '.join(TASKS)}")
    parser.add_argument(
        "--logic", type=int, default=0, help="knights-and-knaves puzzles in train (held-out: in proportion)"
    )
    parser.add_argument(
        "--math", type=int, default=0, help="two-digit additions (text) in train (held-out: in proportion)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tokenizer-only",
        action="store_true",
        help="write only OUT/tokenizer (for your own image data) and print the model ids it needs",
    )
    parser.add_argument(
        "--base", choices=("chat", "qwen3"), default="chat", help="the tokenizer to add images to"
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.tokenizer_only:
        ids = vl_model_ids(write_vl_tokenizer(out / "tokenizer", base=args.base))
        print(f"wrote {out}/tokenizer; set data.tokenizer: {out}/tokenizer and in model.hf_config:")
        print("\n".join(f"  {key}: {value}" for key, value in ids.items() if key != "vocab_size"))
        print(f"  text_config: {{vocab_size: {ids['vocab_size']}}}")
        print(
            "or model.hf_config: tiny_vl (the VL demo's model with these ids and a context sized to your data)"
        )
        return
    if (out / "images").is_dir():  # a smaller dataset written over a larger one would keep stale images
        shutil.rmtree(out / "images")
    write_vl_tokenizer(out / "tokenizer")
    write_demo_data(
        out,
        train=args.train,
        heldout=args.heldout,
        tasks=[t for t in args.tasks.split(",") if t],
        logic=args.logic,
        math=args.math,
        seed=args.seed,
    )
    print(f"wrote {out}/tokenizer, {out}/train.jsonl, {out}/heldout.jsonl")


if __name__ == "__main__":
    main()
