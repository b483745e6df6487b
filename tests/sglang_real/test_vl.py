"""Real SGLang 0.5.23 serving a tiny Qwen3-VL-MoE on CPU (the virtualenv of tools/sglang_cpu/install_vl.sh: torch
2.14.1 with a real torchvision, the shim's Qwen ops): generation with images through the project's client (one
image pad per image and PNG data URIs) gives the trainer's expanded prompt length, output log-probs equal to
transformers' full forward, the CPU engine's greedy tokens, and routed experts that agree with transformers'
routers on every token, image tokens included. The model has 3 DeepStack levels and 3 LM layers, as SGLang's
``range(3)`` needs. Then, on the same server: a vision-tower update pushed by the trainer's disk sync, OPD's
teacher scoring with images, 3 RL steps of ``sapo-megatron train`` with R3 and distributed weight sync (the tests
that change the served weights put the original ones back), and a ``fusion: opd`` run with the server as teacher."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from sapo_megatron.algo import AdvantageConfig
from sapo_megatron.config import config_from_dict
from sapo_megatron.rollout.collect import CollectSettings, generate_groups
from sapo_megatron.rollout.cpu.engine import CPUEngine
from sapo_megatron.rollout.protocol import png_data_uri
from sapo_megatron.rollout.sglang.client import SGLangClient
from sapo_megatron.rollout.types import ImageInputs, SamplingParams
from tests.rollout.test_cpu_engine_images import reference
from tests.sglang_real.conftest import API_KEY, real_server_flags, restore_weights, sglang_process
from tests.vl_fixtures import (
    build_tiny_vl_checkpoint,
    image_prompt_records,
    vl_prompts,
    vl_run_config,
    with_qwen3_vl_processor,
    write_jsonl,
)

VL_VENV = Path(os.environ.get("SAPO_SGLANG_VL_VENV", "/opt/sapo-sglang-vl-venv"))
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)


def served_export(root: Path) -> Path:
    """What the server loads is the project's own export: the transformers-5 save (experts ``[E, 2I, H]``, which
    SGLang 0.5.23 cannot load) through ``hf-to-megatron`` and ``megatron-to-hf``, which writes the hub layout
    (``gate_up_proj [E, H, 2I]``) and copies the tokenizer and processor files. The generation tests below then
    prove that SGLang loads it and serves the source model's numbers."""
    from safetensors import safe_open

    from sapo_megatron.conversion.convert import hf_to_megatron, megatron_to_hf

    source = build_tiny_vl_checkpoint(root / "source")
    mcore = hf_to_megatron(source, root / "mcore", progress=False)
    export = megatron_to_hf(
        mcore, root / "export", hf_reference=with_qwen3_vl_processor(source), progress=False
    )
    hidden = json.loads((source / "config.json").read_text())["text_config"]["hidden_size"]
    with safe_open(str(next(export.glob("*.safetensors"))), "pt") as handle:
        fused = [n for n in handle.keys() if n.endswith("mlp.experts.gate_up_proj")]  # noqa: SIM118
        assert fused and all(handle.get_slice(n).get_shape()[1] == hidden for n in fused)  # [E, H, 2I]
    assert (export / "video_preprocessor_config.json").is_file()
    return export


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    directory = served_export(tmp_path_factory.mktemp("sglang_vl"))
    renderer, rows, spec = vl_prompts(directory)
    return directory, renderer, rows, spec


@pytest.fixture(scope="module")
def vl_url(vl, tmp_path_factory):
    log = tmp_path_factory.mktemp("sglang_vl_log") / "server.log"
    with sglang_process(vl[0], log, *real_server_flags(), venv=VL_VENV) as url:
        yield url


