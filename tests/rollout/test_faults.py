"""Failover, exactly-once delivery and refusal of bad replies."""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from sapo_megatron.rollout.base import RolloutError
from sapo_megatron.rollout.cpu.server import CPUServer
from sapo_megatron.rollout.sglang.client import SGLangClient
from sapo_megatron.rollout.sglang.topology import resolve_topology
from sapo_megatron.rollout.types import GenerationRequest, SamplingParams
from tests.rollout.conftest import engine_from

DEAD_URL = "http://127.0.0.1:9"  # discard port: nothing listens, connections are refused


def fast_client(urls, **kwargs) -> SGLangClient:
    settings = {
        "num_layers": 2,
        "max_concurrency": 8,
        "timeout_s": 30,
        "backoff_s": 0.01,
        "max_backoff_s": 0.05,
    }
    return SGLangClient(urls, **(settings | kwargs))


def rollout(groups: int = 6, n: int = 4, **sampling) -> list[GenerationRequest]:
    params = SamplingParams(max_new_tokens=6, seed=7, **sampling)
    return [
        GenerationRequest(prompt_ids=[1 + g, 2 + g, 3 + g], n=n, sampling=params, group_id=100 + g)
        for g in range(groups)
    ]


def as_table(groups):
    return [[(s.group_id, s.sample_index, tuple(s.response_ids)) for s in g] for g in groups]


def all_logprobs(groups):
    return np.array([s.rollout_logp for g in groups for s in g])


def _crash_on_second_answer(server: CPUServer, static: bool, calls: dict[str, int]) -> None:
    """Stop ``server`` right after it computed its second batch (static) or finished rows for the second time
    (continuous), before answering them: the server dies in flight."""

    def crash() -> None:
        calls["b"] += 1
        if calls["b"] == 2:  # computed but never answered
            server.stopped = True  # at once, so that no handler of this batch replies
            threading.Thread(target=server.stop).start()  # then close the port

    if static:
        generate_rows = server.engine.generate_rows

        def crash_on_second_batch(rows):
            result = generate_rows(rows)
            crash()
            return result

        server.engine.generate_rows = crash_on_second_batch
        return
    answer = server.batcher._answer_finished

    def crash_on_second_answer(run):
        if any(r.done for r in run.rows):
            crash()
        return answer(run)

    server.batcher._answer_finished = crash_on_second_answer


@pytest.mark.parametrize("static", [False, True], ids=["continuous", "static"])
def test_server_stopped_mid_rollout_loses_and_duplicates_nothing(moe_dir, static):
    server_a = CPUServer(engine_from(moe_dir)).start()
    server_b = CPUServer(engine_from(moe_dir), static_batches=static).start()
    calls = {"b": 0}
    _crash_on_second_answer(server_b, static, calls)
    try:
        with fast_client([server_a.url, server_b.url], max_concurrency=4) as client:
            groups = client.generate(rollout())
            metrics = client.metrics()
        assert calls["b"] >= 2 and server_b.stopped
        assert metrics["rollout/retries"] >= 1 and metrics["rollout/failovers"] >= 1
        assert [[(s.group_id, s.sample_index) for s in g] for g in groups] == [
            [(100 + g, i) for i in range(4)] for g in range(6)
        ]
        # Seeded sampling: the result equals a rollout on one healthy server, sample for sample (logprobs up to
        # the fp32 noise of a different batch composition).
        with fast_client(server_a.url) as healthy:
            expected = healthy.generate(rollout())
        assert as_table(groups) == as_table(expected)
        np.testing.assert_allclose(all_logprobs(groups), all_logprobs(expected), atol=1e-4)
    finally:
        server_a.stop()
        server_b.stop()


def test_unreachable_server_is_skipped_and_left_out_after_weight_sync(moe_dir, moe_dir_b):
    with (
        CPUServer(engine_from(moe_dir)) as server,
        fast_client([DEAD_URL, server.url]) as client,
    ):
        first = client.generate(rollout(groups=2, n=2))
        assert sum(len(g) for g in first) == 4 and client.metrics()["rollout/failovers"] >= 1
        client.update_weights_from_disk(str(moe_dir_b))
        assert client.metrics()["rollout/stale_servers"] == 1
        retries = client.metrics()["rollout/retries"]
        client.generate(rollout(groups=2, n=2))
        assert client.metrics()["rollout/retries"] == retries  # the stale server is no longer tried


