"""The RL loop on prompts with images end to end on CPU: a tiny Qwen3-VL-MoE (transformers checkpoint) trained by
the Megatron VL model with rollouts from the CPU engine, padded and packed micro-batches, in-process tensor weight
sync (vision tower included), R3 routing replay. Two steps each; the trainer's old log-probs on the images' prompts
must equal the engine's (mismatch metrics), which they only do when the trainer gets the same pixels and grids, and
the engine's routes must land on the trainer's image tokens. The same run on 2 ranks (EP2 in DP2, TP2 + SP, PP2
padded, PP2 packed with R2) repeats the single-process one."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.rl.test_trainer import train
from tests.vl_fixtures import build_tiny_vl_checkpoint, image_prompt_records, vl_run_config, write_jsonl

pytestmark = pytest.mark.slow


# A reward with a learning signal on a random model (exact answers never come): a fixed function of the response
# text, so that every layout draws the same rewards from the same samples.
REWARD = """
def reward(response, label, prompt, source):
    return (sum(map(ord, response)) % 3) / 2
"""


@pytest.fixture(scope="module")
def vl_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl")
    # 6 LM layers: PP2 keeps the 3 DeepStack layers on the first stage; an even vocabulary for TP2
    model = build_tiny_vl_checkpoint(root / "model", seed=3, lm_layers=6, vocab_multiple=2)
    records = image_prompt_records() + [{"prompt": f"Say {i}.", "ground_truth": str(i)} for i in range(3)]
    train_file = write_jsonl(root / "train.jsonl", records)
    (root / "reward.py").write_text(REWARD)
    return model, train_file


PACKED = {"max_tokens_per_micro_batch": 512}
# name: (processes, parallel, routing replay, the single-process run it must reproduce)
LAYOUTS = {
    "padded": (1, {}, "r3", None),
    "packed": (1, PACKED, "r3", None),
    "ep2": (2, {"ep": 2}, "r3", "padded"),  # 2 ranks, EP2 inside DP2: each rank trains half the batch
    "tp2-sp": (2, {"tp": 2, "sequence_parallel": True}, "r3", "padded"),
    "pp2": (2, {"pp": 2}, "r3", "padded"),
    # R2 replays the old-log-prob pass's own routes, which equal the engine's here (agreement 1.0, asserted):
    # the same updates as R3
    "pp2-packed-r2": (2, {"pp": 2, **PACKED}, "r2", "packed"),
}


@pytest.fixture(scope="module")
def vl_runs(tmp_path_factory, vl_data):
    """``run(name)``: the RL rows of a 2-step run in layout ``name`` of :data:`LAYOUTS` (each run once)."""
    done: dict[str, list[dict]] = {}

    def run(name: str) -> list[dict]:
        if name not in done:
            done[name] = _two_steps(tmp_path_factory.mktemp(name), vl_data, *LAYOUTS[name][:3])
        return done[name]

    return run


def _two_steps(tmp_path, vl_data, procs: int, parallel: dict, replay: str) -> list[dict]:
    model, train_file = vl_data
    cfg = vl_run_config(model, train_file, tmp_path / "run")
    cfg["trainer"].update(
        steps=2, prompts_per_step=4, mini_batches=2, save_every=0, log_samples_every=1, export_hf=False
    )
    cfg["parallel"] = parallel
    cfg["launch"] = {
        "procs_per_node": procs,
        "cpu_threads": 1,
    }  # tiny model: more threads are slower (7 s a step)
    cfg["rollout"].update(n_samples=2, max_new_tokens=4, temperature=1.0, routed_experts=True)
    cfg["algorithm"].update(
        reward=f"{train_file.parent / 'reward.py'}:reward", reward_workers=0, routing_replay=replay
    )  # inline: no worker processes to start
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg))
    train(config)
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    for step in (1, 2):  # both steps trained on prompts with images (two images: two names)
        assert any(len(s.get("images", ())) >= 1 for s in samples if s["step"] == step)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rl = [row for row in rows if row["phase"] == "rl"]
    assert [row["step"] for row in rl] == [1, 2]
    for row in rl:
        # trainer (Megatron VL, images through the micro-batches) vs CPU engine log-probs, fp32
        assert row["mismatch/abs_delta_mean"] < 1e-5, row["mismatch/abs_delta_mean"]
        # the engine's routes cover the expanded prompt: on the image tokens the trainer's live routing (at the
        # rollout's weights) and the replayed routes are the engine's, token-layer for token-layer
        assert row["routing/agreement_image"] == 1.0 and row["routing/agreement_used_image"] == 1.0
        assert row["routing/agreement"] == 1.0 and row["routing/agreement_used"] == 1.0
        assert row["grad_norm"] > 0.0
    return rl


@pytest.mark.parametrize("name", ["padded", "packed"])
def test_two_rl_steps_on_images_with_r3(vl_runs, name):
    """Every run's checks are :func:`_two_steps`'s (log-probs, routes on image tokens, images in both steps)."""
    for row in vl_runs(name):
        print(
            f"{name} step {row['step']}: trainer/engine mean |Δ log p| {row['mismatch/abs_delta_mean']:.2e}, "
            f"loss {row['loss/total']:.6g}, grad norm {row['grad_norm']:.6g}"
        )


COMPARED = ("loss/total", "grad_norm", "entropy", "ratio/mean")


@pytest.mark.parametrize("name", [n for n, layout in LAYOUTS.items() if layout[3]])
def test_parallel_layout_repeats_the_single_process_run(vl_runs, name):
    """The same seeds on 2 ranks: the same samples and rewards, and the trainer's metrics within fp32 rounding
    (pixels and grids reach the first pipeline stage, MRoPE and DeepStack the later ones, log-probs come from
    the last; routes are sliced for sequence parallelism and split over stages)."""
    reference = vl_runs(LAYOUTS[name][3])
    for row, ref in zip(vl_runs(name), reference, strict=True):
        assert row["reward/mean"] == ref["reward/mean"]  # the same rollouts
        assert row["response/length_mean"] == ref["response/length_mean"]
        for key in COMPARED:
            rel = abs(row[key] - ref[key]) / max(abs(ref[key]), 1e-12)
            print(
                f"{name} step {row['step']} {key}: {row[key]:.8g}, single process {ref[key]:.8g} ({rel:.1e})"
            )
            assert row[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), key


def test_sft_warm_start_on_image_rows(tmp_path, vl_data):
    """SFT batches carry the prompts' pixels: the NLL on the image rows falls, and the RL step after it finds the
    Megatron VL log-probs equal to the CPU engine's (a padded transformers forward) at the SFT-trained weights."""
    model, train_file = vl_data
    images_only = tmp_path / "images.jsonl"
    lines = [line for line in train_file.read_text().splitlines() if '"images"' in line]
    images_only.write_text("".join(line + "\n" for line in lines))
    cfg = vl_run_config(model, images_only, tmp_path / "run")
    cfg["sft"].update(steps=6, global_batch=len(lines), lr=1e-2, log_every=1)
    cfg["launch"] = {"cpu_threads": 1}
    cfg["trainer"].update(steps=1, prompts_per_step=2, mini_batches=1, save_every=0)
    cfg["rollout"].update(n_samples=2, max_new_tokens=4, temperature=1.0)
    cfg["algorithm"]["reward"] = "exact_match"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg))
    train(config)

    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    sft = [row for row in rows if row["phase"] == "sft"]
    assert [row["step"] for row in sft] == list(range(1, 7))
    nll = [row["sft/nll"] for row in sft]
    print(f"SFT NLL on image rows: {nll[0]:.3f} -> {nll[-1]:.3f}")
    assert nll[-1] < 0.7 * nll[0], nll  # measured: 5.79 -> 3.56
    # step 1's NLL is at the checkpoint's weights: the transformers forward with the rows' pixels gives the same
    reference = _hf_sft_nll(model, images_only)
    print(f"step-1 NLL {nll[0]:.6f}, transformers {reference:.6f}")
    assert nll[0] == pytest.approx(reference, abs=1e-4)
    (rl,) = [row for row in rows if row["phase"] == "rl"]
    assert rl["mismatch/abs_delta_mean"] < 1e-5, rl["mismatch/abs_delta_mean"]


