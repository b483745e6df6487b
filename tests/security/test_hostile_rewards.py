"""Hostile reward functions and reward servers (issue 30, area "rewards"). A reward that cannot be used is refused
when the runner is built (CLEAR); one that misbehaves per sample scores 0.0 with an error naming what it did, and
the step's error budget stops the run with that error (CLEAR); a harmless oddity is scored as documented (OK);
fields too large to log are replaced by a note, with a warning (WARN). Inline rewards are bounded like pooled ones.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from sapo_megatron.rewards import remote as remote_module
from sapo_megatron.rewards.runner import build_reward_runner
from sapo_megatron.rewards.types import RewardInput
from sapo_megatron.runtime.interrupts import InterruptGuard, WaitInterrupted
from tests.security.hostile import case, expect

AREA = "rewards"
REWARDS = """
import json, os, subprocess, sys, time

def ok(response, label):
    return 1.0

def f(x):
    return 1.0

def positional_only(response, label, /):
    return 1.0

def extra_required(response, label, needed):
    return 1.0

def returns_text_number(response, label):
    return "1.0"

def returns_yes(response, label):
    return "yes"

def returns_none(response, label):
    return None

def returns_true(response, label):
    return True

def returns_minus_inf(response, label):
    return float("-inf")

def returns_huge(response, label):
    return 1e308

def returns_plus_minus_huge(response, label):
    return 1e308 if len(response) % 2 else -1e308

def returns_nan_dict(response, label):
    return {"score": "nan"}

def self_referencing(response, label):
    d = {"score": 1.0}
    d["self"] = d
    return d

def big_field(response, label):
    return {"score": 1.0, "blob": "x" * (20 << 20)}

def many_keys(response, label):
    return {"score": 1.0, **{f"k{i}": i for i in range(200_000)}}

def sleeps(response, label):
    time.sleep(3600)

def hard_exit(response, label):
    os._exit(3)

def soft_exit(response, label):
    sys.exit(0)

def interrupt(response, label):
    raise KeyboardInterrupt

def forks_daemon(response, label):
    pid_file = os.environ["SAPO_TEST_DAEMON_PIDS"]
    code = f"import os, time; open({pid_file!r}, 'a').write(str(os.getpid()) + chr(10)); time.sleep(3600)"
    subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    time.sleep(0.3)
    return 1.0

def forks_and_returns(response, label):
    os.fork()
    return 1.0

def reads_stdin(response, label):
    return float(len(sys.stdin.read()))

def uses_alarm(response, label):
    import signal

    def own_timeout(*args):
        raise TimeoutError("the reward's own alarm")

    previous = signal.signal(signal.SIGALRM, own_timeout)
    signal.alarm(2)
    try:
        time.sleep(0.5)
        return 1.0
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)

def prints(response, label):
    print("x" * 100_000)
    return 1.0
