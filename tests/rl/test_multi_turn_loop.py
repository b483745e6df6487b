"""The RL loop on multi-turn episodes (rollout.multi_turn with a user episode function) end to end on CPU: a
tiny Qwen3-MoE with the project's chat BPE, R3 replaying routes spliced across turns, two-span loss masks through
packing into SAPO updates; the step metrics count turns, tool calls and generated tokens; `sapo-megatron eval` with
the run's config evaluates with the same episodes."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from sapo_megatron.cli import main
from sapo_megatron.data.prompts import PromptRow, save_jsonl
from sapo_megatron.defaults import embedded_default_dict
from sapo_megatron.model.tiny import make_tiny_hf_checkpoint
from tests.data.chat_fixtures import make_chat_tokenizer
from tests.rl.test_trainer import train

MAX_NEW_TOKENS = 5


def two_turn_config(tmp_path: Path, **trainer) -> tuple[Path, Path, list[PromptRow]]:
    """The run's config (written), the tiny chat model and the prompts: two-turn episodes, R3, packing."""
    model = make_tiny_hf_checkpoint(tmp_path / "model", "moe", vocab_size=384, max_position_embeddings=512)
    make_chat_tokenizer(model)
    rows = [PromptRow(prompt=f"What is {i} plus 30?", ground_truth=str(i + 30)) for i in range(8)]
    cfg = embedded_default_dict()
    cfg.update(
        output_dir=str(tmp_path / "run"),
        model={"hf_config": str(model), "init": "hf", "init_path": str(model)},
        data={
            "train": str(save_jsonl(rows, tmp_path / "train.jsonl")),
            "tokenizer": str(model),
            "apply_chat_template": True,
            "chat_template_kwargs": {"enable_thinking": False},
        },
        eval={"datasets": []},
    )
    cfg["sft"]["steps"] = 0
    cfg["trainer"].update(steps=2, prompts_per_step=4, mini_batches=2, save_every=0, log_samples_every=1)
    cfg["trainer"].update(trainer)
    cfg["parallel"] = {"max_tokens_per_micro_batch": 512}
    cfg["rollout"].update(
        n_samples=2,
        max_new_tokens=MAX_NEW_TOKENS,
        routed_experts=True,
        multi_turn={
            "python_tool": False,
            "episode_function": "tests.rl.multi_turn_episode:two_turns",
            "max_context_tokens": 400,
        },
    )
    cfg["algorithm"]["routing_replay"] = "r3"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg))
    return config, model, rows


def rl_rows(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if row["phase"] == "rl"]


def test_rl_steps_on_two_turn_episodes_with_r3_and_packing(tmp_path):
    config, model, rows = two_turn_config(tmp_path)
    train(config)

    rl = rl_rows(tmp_path / "run")
    assert len(rl) == 2
    for row in rl:
        assert row["episode/turns_mean"] == 2.0 and row["episode/tool_calls_mean"] == 1.0
        assert 2 <= row["response/length_mean"] <= 2 * MAX_NEW_TOKENS  # generated tokens, not the observation
        assert row["episode/observation_tokens_mean"] > 5
        assert row["grad_norm"] >= 0.0
        # trainer (Megatron, R3) vs engine log-probs on the mask-1 tokens: an observation token in the mask would
        # compare the engine's 0 with a trainer log-prob of about -6
        assert row["mismatch/abs_delta_mean"] < 1e-4, row["mismatch/abs_delta_mean"]
        print(f"step {row['step']}: trainer/engine mean |Δ log p| {row['mismatch/abs_delta_mean']:.2e}")
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["turns"] == 2 and s["status"] == "completed" for s in samples)
    assert all(s["response_tokens"] + s["observation_tokens"] > s["response_tokens"] for s in samples)
    assert all("tool\n42" in s["response"] for s in samples)  # the observation (the fixture's tool role)

    # evaluation runs the same episodes and reports turns and tool calls per sample
    heldout = str(save_jsonl(rows[:2], tmp_path / "heldout.jsonl"))
    out = tmp_path / "eval"
    args = [
        "eval",
        str(config),
        "--model",
        str(model),
        "--data",
        f"held={heldout}",
        "--n",
        "2",
        "--temperature",
        "1.0",
    ]
    assert main([*args, "--output-dir", str(out)]) == 0
    metrics = json.loads((out / "eval.json").read_text())["datasets"]["held"]
    assert (metrics["turns_mean"], metrics["tool_calls_mean"]) == (2.0, 1.0)
    assert 2 <= metrics["response_length_mean"] <= 2 * MAX_NEW_TOKENS
    rows_out = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows_out) == 4 and all(r["turns"] == 2 and r["status"] == "completed" for r in rows_out)


def test_two_turn_episodes_under_fully_async_with_two_chunks_in_flight(tmp_path):
    """``rollout_mode: fully_async``: the producer runs episodes (two chunks in flight) while the trainer trains,
    weight updates pause them in place and they carry on; every step trains within ``max_staleness``, episodes stay
    whole (two turns, one tool call), and the first step – version-0 tokens only – matches the engine's log-probs
    on the mask-1 tokens as the synchronous run does (R3 replaying routes spliced across turns)."""
    config, _, _ = two_turn_config(
        tmp_path,
        steps=3,
        rollout_mode="fully_async",
        max_staleness=1,
        async_inflight_chunks=2,
        async_chunk_groups=2,
    )
    train(config)
    rl = rl_rows(tmp_path / "run")
    assert len(rl) == 3
    for row in rl:
        assert row["episode/turns_mean"] == 2.0 and row["episode/tool_calls_mean"] == 1.0
        assert row["staleness/token_max"] <= 1.0
        assert row["routing/agreement_used"] == 1.0
    assert rl[0]["staleness/token_max"] == 0.0
    assert rl[0]["mismatch/abs_delta_mean"] < 1e-4, rl[0]["mismatch/abs_delta_mean"]
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["turns"] == 2 and s["status"] == "completed" for s in samples)
    print("fully_async episodes: staleness/token_mean", [row["staleness/token_mean"] for row in rl])