def test_all_servers_down_is_an_error_naming_the_request():
    with fast_client([DEAD_URL], max_retries=2) as client, pytest.raises(RolloutError) as err:
        client.generate(rollout(groups=1, n=1))
    message = str(err.value)
    assert "3 attempts" in message and "server=http://127.0.0.1:9" in message and "-g100-s0" in message
    assert "field=transport" in message


class FakeSGLang(BaseHTTPRequestHandler):
    """Answers /generate according to ``server.mode``; records every request body."""

    protocol_version = "HTTP/1.0"

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.server.auth.append((self.path, self.headers.get("Authorization")))
        if self.path == "/get_server_info":
            return self._json(200, {"tp_size": 4, "dp_size": 1, **self.server.server_info})
        self._send(200, b"")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"] or 0)) or b"{}")
        self.server.bodies.append((self.path, body))
        self.server.auth.append((self.path, self.headers.get("Authorization")))
        if self.path != "/generate":
            return self._json(200, {"success": self.server.mode != "refuse", "message": "fake"})
        mode = self.server.mode
        if mode == "bad_json":
            return self._send(200, b'{"text": "unterminated')
        if mode == "http_400":
            return self._json(400, {"error": {"message": "prompt is too long"}})
        if mode == "http_503":
            return self._json(503, {"error": {"message": "overloaded"}})
        prompt = body["input_ids"]
        out = [5, 6]
        meta = {
            "id": body["rid"],
            "finish_reason": {"type": "abort", "message": "x"}
            if mode == "abort"
            else {"type": "length", "length": 2},
            "prompt_tokens": len(prompt),
            "completion_tokens": 2,
            "output_token_logprobs": [[-0.5, 5, None], [-0.25, 6, None]],
        }
        rows = len(prompt) + len(out) - 1
        meta["routed_experts"] = base64.b64encode(np.zeros((rows, 2, 2), "<i4").tobytes()).decode()
        if mode == "short_logprobs":
            meta["output_token_logprobs"] = meta["output_token_logprobs"][:1]
        elif mode == "wrong_token":
            meta["output_token_logprobs"][1][1] = 7
        elif mode == "routed_size":
            meta["routed_experts"] = base64.b64encode(np.zeros((rows - 1, 2, 2), "<i4").tobytes()).decode()
        elif mode == "routed_b64":
            meta["routed_experts"] = "***not base64***"
        elif mode == "routed_missing":
            del meta["routed_experts"]
        elif mode == "no_meta":
            meta = None
        elif mode == "nan_logprob":
            meta["output_token_logprobs"][0][0] = float("nan")
        reply = {"text": "", "output_ids": out}
        if meta is not None:
            reply["meta_info"] = meta
        self._json(200, reply)

    def _json(self, status, payload):
        self._send(status, json.dumps(payload).encode())

    def _send(self, status, data):
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def fake():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeSGLang)
    httpd.daemon_threads = True
    httpd.mode, httpd.bodies, httpd.auth, httpd.server_info = "ok", [], [], {}
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def routed_request():
    return [
        GenerationRequest(
            prompt_ids=[1, 2, 3],
            n=1,
            sampling=SamplingParams(max_new_tokens=4),
            return_routed_experts=True,
            group_id=5,
        )
    ]


def test_fake_server_ok_and_the_request_body(fake):
    with fast_client(fake.url, top_k=2) as client:
        sample = client.generate(routed_request())[0][0]
    assert (
        sample.response_ids == [5, 6]
        and sample.rollout_logp == [-0.5, -0.25]
        and sample.routed_experts.shape == (4, 2, 2)
    )
    path, body = fake.bodies[0]
    assert path == "/generate"
    assert (
        body["input_ids"] == [1, 2, 3] and body["return_logprob"] is True and body["logprob_start_len"] == -1
    )
    assert body["return_routed_experts"] is True and body["rid"].endswith("-g5-s0-a0")
    assert body["sampling_params"] == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "max_new_tokens": 4,
        "stop_token_ids": [],
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }


