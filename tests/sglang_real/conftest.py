"""The real SGLang server on CPU (tools/sglang_cpu), shared by every test of this tier: ONE server per session,
started from the virtualenv that ``tools/sglang_cpu/install.sh`` made (``$SAPO_SGLANG_VENV``, default
``/opt/sapo-sglang-venv``), on the embedded demo's architecture (random weights, the project's character
tokenizer), in float32, with routed experts and an API key.

The tier runs when asked: SAPO_REQUIRE_SGLANG=1 (``make test-sglang``) or SAPO_SGLANG_VENV set; a plain
``pytest`` / ``make test`` skips it, even where the virtualenv exists, so that adding it to CI is a decision taken
in ``.ci/run``. Asked for without the virtualenv (or when the server does not start), it is skipped, unless
SAPO_REQUIRE_SGLANG=1, which turns that into a failure, as SAPO_REQUIRE_SLURM does for the Slurm tests.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import httpx
import pytest
import torch
import transformers

from sapo_megatron.rollout.sglang.client import SGLangClient
from tests.ports import free_port
from tests.servers import ServerStartError, cpu_server, process, save_demo_model

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVE = REPO_ROOT / "tools" / "sglang_cpu" / "serve.sh"
STAMP = ".sapo-sglang-installed"
API_KEY = "sapo-conformance-key"
NUM_LAYERS, TOP_K = 2, 2  # sapo_megatron.defaults.DEMO_MODEL
# 80-130 s on an idle 2-core machine; the suite's other processes can double it.
STARTUP_TIMEOUT_S = float(os.environ.get("SAPO_SGLANG_STARTUP_S", "420"))


def sglang_venv() -> Path:
    return Path(os.environ.get("SAPO_SGLANG_VENV", "/opt/sapo-sglang-venv"))


def unavailable(reason: str) -> None:
    if os.environ.get("SAPO_REQUIRE_SGLANG") == "1":
        pytest.fail(f"SAPO_REQUIRE_SGLANG=1 but real SGLang is not usable: {reason}")
    pytest.skip(f"no real SGLang here: {reason}")


def pytest_collection_modifyitems(config, items) -> None:
    """Skip the tier before any fixture starts a server unless it was asked for."""
    if os.environ.get("SAPO_REQUIRE_SGLANG") == "1" or os.environ.get("SAPO_SGLANG_VENV"):
        return
    reason = "the real-SGLang tier runs with SAPO_REQUIRE_SGLANG=1 (make test-sglang) or SAPO_SGLANG_VENV set"
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return save_demo_model(tmp_path_factory.mktemp("sglang_model"), seed=0)


@pytest.fixture(scope="session")
def reference(model_dir) -> torch.nn.Module:
    """The same checkpoint in transformers, float32: what the served log-probs and routes are checked against."""
    return transformers.Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@contextlib.contextmanager
def sglang_process(model_dir: Path, log: Path, *flags: str, venv: Path | None = None):
    """A real server from ``venv`` (default: the tier's; the VL tests pass install_vl.sh's)."""
    venv = venv or sglang_venv()
    if not (venv / STAMP).is_file():
        script = "install_vl.sh" if venv != sglang_venv() else "install.sh"
        unavailable(f"{venv} has no {STAMP}; run tools/sglang_cpu/{script} {venv}")
    port = free_port()
    command = [str(SERVE), "--model-path", str(model_dir), "--port", str(port), *flags]
    if venv != sglang_venv():
        command = ["env", f"SAPO_SGLANG_VENV={venv}", *command]
    with contextlib.ExitStack() as stack:  # the server is stopped and reaped however the tests end
        try:
            url = stack.enter_context(
                process(command, log, f"http://127.0.0.1:{port}", timeout=STARTUP_TIMEOUT_S)
            )
        except ServerStartError as exc:
            unavailable(f"the server did not start: {exc}")
        yield url


def real_server_flags() -> list[str]:
    """The tier's server: float32, the API key, routed experts, a fixed seed."""
    flags = ["--dtype", "float32", "--api-key", API_KEY, "--enable-return-routed-experts"]
    return [*flags, "--random-seed", "0", "--log-level", "warning"]


@pytest.fixture(scope="session")
def sglang_url(model_dir, tmp_path_factory):
    """One real server for the whole tier (its start is the tier's main cost)."""
    log = tmp_path_factory.mktemp("sglang_log") / "server.log"
    with sglang_process(model_dir, log, *real_server_flags()) as url:
        yield url


@pytest.fixture(scope="session")
def sglang_bf16_url(model_dir, tmp_path_factory):
    """A second real server in bfloat16 (the precision clusters serve in); started when a test asks for it."""
    log = tmp_path_factory.mktemp("sglang_bf16_log") / "server.log"
    with sglang_process(model_dir, log, "--dtype", "bfloat16", "--log-level", "warning") as url:
        yield url


@pytest.fixture(scope="session")
def standin_url(model_dir, tmp_path_factory):
    """The project's CPU server on the same checkpoint, for the checks that compare it with SGLang."""
    with cpu_server(model_dir, tmp_path_factory.mktemp("standin_log") / "server.log", api_key=API_KEY) as url:
        yield url


@pytest.fixture()
def client(sglang_url):
    engine = SGLangClient(
        [sglang_url], api_key=API_KEY, num_layers=NUM_LAYERS, top_k=TOP_K, timeout_s=120.0, max_retries=0
    )
    yield engine
    engine.close()


def restore_weights(url: str, model_dir: Path, headers: dict[str, str] | None = None) -> None:
    """Load ``model_dir`` back into the server at ``url`` (``update_weights_from_disk``), so that the tests after a
    training run see the weights they expect."""
    reply = httpx.post(
        url + "/update_weights_from_disk",
        json={"model_path": str(model_dir)},
        headers=headers or {"Authorization": f"Bearer {API_KEY}"},
        timeout=300,
    )
    assert reply.json()["success"] is True, (url, reply.text[:500])