def _hf_sft_nll(model_dir, data_file) -> float:
    """Token-mean NLL of the SFT targets by transformers' Qwen3-VL-MoE, one sequence (with its images) at a time."""
    import torch
    import transformers

    from sapo_megatron.data.datasets import DatasetKeys, read_dataset
    from sapo_megatron.data.render import PromptRenderer
    from sapo_megatron.data.tokenizer import load_tokenizer
    from sapo_megatron.data.vision import load_image_processor, vision_spec

    tok = load_tokenizer(str(model_dir))
    spec = vision_spec(tok, load_image_processor(model_dir), str(model_dir))
    keys = DatasetKeys(apply_chat_template=True)
    rows = read_dataset(
        data_file, keys, keys.image_policy(spec.factor, spec.min_pixels, spec.max_pixels)
    ).rows
    renderer = PromptRenderer(tok, keys, spec)
    hf = transformers.AutoModelForImageTextToText.from_pretrained(str(model_dir)).float().eval()
    total, count = 0.0, 0
    for row in rows:
        prompt, target = renderer.sft_ids(row)
        ids = torch.tensor([list(prompt) + list(target)])
        mm = torch.zeros_like(ids)
        mm[0, : len(prompt)] = torch.tensor(prompt) == spec.pad_id  # image pads of the prompt only
        with torch.no_grad():
            out = hf(input_ids=ids, mm_token_type_ids=mm, **renderer.image_inputs(row))
        logits = out.logits[0, len(prompt) - 1 : -1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(target)[:, None])
        total -= logp.sum().item()
        count += len(target)
    return total / count
