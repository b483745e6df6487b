"""The trainer never waits on a dead peer longer than its config says, and the first signal ends the wait."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest

from sapo_megatron.config import config_from_dict
from sapo_megatron.loop.session import _sglang_client
from sapo_megatron.model.tiny import tiny_hf_config
from sapo_megatron.rollout.sglang.client import SGLangClient
from sapo_megatron.rollout.sglang.topology import Topology
from sapo_megatron.runtime.interrupts import InterruptGuard, WaitInterrupted, stop_requested


@pytest.fixture
def silent_server():
    """Accepts connections and reads requests but never answers (a hung SGLang server)."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            held.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    listener.close()
    for conn in held:
        conn.close()


def test_the_weight_sync_timeout_comes_from_the_config():
    cfg = config_from_dict(
        {"model": {"hf_config": tiny_hf_config("moe")}, "rollout": {"weight_sync_timeout_s": 42.0}}
    )
    client = _sglang_client(cfg, Topology(workers=("http://127.0.0.1:9",), tp_sizes=(1,)), None)
    try:
        assert client.control.weight_sync_timeout_s == 42.0
    finally:
        client.close()


def test_the_first_signal_ends_a_weight_sync_wait_within_a_second(silent_server):
    client = SGLangClient([silent_server], weight_sync_timeout_s=600.0, max_retries=0)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
    try:
        with InterruptGuard(announce=None):
            timer.start()
            started = time.monotonic()
            with pytest.raises(WaitInterrupted, match="interrupted by a signal"):
                client.update_weights_from_disk("/nowhere/weights")
            assert time.monotonic() - started < 2.0  # not the 600 s timeout
            assert stop_requested()
        assert not stop_requested()  # cleared with the guard
    finally:
        timer.cancel()
        client.close()


def test_an_output_id_outside_the_vocabulary_names_the_server():
    from sapo_megatron.rollout.base import RolloutError
    from sapo_megatron.rollout.protocol import parse_generate_reply

    reply = {
        "output_ids": [3, 70],
        "meta_info": {"id": "r", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 1},
    }
    with pytest.raises(RolloutError, match=r"outside the trainer's vocabulary of 64: \[70\]") as caught:
        parse_generate_reply(
            reply,
            prompt_ids=[1],
            max_new_tokens=2,
            rid="r",
            server="http://127.0.0.1:1",
            want_routed_experts=False,
            num_layers=None,
            top_k=None,
            vocab_size=64,
        )
    assert "http://127.0.0.1:1" in str(caught.value) + repr(caught.value.__dict__)
