"""A tiny CPU demo of RL with a tool: a warm-started model learns to call a calculator for two-digit products.

    python tools/demo_calculator.py [--out runs/demo_calculator] [--sft-steps 600] [--rl-steps 30] [--tool-frac 0.3]

The task: "What is 47 times 38?", answered as ``\\boxed{1786}`` (reward: numeric_match). The tiny Qwen3-MoE of the
embedded demo cannot multiply; a ``calculator`` tool can. The supervised warm start shows both ways of answering:
``--tool-frac`` of its examples call the tool (``<tool_call>`` with the expression, the tool's result, then the
boxed result), the rest answer at once with the right product (which the model can only guess). RL then runs
multi-turn episodes with the real tool (``rollout.multi_turn``, the tool loaded by import path from this file);
the held-out avg@4 with tools, evaluated after the warm start and after RL, shows how much the model learnt to
rely on the tool, and ``episode/tool_calls_mean`` per step how often it calls it.

Everything is built here, offline: the byte-level BPE with a Qwen-style chat template (trained on the task's own
text), the data, the tools file and the config; then ``sapo-megatron train`` runs. Prints the summary.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_PRODUCT = re.compile(r"^\s*(\d{1,4})\s*\*\s*(\d{1,4})\s*$")


async def calculator(expression: str) -> str:
    """The demo's tool: the product ``a*b`` of two whole numbers (anything else is an error)."""
    match = _PRODUCT.match(str(expression))
    if match is None:
        raise ValueError(f"expected 'a*b' with whole numbers, got {expression!r}")
    return str(int(match.group(1)) * int(match.group(2)))


def tool_call(a: int, b: int) -> str:
    payload = {"name": "calculator", "arguments": {"expression": f"{a}*{b}"}}
    return "<tool_call>\n" + json.dumps(payload) + "\n</tool_call>"


def with_tool(a: int, b: int) -> str:
    """The assistant's whole answer using the tool, as the episode's tokens will hold it."""
    return f"{tool_call(a, b)}<|im_end|>\n<|im_start|>tool\n{a * b}<|im_end|>\n<|im_start|>assistant\n\\boxed{{{a * b}}}"


def problems(seed: int, count: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(count)]


def build_tokenizer(directory: Path) -> int:
    """A byte-level BPE on the task's text with the template above; returns its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [f"What is {a} times {b}?\n" + with_tool(a, b) for a, b in problems(99, 400)]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(str(directory))
    return len(tokenizer)


def write_data(out: Path, tool_frac: float) -> dict[str, str]:
    rng = random.Random(1)
    heldout = set(problems(7, 64))
    train = [p for p in problems(3, 3000) if p not in heldout]
    rows = []
    for a, b in train:
        response = with_tool(a, b) if rng.random() < tool_frac else f"\\boxed{{{a * b}}}"
        rows.append({"prompt": f"What is {a} times {b}?", "ground_truth": str(a * b), "response": response})
    held = [{"prompt": f"What is {a} times {b}?", "ground_truth": str(a * b)} for a, b in sorted(heldout)]
    paths = {"train": out / "train.jsonl", "heldout": out / "heldout.jsonl"}
    for name, records in (("train", rows), ("heldout", held)):
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in records))
    return {k: str(v) for k, v in paths.items()}


def write_config(out: Path, vocab: int, data: dict[str, str], args) -> Path:
    import yaml

    from sapo_megatron.defaults import DEMO_MODEL, embedded_default_dict

    tokenizer_dir = out / "tokenizer"
    tools = out / "tools.yaml"
    tools.write_text(
        yaml.safe_dump(
            {
                "tools": [
                    {
                        "import": f"{Path(__file__).resolve()}:calculator",
                        "schema": {
                            "type": "function",
                            "function": {
                                "name": "calculator",
                                "description": "the product of two whole numbers",
                                "parameters": {
                                    "type": "object",
                                    "properties": {"expression": {"type": "string"}},
                                    "required": ["expression"],
                                },
                            },
                        },
                    }
                ]
            }
        )
    )
    cfg = embedded_default_dict()
    model = {**DEMO_MODEL, "vocab_size": vocab, "max_position_embeddings": 256}
    model.update(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg.update(
        name="demo-calculator",
        output_dir=str(out / "run"),
        model={"hf_config": model, "init_std": 0.02},
        data={
            "train": data["train"],
            "tokenizer": str(tokenizer_dir),
            "apply_chat_template": True,
            "response_key": "response",  # the warm start's target (with or without the tool)
        },
        eval={
            "every": 0,
            "datasets": [{"name": "products", "path": data["heldout"], "n": 4, "temperature": 1.0}],
        },
    )
    cfg["sft"].update(steps=args.sft_steps, global_batch=64, lr=1e-3, log_every=50)
    cfg["optimizer"]["lr"] = args.rl_lr
    cfg["trainer"].update(steps=args.rl_steps, prompts_per_step=16, mini_batches=2, save_every=0)
    cfg["rollout"].update(
        n_samples=8,
        temperature=1.0,
        max_new_tokens=32,
        multi_turn={
            "python_tool": False,
            "tools_file": str(tools),
            "max_turns": 3,
            "max_tool_calls": 2,
            "max_context_tokens": 160,
        },
    )
    cfg["algorithm"]["reward"] = "numeric_match"
    path = out / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _mean(values: list[float]) -> float:
    return round(sum(values) / max(len(values), 1), 3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/demo_calculator")
    parser.add_argument("--sft-steps", type=int, default=600)
    parser.add_argument("--rl-steps", type=int, default=30)
    parser.add_argument("--rl-lr", type=float, default=3e-4)
    parser.add_argument("--tool-frac", type=float, default=0.3)
    args = parser.parse_args(argv)
    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out / "tokenizer")
    config = write_config(out, vocab, write_data(out, args.tool_frac), args)
    command = [sys.executable, "-m", "sapo_megatron.cli", "train", str(config), "--overwrite"]
    subprocess.run(command, check=True, cwd=REPO)
    summary = json.loads((out / "run" / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    rl = [row for row in metrics if row["phase"] == "rl"]
    calls = [row.get("episode/tool_calls_mean", 0.0) for row in rl]
    rewards = [row["reward/mean"] for row in rl]
    print(
        json.dumps(
            {
                "heldout_avg@4_with_tools": [summary["accuracy_before"], summary["accuracy_after"]],
                "tool_calls_per_sample_first_last_5_steps": [_mean(calls[:5]), _mean(calls[-5:])],
                "reward_first_last_5_steps": [_mean(rewards[:5]), _mean(rewards[-5:])],
                "wall_seconds": summary["wall_seconds"],
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
