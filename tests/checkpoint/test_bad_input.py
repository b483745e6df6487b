"""Bad input is refused before anything is written, with a message that names the tensor and what was expected;
an output that would overwrite an input is refused even with --force; a run folder is a valid --megatron; an
interrupted conversion never leaves an output that looks complete."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sapo_megatron.checkpoint import atomic
from sapo_megatron.checkpoint.atomic import IncompleteCheckpointError
from sapo_megatron.conversion import cli, convert, to_megatron
from sapo_megatron.conversion import verify as parity
from sapo_megatron.conversion.convert import ConversionError, hf_to_megatron, megatron_to_hf
from sapo_megatron.data.tokenizer import CharTokenizer
from tests.checkpoint.conftest import assert_bitwise_equal, read_hf_tensors
from tests.distributed import run_distributed

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def hf_copy(hf_checkpoints, tmp_path) -> Path:
    """A private copy of the tiny fp32 MoE checkpoint, to damage."""
    return Path(shutil.copytree(hf_checkpoints["moe-fp32"], tmp_path / "hf"))


def _edit_tensors(hf_dir: Path, edit) -> None:
    tensors = load_file(hf_dir / "model.safetensors")
    edit(tensors)
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})


def _convert_fails(hf_dir: Path, out: Path) -> str:
    with pytest.raises(ConversionError) as err:
        hf_to_megatron(hf_dir, out, progress=False)
    assert not out.exists() and not atomic.partial_path(out).exists(), "something was written"
    return str(err.value)


def test_missing_tensor(hf_copy, tmp_path):
    _edit_tensors(hf_copy, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    message = _convert_fails(hf_copy, tmp_path / "out")
    assert "missing tensor model.layers.1.self_attn.k_proj.weight (expected shape (16, 32))" in message


def test_unexpected_tensor(hf_copy, tmp_path):
    _edit_tensors(hf_copy, lambda t: t.update({"model.layers.0.mlp.shared_expert.weight": torch.zeros(4, 4)}))
    message = _convert_fails(hf_copy, tmp_path / "out")
    assert "unexpected tensor model.layers.0.mlp.shared_expert.weight" in message


def test_wrong_shape(hf_copy, tmp_path):
    _edit_tensors(
        hf_copy, lambda t: t.update({"model.layers.0.self_attn.o_proj.weight": torch.zeros(32, 16)})
    )
    message = _convert_fails(hf_copy, tmp_path / "out")
    assert (
        "tensor model.layers.0.self_attn.o_proj.weight has shape (32, 16), the config implies (32, 32)"
        in message
    )


def test_wrong_dtype(hf_copy, tmp_path):
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    _edit_tensors(hf_copy, lambda t: t.update({name: t[name].half()}))
    message = _convert_fails(hf_copy, tmp_path / "out")
    assert f"tensor {name} has dtype F16, expected F32" in message


def test_config_disagrees_with_weights(hf_copy, tmp_path):
    config = json.loads((hf_copy / "config.json").read_text())
    config["num_local_experts"] = config["num_experts"] = 4  # the weights hold 8 experts per layer
    (hf_copy / "config.json").write_text(json.dumps(config))
    message = _convert_fails(hf_copy, tmp_path / "out")
    assert "unexpected tensor model.layers.0.mlp.experts.4.down_proj.weight" in message
    assert "model.layers.0.mlp.gate.weight has shape (8, 32), the config implies (4, 32)" in message
    assert "hint: config.json says num_experts=4, the weights hold 8 experts per MoE layer" in message


def test_unsupported_config(hf_copy, tmp_path):
    config = json.loads((hf_copy / "config.json").read_text())
    config["hidden_act"] = "gelu"
    (hf_copy / "config.json").write_text(json.dumps(config))
    assert "hidden_act='gelu' is not supported" in _convert_fails(hf_copy, tmp_path / "out")


def test_refuses_non_empty_output_unless_forced(hf_checkpoints, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not empty; choose another path or pass --force"):
        hf_to_megatron(hf_checkpoints["dense-fp32"], out, progress=False)
    assert (out / "precious.txt").read_text() == "keep me"
    hf_to_megatron(hf_checkpoints["dense-fp32"], out, force=True, progress=False)
    assert atomic.read_marker(out)["kind"] == "model" and not (out / "precious.txt").exists()


def test_error_inside_conversion_leaves_nothing(hf_checkpoints, tmp_path, monkeypatch):
    calls = []
    build = to_megatron._Materializer._build

    def failing_build(self, p_idx):
        calls.append(p_idx)
        if len(calls) > 5:
            raise OSError("disk on fire")
        return build(self, p_idx)

    monkeypatch.setattr(to_megatron._Materializer, "_build", failing_build)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="disk on fire"):
        hf_to_megatron(hf_checkpoints["moe-fp32"], out, progress=False, workers=1)
    assert not out.exists() and not atomic.partial_path(out).exists()


_SLOW_CONVERSION = """
import sys, time
from sapo_megatron.conversion import convert, to_megatron
build = to_megatron._Materializer._build
def slow_build(self, p_idx):
    if p_idx == 10:
        print("WRITING", flush=True)
        time.sleep(120)
    return build(self, p_idx)
