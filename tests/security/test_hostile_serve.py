"""Hostile HTTP requests to ``sapo-megatron serve`` (issue 30, area "serve"), against two loopback servers in
this process: one with an API key and an allowed weight directory, one without. CLEAR: a 4xx (or 5xx for
overload) whose body names the problem; OK: served as SGLang serves it."""

from __future__ import annotations

import base64
import json
import pickle
import shutil
import socket
import time
from pathlib import Path

import httpx
import pytest

from sapo_megatron.rollout.cpu.server import CPUServer
from sapo_megatron.rollout.cpu.weights import WeightGuard
from tests.rollout.conftest import engine_from
from tests.security.hostile import case

AREA = "serve"
KEY = "k3y"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONNECT_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def dirs(moe_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("serve")
    allowed, outside = root / "allowed", root / "outside"
    shutil.copytree(moe_dir, allowed / "model")
    shutil.copytree(moe_dir, outside / "model")
    (allowed / "passwd").mkdir()
    (allowed / "passwd" / "config.json").symlink_to(allowed / "model" / "config.json")
    (allowed / "passwd" / "model.safetensors").symlink_to("/etc/passwd")
    (allowed / "evil").mkdir()
    for entry in (outside / "model").iterdir():
        (allowed / "evil" / entry.name).symlink_to(entry)
    small = root / "allowed" / "other_size"
    _other_size_model(small)
    return {"allowed": allowed, "outside": outside}


def _other_size_model(path: Path) -> None:
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=2, num_experts_per_tok=1,
    )  # fmt: skip
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(path)


@pytest.fixture(scope="module")
def servers(moe_dir, dirs):
    guard = WeightGuard(allowed_weight_dirs=[dirs["allowed"]], connect_timeout_s=CONNECT_TIMEOUT_S)
    keyed = CPUServer(engine_from(moe_dir, seed=0), api_key=KEY, guard=guard).start()
    open_ = CPUServer(engine_from(moe_dir, seed=0), guard=guard).start()
    yield keyed, open_
    keyed.stop()
    open_.stop()


def raw(url: str, data: bytes, timeout: float = 10.0) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


def check(cls: str, status: int, text: str, words: str) -> None:
    if cls == "CLEAR":  # 501: http.server's "Unsupported method ('DELETE')"
        assert 400 <= status < 500 or status == 501, (status, text[:300])
    else:
        assert status == 200, (status, text[:300])
    assert words in text, (words, text[:500])
    assert "Traceback" not in text and "/etc/passwd" not in text.replace("file symlink", "")


def post(server: CPUServer, path: str, body, headers=AUTH, timeout=30.0) -> tuple[int, str]:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    reply = httpx.post(
        server.url + path,
        content=content,
        headers={**headers, "Content-Type": "application/json"},
        timeout=timeout,
    )
    return reply.status_code, reply.text


GENERATE = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


def head(method: str, path: str, extra: str = "", body: bytes = b"", auth: bool = True) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: x", "Connection: close"]
    lines += [f"Authorization: Bearer {KEY}"] if auth else []
    return ("\r\n".join(lines) + "\r\n" + extra + "\r\n").encode() + body


def _chunked(body: dict, trailers: int) -> bytes:
    data = json.dumps(body).encode()
    flood = "".join(f"X-T{i}: 1\r\n" for i in range(trailers)).encode()
    return f"{len(data):x}\r\n".encode() + data + b"\r\n0\r\n" + flood + b"\r\n"


def _smuggled() -> bytes:
    body = json.dumps(GENERATE).encode()
    hidden = b"GET /get_server_info HTTP/1.1\r\nHost: x\r\nX-Note: smuggled\r\nConnection: close\r\n\r\n"
    return (
        f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
        + hidden
    )