@pytest.mark.parametrize(
    ("mode", "field", "words"),
    [
        ("bad_json", "<body>", "not valid JSON"),
        ("short_logprobs", "meta_info.output_token_logprobs", "1 entries for 2 output tokens"),
        ("wrong_token", "meta_info.output_token_logprobs[1]", "is for token 7"),
        ("nan_logprob", "meta_info.output_token_logprobs[0]", "logprob nan"),
        ("routed_size", "meta_info.routed_experts", "expected 16"),
        ("routed_b64", "meta_info.routed_experts", "not valid base64"),
        ("routed_missing", "meta_info.routed_experts", "--enable-return-routed-experts"),
        ("no_meta", "meta_info", "is missing"),
        ("http_400", "<status>", "prompt is too long"),
    ],
)
def test_bad_replies_raise_rollout_error_naming_the_problem(fake, mode, field, words):
    fake.mode = mode
    with fast_client(fake.url, top_k=2) as client, pytest.raises(RolloutError) as err:
        client.generate(routed_request())
    assert (
        err.value.field == field and err.value.server == fake.url and err.value.request.endswith("-g5-s0-a0")
    )
    assert words in str(err.value) and f"field={field}" in str(err.value)
    assert len(fake.bodies) == 1  # a bad reply is a misconfiguration: not retried


def test_transient_errors_and_aborts_are_retried(fake):
    fake.mode = "http_503"
    with fast_client(fake.url, max_retries=2) as client, pytest.raises(RolloutError, match="HTTP 503"):
        client.generate(routed_request())
    assert len(fake.bodies) == 3
    fake.mode, fake.bodies[:] = "abort", []
    with fast_client(fake.url, max_retries=1) as client:
        sample = client.generate(routed_request())[0][0]
        assert sample.finish_reason == "abort" and client.metrics()["rollout/aborted_samples"] == 1
    assert len(fake.bodies) == 2


def test_weight_sync_payloads(fake):
    def serializer(named):
        buffer = io.BytesIO()
        torch.save(named, buffer)
        return base64.b64encode(buffer.getvalue()).decode()

    with fast_client([fake.url], serializer=serializer, tp_size=2) as client:
        client.update_weights_from_disk("/ckpt/step_3")
        client.update_weights_from_tensors([("model.norm.weight", torch.ones(4))])  # one bucket ...
        client.finish_weight_update()  # ... then the update is complete: flush once
        assert client.weight_group_layout() == (3, [1])  # trainer rank 0, the worker's 2 TP ranks 1..2
        client.init_weights_update_group("10.0.0.1", 29500, world_size=3, rank_offsets=[1]).result(timeout=10)
        client.update_weights_from_distributed(["w"], ["bfloat16"], [[2, 3]]).result(timeout=10)
        client.finish_weight_update(flush_cache=False)
        fake.mode = "refuse"
        with pytest.raises(RolloutError, match="update_weights_from_disk failed: fake"):
            client.update_weights_from_disk("/ckpt/bad")
    paths = [p for p, _ in fake.bodies]
    # tensor and distributed updates run inside SGLang's weight-update session (begin/end, SGLang 0.5.23)
    assert paths == [
        "/update_weights_from_disk",
        "/flush_cache",
        "/begin_weight_update",
        "/update_weights_from_tensor",
        "/end_weight_update",
        "/flush_cache",
        "/init_weights_update_group",
        "/begin_weight_update",
        "/update_weights_from_distributed",
        "/end_weight_update",
        "/update_weights_from_disk",
    ]
    bodies = [b for p, b in fake.bodies if p not in ("/begin_weight_update", "/end_weight_update")]
    # the fleet's next version; the flush comes after every worker's update (/flush_cache above)
    assert bodies[0] == {"model_path": "/ckpt/step_3", "weight_version": "1", "flush_cache": False}
    tensors = bodies[2]["serialized_named_tensors"]
    assert len(tensors) == 2 and bodies[2]["flush_cache"] is False  # flushed once, after the last bucket
    assert bodies[2]["weight_version"] == "2"
    name, tensor = torch.load(io.BytesIO(base64.b64decode(tensors[0])))[0]
    assert name == "model.norm.weight" and torch.equal(tensor, torch.ones(4))
    assert bodies[4] == {
        "master_address": "10.0.0.1",
        "master_port": 29500,
        "rank_offset": 1,
        "world_size": 3,
        "group_name": "weight_update_group",
        "backend": "nccl",
    }
    assert bodies[5] == {
        "names": ["w"],
        "dtypes": ["bfloat16"],
        "shapes": [[2, 3]],
        "group_name": "weight_update_group",
        "flush_cache": False,
        "weight_version": "3",  # the third update: SGLang labels each token's forward with it
    }


