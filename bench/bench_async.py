"""RL step time with ``trainer.rollout_mode: one_step_off`` against synchronous rollouts, measured in the same run: a Megatron
trainer process against the CPU rollout server in another process (``sapo-megatron serve``, the stand-in for an
SGLang worker), one torch thread each (``launch.cpu_threads``, ``--threads``) so that generation and training can
overlap on two cores.

    python bench/bench_async.py [--steps 10] [--rounds 2] [--prompts 4] [--samples 4] [--max-new-tokens 48]
                                [--mini-batches 4] [--hidden 256] [--layers 2]

The model is the demo's tiny Qwen3-MoE widened to ``--hidden`` (256: the matrix products, not Python overhead,
dominate both sides), from random weights and without the supervised warm start: its responses run to
``--max-new-tokens``, so every step generates the same amount. The defaults make generation and training take
about as long on the development machine. Few samples with long responses keep the trainer process's share of
generation small: the HTTP client runs in the trainer's background thread, one request per sample, and holds
the interpreter lock the training thread needs. Weight sync is ``disk``
(the server loads each version), inside the step for both arms. Prints per arm the medians over steps 2.. of
the step time (``time/step_s``: from taking the batch to the end of the weight push), generation
(``time/rollout_s``), training (``time/train_s``), the wait for rollouts and the weight sync, and the ratio of
step times async / sync (lower is better; 0.5 is the bound when generation and training take equally long).
Also printed: the ratio perfect overlap would reach, ``(max(gen, train) + sync) / (gen + train + sync)`` from
the sync arm's medians (generation and training on separate hardware, as on a cluster), and how much slower
generation and training ran in the async arm, where they overlap, than alone in the sync arm: two busy processes
on a small shared machine slow each other down (caches, memory bandwidth, other jobs).

The arms alternate (sync, async, sync, async for two ``--rounds``) so that a change in the machine's load
during the run reaches both; the load average is printed with the result. The trainer runs in a session of its
own: with Linux's autogroup scheduling, processes of one session share one slice of a busy machine, so a trainer
and a server in the same session could not overlap there (they would on separate machines, or an idle one).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
TIMES = ("time/step_s", "time/rollout_s", "time/train_s", "time/rollout_wait_s", "time/weight_sync_s")


def save_model(path: Path, arch: dict) -> Path:
    import torch
    import transformers

    from sapo_megatron.data.tokenizer import CharTokenizer

    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**arch)).save_pretrained(path)
    CharTokenizer().save(path)
    return path


def write_config(path: Path, *, model_dir: Path, url: str, overlap: bool, args) -> Path:
    from sapo_megatron.defaults import embedded_default_dict

    cfg = embedded_default_dict()
    cfg["output_dir"] = str(path.parent / "run")
    cfg["model"] = {"hf_config": str(model_dir), "init": "random"}
    cfg["launch"] = {"cpu_threads": 1}
    cfg["sft"]["steps"] = 0
    cfg["data"].update(train_size=1024)
    cfg["eval"] = {"datasets": []}
    cfg["rollout"] = {
        "engine": "sglang",
        "urls": [url],
        "weight_sync": "disk",
        "n_samples": args.samples,
        "temperature": 1.0,
        "max_new_tokens": args.max_new_tokens,
        "timeout_s": 600.0,
    }
    cfg["trainer"] = {
        "steps": args.steps,
        "prompts_per_step": args.prompts,
        "mini_batches": args.mini_batches,
        "save_every": 0,
        "export_hf": False,
        "rollout_mode": "one_step_off" if overlap else "sync",
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_arm(root: Path, name: str, **kwargs) -> list[dict[str, float]]:
    """One training run; the times of its steps 2.. (step 1 generates before it trains in both arms)."""
    (root / name).mkdir()
    config = write_config(root / name / "run.yaml", **kwargs)
    proc = subprocess.run(
        [sys.executable, "-m", "sapo_megatron.cli", "train", str(config)],
        capture_output=True,
        text=True,
        check=False,
        start_new_session=True,  # its own scheduler group (Linux autogroup), apart from the server's: see above
    )
    if proc.returncode != 0:
        raise SystemExit(f"{name} run failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (config.parent / "run" / "metrics.jsonl").read_text().splitlines()]
    return [{key: row[key] for key in TIMES} for row in rows if row["phase"] == "rl"][1:]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=10, help="RL steps per run")
    parser.add_argument("--rounds", type=int, default=2, help="runs per arm, alternating")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--samples", type=int, default=4, help="responses per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--mini-batches", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    from sapo_megatron.defaults import DEMO_MODEL
    from sapo_megatron.rollout.cpu.process import ServerProcess

    arch = {**DEMO_MODEL, "hidden_size": args.hidden, "num_hidden_layers": args.layers}
    arch.update(intermediate_size=2 * args.hidden, moe_intermediate_size=args.hidden)
    arch["max_position_embeddings"] = max(64, 16 + args.max_new_tokens)
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        root = Path(tmp)
        model_dir = save_model(root / "model", arch)
        server = ServerProcess("--model-path", str(model_dir), "--port", "0", "--threads", "1")
        steps: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
        try:
            for round_ in range(args.rounds):
                for name, overlap in (("sync", False), ("async", True)):
                    kwargs = {"model_dir": model_dir, "url": server.url, "overlap": overlap, "args": args}
                    steps[name] += run_arm(root, f"{name}{round_}", **kwargs)
        finally:
            server.stop(timeout_s=60)
    arms = {
        name: {key: statistics.median(row[key] for row in rows) for key in TIMES}
        for name, rows in steps.items()
    }
    print(
        f"tiny Qwen3-MoE (hidden {args.hidden}, {args.layers} layers), {args.prompts} prompts x {args.samples} "
        f"samples x {args.max_new_tokens} new tokens, {args.mini_batches} updates per step, "
        f"medians of steps 2-{args.steps} of {args.rounds} runs per arm; load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'arm':6s} " + " ".join(f"{key.split('/')[1]:>15s}" for key in TIMES))
    for name, times in arms.items():
        print(f"{name:6s} " + " ".join(f"{times[key]:13.3f} s" for key in TIMES))
    ratio = arms["async"]["time/step_s"] / arms["sync"]["time/step_s"]
    sync = arms["sync"]
    gen, train, push = sync["time/rollout_s"], sync["time/train_s"], sync["time/weight_sync_s"]

    overlapped = arms["async"]
    print(f"ratio async / sync step time: {ratio:.2f}")
    print(
        f"perfect overlap would give {(max(gen, train) + push) / (gen + train + push):.2f}; while overlapping, "
        f"generation ran {overlapped['time/rollout_s'] / gen:.2f}x and training "
        f"{overlapped['time/train_s'] / train:.2f}x as long as alone"
    )


if __name__ == "__main__":
    main()
