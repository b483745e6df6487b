"""The serve command line: SGLang's flag names, one "serving ..." line, clean exit on signals, clear refusals."""

from __future__ import annotations

import argparse
import signal

import httpx
import pytest

from sapo_megatron.rollout.cpu.server import ServeError, add_serve_arguments, main, serve_from_args
from tests.rollout.server_process import ServerProcess


def parser() -> argparse.ArgumentParser:
    result = argparse.ArgumentParser(prog="serve")
    add_serve_arguments(result)
    return result


def test_flags_take_sglangs_names_and_aliases():
    args = parser().parse_args(
        [
            "--model",
            "/m",
            "--tensor-parallel-size",
            "1",
            "--random-seed",
            "5",
            "--enable-return-routed-experts",
        ]
    )
    assert (args.model_path, args.tp_size, args.seed, args.enable_return_routed_experts) == ("/m", 1, 5, True)
    args = parser().parse_args(["--model-path", "/m", "--tp", "1", "--api-key", "k", "--dist-timeout", "9"])
    assert (args.host, args.port, args.api_key, args.dist_timeout, args.threads) == (
        "127.0.0.1",
        30000,
        "k",
        9.0,
        None,
    )


def test_every_option_shows_its_default_in_help():
    text = " ".join(parser().format_help().split())
    for default in ("(default: 127.0.0.1)", "(default: 30000)", "(default: None, no key)", "(default: 1)"):
        assert default in text
    assert text.count("(default:") == 20  # every option but --model-path (required) and -h


def test_unknown_flags_are_named(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parser().parse_args(["--model-path", "/m", "--mem-fraction-static", "0.8"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --mem-fraction-static 0.8" in capsys.readouterr().err


def test_only_one_tensor_parallel_rank(capsys, moe_dir):
    with pytest.raises(ServeError, match="only --tp-size 1"):
        serve_from_args(parser().parse_args(["--model-path", str(moe_dir), "--tp-size", "2"]))
    assert main(["--model-path", str(moe_dir), "--tp", "4"]) == 2
    assert "error: --tp-size 4: the CPU server runs a single rank" in capsys.readouterr().err


def test_missing_model_is_a_clear_error(capsys, tmp_path):
    assert main(["--model-path", str(tmp_path / "nope"), "--port", "0"]) == 2
    assert "--model-path" in capsys.readouterr().err


@pytest.mark.slow
def test_module_serves_with_sglang_flags_and_stops_on_sigint(moe_dir):
    flags = ["--model-path", str(moe_dir), "--port", "0", "--threads", "1", "--api-key", "k", "--tp", "1"]
    proc = ServerProcess(*flags, "--enable-return-routed-experts", "--seed", "3")
    try:
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}, "return_routed_experts": True}
        assert httpx.post(proc.url + "/generate", json=body, timeout=60).status_code == 401
        reply = httpx.post(
            proc.url + "/generate", json=body, headers={"Authorization": "Bearer k"}, timeout=60
        )
        assert len(reply.json()["output_ids"]) == 2 and "routed_experts" in reply.json()["meta_info"]
        info = httpx.get(
            proc.url + "/get_server_info", headers={"Authorization": "Bearer k"}, timeout=30
        ).json()
        assert info["random_seed"] == 3 and info["tp_size"] == 1
    finally:
        code = proc.stop(signal.SIGINT)
    assert code == 0 and "Traceback" not in proc.stderr
    assert proc.lines == [f"serving {moe_dir} at {proc.url}\n"]
