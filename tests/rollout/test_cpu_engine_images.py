"""The CPU engine with images (a tiny Qwen3-VL-MoE of transformers): the trainer's expanded prompt equals the
engine's, output log-probs equal a full transformers forward over prompt + response (the trainer's view), routed
experts cover the image tokens and agree with that forward's routers, a left-padded mixed batch equals each row
alone, a mismatch stops naming the group, and samples.jsonl names the images."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from sapo_megatron.algo import AdvantageConfig
from sapo_megatron.data.samples import SampleLog
from sapo_megatron.data.vision import pixel_inputs
from sapo_megatron.rollout.base import RolloutError
from sapo_megatron.rollout.collect import CollectSettings, RolloutBatch, generate_groups
from sapo_megatron.rollout.cpu.engine import CPUEngine
from sapo_megatron.rollout.types import GenerationRequest, ImageInputs, SamplingParams
from tests.vl_fixtures import build_tiny_vl_checkpoint, vl_prompts

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """The checkpoint, its engine, renderer and three prompts: one image, two images of other sizes, text only."""
    directory = build_tiny_vl_checkpoint(tmp_path_factory.mktemp("vl"))
    renderer, rows, spec = vl_prompts(directory)
    engine = CPUEngine.from_pretrained(directory, seed=0)
    yield directory, engine, renderer, rows, spec
    engine.close()


def settings(spec, **kwargs) -> CollectSettings:
    return CollectSettings(
        n_samples=1, sampling=GREEDY, advantage=AdvantageConfig(), image_pad_id=spec.pad_id, **kwargs
    )


def reference(engine: CPUEngine, row, ids: list[int], spec) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Log-probs of ``ids[1:]`` and each MoE layer's router top-k from one transformers forward over the whole
    sequence, no cache, no padding (what the trainer computes)."""
    model = engine.model
    kwargs = {}
    if row.images:
        kwargs = pixel_inputs(engine._vision.processor, [image.load() for image in row.images])
    input_ids = torch.tensor([ids])
    routes: dict[int, torch.Tensor] = {}
    hooks = [
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out, k=k: routes.__setitem__(k, out[-1]))
        for k, layer in enumerate(model.get_decoder().layers)
    ]
    try:
        with torch.no_grad():
            logits = model(
                input_ids=input_ids, mm_token_type_ids=(input_ids == spec.pad_id).long(), **kwargs
            ).logits[0]
    finally:
        for hook in hooks:
            hook.remove()
    logp = torch.log_softmax(logits.float(), -1)[:-1].gather(1, input_ids[0, 1:, None]).squeeze(1)
    return logp, routes


def test_generation_with_images_matches_a_full_forward(vl):
    _, engine, renderer, rows, spec = vl
    groups = generate_groups(
        engine, rows[:2], renderer.encode, settings(spec, return_routed_experts=True), seed=3
    )
    worst, agree, total = 0.0, 0, 0
    for row, (sample,) in zip(rows[:2], groups):
        assert sample.prompt_ids == renderer.encode(row)  # the trainer's ids, image pads expanded
        assert sum(t == spec.pad_id for t in sample.prompt_ids) == sum(
            spec.tokens_for(image.size) for image in row.images
        )
        routed = sample.routed_experts  # [prompt + response - 1, layers, top_k], image tokens included
        assert routed.shape == (len(sample.token_ids) - 1, 3, 2)
        # A random model may sample <|image_pad|> itself; transformers' forward would take it for an image
        # position, so the reference stops before such a token (the engine's decoding never looks at it).
        response = sample.response_ids
        cut = response.index(spec.pad_id) if spec.pad_id in response else len(response)
        assert cut >= 2
        logp, routes = reference(engine, row, sample.prompt_ids + response[:cut], spec)
        start = len(sample.prompt_ids) - 1
        engine_logp = torch.tensor(sample.rollout_logp[:cut])
        worst = max(worst, float((engine_logp - logp[start:]).abs().max()))
        routed = routed[: len(sample.prompt_ids) + cut - 1]
        for layer, top in routes.items():
            expected = np.sort(top[: routed.shape[0]].numpy(), axis=-1)
            got = np.sort(routed[:, layer, :], axis=-1)
            agree += int((expected == got).all(axis=-1).sum())
            total += routed.shape[0]
    print(f"CPU engine vs full forward with images: max |dlogp| {worst:.2e}, routes {agree}/{total} agree")
    assert worst < 1e-4
    assert agree == total


def request(renderer, spec, row, index: int, sampling: SamplingParams) -> GenerationRequest:
    images = None
    if row.images:
        images = ImageInputs(png=tuple(image.png() for image in row.images), pad_id=spec.pad_id)
    return GenerationRequest(
        prompt_ids=renderer.encode(row), n=2, sampling=sampling, group_id=index, images=images
    )