to_megatron._Materializer._build = slow_build
convert.hf_to_megatron(sys.argv[1], sys.argv[2], progress=False, workers=1)
"""


def test_killed_conversion_is_never_mistaken_for_a_checkpoint(hf_checkpoints, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_CONVERSION, str(hf_checkpoints["moe-fp32"]), str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert proc.stdout.readline().strip() == "WRITING"
        time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    partial = atomic.partial_path(out)
    assert not out.exists() and partial.is_dir()
    with pytest.raises(IncompleteCheckpointError, match="interrupted save"):
        megatron_to_hf(partial, tmp_path / "hf", progress=False)
    hf_to_megatron(hf_checkpoints["moe-fp32"], out, progress=False)  # a rerun cleans up and completes
    assert not partial.exists() and atomic.read_marker(out)


def test_directory_without_marker_is_refused(converted, tmp_path):
    damaged = Path(shutil.copytree(converted["dense-fp32"], tmp_path / "damaged"))
    (damaged / atomic.MARKER).unlink()
    with pytest.raises(IncompleteCheckpointError, match=f"{damaged} is not a complete checkpoint"):
        megatron_to_hf(damaged, tmp_path / "hf", progress=False)
    assert not (tmp_path / "hf").exists()


def test_cli_reports_bad_input_and_converts(hf_copy, tmp_path, capsys):
    _edit_tensors(hf_copy, lambda t: t.pop("model.norm.weight"))
    assert cli.main(["convert", "hf-to-megatron", "--hf", str(hf_copy), "--out", str(tmp_path / "x")]) == 2
    assert "missing tensor model.norm.weight" in capsys.readouterr().err


def test_cli_round_trip(hf_checkpoints, tmp_path):
    hf = hf_checkpoints["dense-bf16"]
    mcore, back = tmp_path / "mcore", tmp_path / "back"
    assert cli.main(["convert", "hf-to-megatron", "--hf", str(hf), "--out", str(mcore), "--no-progress"]) == 0
    args = [
        "convert",
        "megatron-to-hf",
        "--megatron",
        str(mcore),
        "--out",
        str(back),
        "--hf-reference",
        str(hf),
    ]
    assert cli.main([*args, "--max-shard-size", "20KB", "--no-progress"]) == 0
    assert read_hf_tensors(back).keys() == read_hf_tensors(hf).keys()
    assert (back / "model.safetensors.index.json").is_file()


def test_cli_verify_exit_status(monkeypatch):
    def fake_verify(*args, tolerance=None, **kwargs):
        return convert.ParityReport(2e-3, 1e-4, 0.9999, tolerance or 1e-3, "fp32", 64)

    monkeypatch.setattr(parity, "verify", fake_verify)
    base = ["convert", "verify", "--hf", "a", "--megatron", "b"]
    assert cli.main(base) == 1
    assert cli.main([*base, "--tolerance", "1e-2"]) == 0


def test_parse_size():
    assert cli.parse_size("5GB") == 5 * 10**9
    assert cli.parse_size("512MiB") == 512 * 2**20
    assert cli.parse_size("1000") == 1000


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    ("hf_arg", "out_arg"),
    [("hf", "hf"), ("hf", "hf/megatron"), ("run/hf", "run")],
    ids=["same", "output-inside-input", "input-inside-output"],
)
def test_hf_to_megatron_never_overwrites_its_input(hf_checkpoints, tmp_path, capsys, hf_arg, out_arg):
    hf = Path(shutil.copytree(hf_checkpoints["dense-fp32"], tmp_path / hf_arg))
    before = _tree(tmp_path)
    argv = ["convert", "hf-to-megatron", "--hf", str(hf), "--out", str(tmp_path / out_arg), "--force"]
    assert cli.main([*argv, "--no-progress"]) == 2
    relation = {"same": "is the same directory as", "output": "lies inside", "input": "contains"}
    err = capsys.readouterr().err
    assert (
        f"error: the output directory {tmp_path / out_arg} " in err
        and f"the HF checkpoint (--hf) {hf}" in err
    )
    assert any(text in err for text in relation.values()) and "--force does not change that" in err
    assert _tree(tmp_path) == before  # nothing written, nothing removed


def test_megatron_to_hf_never_overwrites_its_inputs(converted, hf_checkpoints, tmp_path, capsys):
    mcore = Path(shutil.copytree(converted["dense-fp32"], tmp_path / "mcore"))
    reference = Path(shutil.copytree(hf_checkpoints["dense-fp32"], tmp_path / "reference"))
    before = _tree(tmp_path)
    base = ["convert", "megatron-to-hf", "--megatron", str(mcore), "--force", "--no-progress"]
    assert cli.main([*base, "--out", str(mcore)]) == 2
    assert f"{mcore} is the same directory as the Megatron checkpoint (--megatron)" in capsys.readouterr().err
    assert cli.main([*base, "--out", str(reference), "--hf-reference", str(reference)]) == 2
    assert (
        f"{reference} is the same directory as the HF reference (--hf-reference)" in capsys.readouterr().err
    )
    assert cli.main([*base, "--out", str(tmp_path)]) == 2
    assert f"{tmp_path} contains the Megatron checkpoint (--megatron) {mcore}" in capsys.readouterr().err
    assert _tree(tmp_path) == before


def _fake_run(tmp_path: Path, checkpoint: Path) -> Path:
    """A training run's output_dir: checkpoints/step_000002 (+ latest) and an hf/ export with the tokenizer."""
    run = tmp_path / "run"
    shutil.copytree(checkpoint, run / "checkpoints" / "step_000002")
    (run / "checkpoints" / "latest").write_text("step_000002\n")
    CharTokenizer().save(run / "hf")
    return run