def test_generation_with_images_matches_transformers_and_the_cpu_engine(vl, vl_url):
    directory, renderer, rows, spec = vl
    settings = CollectSettings(
        n_samples=1,
        sampling=GREEDY,
        advantage=AdvantageConfig(),
        return_routed_experts=True,
        image_pad_id=spec.pad_id,
    )
    ids = [renderer.encode(row) for row in rows[:2]]
    images = [ImageInputs(png=tuple(i.png() for i in row.images), pad_id=spec.pad_id) for row in rows[:2]]
    with SGLangClient(
        [vl_url], api_key=API_KEY, num_layers=3, top_k=2, timeout_s=300, max_retries=0
    ) as client:
        served = generate_groups(client, rows, renderer.encode, settings, seed=0)
        served_scores = client.score(ids, 1, images=images)  # teacher scoring, image-pad targets masked
    engine = CPUEngine.from_pretrained(directory, seed=0)
    local = generate_groups(engine, rows, renderer.encode, settings, seed=0)
    local_scores = engine.score(ids, 1, images=images)
    worst_score = max(float(np.abs(np.subtract(a, b)).max()) for a, b in zip(served_scores, local_scores))
    worst_tf, worst_cpu, agree, total = 0.0, 0.0, 0, 0
    for row, (sample,), (mine,) in zip(rows, served, local):
        assert sample.prompt_ids == renderer.encode(row)  # SGLang's prompt_tokens matched the trainer's
        assert sample.response_ids == mine.response_ids  # greedy tokens identical
        worst_cpu = max(worst_cpu, float(np.abs(np.subtract(sample.rollout_logp, mine.rollout_logp)).max()))
        response = sample.response_ids
        cut = response.index(spec.pad_id) if spec.pad_id in response else len(response)
        logp, routes = reference(engine, row, sample.prompt_ids + response[:cut], spec)
        start = len(sample.prompt_ids) - 1
        worst_tf = max(worst_tf, float((torch.tensor(sample.rollout_logp[:cut]) - logp[start:]).abs().max()))
        routed = sample.routed_experts[: len(sample.prompt_ids) + cut - 1]
        for layer, top in routes.items():
            same = np.sort(top[: routed.shape[0]].numpy(), axis=-1) == np.sort(routed[:, layer, :], axis=-1)
            agree += int(same.all(axis=-1).sum())
            total += routed.shape[0]
    engine.close()
    print(
        f"SGLang VL vs transformers: max |dlogp| {worst_tf:.2e}; vs CPU engine {worst_cpu:.2e}; "
        f"routes {agree}/{total} agree; scoring vs CPU engine {worst_score:.2e}"
    )
    assert worst_tf < 1e-4 and worst_cpu < 1e-4 and worst_score < 1e-4
    assert agree == total


def test_text_with_image_data_and_expanded_ids(vl, vl_url):
    _, renderer, rows, _ = vl
    headers = {"Authorization": f"Bearer {API_KEY}"}
    images = [png_data_uri(image.png()) for image in rows[1].images]
    body = {"text": renderer.text(rows[1]), "image_data": images, "sampling_params": {"max_new_tokens": 1}}
    reply = httpx.post(f"{vl_url}/generate", json=body, headers=headers, timeout=300).json()
    assert reply["meta_info"]["prompt_tokens"] == len(renderer.encode(rows[1]))
    # already expanded ids: SGLang 0.5.23 fails them (why the client always sends one pad per image)
    expanded = {
        "input_ids": renderer.encode(rows[1]),
        "image_data": images,
        "sampling_params": {"max_new_tokens": 1},
    }
    answer = httpx.post(f"{vl_url}/generate", json=expanded, headers=headers, timeout=300)
    assert answer.status_code >= 400


def _before_pad(response: list[int], pad_id: int) -> list[int]:
    """The response up to a sampled ``<|image_pad|>`` (a forward with images would take it for an image)."""
    return response[: response.index(pad_id)] if pad_id in response else list(response)


def _trainer_model(directory: Path):
    """The Megatron VL model (the trainer's) holding the served checkpoint's weights; the config it was built
    from. Call inside ``megatron.parallel.parallel_context(cfg)``."""
    import transformers

    from sapo_megatron.checkpoint.fused_experts import unfuse
    from sapo_megatron.megatron.model import BuildOptions, build_gpt_model
    from sapo_megatron.megatron.weights import load_hf_weights

    hf = transformers.AutoModelForImageTextToText.from_pretrained(str(directory)).float()
    weights = unfuse(hf.state_dict())
    cfg = config_from_dict(
        {
            "model": {"hf_config": json.loads((directory / "config.json").read_text())},
            "launch": {"procs_per_node": 1},
        }
    )

    def build():
        module = build_gpt_model(BuildOptions(cfg.model, cfg.parallel, cfg.precision))
        load_hf_weights(module, weights.__getitem__, cfg.model.arch)
        return module.eval()

    return cfg, build


