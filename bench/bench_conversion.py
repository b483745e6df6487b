"""HF → Megatron conversion: throughput against a plain copy of the same bytes, and peak memory against the model.

Writes a synthetic Qwen3-MoE checkpoint with the real expert layout (128 experts, per-expert gate/up/down
tensors, ~1 GB safetensors shards; default 12 layers, hidden 1024, expert FFN 384: about 3.9 GB of bf16), then
in the same run:

- copy: ``shutil.copyfile`` of every safetensors file + fsync (the converter fsyncs what it writes too);
- convert: ``hf_to_megatron`` in a child process, timed inside the child (imports excluded), with the child's
  peak resident memory (``ru_maxrss``, which counts memory-mapped file pages too);
- and, for information, ``megatron_to_hf`` back, spot-checked against the source tensors.

Goals: conversion throughput ≥ 0.5 × copy throughput; peak RSS < 0.25 × model size.

``--vl`` writes a synthetic Qwen3-VL-MoE instead: the LM under ``model.language_model.``, experts fused in the
hub layout (``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``), a vision tower (depth 8, hidden 1024) with
three DeepStack mergers.

    python bench/bench_conversion.py                 # ~4 GB model, a few minutes on 2 cores
    python bench/bench_conversion.py --layers 6      # smaller
    python bench/bench_conversion.py --vl --layers 6 # ~2 GB Qwen3-VL-MoE
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sapo_megatron.checkpoint.fused_experts import fuse_specs  # noqa: E402
from sapo_megatron.checkpoint.mapping import hf_expected_shapes  # noqa: E402
from sapo_megatron.checkpoint.safetensors_stream import (  # noqa: E402
    TensorSpec,
    plan_shards,
    write_index,
    write_shard,
)
from sapo_megatron.model.arch import QwenArch  # noqa: E402

THROUGHPUT_GOAL = 0.5
RSS_GOAL = 0.25

_CHILD = """
import json, resource, sys, time
from sapo_megatron.conversion.to_megatron import hf_to_megatron
from sapo_megatron.megatron import dist_ckpt  # import cost is not conversion cost
baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
hf_to_megatron(sys.argv[1], sys.argv[2], progress=False)
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"seconds": seconds, "peak_kb": peak, "baseline_kb": baseline}))
"""


def synthetic_config(layers: int, hidden: int, moe_ffn: int, experts: int) -> dict:
    return QwenArch.from_hf_dict(
        {
            "model_type": "qwen3_moe",
            "vocab_size": 32768,
            "hidden_size": hidden,
            "intermediate_size": 4 * hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "head_dim": 64,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1_000_000.0,
            "max_position_embeddings": 4096,
            "num_experts": experts,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": moe_ffn,
            "norm_topk_prob": True,
        }
    ).to_hf_dict()


def synthetic_vl_config(layers: int, hidden: int, moe_ffn: int, experts: int) -> dict:
    text = synthetic_config(layers, hidden, moe_ffn, experts)
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 5_000_000.0,
        "mrope_section": [12, 10, 10],  # head_dim 64 / 2
        "mrope_interleaved": True,
    }
    vision = {
        "depth": 8,
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_heads": 16,
        "patch_size": 16,
        "out_hidden_size": hidden,
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [2, 4, 6],
    }
    raw = {"model_type": "qwen3_vl_moe", "text_config": text, "vision_config": vision}
    return QwenArch.from_hf_dict(raw).to_hf_dict()


def checkpoint_shapes(arch: QwenArch) -> list[tuple[str, tuple[int, ...]]]:
    """The tensors a checkpoint of ``arch`` stores: per-expert for the text models, fused (hub) for VL."""
    shapes = list(hf_expected_shapes(arch).items())
    return fuse_specs(shapes) if arch.is_vl else shapes


def write_synthetic_checkpoint(out: Path, config: dict, shard_bytes: int) -> int:
    """Random-valued bf16 tensors in HF order, streamed into shards; returns the tensor bytes."""
    out.mkdir(parents=True)
    arch = QwenArch.from_hf_dict(config)
    specs = [TensorSpec(n, s, torch.bfloat16) for n, s in checkpoint_shapes(arch)]
    shards = plan_shards(specs, shard_bytes)
    pool = torch.randn(1 << 25, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)

    def tensors():
        for i, spec in enumerate(specs):
            numel = max(1, spec.nbytes // 2)
            start = (i * 7919) % (pool.numel() - numel) if numel < pool.numel() else 0
            data = (
                pool[start : start + numel]
                if numel <= pool.numel()
                else pool.repeat(numel // pool.numel() + 1)
            )
            yield spec.name, data[:numel].reshape(spec.shape)

    stream = tensors()
    for shard in shards:
        write_shard(out / shard.filename, shard, stream)
    write_index(out, shards)
    (out / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}, indent=2))
    return sum(s.nbytes for s in specs)


def timed_copy(source: Path, dest: Path) -> float:
    dest.mkdir(parents=True)
    start = time.perf_counter()
    for path in sorted(source.glob("*.safetensors")):
        target = dest / path.name
        shutil.copyfile(path, target)
        fd = os.open(target, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    seconds = time.perf_counter() - start
    shutil.rmtree(dest)
    return seconds


def convert_in_child(hf_dir: Path, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(hf_dir), str(out)], capture_output=True, text=True, env=env
    )
    if done.returncode != 0:
        raise RuntimeError(f"conversion failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def spot_check(hf_dir: Path, back: Path, names: list[str]) -> None:
    from safetensors import safe_open

    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"]
    back_index_path = back / "model.safetensors.index.json"
    back_index = json.loads(back_index_path.read_text())["weight_map"] if back_index_path.exists() else {}
    for name in names:
        source = safe_open(str(hf_dir / index[name]), "pt")
        exported = safe_open(str(back / back_index.get(name, "model.safetensors")), "pt")
        if not torch.equal(source.get_tensor(name), exported.get_tensor(name)):
            raise AssertionError(f"{name} differs after HF → Megatron → HF")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--moe-ffn", type=int, default=384)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--shard-gb", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=2, help="conversion runs (copies run around them)")
    parser.add_argument("--workdir", default=None, help="default: a temporary directory, removed at the end")
    parser.add_argument("--vl", action="store_true", help="a Qwen3-VL-MoE (fused hub-layout experts, a ViT)")
    args = parser.parse_args()

    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench_conversion_"))
    try:
        make_config = synthetic_vl_config if args.vl else synthetic_config
        config = make_config(args.layers, args.hidden, args.moe_ffn, args.experts)
        hf_dir = root / "hf"
        start = time.perf_counter()
        model_bytes = write_synthetic_checkpoint(hf_dir, config, int(args.shard_gb * 1e9))
        files = sorted(hf_dir.glob("*.safetensors"))
        file_bytes = sum(p.stat().st_size for p in files)
        print(
            f"synthetic {'Qwen3-VL-MoE' if args.vl else 'Qwen3-MoE'}: {args.layers} layers × {args.experts} experts, hidden {args.hidden}, "
            f"expert FFN {args.moe_ffn}: {model_bytes / 1e9:.2f} GB bf16 in {len(files)} files "
            f"(written in {time.perf_counter() - start:.1f} s)"
        )

        # Interleaved runs, best of each: the machine may be shared, and the page cache is warm for both.
        copies, results = [timed_copy(hf_dir, root / "copy")], []
        for _ in range(args.repeats):
            shutil.rmtree(root / "mcore", ignore_errors=True)
            results.append(convert_in_child(hf_dir, root / "mcore"))
            copies.append(timed_copy(hf_dir, root / "copy"))
        copy_s = min(copies)  # the faster copy: the stricter baseline
        result = min(results, key=lambda r: r["seconds"])
        convert_s = result["seconds"]
        peak_kb = max(r["peak_kb"] for r in results)
        ratio = copy_s / convert_s
        peak = peak_kb * 1024
        rss_ratio = peak / model_bytes

        start = time.perf_counter()
        from sapo_megatron.conversion.to_hf import megatron_to_hf

        megatron_to_hf(root / "mcore", root / "back", progress=False)
        back_s = time.perf_counter() - start
        names = [n for n, _ in checkpoint_shapes(QwenArch.from_hf_dict(config))]
        spot_check(hf_dir, root / "back", [names[0], names[len(names) // 2], names[-1]])

        print(
            f"copy (copyfile + fsync):  {copy_s:6.2f} s  {file_bytes / copy_s / 1e9:6.2f} GB/s  (runs: "
            + ", ".join(f"{c:.2f} s" for c in copies)
            + ")"
        )
        print(
            f"hf_to_megatron:           {convert_s:6.2f} s  {model_bytes / convert_s / 1e9:6.2f} GB/s  (runs: "
            + ", ".join(f"{r['seconds']:.2f} s" for r in results)
            + ")"
        )
        print(
            f"megatron_to_hf (info):    {back_s:6.2f} s  {model_bytes / back_s / 1e9:6.2f} GB/s  (in-process)"
        )
        print(
            f"peak RSS of the converting process: {peak / 1e6:.0f} MB "
            f"(after imports: {result['baseline_kb'] * 1024 / 1e6:.0f} MB; model {model_bytes / 1e6:.0f} MB)"
        )
        met_speed, met_rss = ratio >= THROUGHPUT_GOAL, rss_ratio < RSS_GOAL
        print(
            f"RATIO throughput (conversion / copy) = {ratio:.2f}   goal >= {THROUGHPUT_GOAL}: "
            f"{'met' if met_speed else 'MISSED'}"
        )
        print(
            f"RATIO peak RSS / model size          = {rss_ratio:.3f}  goal <  {RSS_GOAL}: "
            f"{'met' if met_rss else 'MISSED'}"
        )
        print(f"(this process: max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB)")
        return 0
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
