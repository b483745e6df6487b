"""Fixtures of the launch tests: a real one-machine Slurm cluster and the tiny demo model as an HF directory.

Without Slurm (not root, slurm-wlm not installed) the Slurm tests are skipped, unless SAPO_REQUIRE_SLURM=1 (set by
.ci/run), which turns that into a failure so that CI can never pass by skipping them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.launch.slurm import SlurmUnavailable, start_cluster

BIN = Path(sys.executable).parent


@pytest.fixture(scope="session")
def slurm_cluster() -> None:
    try:
        start_cluster()
    except SlurmUnavailable as reason:
        if os.environ.get("SAPO_REQUIRE_SLURM") == "1":
            pytest.fail(f"SAPO_REQUIRE_SLURM=1 but Slurm is not usable: {reason}")
        pytest.skip(f"no Slurm here: {reason}")


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory) -> Path:
    """The embedded demo architecture (sapo_megatron.defaults.DEMO_MODEL), random weights, with its tokenizer."""
    import torch
    import transformers

    from sapo_megatron.data.tokenizer import CharTokenizer
    from sapo_megatron.defaults import DEMO_MODEL

    path = tmp_path_factory.mktemp("demo_hf")
    fields = {key: value for key, value in DEMO_MODEL.items() if key != "model_type"}
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**fields)).save_pretrained(path)
    CharTokenizer().save(path)
    return path


@pytest.fixture(scope="session")
def launch_env() -> dict[str, str]:
    """Environment every submitted job gets on top of this one: this venv's python and CLI, the loopback
    interface for binding (exercises SAPO_BIND_IFNAME), fast polling."""
    return {
        "SAPO_PYTHON": sys.executable,
        "SAPO_MEGATRON": str(BIN / "sapo-megatron"),
        "SAPO_BIND_IFNAME": "lo",
        "SAPO_POLL_S": "0.2",
        "PATH": f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}",
    }