def test_a_weight_update_of_the_vision_tower_reaches_the_server(vl, vl_url, tmp_path):
    """Only the trainer's vision tower changes; the project's disk weight sync (``DiskSync``: the trainer's HF
    export, ``update_weights_from_disk``) pushes it to the running server. Image prompts' greedy log-probs then
    equal a transformers forward at the new weights and differ from the old ones; the text-only prompt's stay."""
    import sapo_megatron.megatron  # noqa: F401 - megatron-core's stand-ins before it is imported
    from sapo_megatron.data.tokenizer import load_tokenizer
    from sapo_megatron.megatron.parallel import parallel_context
    from sapo_megatron.megatron.weights import VISION_PREFIX
    from sapo_megatron.weight_sync import DiskSync

    directory, renderer, rows, spec = vl
    settings = CollectSettings(
        n_samples=1, sampling=GREEDY, advantage=AdvantageConfig(), image_pad_id=spec.pad_id
    )
    ids = [renderer.encode(row) for row in rows]
    images = [ImageInputs(png=tuple(i.png() for i in row.images), pad_id=spec.pad_id) for row in rows]
    client = SGLangClient([vl_url], api_key=API_KEY, num_layers=3, top_k=2, timeout_s=300, max_retries=0)
    cfg, build = _trainer_model(directory)
    try:
        old = generate_groups(client, rows, renderer.encode, settings, seed=0)
        # scored: each prompt with its old greedy response, up to a sampled <|image_pad|> (SGLang would take
        # it for an image placeholder), before and after the update
        scored = [i + _before_pad(s.response_ids, spec.pad_id) for i, (s,) in zip(ids, old)]
        scored_old = client.score(scored, 1, images=images)  # every target from position 1 on
        with parallel_context(cfg):
            module = build()
            generator = torch.Generator().manual_seed(11)
            with torch.no_grad():
                vision = [p for name, p in module.named_parameters() if name.startswith(VISION_PREFIX)]
                for param in vision:
                    param.add_(
                        0.2 * param.std().clamp_min(0.02) * torch.randn(param.shape, generator=generator)
                    )
            sync = DiskSync(
                client,
                cfg.model.arch,
                staging_dir=tmp_path / "sync",
                tokenizer=load_tokenizer(str(directory)),
            )
            pushed = sync.push(module)
        new = generate_groups(client, rows, renderer.encode, settings, seed=0)
        scored_new = client.score(scored, 1, images=images)
        engine = CPUEngine.from_pretrained(sync.version_dir(1), seed=0)  # transformers at the pushed weights
        worst, moved = 0.0, []
        for row, (sample,), before, after in zip(rows, new, scored_old, scored_new):
            response = sample.response_ids
            cut = len(_before_pad(response, spec.pad_id))
            logp, _ = reference(engine, row, sample.prompt_ids + response[:cut], spec)
            start = len(sample.prompt_ids) - 1
            worst = max(worst, float((torch.tensor(sample.rollout_logp[:cut]) - logp[start:]).abs().max()))
            moved.append(float(np.abs(np.subtract(after, before)).max()))
        engine.close()
    finally:
        client.update_weights_from_disk(str(directory))  # the module's other tests see the original weights
        client.close()
    print(
        f"vision-tower update via DiskSync ({len(vision)} tensors, {pushed['weight_sync/bytes']:.0f} bytes): "
        f"served vs transformers at the new weights max |dlogp| {worst:.2e}; "
        f"change of the scored log-probs per prompt (1 image, 2 images, text) {moved}"
    )
    assert len(vision) >= 10 and pushed["weight_sync/bytes"] > 0
    assert worst < 1e-4
    assert moved[0] > 1e-3 and moved[1] > 1e-3  # the image prompts see the new tower
    assert moved[2] < 1e-5  # the text-only prompt never runs the vision tower (batching noise only)