"""


@pytest.fixture(scope="module")
def rewards_file(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hostile_rewards")
    (root / "rewards.py").write_text(REWARDS)
    (root / "exits.py").write_text("import sys\nsys.exit(3)\n")
    (root / "interrupts.py").write_text("raise KeyboardInterrupt\n")
    (root / "raises.py").write_text("raise RuntimeError('broken import')\n")
    return root / "rewards.py"


def inputs(n: int = 2) -> list[RewardInput]:
    return [RewardInput(response="4" * (i + 1), label="4", group_id=i) for i in range(n)]


def score(spec, *, workers: int, timeout_s: float = 2.0, n: int = 2):
    """Build the runner, score ``n`` samples, apply a zero error budget; returns the outputs."""
    with build_reward_runner(spec, workers=workers, timeout_s=timeout_s) as runner:
        outputs = runner.score(inputs(n))
        assert len(outputs) == n
        runner.check_error_budget(0.0)
        return outputs


@pytest.mark.parametrize(
    ("cls", "spec", "words"),
    [
        case(AREA, "file.py missing", "CLEAR", "missing.py:ok", "does not exist"),
        case(AREA, "function missing", "CLEAR", "rewards.py:nope", "has no attribute 'nope'"),
        case(AREA, "wrong signature f(x)", "CLEAR", "rewards.py:f", "response"),
        case(AREA, "positional-only signature", "CLEAR", "rewards.py:positional_only", "positional"),
        case(AREA, "extra required arg", "CLEAR", "rewards.py:extra_required", "needed"),
        case(AREA, "sys.exit() at import", "CLEAR", "exits.py:ok", "called sys.exit(3)"),
        case(AREA, "raise at import", "CLEAR", "raises.py:ok", "raised RuntimeError: broken import"),
        case(AREA, "KeyboardInterrupt at import", "CLEAR", "interrupts.py:ok", "raised KeyboardInterrupt"),
        case(AREA, "module not importable", "CLEAR", "no_such_module_xyz:fn", "cannot import module"),
        case(AREA, "os:system", "CLEAR", "os:system", ""),
    ],
)
def test_rewards_that_cannot_be_used_are_refused_when_built(rewards_file, cls, spec, words):
    if not spec.startswith(("os:", "no_such")):
        spec = str(rewards_file.parent / spec)
    expect(cls, lambda: build_reward_runner(spec, workers=0), words)


@pytest.mark.parametrize(
    ("cls", "fn", "workers", "words"),
    [
        case(AREA, 'returns "1.0"', "CLEAR", "returns_text_number", 0, "as its score; return a number"),
        case(AREA, 'returns "yes"', "CLEAR", "returns_yes", 0, "reward returned the text 'yes'"),
        case(AREA, "returns None", "CLEAR", "returns_none", 0, "returned None"),
        case(AREA, "returns True", "OK", "returns_true", 0, ""),
        case(AREA, "returns -inf", "CLEAR", "returns_minus_inf", 0, "non-finite score -inf"),
        case(AREA, "returns 1e308", "CLEAR", "returns_huge", 0, "outside the accepted range [-1e+06, 1e+06]"),
        case(AREA, "returns +-1e308", "CLEAR", "returns_plus_minus_huge", 0, "outside the accepted range"),
        case(AREA, 'returns {"score": "nan"}', "CLEAR", "returns_nan_dict", 0, "as its score"),
        case(AREA, "self-referencing dict", "CLEAR", "self_referencing", 0, "RecursionError"),
        case(AREA, "20 MB field, log_samples_every=1", "WARN", "big_field", 0, "over the limit of 65536"),
        case(AREA, "200k-key dict", "WARN", "many_keys", 0, "JSON, over 65536"),
        case(AREA, "sleeps forever (pool)", "CLEAR", "sleeps", 1, "timed out after 1 s (worker killed)"),
        case(AREA, "os._exit (pool)", "CLEAR", "hard_exit", 1, "its reward worker died (exit code 3)"),
        case(AREA, "sys.exit (pool)", "CLEAR", "soft_exit", 1, "the reward called sys.exit(0)"),
        case(AREA, "KeyboardInterrupt (pool)", "CLEAR", "interrupt", 1, "KeyboardInterrupt"),
        case(AREA, "sys.exit(0) inline", "CLEAR", "soft_exit", 0, "the reward called sys.exit(0)"),
        case(AREA, "KeyboardInterrupt inline", "CLEAR", "interrupt", 0, "KeyboardInterrupt"),
        case(AREA, "os._exit(3) inline", "CLEAR", "hard_exit", 0, "the reward called os._exit(3)"),
        case(AREA, "sleeps forever inline (documented)", "CLEAR", "sleeps", 0, "timed out after 1 s (inline"),
        case(AREA, "reads stdin (pool)", "OK", "reads_stdin", 1, ""),
        case(AREA, "prints 100 kB", "OK", "prints", 1, ""),
    ],
)
def test_misbehaving_rewards(rewards_file, cls, fn, workers, words):
    spec = f"{rewards_file}:{fn}"
    started = time.monotonic()
    timeout_s = 1.0 if fn == "sleeps" else 30.0
    outputs = expect(cls, lambda: score(spec, workers=workers, timeout_s=timeout_s), words)
    assert time.monotonic() - started < 40
    if fn == "sleeps":  # each sample gets its own timeout, the second too
        with build_reward_runner(spec, workers=workers, timeout_s=0.5) as runner:
            errors = [out.error for out in runner.score(inputs(2))]
        assert all("timed out after 0.5 s" in error for error in errors), errors
    if cls == "OK":
        assert all(out.error is None for out in outputs)
        assert [out.score for out in outputs] == ([0.0, 0.0] if fn == "reads_stdin" else [1.0, 1.0])
    if cls == "WARN":
        assert all(out.score == 1.0 and list(out.fields) == ["fields_dropped"] for out in outputs)


def test_a_reward_with_its_own_alarm_keeps_it_inline(rewards_file):
    """math-verify's timeouts use signal.alarm inside the call: the inline watchdog must not fire them early."""
    outputs = score(f"{rewards_file}:uses_alarm", workers=0, timeout_s=5.0)
    assert [(out.score, out.error) for out in outputs] == [(1.0, None), (1.0, None)]


