"""Custom rewards (import paths, signatures, group form) and the worker pool: every bad reward behaves as
documented in docs/rewards.md, the order is kept, and the trainer never waits past the timeout."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from sapo_megatron.config import ConfigError, config_from_dict
from sapo_megatron.defaults import embedded_default_dict
from sapo_megatron.rewards.registry import RewardError
from sapo_megatron.rewards.runner import build_reward_runner, check_reward_available, default_workers
from sapo_megatron.rewards.types import RewardInput

CHAOS = """
import math, os, signal, sys, time

def reward(response, label, source=None):
    if response == "raise":
        raise RuntimeError("boom")
    if response == "hang":
        time.sleep(60)
    if response == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    if response == "exit":
        os._exit(3)
    if response == "nan":
        return float("nan")
    if response == "print":
        print("noise on the worker's stdout")
    if response == "main thread?":  # math-verify's signal.alarm timeouts need it
        import threading
        return float(threading.current_thread() is threading.main_thread())
    if response == "torch?":
        return {"score": float("torch" in sys.modules)}
    return {"score": float(response == label), "answer": response, "pid": os.getpid(), "source": source}
"""

GROUP = '''
from sapo_megatron.rewards import group_reward

@group_reward
def rank(samples, bonus=0.0):
    """1.0 for the longest response of the group, 0.0 for the others; ``size`` says how the group arrived."""
    longest = max(len(s.response) for s in samples)
    return [{"score": float(len(s.response) == longest) + bonus, "size": len(samples)} for s in samples]

@group_reward
def short(samples):
    return [1.0]
'''


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("rewards")
    (folder / "chaos.py").write_text(CHAOS)
    (folder / "group.py").write_text(GROUP)
    (folder / "kinds.py").write_text(
        "def all_args(response, label, prompt, source, metadata):\n"
        "    return {'score': 1.0, 'seen': [prompt, source, metadata]}\n"
        "def kw(response, **kwargs):\n"
        "    return {'score': 0.5, 'keys': sorted(kwargs)}\n"
        "def positional(text, gt):\n    return 1.0\n"
        "def extra(response, label, threshold):\n    return 1.0\n"
        "not_a_function = 3\n"
    )
    (folder / "broken.py").write_text("raise ImportError('needs a package that is missing')\n")
    return folder


def inputs(*responses: str, label: str = "ok") -> list[RewardInput]:
    return [RewardInput(response=r, label=label, source="src") for r in responses]


def test_each_bad_spec_is_one_named_line(reward_dir):
    d = reward_dir
    cases = {
        f"{d}/missing.py:fn": f"reward file {d}/missing.py does not exist",
        "no_such_package.mod:fn": "cannot import module 'no_such_package.mod': ModuleNotFoundError",
        f"{d}/broken.py:fn": "raised ImportError: needs a package that is missing",
        f"{d}/kinds.py:nope": "has no attribute 'nope'",
        f"{d}/kinds.py:not_a_function": "is a int, not a function",
        f"{d}/kinds.py:positional": "matches none of the accepted reward shapes",
        f"{d}/kinds.py:extra": "its argument 'threshold' would get no value",
        f"{d}/group.py:short:": "is not 'path/to/file.py:function'",
    }
    for spec, expected in cases.items():
        with pytest.raises(ConfigError) as err:
            check_reward_available(spec, field="algorithm.reward")
        message = str(err.value)
        assert message.startswith(f"algorithm.reward={spec!r}: ") and expected in message, message
        assert "\n" not in message
    with pytest.raises(ConfigError, match="reward_kwargs has 'mode', which the reward does not accept"):
        check_reward_available("numeric_match", kwargs={"mode": "all"})
    check_reward_available(f"{d}/kinds.py:extra", kwargs={"threshold": 0.5})  # now it gets a value
    check_reward_available("sapo_megatron.rewards.answers:numeric_match")  # package.module:function
    with pytest.raises(ConfigError, match="must start with http"):
        check_reward_available({"url": "localhost:1234"})


def test_config_accepts_every_spec_form():
    raw = embedded_default_dict()
    cfg = config_from_dict(raw)
    assert cfg.algorithm.reward == "numeric_match" and cfg.algorithm.reward_workers == "auto"
    assert default_workers("numeric_match") == 0  # the demo stays inline: no process start, same speed
    assert default_workers("math_verify") >= 1 and default_workers({"url": "http://x"}) == 0
    raw["algorithm"].update(
        reward={"url": "http://127.0.0.1:9/score", "api_key_env": "KEY"}, reward_workers=2
    )
    cfg = config_from_dict(raw)
    assert cfg.algorithm.reward.url.endswith("/score") and cfg.algorithm.reward.max_retries == 3
    raw["algorithm"]["reward_workers"] = -1
    with pytest.raises(ConfigError, match="reward_workers"):
        config_from_dict(raw)


def test_optional_arguments_and_kwargs(reward_dir):
    item = RewardInput(response="r", label="l", prompt="p", source="s", metadata={"k": 1})
    with build_reward_runner(f"{reward_dir}/kinds.py:all_args", workers=0) as runner:
        assert runner.score([item])[0].fields == {"seen": ["p", "s", {"k": 1}]}
    with build_reward_runner(f"{reward_dir}/kinds.py:kw", workers=0) as runner:
        out = runner.score([item])[0]
        assert (out.score, out.fields) == (0.5, {"keys": ["label", "metadata", "prompt", "source"]})


def test_pool_contains_every_failure_and_keeps_order(reward_dir):
    responses = ["ok", "raise", "hang", "die", "exit", "nan", "print", "no", "torch?", "ok"]
    with build_reward_runner(f"{reward_dir}/chaos.py:reward", workers=2, timeout_s=2.5) as runner:
        first_pids = {w.process.pid for w in runner.backend._workers}
        start = time.monotonic()
        out = runner.score(inputs(*responses))
        elapsed = time.monotonic() - start
        scores = [o.score for o in out]
        assert scores == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
        errors = {r: o.error for r, o in zip(responses, out) if o.error}
        assert set(errors) == {"raise", "hang", "die", "exit", "nan"}
        assert errors["raise"].startswith("RuntimeError: boom (at ")
        assert errors["hang"] == "timed out after 2.5 s (worker killed)"
        assert errors["die"] == "its reward worker died (killed by signal SIGKILL)"
        assert errors["exit"] == "its reward worker died (exit code 3)"
        assert errors["nan"] == "reward returned a non-finite score nan; a score is a finite number"
        assert out[0].fields["answer"] == "ok" and out[0].fields["source"] == "src"
        assert out[8].fields == {}  # no torch in the workers (score 0.0 = not imported)
        assert elapsed < 20  # bounded by the timeout, not by the 60 s sleep
        m = runner.metrics()
        assert (m["reward/worker_restarts"], m["reward/timeouts"], m["reward/errors"]) == (3.0, 1.0, 5.0)
        for pid in first_pids - {w.process.pid for w in runner.backend._workers}:
            assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
        with pytest.raises(RewardError) as err:  # 5 of 10 failed: past a 10 % budget
            runner.check_error_budget(0.1)
        assert "failed on 5 of 10 samples this step (50%)" in str(err.value)
        assert "first error: RuntimeError: boom" in str(err.value)
        step = runner.take_step_metrics()
        assert step["reward/error_frac"] == 0.5 and step["time/reward_s"] > 0
        # the replacement workers score the next batch normally
        again = runner.score(inputs("ok", "no", "ok", "main thread?"))
        assert [o.score for o in again] == [1.0, 0.0, 1.0, 1.0] and not any(o.error for o in again)
        assert {o.fields["pid"] for o in again[:3]} <= {w.process.pid for w in runner.backend._workers}
        runner.check_error_budget(0.0)
    assert all(w.process.poll() is not None for w in runner.backend._workers) or not runner.backend._workers
    assert "torch" not in os.environ.get("PYTHONPATH", "")


@pytest.mark.parametrize("workers", [0, 1])
def test_group_reward_gets_each_prompts_group(reward_dir, workers):
    items = [
        RewardInput(response=r, label="", group_id=g)
        for g, r in [(0, "a"), (0, "abc"), (1, "xy"), (1, "x"), (1, "")]
    ]
    with build_reward_runner(f"{reward_dir}/group.py:rank", workers=workers, kwargs={"bonus": 0.5}) as runner:
        out = runner.score(items)
        assert [o.score for o in out] == [0.5, 1.5, 1.5, 0.5, 0.5]
        assert [o.fields["size"] for o in out] == [2, 2, 3, 3, 3]
    with build_reward_runner(f"{reward_dir}/group.py:short", workers=0) as runner:
        out = runner.score(items[:2])
        assert [o.error for o in out] == ["group reward returned 1 scores for 2 samples"] * 2


def test_a_reward_that_only_breaks_in_a_fresh_process_stops_with_a_user_error(tmp_path):
    from sapo_megatron.errors import UserError
    from sapo_megatron.rewards.pool import PoolError

    for body, expected in [
        ("raise ImportError('only in workers')", "does not load in a worker process: RewardSpecError"),
        ("os._exit(5)", "died while starting (its reward worker died (exit code 5))"),
    ]:
        path = tmp_path / f"fragile_{len(body)}.py"
        path.write_text(
            f"import os, sys\nif sys.argv[0].endswith('worker.py'):\n    {body}\n"
            "def reward(response, label):\n    return 1.0\n"
        )
        runner = build_reward_runner(f"{path}:reward", workers=1, timeout_s=5)
        with runner, pytest.raises(PoolError) as err:
            runner.score(inputs("ok"))
        assert isinstance(err.value, UserError) and expected in str(err.value), str(err.value)


def test_workers_exit_when_the_trainer_dies_mid_call(tmp_path):
    import subprocess
    import sys

    started = tmp_path / "started"
    (tmp_path / "hang.py").write_text(
        f"import time\ndef r(response, label):\n    open({str(started)!r}, 'w').close()\n    time.sleep(600)\n"
    )
    trainer = (
        "import os, threading, time\n"
        "from sapo_megatron.rewards.pool import WorkerPool\n"
        "from sapo_megatron.rewards.types import RewardInput\n"
        f"pool = WorkerPool({str(tmp_path / 'hang.py')!r} + ':r', {{}}, workers=1, timeout_s=100)\n"
        "print(pool._workers[0].process.pid, flush=True)\n"
        "threading.Thread(target=lambda: pool.run([[RewardInput('x', 'y')]]), daemon=True).start()\n"
        f"while not os.path.exists({str(started)!r}):\n    time.sleep(0.05)\n"
        "os._exit(0)\n"  # dies without closing the runner, its worker inside the hanging reward
    )
    done = subprocess.run(
        [sys.executable, "-c", trainer], capture_output=True, text=True, timeout=60, check=True
    )
    worker = Path(f"/proc/{done.stdout.split()[0]}")
    deadline = time.monotonic() + 10
    while worker.exists() and "zombie" not in _state(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not worker.exists() or "zombie" in _state(worker)


def _state(proc: Path) -> str:
    try:
        return next(line for line in (proc / "status").read_text().splitlines() if line.startswith("State"))
    except (OSError, StopIteration):
        return "zombie"


@pytest.mark.parametrize("mix", [False, True], ids=["one reward", "a mix"])
def test_step_metrics_and_error_budget_are_per_thread(reward_dir, mix):
    """The fully-async producer scores several chunks at once, each in its own thread: a chunk's step metrics and
    error budget count its own samples only, however the scoring calls interleave."""
    import threading

    spec = f"{reward_dir}/chaos.py:reward"
    runner = build_reward_runner(
        [spec, {"reward": spec, "weight": 2.0, "name": "twice"}] if mix else spec, workers=0
    )
    in_turn = threading.Barrier(2)
    results: dict[str, dict[str, float]] = {}
    budget: dict[str, str] = {}

    def chunk(name: str, batches: list[list[str]]) -> None:
        for responses in batches:
            runner.score(inputs(*responses))
            in_turn.wait(timeout=30)  # the other chunk scores between this chunk's calls
        try:
            runner.check_error_budget(0.3)
            budget[name] = "ok"
        except RewardError as exc:
            budget[name] = str(exc)
        results[name] = runner.take_step_metrics()

    threads = [
        threading.Thread(target=chunk, args=("clean", [["ok", "no"], ["ok", "ok"]])),
        threading.Thread(target=chunk, args=("failing", [["raise", "ok"], ["raise", "raise"]])),
    ]
    with runner:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert runner.metrics()["reward/calls"] == 8.0 and runner.metrics()["reward/errors"] == 3.0
        assert runner.take_step_metrics()["reward/errors"] == 0.0  # the main thread scored nothing
    assert results["clean"]["reward/error_frac"] == 0.0 and results["clean"]["reward/errors"] == 0.0
    assert results["failing"]["reward/error_frac"] == 0.75 and results["failing"]["reward/errors"] == 3.0
    assert budget["clean"] == "ok" and "on 3 of 4 samples" in budget["failing"]
    if mix:  # the per-function means of each chunk's own samples: 3 of 4 right, 1 of 4
        name = next(key for key in results["clean"] if key.endswith("/mean"))
        assert results["clean"][name] == 0.75 and results["failing"][name] == 0.25
