"""Remote rewards against a loopback server that is slow, fails, then recovers (protocol in docs/rewards.md)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from sapo_megatron.rewards.remote import RemoteReward, RemoteSettings
from sapo_megatron.rewards.runner import RewardRunner, build_reward_runner
from sapo_megatron.rewards.types import RewardInput


class Scripted(BaseHTTPRequestHandler):
    """Replies by a script of behaviours, one per request: "ok", "slow", "500", "400", "garbage"."""

    script: ClassVar[list[str]] = []
    seen: ClassVar[list[dict]] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append({"auth": self.headers.get("Authorization"), "body": body})
        action = self.script.pop(0) if self.script else "ok"
        if action == "slow":
            time.sleep(1.0)
        if action in ("500", "400"):
            self._reply(int(action), {"error": "scripted failure"})
            return
        if action == "garbage":
            self._reply(200, {"nothing": 1})
            return
        scores = [
            {"score": float(s["response"] == s["label"]), "answer": s["response"]} if i % 2 else float(i)
            for i, s in enumerate(body["samples"])
        ]
        self._reply(200, {"scores": scores})

    def _reply(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError):  # the client timed out ("slow")
            self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/score"
    httpd.shutdown()


def runner(url: str, **kw) -> RewardRunner:
    settings = RemoteSettings(url=url, **kw)
    return RewardRunner(RemoteReward(settings, backoff_s=0.05), url, group=False)


def samples(n: int) -> list[RewardInput]:
    return [RewardInput(response=str(i % 3), label="1", group_id=i // 2) for i in range(n)]


def test_batches_retries_and_recovery(server, monkeypatch):
    monkeypatch.setenv("REWARD_KEY", "s3cret")
    Scripted.seen.clear()
    Scripted.script[:] = ["slow", "500", "ok", "ok"]  # a timeout, a 500, then fine
    with runner(server, api_key_env="REWARD_KEY", timeout_s=0.5, max_retries=3, batch_size=3) as remote:
        out = remote.score(samples(5))
        assert [o.score for o in out] == [0.0, 1.0, 2.0, 0.0, 1.0]  # per batch: 0.0, match?, 2.0 (the script)
        assert out[1].fields == {"answer": "1"} and not any(o.error for o in out)
        assert remote.backend.retries == 2
        assert [len(r["body"]["samples"]) for r in Scripted.seen] == [3, 3, 3, 2]  # 2 retries of batch 1
        assert {r["auth"] for r in Scripted.seen} == {"Bearer s3cret"}
        first = Scripted.seen[-1]["body"]["samples"][0]
        assert set(first) == {"response", "label", "prompt", "source", "metadata", "group_id"}

        Scripted.script[:] = ["500", "500", "ok"]  # fails for good within max_retries=1 ...
        Scripted.seen.clear()
        failed = runner(server, max_retries=1, batch_size=8).score(samples(2))
        assert [o.error for o in failed] == [
            f'reward server {server} failed: HTTP 500: {{"error": "scripted failure"}}'
        ] * 2
        assert Scripted.seen[0]["auth"] is None  # no api_key_env: no header
        recovered = remote.score(samples(2))  # ... and the next call finds it recovered
        assert [o.score for o in recovered] == [0.0, 1.0]

        Scripted.script[:] = ["400"]  # a 4xx is not retried
        Scripted.seen.clear()
        assert runner(server, max_retries=3).score(samples(1))[0].error.endswith('scripted failure"}')
        assert len(Scripted.seen) == 1
        Scripted.script[:] = ["garbage"] * 2
        Scripted.seen.clear()
        assert "the reply has no 'scores'" in runner(server, max_retries=1).score(samples(1))[0].error
        assert len(Scripted.seen) == 1  # a wrong answer is not asked again


def test_remote_spec_builds_a_remote_runner(server):
    Scripted.script.clear()
    with build_reward_runner({"url": server, "batch_size": 4}, workers=3) as remote:
        assert isinstance(remote.backend, RemoteReward) and remote.backend.settings.batch_size == 4
        assert [o.score for o in remote.score(samples(3))] == [0.0, 1.0, 2.0]