def test_opd_teacher_scoring_with_images_on_real_sglang(vl, vl_url):
    """OPD's teacher scoring (``TeacherScoring`` with the image-pad id, as the RL step builds it) with the real
    SGLang VL server as the teacher: the response tokens of image prompts get transformers' log-probs with the
    images, and the CPU engine's as teacher; a sampled ``<|image_pad|>`` ends what is scored."""
    from tests.distill.test_teachers import vl_teacher_logp

    directory, renderer, rows, spec = vl
    with SGLangClient(
        [vl_url], api_key=API_KEY, num_layers=3, top_k=2, timeout_s=300, max_retries=0
    ) as client:
        served, metrics, references = vl_teacher_logp(client, directory, renderer, rows, spec)
    engine = CPUEngine.from_pretrained(directory, seed=0)
    local, _, _ = vl_teacher_logp(engine, directory, renderer, rows, spec)
    engine.close()
    pairs = list(zip(served, references, local))
    worst_tf = max(abs(a - b) for s, ref, _ in pairs for a, b in zip(s.teacher_logp, ref))
    worst_cpu = max(abs(a - b) for s, _, c in pairs for a, b in zip(s.teacher_logp, c.teacher_logp))
    print(
        f"real SGLang VL teacher: vs transformers {worst_tf:.2e}, vs the CPU engine as teacher {worst_cpu:.2e}"
    )
    assert worst_tf < 1e-4 and worst_cpu < 1e-4
    assert metrics["teacher/errors"] == 0 and metrics["teacher/unscored_tokens"] >= 2


def test_three_rl_steps_with_r3_on_real_sglang_with_images(vl, vl_url, tmp_path, monkeypatch):
    """``sapo-megatron train`` on the tiny VL-MoE with rollouts from the real SGLang VL server: R3 replays the
    server's routes (prompt + response - 1 rows, image tokens included), weights (vision tower included) go to
    the server over ``update_weights_from_distributed`` after every step, and the trainer's log-probs equal the
    served ones. The same server scores every step's samples as an OPD teacher (``fusion: rl`` measures only):
    it holds the policy that sampled them, so the reverse KL is the trainer/engine mismatch, not a teacher gap."""
    import yaml

    from tests.rl.test_trainer import metrics, train

    directory = vl[0]
    train_file = write_jsonl(tmp_path / "train.jsonl", image_prompt_records())
    # a reward the random policy's samples differ in (exact_match is 0 for all: no gradient, no update to sync)
    (tmp_path / "reward.py").write_text(
        "def spread(response, label):\n    return float(sum(map(ord, response)) % 7)\n"
    )
    monkeypatch.setenv("SAPO_TEST_SGLANG_KEY", API_KEY)
    cfg = vl_run_config(directory, train_file, tmp_path / "run", teachers=[served_teacher(vl_url)])
    cfg["trainer"].update(steps=3, prompts_per_step=2, mini_batches=1, save_every=0)
    cfg["optimizer"]["lr"] = 1e-3  # steps that move the weights (vision tower included) well past fp32 noise
    cfg["rollout"].update(
        n_samples=2,
        max_new_tokens=4,
        temperature=1.0,
        engine="sglang",
        urls=[vl_url],
        weight_sync="distributed",
        api_key_env="SAPO_TEST_SGLANG_KEY",
        routed_experts=True,
    )
    cfg["algorithm"].update(reward=f"{tmp_path}/reward.py:spread", routing_replay="r3", fusion={"mode": "rl"})
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg))
    try:
        train(config)
        final = _served_vs_final_weights(vl, vl_url, tmp_path / "run" / "hf")
    finally:
        restore_weights(vl_url, directory)
    rl = metrics(tmp_path / "run", "rl")
    assert [row["step"] for row in rl] == [1, 2, 3]
    deltas = [row["mismatch/abs_delta_mean"] for row in rl]
    kl = [row["opd/reverse_kl"] for row in rl]
    print(f"VL RL on real SGLang, R3: mismatch/abs_delta_mean per step {deltas}; teacher reverse KL {kl}")
    assert all(delta < 1e-5 for delta in deltas), deltas
    assert all(row["grad_norm"] > 0 for row in rl[:2])  # steps 2 and 3 sample from updated, synced weights
    assert all(row["routing/agreement_used"] == 1.0 for row in rl)
    assert all(
        row["routing/agreement_used_image"] == 1.0 for row in rl
    )  # the server's routes of the image pads
    assert all(row["weight_sync/bytes"] > 0 for row in rl)
    assert all(abs(k) < 1e-5 and row["teacher/errors"] == 0 for k, row in zip(kl, rl))
    # after the last sync the server holds the trained weights, the vision tower's included
    print(
        f"after the run: served vs the trained export {final[0]:.2e}, vs it with the initial tower {final[1]:.2e}"
    )
    assert final[0] < 1e-4 and final[1] > 1e-3