def test_left_padded_mixed_batch_equals_each_row_alone(vl):
    _, engine, renderer, rows, spec = vl
    sampled = SamplingParams(max_new_tokens=5, temperature=1.0, seed=11)
    together = engine.generate([request(renderer, spec, row, i, sampled) for i, row in enumerate(rows)])
    for index, row in enumerate(rows):
        alone = engine.generate([request(renderer, spec, row, index, sampled)])[0]
        for a, b in zip(alone, together[index]):
            assert a.response_ids == b.response_ids
            assert np.allclose(a.rollout_logp, b.rollout_logp, atol=1e-5)


def test_teacher_scoring_with_images_masks_image_pad_targets(vl):
    _, engine, renderer, rows, spec = vl
    requests = [request(renderer, spec, row, i, GREEDY) for i, row in enumerate(rows[:2])]
    ids = [list(r.prompt_ids) for r in requests]
    scored = engine.score(ids, 1, images=[r.images for r in requests])
    for row, sequence, values in zip(rows, ids, scored):
        logp, _ = reference(engine, row, sequence, spec)
        targets = torch.tensor(sequence[1:])
        pads = targets == spec.pad_id
        assert int(pads.sum()) == sum(spec.tokens_for(image.size) for image in row.images)
        values = torch.tensor(values)
        assert torch.all(values[pads] == 0.0)  # masked: no loss on image tokens, SGLang reports a placeholder
        assert torch.allclose(values[~pads], logp[~pads], atol=1e-5)


def test_a_prompt_the_engine_expands_differently_stops_naming_the_group(vl):
    _, engine, renderer, rows, spec = vl
    ids = renderer.encode(rows[0])
    short = [
        t for i, t in enumerate(ids) if not (t == spec.pad_id and i == ids.index(spec.pad_id))
    ]  # one pad fewer
    request = GenerationRequest(
        prompt_ids=short,
        n=1,
        sampling=GREEDY,
        group_id=7,
        images=ImageInputs(png=(rows[0].images[0].png(),), pad_id=spec.pad_id),
    )
    with pytest.raises(
        RolloutError, match=r"group 7: the engine's prompt has \d+ tokens after expanding its images"
    ):
        engine.generate([request])
    two_images = ImageInputs(png=(rows[0].images[0].png(),) * 2, pad_id=spec.pad_id)
    with pytest.raises(
        RolloutError, match="group 7: input_ids and image_data do not match: 1 image-pad tokens for 2"
    ):
        engine.generate(
            [GenerationRequest(prompt_ids=ids, n=1, sampling=GREEDY, group_id=7, images=two_images)]
        )


def test_samples_file_names_the_images(vl, tmp_path):
    _, engine, renderer, rows, spec = vl
    groups = generate_groups(engine, rows[1:2], renderer.encode, settings(spec), seed=0)
    batch = RolloutBatch(
        prompts=rows[1:2], groups=groups, rewards=torch.zeros(1, 1), advantages=torch.zeros(1, 1)
    )
    written = SampleLog(tmp_path, every=1, tokenizer=renderer.tokenizer, enabled=True).record(1, batch)
    digests = [image.digest for image in rows[1].images]
    assert written[0]["images"] == [f"bytes:{d}" for d in digests]
    # 48 wide x 32 high: 6 x 4 patches of 8 pixels, 6 tokens after the 2 x 2 merge; 16 x 64: 2 x 8 patches, 4
    assert written[0]["prompt"].count("<|image_pad|>") == 6 + 4


def test_sglang_client_sends_one_pad_per_image_and_png_data_uris(vl):
    import base64

    from sapo_megatron.rollout.sglang.generation import wire_prompt

    _, _, renderer, rows, spec = vl
    req = request(renderer, spec, rows[1], 0, GREEDY)
    ids, image_data = wire_prompt(req)
    assert ids == renderer.encode_text(renderer.text(rows[1]))  # unexpanded: what SGLang 0.5.23 takes
    assert sum(t == spec.pad_id for t in ids) == 2
    assert [base64.b64decode(uri.split(",", 1)[1]) for uri in image_data] == list(req.images.png)
    assert all(uri.startswith("data:image/png;base64,") for uri in image_data)
    assert wire_prompt(request(renderer, spec, rows[2], 0, GREEDY)) == (renderer.encode(rows[2]), None)


