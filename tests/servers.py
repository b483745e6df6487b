"""Real server processes for tests: CPU rollout servers (the stand-in for SGLang) and the real ``sglang-router``
(PyPI wheel), each in its own process on a free loopback port, stopped and reaped by the context managers."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import httpx
import numpy as np
import torch
import transformers

from sapo_megatron.data.tokenizer import CharTokenizer
from sapo_megatron.defaults import DEMO_MODEL
from tests.ports import free_port
from tests.rollout.server_process import ServerProcess


def save_demo_model(path: Path, seed: int = 0) -> Path:
    """A random HF checkpoint of the embedded demo's architecture (with its character tokenizer)."""
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(**DEMO_MODEL)
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(path)
    CharTokenizer().save(path)
    return path


class ServerStartError(RuntimeError):
    """A server process exited or was not ready in time (its log's tail in the message)."""


def wait_healthy(
    url: str,
    proc: subprocess.Popen,
    log: Path,
    timeout: float = 120.0,
    ready: Callable[[], bool] | None = None,
) -> None:
    """Until ``url`` answers ``/health`` with 200 and ``ready()`` (if given) holds; :class:`ServerStartError`
    when the process exits first or the time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerStartError(f"{url} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url + "/health", timeout=2.0).status_code == 200 and (ready is None or ready()):
                return
        time.sleep(0.2)
    raise ServerStartError(f"{url} not ready after {timeout:.0f} s:\n{log.read_text()[-3000:]}")


@contextlib.contextmanager
def process(
    command: Sequence[str],
    log: Path,
    url: str,
    ready: Callable[[], bool] | None = None,
    timeout: float = 120.0,
) -> Iterator[str]:
    """Run ``command`` in its own session with its output in ``log``; yield ``url`` once it is healthy (and
    ``ready()``); stop and reap the whole process group afterwards."""
    with log.open("w") as out:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(
            list(command), stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        wait_healthy(url, proc, log, timeout=timeout, ready=ready)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)


@contextlib.contextmanager
def cpu_server(
    model_dir: Path, log: Path, *, api_key: str | None = None, allowed_weight_dir: Path | None = None
) -> Iterator[str]:
    """``python -m sapo_megatron.rollout.cpu.server`` on a free port (it prints its URL); yields the URL. Its
    stderr lands in ``log`` when it stops. ``allowed_weight_dir``: where a trainer's disk sync writes, when that is
    not beside ``model_dir`` (the server's default)."""
    flags = ["--model-path", str(model_dir), "--host", "127.0.0.1", "--port", "0", "--threads", "1"]
    flags += ["--allowed-weight-dir", str(allowed_weight_dir)] if allowed_weight_dir else []
    server = ServerProcess(*flags, *(["--api-key", api_key] if api_key else []))
    try:
        yield server.url
    finally:
        server.stop()
        log.write_text(server.stderr)


def router(workers: Sequence[str], log: Path, *, api_key: str | None = None, wait_for_workers: bool = True):
    """The real sglang-router in front of ``workers``; yields its URL once ``GET /workers`` lists them all (it
    registers them in the background after ``/health`` is 200; ``wait_for_workers=False`` yields at health).
    Each router also opens a Prometheus port, which must differ between routers on one host."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def lists_every_worker() -> bool:
        reply = httpx.get(url + "/workers", headers=headers, timeout=2.0).json()
        listed = {entry.get("url", "").rstrip("/") for entry in reply.get("workers", [])}
        return listed >= {w.rstrip("/") for w in workers}

    command = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *workers]
    command += ["--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port())]
    command += ["--policy", "round_robin", "--log-level", "warn"]
    if api_key:
        command += ["--api-key", api_key]
    return process(command, log, url, ready=lists_every_worker if wait_for_workers else None)


def served_logprobs(
    url: str, prompt_ids: Sequence[int], *, headers: dict[str, str] | None = None, timeout: float = 60.0
) -> np.ndarray:
    """The server's log-probs of ``prompt_ids[1:]`` (SGLang's scoring request: ``max_new_tokens`` 0,
    ``logprob_start_len`` 0; the first input entry has none)."""
    body = {
        "input_ids": list(prompt_ids),
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    reply = httpx.post(url + "/generate", json=body, headers=headers, timeout=timeout).json()
    return np.array([entry[0] for entry in reply["meta_info"]["input_token_logprobs"][1:]])


def local_logprobs(model_dir: Path, prompt_ids: Sequence[int]) -> np.ndarray:
    """The same log-probs from the HF checkpoint ``model_dir``, scored in this process."""
    from sapo_megatron.rollout.cpu.engine import CPUEngine

    return np.array(CPUEngine.from_pretrained(model_dir, num_threads=1).score([list(prompt_ids)], 1)[0])