@pytest.fixture
def warned_fresh(monkeypatch):
    from sapo_megatron.rewards import limits

    monkeypatch.setattr(limits, "_WARNED_FIELDS", False)


@pytest.mark.usefixtures("warned_fresh")
def test_the_field_warning_is_said(rewards_file, caplog):
    outputs = score(f"{rewards_file}:big_field", workers=0)
    assert outputs[0].fields["fields_dropped"].startswith("the reward's extra fields took")
    assert "over the limit of 65536" in caplog.text


@pytest.mark.parametrize(
    ("cls", "workers"),
    [case(AREA, "forks a setsid daemon", "OK", 2)],
)
def test_a_reward_daemon_dies_with_its_worker(rewards_file, tmp_path, monkeypatch, cls, workers):
    pids = tmp_path / "daemons"
    monkeypatch.setenv("SAPO_TEST_DAEMON_PIDS", str(pids))
    outputs = expect(cls, lambda: score(f"{rewards_file}:forks_daemon", workers=workers, timeout_s=10))
    assert [out.score for out in outputs] == [1.0, 1.0]
    started = [int(line) for line in pids.read_text().split()]
    assert len(started) == 2
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in started), "a daemon the reward started outlived the runner"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize(
    ("cls", "workers"),
    [case(AREA, "forks and both processes return", "OK", 1)],
)
def test_a_forking_reward_returns_once(rewards_file, cls, workers):
    for mode in (workers, 0):  # in a worker, and inline: only the caller goes on
        pid = os.getpid()
        outputs = expect(cls, lambda mode=mode: score(f"{rewards_file}:forks_and_returns", workers=mode))
        assert os.getpid() == pid and [out.score for out in outputs] == [1.0, 1.0]


@pytest.mark.parametrize(("cls",), [case(AREA, "SIGTERM to trainer", "OK")])
def test_sigterm_during_scoring(rewards_file, cls):
    """Pool: the step's scoring finishes and the run stops after it. Inline: a reward that sleeps stops at
    the signal (WaitInterrupted, the run's interrupted exit) instead of waiting for its timeout."""
    timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
    with InterruptGuard(announce=None) as guard:
        timer.start()
        outputs = expect(cls, lambda: score(f"{rewards_file}:ok", workers=1))
        time.sleep(0.5)
        assert guard.requested and [out.score for out in outputs] == [1.0, 1.0]
    with InterruptGuard(announce=None):
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        started = time.monotonic()
        with pytest.raises(WaitInterrupted, match="an inline reward call: interrupted by a signal"):
            score(f"{rewards_file}:sleeps", workers=0, timeout_s=60)
        assert time.monotonic() - started < 3
        time.sleep(1.1)  # past the guard's repeat window


# ----------------------------------------------------------------------------------------------------------
# Remote reward servers
# ----------------------------------------------------------------------------------------------------------