@pytest.mark.slow  # starts a server
def test_cpu_server_serves_images_through_the_sglang_client(vl):
    import httpx

    from sapo_megatron.rollout.cpu.server import CPUServer
    from sapo_megatron.rollout.sglang.client import SGLangClient

    directory, engine, renderer, rows, spec = vl
    requests = [
        dataclasses.replace(request(renderer, spec, row, i, GREEDY), n=1, return_routed_experts=True)
        for i, row in enumerate(rows)
    ]
    local = engine.generate(requests)
    with (
        CPUServer(CPUEngine.from_pretrained(directory, seed=0), tokenizer=renderer.tokenizer) as server,
        SGLangClient(server.url, num_layers=3, top_k=2, max_retries=0, timeout_s=120) as client,
    ):
        remote = client.generate(requests)
        for (a,), (b,) in zip(local, remote):
            assert a.response_ids == b.response_ids and a.prompt_ids == b.prompt_ids
            assert np.allclose(a.rollout_logp, b.rollout_logp, atol=1e-6)
            assert np.array_equal(a.routed_experts, b.routed_experts)
        ids = [list(r.prompt_ids) for r in requests]
        images = [r.images for r in requests]
        assert np.allclose(
            np.concatenate(client.score(ids, 1, images=images)),
            np.concatenate(engine.score(ids, 1, images=images)),
            atol=1e-6,
        )
        # text + image_data, as SGLang takes it too: the reported prompt is the expanded one
        uris = [
            f"data:image/png;base64,{__import__('base64').b64encode(p).decode()}"
            for p in requests[0].images.png
        ]
        body = {"text": renderer.text(rows[0]), "image_data": uris, "sampling_params": {"max_new_tokens": 2}}
        reply = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
        assert reply["meta_info"]["prompt_tokens"] == len(renderer.encode(rows[0]))
        for bad, message in (
            ("/etc/passwd", "no paths, no URLs"),
            ("data:image/png;base64,%%", "invalid base64"),
        ):
            answer = httpx.post(f"{server.url}/generate", json={**body, "image_data": [bad]}, timeout=60)
            assert answer.status_code == 400 and message in answer.text
        # the trainer counted other pads than the server's processor: the client stops, naming the request
        ids = renderer.encode(rows[0])
        short = ids[: ids.index(spec.pad_id)] + ids[ids.index(spec.pad_id) + 1 :]
        wrong = dataclasses.replace(requests[0], prompt_ids=short, group_id=5)
        with pytest.raises(
            RolloutError, match=r"prompt_tokens is \d+, expected \d+ \(the trainer's prompt with its images"
        ):
            client.generate([wrong])


@pytest.mark.slow  # two server processes and the real sglang-router
def test_images_through_the_real_router(vl, tmp_path):
    from sapo_megatron.rollout.sglang.client import SGLangClient
    from tests.servers import cpu_server, router

    directory, engine, renderer, rows, spec = vl
    requests = [
        dataclasses.replace(request(renderer, spec, row, i, GREEDY), n=1)  # the router drops routed experts
        for i, row in enumerate(rows)
    ]
    local = engine.generate(requests)
    with (
        cpu_server(directory, tmp_path / "w1.log") as w1,
        cpu_server(directory, tmp_path / "w2.log") as w2,
        router([w1, w2], tmp_path / "router.log") as url,
        SGLangClient([w1, w2], router_url=url, num_layers=3, top_k=2, max_retries=0, timeout_s=120) as client,
    ):
        assert client.router_url == url  # /generate goes through the router
        routed = client.generate(requests)
    for (a,), (b,) in zip(local, routed):
        assert a.response_ids == b.response_ids and a.prompt_ids == b.prompt_ids
        assert np.allclose(a.rollout_logp, b.rollout_logp, atol=1e-6)


def test_vl_rows_join_the_running_batch_of_the_server_as_they_run_alone(vl):
    """Continuous batching (the CPU server's batcher) with images: rows that join a running VL batch (two images,
    text only) sample the tokens and log-probs they sample alone."""
    from sapo_megatron.rollout.cpu.continuous import ContinuousBatcher
    from sapo_megatron.rollout.cpu.decode import RowSpec

    _, engine, renderer, rows, _ = vl
    finished: list[int] = []

    def spec_of(row, tokens: int, seed: int) -> RowSpec:
        images = tuple(image.png() for image in row.images) if row.images else ()
        out = RowSpec(
            prompt_ids=renderer.encode(row),
            sampling=SamplingParams(max_new_tokens=tokens, temperature=1.0),
            seed=seed,
            images=images,
        )
        if images:
            engine.prepare_images(out)
        return out

    def run(joined: bool) -> list:
        batcher = ContinuousBatcher(engine, engine.max_batch_size)
        futures: list = []
        calls = [0]

        def hook(*_: object) -> None:
            calls[0] += 1
            if joined and calls[0] == 3:  # while the first row decodes
                futures.extend(batcher.submit([spec_of(row, 4, 20 + i)]) for i, row in enumerate(rows[1:]))
                for i, future in enumerate(futures):
                    future.add_done_callback(lambda _, i=i: finished.append(i + 1))

        handle = engine.model.register_forward_pre_hook(hook)
        try:
            first_future = batcher.submit([spec_of(rows[0], 12, 7)])
            first_future.add_done_callback(lambda _: finished.append(0))
            first = first_future.result(60)
            if not joined:
                futures.extend(batcher.submit([spec_of(row, 4, 20 + i)]) for i, row in enumerate(rows[1:]))
            return [first[0]] + [f.result(60)[0] for f in futures]
        finally:
            handle.remove()
            batcher.stop()

    together = run(joined=True)
    assert finished == [1, 2, 0]  # the joined rows were answered while the first one ran
    alone = run(joined=False)
    assert [len(r.output_ids) for r in together] == [12, 4, 4]
    for got, want in zip(together, alone):
        assert got.output_ids == want.output_ids
        np.testing.assert_allclose(got.output_logprobs, want.output_logprobs, atol=1e-4)