def test_opd_run_with_the_real_sglang_vl_server_as_teacher(vl, vl_url, tmp_path, monkeypatch):
    """``sapo-megatron train`` with ``fusion: opd`` on image prompts: the student samples with the in-process CPU
    engine, the real SGLang VL server is the teacher and serves the initial weights (the module's other tests put
    them back when they end; this run never syncs to it). At step 1 the teacher scores the samples as the policy
    that drew them did, so the reverse KL is ~0, which it is only when the server gets each prompt's images
    (without them its log-probs are of other inputs); after an update the student has moved away from it and the
    OPD advantage is the gap. The same run with a CPU teacher: tests/distill/test_loop.py."""
    import time

    import yaml

    from tests.rl.test_trainer import metrics, train

    directory = vl[0]
    monkeypatch.setenv("SAPO_TEST_SGLANG_KEY", API_KEY)
    train_file = write_jsonl(tmp_path / "train.jsonl", image_prompt_records())
    cfg = vl_run_config(directory, train_file, tmp_path / "run", teachers=[served_teacher(vl_url)])
    cfg["optimizer"]["lr"] = 1e-2
    cfg["trainer"].update(steps=2, prompts_per_step=4, mini_batches=1, save_every=0, export_hf=False)
    cfg["rollout"].update(engine="cpu", n_samples=2, max_new_tokens=4, temperature=1.0)
    cfg["algorithm"].update(reward="exact_match", fusion={"mode": "opd"})
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg))
    start = time.monotonic()
    train(config)
    wall = time.monotonic() - start
    rl = metrics(tmp_path / "run", "rl")
    kl = [row["opd/reverse_kl"] for row in rl]
    adv = [row["opd/adv_abs_mean"] for row in rl]
    print(
        f"OPD with the real SGLang VL server as teacher: reverse KL per step {kl}, |A_opd| mean {adv}, "
        f"train {wall:.1f} s"
    )
    assert [row["step"] for row in rl] == [1, 2]
    assert [row["teacher/sequences"] for row in rl] == [8.0, 8.0]
    assert all(row["teacher/errors"] == 0 for row in rl)
    assert abs(kl[0]) < 1e-5 and adv[0] < 1e-5  # teacher = the sampling policy, images included
    assert kl[1] > 1e-4 and adv[1] > 1e-4  # the update moved the student; the teacher stayed


def _served_vs_final_weights(vl, url: str, trained: Path) -> tuple[float, float]:
    """Image prompts scored by the server against the CPU engine at the run's exported (trained) weights, and at
    those weights with the initial vision tower put back: max |dlogp| each. The first gap is small and the second
    large only if the server's vision tower is the trained one."""
    from safetensors.torch import load_file, save_file

    directory, renderer, rows, spec = vl
    old_tower = trained.parent / "hf_initial_tower"
    shutil.copytree(trained, old_tower)
    (shard,) = trained.glob("*.safetensors")
    tuned, initial = load_file(str(shard)), load_file(str(next(directory.glob("*.safetensors"))))
    moved = [n for n in tuned if n.startswith("model.visual.") and not torch.equal(tuned[n], initial[n])]
    assert len(moved) >= 10  # training changed the tower
    save_file(
        {**tuned, **{n: initial[n] for n in moved}}, str(old_tower / shard.name), metadata={"format": "pt"}
    )
    ids = [renderer.encode(row) for row in rows[:2]]
    images = [ImageInputs(png=tuple(i.png() for i in row.images), pad_id=spec.pad_id) for row in rows[:2]]
    with SGLangClient([url], api_key=API_KEY, timeout_s=300, max_retries=0) as client:
        served = client.score(ids, 1, images=images)
    gaps = []
    for path in (trained, old_tower):
        engine = CPUEngine.from_pretrained(path, seed=0)
        local = engine.score(ids, 1, images=images)
        engine.close()
        gaps.append(max(float(np.abs(np.subtract(a, b)).max()) for a, b in zip(served, local)))
    return gaps[0], gaps[1]


def served_teacher(url: str) -> dict[str, Any]:
    """The VL server as a teacher of the run (its key from the environment the tests set)."""
    return {"name": "served", "engine": "sglang", "urls": [url], "api_key_env": "SAPO_TEST_SGLANG_KEY"}
