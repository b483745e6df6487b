"""A real SGLang 0.5.23 server on CPU for the benchmarks (``--engine sglang`` of bench_multiturn.py and
bench_fully_async.py): ``tools/sglang_cpu/serve.sh`` from ``$SAPO_SGLANG_VENV`` (default /opt/sapo-sglang-venv),
float32, one thread, as tests/sglang_real starts it; continuous batching and its prefix cache are SGLang's own.

The model is the embedded demo's architecture widened to ``hidden``, with the character tokenizer, and no
end-of-sequence token in the config, generation config or tokenizer files, so that SGLang (which also stops at the
tokenizer's EOS) never ends a response early: every response runs to its ``max_new_tokens``.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def sglang_venv() -> Path:
    return Path(os.environ.get("SAPO_SGLANG_VENV", "/opt/sapo-sglang-venv"))


def save_sglang_model(path: Path, hidden: int) -> Path:
    """The demo's Qwen3-MoE widened to ``hidden`` (random weights, seed 0), without EOS, with its tokenizer."""
    import torch
    import transformers

    from sapo_megatron.defaults import DEMO_MODEL, TOKENIZER

    torch.manual_seed(0)
    sizes = {"hidden_size": hidden, "intermediate_size": 2 * hidden, "moe_intermediate_size": hidden}
    sizes |= {"head_dim": hidden // 4, "max_position_embeddings": 1024, "eos_token_id": None}
    config = transformers.Qwen3MoeConfig(**{**DEMO_MODEL, **sizes})
    transformers.Qwen3MoeForCausalLM(config).save_pretrained(path)
    TOKENIZER.save(path)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        data = json.loads((path / name).read_text())
        data.pop("eos_token", None)
        (path / name).write_text(json.dumps(data))
    return path


@contextlib.contextmanager
def sglang_server(
    model: Path, log: Path, *, timeout_s: float = 600.0, extra_flags: Sequence[str] = ()
) -> Iterator[str]:
    """A real SGLang server on CPU serving ``model``, its output in ``log``; yields its URL once healthy and stops
    its process group on exit. ``extra_flags``: more ``sglang.launch_server`` flags (scheduler settings such as
    ``--enable-mixed-chunk``). Exits with one line when ``$SAPO_SGLANG_VENV`` holds no installed SGLang."""
    from sapo_megatron.cli import free_port
    from tests.servers import process

    venv = sglang_venv()
    if not (venv / ".sapo-sglang-installed").is_file():
        raise SystemExit(f"no real SGLang at {venv}; run tools/sglang_cpu/install.sh {venv}")
    port = free_port()
    flags = ["--dtype", "float32", "--random-seed", "0", "--log-level", "warning"]
    command = [
        str(REPO / "tools/sglang_cpu/serve.sh"),
        "--model-path",
        str(model),
        "--port",
        str(port),
        *flags,
        *extra_flags,
    ]
    with process(command, log, f"http://127.0.0.1:{port}", timeout=timeout_s) as url:
        yield url