def test_megatron_to_hf_accepts_a_run_folder(converted, hf_checkpoints, tmp_path, capsys):
    run = _fake_run(tmp_path, converted["dense-fp32"])
    out = tmp_path / "export"
    assert (
        cli.main(["convert", "megatron-to-hf", "--megatron", str(run), "--out", str(out), "--no-progress"])
        == 0
    )
    assert f"copying the run's tokenizer files from {run / 'hf'}" in capsys.readouterr().out
    assert_bitwise_equal(read_hf_tensors(out), read_hf_tensors(hf_checkpoints["dense-fp32"]))
    for name in ("tokenizer.json", "tokenizer_config.json", "char_tokenizer.json"):
        assert (out / name).read_bytes() == (run / "hf" / name).read_bytes()
    # re-exporting into the run's own hf/ is allowed (it is no input of the weights)
    argv = ["convert", "megatron-to-hf", "--megatron", str(run), "--out", str(run / "hf"), "--force"]
    assert cli.main([*argv, "--no-progress"]) == 0
    assert_bitwise_equal(read_hf_tensors(run / "hf"), read_hf_tensors(hf_checkpoints["dense-fp32"]))


def test_what_is_not_a_checkpoint_is_explained(tmp_path):
    def refusal(path: Path) -> str:
        with pytest.raises(IncompleteCheckpointError) as err:
            megatron_to_hf(path, tmp_path / "out", progress=False)
        assert not (tmp_path / "out").exists()
        return str(err.value)

    (tmp_path / "empty").mkdir()
    assert refusal(tmp_path / "empty") == (
        f"{tmp_path / 'empty'} is not a Megatron checkpoint: looked for {tmp_path / 'empty' / atomic.MARKER} "
        f"(a checkpoint), {tmp_path / 'empty' / 'latest'} (a folder of checkpoints) and "
        f"{tmp_path / 'empty' / 'checkpoints' / 'latest'} (a training run's output_dir)"
    )
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    assert refusal(tmp_path / "run").endswith(
        "has no 'latest' pointer: no checkpoint of this run was completed"
    )
    CharTokenizer().save(tmp_path / "exported" / "hf")
    (tmp_path / "exported" / "hf" / "config.json").write_text("{}")
    assert refusal(tmp_path / "exported").endswith(
        f"this run's HF export is already in {tmp_path / 'exported' / 'hf'}"
    )
    assert refusal(tmp_path / "missing") == f"checkpoint directory {tmp_path / 'missing'} does not exist"


def save_initial_train_state(payload: dict) -> None:
    """One rank: a TrainEngine initialised from an HF checkpoint saves its training state as the trainer does."""
    from sapo_megatron.config import config_from_dict
    from sapo_megatron.megatron import dist_ckpt
    from sapo_megatron.megatron.parallel import init_parallel
    from sapo_megatron.megatron.train_step import TrainEngine
    from tests.checkpoint.scenarios import _allow_child_processes

    _allow_child_processes()  # Megatron's checkpoint writer starts worker processes
    hf = payload["hf_dir"]
    cfg = config_from_dict({"model": {"hf_config": hf, "init": "hf", "init_path": hf}})
    init_parallel(cfg.parallel, seed=0, cfg=cfg, cpu_threads=1)
    engine = TrainEngine(cfg, total_steps=2)
    dist_ckpt.save_train_state(engine, Path(payload["run"]) / "checkpoints" / "step_000001", {"step": 1})


def test_training_state_of_a_run_exports_its_weights(hf_checkpoints, tmp_path):
    hf = hf_checkpoints["moe-fp32"]
    run_distributed(
        f"{__name__}:save_initial_train_state", 1, {"hf_dir": str(hf), "run": str(tmp_path / "run")}
    )
    marker = atomic.read_marker(tmp_path / "run" / "checkpoints" / "step_000001")
    assert marker["kind"] == "train_state"  # model, optimizer, schedule and RNG in one checkpoint
    megatron_to_hf(tmp_path / "run", tmp_path / "export", progress=False)
    assert_bitwise_equal(read_hf_tensors(tmp_path / "export"), read_hf_tensors(hf))