class Hostile(BaseHTTPRequestHandler):
    """Answers by the path: /html, /500, /few, /many, /strings, /nan, /drip, /silent, /redirect, /file_redirect,
    /big, /fat_fields, /key; anything else scores 1.0."""

    protocol_version = "HTTP/1.1"
    hits: ClassVar[list[str]] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        n = len(body["samples"])
        self.hits.append(self.path)
        kind = self.path.strip("/")
        if kind == "html":
            return self._send(200, b"<html><body>login</body></html>", "text/html")
        if kind == "500":
            return self._json(500, {"error": "boom"})
        if kind in ("redirect", "file_redirect"):
            target = "file:///etc/passwd" if kind == "file_redirect" else "/elsewhere"
            self.send_response(307)
            self.send_header("Location", target)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        if kind == "key" and self.headers.get("Authorization") is None:
            return self._json(401, {"error": "missing key"})
        if kind == "silent":
            time.sleep(5)
            return None
        if kind == "drip":
            return self._drip(json.dumps({"scores": [1.0] * n}).encode())
        if kind == "big":
            return self._send(200, b'{"scores": [' + b" " * (3 << 20) + b"]}", "application/json")
        scores = {
            "few": [1.0] * (n - 1),
            "many": [1.0] * (n + 1),
            "strings": ["1.0"] * n,
            "nan": [float("nan")] * n,
            "fat_fields": [{"score": 1.0, "blob": "x" * (5 << 20)}] * n,
        }.get(kind, [1.0] * n)
        return self._json(200, {"scores": scores})

    def _json(self, status: int, payload: dict) -> None:
        self._send(status, json.dumps(payload).encode(), "application/json")

    def _send(self, status: int, data: bytes, kind: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        with contextlib.suppress(OSError):
            self.wfile.write(data)

    def _drip(self, data: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        with contextlib.suppress(OSError):
            for byte in data:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.2)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def reward_server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.mark.parametrize(
    ("cls", "path", "words"),
    [
        case(AREA, "remote: HTML 200", "CLEAR", "/html", "HTTP 200 with text/html, not JSON"),
        case(AREA, "remote: 500", "CLEAR", "/500", "HTTP 500"),
        case(AREA, "remote: too few scores", "CLEAR", "/few", "returned 1 scores for 2"),
        case(AREA, "remote: too many scores", "CLEAR", "/many", "returned 3 scores for 2"),
        case(AREA, "remote: string scores", "CLEAR", "/strings", "as its score; return a number"),
        case(AREA, "remote: NaN scores", "CLEAR", "/nan", "non-finite score nan"),
        case(
            AREA,
            "remote: slow drip past timeout_s",
            "CLEAR",
            "/drip",
            "the reply took longer than timeout_s=1 s",
        ),
        case(AREA, "remote: never answers", "CLEAR", "/silent", "timed out"),
        case(AREA, "remote: 307 redirect", "CLEAR", "/redirect", "a redirect to '/elsewhere'"),
        case(
            AREA,
            "remote: redirect to file://",
            "CLEAR",
            "/file_redirect",
            "a redirect to 'file:///etc/passwd'",
        ),
        case(AREA, "remote: 200 MB body", "CLEAR", "/big", "larger than 1048576 bytes"),
        case(AREA, "remote: 5 MB fields per score", "WARN", "/fat_fields", ""),
        case(
            AREA,
            "remote: 401, api_key_env unset",
            "CLEAR",
            "/key",
            "the key variable SAPO_HOSTILE_KEY is not set",
        ),
        case(
            AREA, "remote: file:// url", "CLEAR", "file:///etc/passwd", "must start with http:// or https://"
        ),
        case(AREA, "remote: connection refused", "CLEAR", "http://127.0.0.1:1/score", "Connection refused"),
    ],
)
def test_hostile_reward_servers(reward_server, monkeypatch, cls, path, words):
    if path == "/big":
        monkeypatch.setattr(remote_module, "MAX_REPLY_BYTES", 1 << 20)  # the 200 MB case, 3 MB here
    monkeypatch.delenv("SAPO_HOSTILE_KEY", raising=False)
    url = path if "://" in path else reward_server + path
    spec = {"url": url, "timeout_s": 1.0, "max_retries": 0, "api_key_env": "SAPO_HOSTILE_KEY"}
    started = time.monotonic()
    outputs = expect(cls, lambda: score(spec, workers=0), words)
    assert time.monotonic() - started < 10
    if cls == "WARN":
        assert [out.score for out in outputs] == [1.0, 1.0] and "fields_dropped" in outputs[0].fields


def test_the_budget_hint_follows_the_error(reward_server, rewards_file):
    spec = {"url": reward_server + "/500", "timeout_s": 1.0, "max_retries": 0}
    err = expect("CLEAR", lambda: score(spec, workers=0), "check the reward server")
    assert "reward_timeout_s" not in err.hint
    err = expect(
        "CLEAR",
        lambda: score(f"{rewards_file}:sleeps", workers=1, timeout_s=0.5),
        "raise algorithm.reward_timeout_s",
    )
    assert textwrap.shorten(str(err), 40)
