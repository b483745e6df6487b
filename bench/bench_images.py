"""Images: (1) reading and checking a geo3k-style parquet of N image rows (default 10,000; 200 distinct drawn PNGs
of 200-640 px, reused), as the dry run does, with Qwen3-VL's resize policy; (2) the CPU engine's samples/s with one
64x64 image a prompt against the same prompts without it, on the tests' tiny Qwen3-VL-MoE (8 prompts x 4 samples,
32 new tokens, 1 thread). Everything lives in a temporary directory.

    python bench/bench_images.py [--rows 10000] [--skip-engine]
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sapo_megatron.data.datasets import DatasetKeys, read_dataset  # noqa: E402
from sapo_megatron.data.images import ImagePolicy  # noqa: E402


def _drawn_png(rng: random.Random) -> bytes:
    from PIL import Image, ImageDraw

    width, height = rng.randint(200, 640), rng.randint(200, 640)
    image = Image.new("RGB", (width, height), (rng.randrange(256),) * 3)
    draw = ImageDraw.Draw(image)
    for _ in range(8):
        x, y = rng.randrange(width), rng.randrange(height)
        draw.ellipse((x, y, x + 40, y + 30), fill=(rng.randrange(256), rng.randrange(256), 0))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def bench_read(root: Path, rows: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    pool = [_drawn_png(rng) for _ in range(200)]
    records = [
        {
            "data_source": "geo",
            "prompt": [{"role": "user", "content": "<image>Find x."}],
            "images": [{"bytes": pool[i % len(pool)], "path": None}],
            "reward_model": {"ground_truth": "1"},
        }
        for i in range(rows)
    ]
    path = root / "geo.parquet"
    pq.write_table(pa.Table.from_pylist(records), path)
    megabytes = sum(len(r["images"][0]["bytes"]) for r in records) / 1e6
    policy = ImagePolicy(factor=32, min_pixels=65536, max_pixels=16777216)  # Qwen3-VL's processor
    started = time.perf_counter()
    read_dataset(path, DatasetKeys(), policy)
    print(
        f"{rows} rows, {megabytes:.0f} MB of PNG: read, decoded and checked in {time.perf_counter() - started:.1f} s"
    )


def bench_engine(root: Path) -> None:
    from sapo_megatron.algo import AdvantageConfig
    from sapo_megatron.data.render import PromptRenderer
    from sapo_megatron.data.tokenizer import load_tokenizer
    from sapo_megatron.data.vision import load_image_processor, vision_spec
    from sapo_megatron.rollout.collect import CollectSettings, generate_groups
    from sapo_megatron.rollout.cpu.engine import CPUEngine
    from sapo_megatron.rollout.types import SamplingParams
    from tests.data.test_images import png, uri
    from tests.vl_fixtures import build_tiny_vl_checkpoint

    directory = build_tiny_vl_checkpoint(root / "vl")
    tok = load_tokenizer(str(directory))
    spec = vision_spec(tok, load_image_processor(directory), str(directory))
    records = [
        {
            "prompt": f"What is in <image>? case {i}",
            "ground_truth": "a",
            "images": [uri(png(64, 64, (i * 20, 0, 0)))],
        }
        for i in range(8)
    ]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    keys = DatasetKeys(apply_chat_template=True)
    rows = read_dataset(
        root / "prompts.jsonl", keys, keys.image_policy(spec.factor, spec.min_pixels, spec.max_pixels)
    ).rows
    text_rows = [
        dataclasses.replace(r, prompt=r.prompt.replace("<image>", "the picture"), images=()) for r in rows
    ]
    renderer = PromptRenderer(tok, keys, spec)
    engine = CPUEngine.from_pretrained(directory, seed=0, num_threads=1)
    sampling = SamplingParams(max_new_tokens=32, temperature=1.0)
    settings = CollectSettings(
        n_samples=4, sampling=sampling, advantage=AdvantageConfig(), image_pad_id=spec.pad_id
    )
    print(
        f"prompt tokens: {len(renderer.encode(rows[0]))} with the image, {len(renderer.encode(text_rows[0]))} without"
    )
    for name, batch in (("text", text_rows), ("image", rows)) * 2:
        started = time.perf_counter()
        groups = generate_groups(engine, batch, renderer.encode, settings, seed=1)
        seconds = time.perf_counter() - started
        tokens = sum(len(s.response_ids) for group in groups for s in group)
        print(f"{name}: {32 / seconds:.1f} samples/s, {tokens / seconds:.0f} tokens/s")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--skip-engine", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bench_read(Path(tmp), args.rows)
        if not args.skip_engine:
            bench_engine(Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