@pytest.mark.parametrize(
    ("cls", "requests", "words"),
    [
        case(
            AREA,
            "no key: model/server info",
            "CLEAR",
            [head("GET", "/get_model_info", auth=False), head("GET", "/get_server_info", auth=False)],
            "Unauthorized",
        ),
        case(
            AREA,
            "/health prefix / ../ / absolute-URI tricks",
            "CLEAR",
            [
                head("GET", p, auth=False)
                for p in (
                    "/healthz/../get_model_info",
                    "/health/../get_server_info",
                    "/health%2f..%2fget_model_info",
                )
            ]
            + [head("GET", "http://x/get_model_info", auth=False)],
            "",
        ),
        case(
            AREA, "OPTIONS / DELETE", "CLEAR", [head("OPTIONS", "/generate"), head("DELETE", "/generate")], ""
        ),
        case(
            AREA,
            "negative Content-Length",
            "CLEAR",
            [head("POST", "/generate", "Content-Length: -5\r\n")],
            "bad Content-Length -5",
        ),
        case(
            AREA,
            "two Content-Length headers",
            "CLEAR",
            [head("POST", "/generate", "Content-Length: 2\r\nContent-Length: 40\r\n", b"{}")],
            "2 Content-Length headers",
        ),
        case(
            AREA,
            "Content-Length + chunked",
            "CLEAR",
            [
                head(
                    "POST",
                    "/generate",
                    "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",
                    b"2\r\n{}\r\n0\r\n\r\n",
                )
            ],
            "Content-Length together with Transfer-Encoding",
        ),
        case(
            AREA,
            "500 headers / 200 kB header / 100 kB URL",
            "CLEAR",
            [
                head("GET", "/get_model_info", "".join(f"X-{i}: 1\r\n" for i in range(500))),
                head("GET", "/get_model_info", "X-Big: " + "a" * 200_000 + "\r\n"),
                head("GET", "/get_model_info?" + "a" * 100_000),
            ],
            "",
        ),
        case(
            AREA,
            "chunk trailer flood",
            "OK",
            [head("POST", "/generate", "Transfer-Encoding: chunked\r\n", _chunked(GENERATE, trailers=2000))],
            "output_ids",
        ),
        case(
            AREA,
            "negative chunk size",
            "CLEAR",
            [head("POST", "/generate", "Transfer-Encoding: chunked\r\n", b"-5\r\nabc\r\n0\r\n\r\n")],
            "bad chunk size",
        ),
        case(
            AREA,
            "PUT update_weights_from_disk",
            "CLEAR",
            [head("PUT", "/update_weights_from_disk", "Content-Length: 2\r\n", b"{}")],
            "Method Not Allowed",
        ),
        case(
            AREA,
            "smuggled 2nd request on keyed server",
            "OK",
            [_smuggled()],
            "output_ids",
        ),
    ],
)
def test_hostile_http_framing(servers, cls, requests, words):
    keyed, _ = servers
    for request in requests:
        reply = raw(keyed.url, request)
        text = reply.decode("latin-1")
        status = status_of(reply)
        check(cls, status, text, words)
    if "smuggled" in requests[0].decode("latin-1", "replace"):
        assert (
            text.count("HTTP/1.1 401") == 1
        )  # the hidden second request, without the key, is refused itself


@pytest.mark.parametrize(
    ("cls", "body", "words"),
    [
        case(AREA, "malformed JSON / array body", "CLEAR", [b"{not json", b"[1, 2]"], "request body"),
        case(AREA, "200k-deep JSON", "CLEAR", [b"[" * 200_000 + b"]" * 200_000], "nested too deeply"),
        case(
            AREA, "5000-digit token id", "CLEAR", [b'{"input_ids": [' + b"9" * 5000 + b"]}"], "cannot convert"
        ),
        case(
            AREA,
            "13 bad /generate fields (OOV, negative ids, empty, text+ids, 8 MB text, n, top_p<0, ...)",
            "CLEAR",
            [
                {"input_ids": [10**6]},
                {"input_ids": [-1]},
                {"input_ids": []},
                {"input_ids": [1], "text": "hi"},
                {"text": "x" * (8 << 20)},
                {"input_ids": [1], "sampling_params": {"n": 2}},
                {"input_ids": [1], "sampling_params": {"top_p": -0.5}},
                {"input_ids": [1], "sampling_params": {"temperature": -1}},
                {"input_ids": [1], "sampling_params": {"max_new_tokens": -1}},
                {"input_ids": [1], "sampling_params": {"top_k": 0}},
                {"input_ids": "abc"},
                {"input_ids": [1], "sampling_params": {"bogus": 1}},
                {"input_ids": [1], "sampling_params": []},
            ],
            "",
        ),
        case(AREA, "rid as object", "OK", [{**GENERATE, "rid": {"a": 1}}], "output_ids"),
        case(
            AREA,
            "top_k 1e18",
            "OK",
            [{**GENERATE, "sampling_params": {"max_new_tokens": 2, "top_k": 10**18}}],
            "output_ids",
        ),
    ],
)
def test_hostile_generate_bodies(servers, cls, body, words):
    keyed, _ = servers
    for item in body:
        status, text = post(keyed, "/generate", item)
        check(cls, status, text, words)
        if cls == "CLEAR" and status not in (413,):
            assert status == 400 and ("message" in text), text[:200]


def _tensor_body(raw_bytes: bytes) -> dict:
    return {"serialized_named_tensors": [base64.b64encode(raw_bytes).decode()]}