def test_tensor_sync_sends_cpu_tensors_as_shared_memory_files(fake):
    """Our serializer with named shared-memory files: a separate server can open them (SGLang's default
    file-descriptor handles kill a real SGLang scheduler that is not the sender's child)."""
    import base64

    with fast_client(fake.url) as client:
        client.update_weights_from_tensors([("w", torch.ones(1))])
    [body] = [b for p, b in fake.bodies if p == "/update_weights_from_tensor"]
    pickled = base64.b64decode(body["serialized_named_tensors"][0], validate=True)
    assert b"rebuild_storage_filename" in pickled and b"rebuild_storage_fd" not in pickled
    assert torch.multiprocessing.get_sharing_strategy() == "file_descriptor"  # the process's own is kept


@pytest.mark.skipif(
    importlib.util.find_spec("sglang") is not None, reason="checks the message shown where sglang is missing"
)
def test_tensor_sync_of_cuda_tensors_without_sglang_says_what_is_needed(fake):
    # a tensor on any device but the CPU goes through SGLang's serializer, which needs the GPU extra
    with fast_client(fake.url) as client, pytest.raises(RolloutError, match=r"sapo-megatron\[gpu\]"):
        client.update_weights_from_tensors([("w", torch.empty(1, device="meta"))])


def test_topology_reads_each_workers_tp_size_and_sends_the_api_key(fake):
    topology = resolve_topology(urls=[fake.url], api_key="s3cret", timeout_s=10, log=lambda _: None)
    assert topology.tp_sizes == (4,)  # from /get_server_info, as SGLang reports its server args
    assert ("/get_server_info", "Bearer s3cret") in fake.auth
    with fast_client([fake.url], api_key="s3cret", tp_size=topology.tp_sizes) as client:
        client.generate(rollout(groups=1, n=1))
        assert client.weight_group_layout() == (
            5,
            [1],
        )  # one worker with 4 TP ranks after the trainer's rank 0
    assert fake.auth[-1] == ("/generate", "Bearer s3cret")


def test_disk_sync_paths_are_absolute(fake, tmp_path, monkeypatch):
    from sapo_megatron.model.tiny import tiny_hf_config
    from sapo_megatron.weight_sync import DiskSync

    monkeypatch.chdir(tmp_path)
    with fast_client([fake.url]) as client:
        with pytest.raises(ValueError, match="absolute path"):
            client.update_weights_from_disk("runs/demo/rollout_weights/v000001")
        sync = DiskSync(client, _arch(tiny_hf_config("moe")), staging_dir="runs/demo/rollout_weights")
    assert sync.version_dir(3) == tmp_path / "runs/demo/rollout_weights/v000003"


def _arch(hf_config):
    from sapo_megatron.model.arch import QwenArch

    return QwenArch.from_hf_dict(hf_config)


def test_a_server_whose_precision_differs_from_the_config_is_named(fake):
    fake.server_info = {"quantization": "fp8", "dtype": "bfloat16"}
    said: list[str] = []
    resolve_topology(urls=[fake.url], precision="fp32", timeout_s=10, log=said.append)
    assert len(said) == 1 and f"{fake.url} serves fp8" in said[0] and "rollout.precision is fp32" in said[0]
    said.clear()
    resolve_topology(urls=[fake.url], precision="fp8", timeout_s=10, log=said.append)
    assert said == []
