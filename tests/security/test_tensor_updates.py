"""``/update_weights_from_tensor`` against forged handles (issue 20, Why 1): every one is refused with 400 (403 from
another machine) before anything is mapped, dialled or changed."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import httpx
import pytest
import torch

from sapo_megatron.rollout.cpu.http import Request
from sapo_megatron.rollout.cpu.server import CPUServer
from tests.rollout.conftest import engine_from
from tests.security.payloads import body, fd_storage, file_storage, tensor_of

NORM = "model.norm.weight"  # [32] in the tiny MoE


@pytest.fixture(scope="module")
def server(moe_dir):
    with CPUServer(engine_from(moe_dir, seed=0)) as srv:
        yield srv


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def norm_of(server: CPUServer) -> torch.Tensor:
    return dict(server.engine.model.named_parameters())[NORM].detach().clone()


def refused(http: httpx.Client, payload: dict, *words: str) -> str:
    reply = http.post("/update_weights_from_tensor", json=payload)
    assert reply.status_code == 400 and reply.json()["success"] is False, reply.text
    message = reply.json()["message"]
    assert all(word in message for word in words), message
    return message


def test_file_name_handles_open_only_the_trainers_own_existing_files(server, http, tmp_path):
    before, version = norm_of(server), server.weights.weight_version
    manager = tmp_path / "manager.sock"  # a Unix socket of this user, so only the name is wrong
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(manager))
    victim = Path("/dev/shm") / f"i20_victim_{os.getpid()}"
    victim.write_bytes(b"x" * 64)
    small = Path("/dev/shm") / f"torch_{os.getpid()}_1_1"  # our pid's name pattern, but smaller than claimed
    small.write_bytes(b"y" * 16)
    try:
        for name, words in [
            (f"/{victim.name}".encode(), ("is not one torch made",)),  # any name the sender picks
            (f"/torch_{os.getpid() + 1}_1_1".encode(), ("allowed sender process",)),  # another process's name
            (f"/{small.name}".encode(), ("holding 1048576 bytes",)),  # would be grown with heap garbage
        ]:
            storage = file_storage(str(manager).encode(), name, 1 << 20)
            refused(http, body([(NORM, tensor_of(storage, [32], [1]))]), *words, "nothing was opened")
        storage = file_storage(b"/tmp/nowhere.sock", f"/{small.name}".encode(), 16)
        refused(http, body([(NORM, tensor_of(storage, [4], [1]))]), "manager", "does not exist")
        assert victim.read_bytes() == b"x" * 64 and small.stat().st_size == 16  # neither mapped nor grown
    finally:
        listener.close()
        victim.unlink()
        small.unlink()
    assert torch.equal(norm_of(server), before) and server.weights.weight_version == version


def test_fd_handles_never_dial_a_sender_chosen_address(http):
    probe = socket.create_server(
        ("127.0.0.1", 0)
    )  # a port the forged handle names: it must see no connection
    probe.settimeout(0.3)
    closed_port = socket.create_server(("127.0.0.1", 0))
    closed = closed_port.getsockname()
    closed_port.close()
    try:
        messages = {
            refused(http, body([(NORM, tensor_of(fd_storage(address, 128), [32], [1]))]), "not a local Unix")
            for address in (probe.getsockname(), closed)
        }
        assert len(messages) == 2 and all("network addresses are refused" in m for m in messages)
        # Same text shape for an open and a closed port: no port scanner (only the address differs).
        assert {m.replace(str(probe.getsockname()[1]), "P").replace(str(closed[1]), "P") for m in messages}
        with pytest.raises(TimeoutError):
            probe.accept()
        refused(
            http, body([(NORM, tensor_of(fd_storage("/etc/passwd", 128), [32], [1]))]), "not a Unix socket"
        )
    finally:
        probe.close()


def test_a_view_larger_than_its_storage_is_refused_before_mapping(server, http):
    before = norm_of(server)
    small = torch.zeros(16)
    view = tensor_of(small.untyped_storage(), [52, 64], [64, 1])  # 3328 elements of a 16-element storage
    refused(http, body([("model.embed_tokens.weight", view)]), "reaches element 3327 of a 16-element storage")
    negative = tensor_of(small.untyped_storage(), [4], [-1], offset=3)
    refused(http, body([(NORM, negative)]), "not a list of non-negative ints")
    assert torch.equal(norm_of(server), before)


def test_dtype_shape_and_name_must_match_the_model(server, http):
    before, version = norm_of(server), server.weights.weight_version
    for named, words in [
        ([(NORM, torch.ones(32, dtype=torch.int64))], "dtype torch.int64"),
        ([(NORM, torch.ones(33))], "has shape [33], the model expects [32]"),
        ([("model.no_such.weight", torch.ones(32))], "unknown weight name"),
        ([(NORM, torch.ones(32)), (NORM + "x", torch.ones(32))], "unknown weight name"),  # all or nothing
    ]:
        from sapo_megatron.rollout.tensor_transport import serialize_named_tensors

        refused(http, {"serialized_named_tensors": [serialize_named_tensors(named)]}, *words)
    assert torch.equal(norm_of(server), before) and server.weights.weight_version == version


def test_tensor_updates_from_another_machine_are_forbidden_unread(server):
    # A request from a non-loopback peer, handed to the application directly: no packet leaves this machine.
    started = time.monotonic()
    status, payload, _ = server.handle(
        "POST",
        "/update_weights_from_tensor",
        {},
        b'{"serialized_named_tensors": ["not even base64 !"]}',
        Request(peer_host="192.0.2.7"),
    )
    assert status == 403 and "only taken from this machine" in payload.decode()
    assert time.monotonic() - started < 1.0