@pytest.mark.parametrize(
    ("cls", "path", "body", "words"),
    [
        case(
            AREA,
            "update_disk ../ traversal",
            "CLEAR",
            "/update_weights_from_disk",
            {"model_path": "ALLOWED/../outside/model"},
            "outside the directories",
        ),
        case(
            AREA,
            "update_disk NUL byte",
            "CLEAR",
            "/update_weights_from_disk",
            {"model_path": "ALLOWED/model\x00/etc"},
            "NUL character",
        ),
        case(
            AREA,
            "update_disk non-string path",
            "CLEAR",
            "/update_weights_from_disk",
            {"model_path": ["a"]},
            "model_path",
        ),
        case(
            AREA,
            "update_disk file symlink -> /etc/passwd",
            "CLEAR",
            "/update_weights_from_disk",
            {"model_path": "ALLOWED/passwd"},
            "model.safetensors is a symbolic link that leads outside",
        ),
        case(
            AREA,
            "update_disk file symlink -> weights outside allowed dir",
            "CLEAR",
            "/update_weights_from_disk",
            {"model_path": "ALLOWED/evil"},
            "is a symbolic link that leads outside",
        ),
        case(
            AREA,
            "update_disk other model size",
            "CLEAR",
            "/update_weights_from_disk",
            {"model_path": "ALLOWED/other_size"},
            "not the served model's architecture: ",
        ),
        case(
            AREA,
            "init_group nccl on CPU",
            "CLEAR",
            "/init_weights_update_group",
            {
                "master_address": "127.0.0.1",
                "master_port": 1,
                "rank_offset": 1,
                "world_size": 2,
                "backend": "nccl",
            },
            "needs CUDA",
        ),
        case(
            AREA,
            "update_distributed without group",
            "CLEAR",
            "/update_weights_from_distributed",
            {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]]},
            "Please call `init_weights_update_group` first",
        ),
        case(
            AREA,
            "tensor update: bad base64 / non-list pickle",
            "CLEAR",
            "/update_weights_from_tensor",
            [{"serialized_named_tensors": ["%%%"]}, _tensor_body(pickle.dumps({"a": 1}))],
            "",
        ),
    ],
)
def test_hostile_weight_requests(servers, dirs, cls, path, body, words):
    keyed, _ = servers
    before = httpx.get(keyed.url + "/get_weight_version", headers=AUTH).json()
    for item in body if isinstance(body, list) else [body]:
        if isinstance(item.get("model_path"), str):
            item = {"model_path": item["model_path"].replace("ALLOWED", str(dirs["allowed"]))}
        status, text = post(keyed, path, item)
        check(cls, status, text, words)
        assert "root:" not in text and str(Path("/etc/passwd").stat().st_size) + " bytes" not in text
    assert httpx.get(keyed.url + "/get_weight_version", headers=AUTH).json() == before  # nothing loaded


def test_allowed_links_inside_the_directory_still_load(servers, dirs):
    """A checkpoint folder of links to files inside the allowed directory (what a run's export may hold)."""
    keyed, _ = servers
    inside = dirs["allowed"] / "links"
    inside.mkdir(exist_ok=True)
    for entry in (dirs["allowed"] / "model").iterdir():
        if not (inside / entry.name).exists():
            (inside / entry.name).symlink_to(entry)
    status, text = post(keyed, "/update_weights_from_disk", {"model_path": str(inside)})
    assert status == 200 and json.loads(text)["success"] is True


@pytest.mark.parametrize(
    ("cls", "path", "words"),
    [
        case(AREA, "weight endpoints without key", "CLEAR", "/update_weights_from_disk", "Unauthorized"),
    ],
)
def test_weight_endpoints_need_the_key(servers, cls, path, words):
    keyed, _ = servers
    for endpoint in (
        path,
        "/update_weights_from_tensor",
        "/init_weights_update_group",
        "/begin_weight_update",
    ):
        status, text = post(keyed, endpoint, {}, headers={})
        check(cls, status, text, words)


@pytest.mark.parametrize(
    ("cls", "words"),
    [case(AREA, "key in lowercase scheme / x-api-key / prefix / query", "OK", "")],
)
def test_key_spellings_follow_sglang(servers, cls, words):
    keyed, _ = servers
    # SGLang accepts a case-insensitive scheme and the x-api-key header; a key prefix or a query key is no key
    for headers, status in (
        ({"Authorization": f"bearer {KEY}"}, 200),
        ({"x-api-key": KEY}, 200),
        ({"Authorization": f"Bearer {KEY[:-1]}"}, 401),
        ({}, 401),
    ):
        assert httpx.get(keyed.url + "/get_model_info", headers=headers).status_code == status
    assert httpx.get(keyed.url + f"/get_model_info?api_key={KEY}").status_code == 401
    check(cls, 200, "", words)


@pytest.mark.parametrize(
    ("cls", "words"),
    [
        case(AREA, "end without begin / begin twice", "CLEAR", ""),
    ],
)
def test_weight_sessions_out_of_order(servers, cls, words):
    keyed, _ = servers
    status, text = post(keyed, "/end_weight_update", {})
    check(cls, status, text, words)
    assert post(keyed, "/begin_weight_update", {})[0] == 200
    try:
        status, text = post(keyed, "/begin_weight_update", {})
        check(cls, status, text, words)
    finally:
        post(keyed, "/end_weight_update", {})


@pytest.mark.parametrize(
    ("cls", "words"),
    [case(AREA, "init_group to a loopback HTTP port", "CLEAR", "did not answer as a torch TCP store")],
)
def test_a_group_master_that_is_not_a_store_is_refused_within_the_connect_timeout(servers, cls, words):
    keyed, open_ = servers
    port = int(open_.url.rsplit(":", 1)[1])  # an HTTP server, which accepts and never answers as a store
    body = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "backend": "gloo",
    }
    started = time.monotonic()
    status, text = post(keyed, "/init_weights_update_group", body, timeout=60)
    assert time.monotonic() - started < CONNECT_TIMEOUT_S + 3
    check(cls, status, text, words)
