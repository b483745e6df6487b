"""tools/gpu_check.py: the GPU validation script. On CPU its checks run with --allow-cpu (contract test);
on a CUDA machine the real run must pass every check it does not skip."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "gpu_check.py"
HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
FP8_RECIPES = ("delayed", "tensorwise", "blockwise", "mxfp8")


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600, check=False
    )


def table_rows(stdout: str) -> dict[str, str]:
    return {name: status for name, (status, _) in table_details(stdout).items()}


def table_details(stdout: str) -> dict[str, tuple[str, str]]:
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[1] in ("PASS", "FAIL", "SKIP"):
            rows[cells[0]] = (cells[1], "|".join(cells[2:]))
    return rows


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU contract run is for machines without CUDA")
def test_checks_run_on_cpu_and_report_a_table():
    proc = run_script("--allow-cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = table_rows(proc.stdout)
    for kind in ("dense", "moe"):
        assert rows[f"{kind}: logit parity vs HF, local spec"] == "PASS"
        assert rows[f"{kind}: SFT + SAPO steps, fp32"] == "PASS"
        assert rows[f"{kind}: packed vs padded micro-batches"] == "PASS"
        assert rows[f"{kind}: trainer offload and onload"] == "PASS"
        assert rows[f"{kind}: SFT + SAPO steps, bf16"] == "PASS"
        expected_te = "PASS" if HAVE_TE else "SKIP"
        assert rows[f"{kind}: logit parity vs HF, TE spec"] == expected_te
    assert rows["vl_moe: logit parity vs HF (images), local spec"] == "PASS"
    assert rows["vl_moe: logit parity vs HF (images), TE spec"] == ("PASS" if HAVE_TE else "SKIP")
    assert (
        rows["vl_moe: SFT steps with images, fp32"] == rows["vl_moe: SFT steps with images, bf16"] == "PASS"
    )
    status, detail = table_details(proc.stdout)["chunked log-probs: memory and values vs naive"]
    assert status == "PASS" and "values and gradients only" in detail
    status, detail = table_details(proc.stdout)["process group of one: collectives"]
    assert status == "PASS" and detail.startswith("gloo:")
    status, detail = table_details(proc.stdout)["tensor transport to a second process"]
    assert status == "PASS" and "bytes equal, its write seen here" in detail
    for kind in ("dense", "moe"):
        assert rows[f"{kind}: logit parity vs HF, local spec, bf16"] == "PASS"
        assert rows[f"{kind}: packed THD through TE vs padded"] == ("PASS" if HAVE_TE else "SKIP")
        assert (
            "moved to pageable CPU memory"
            in table_details(proc.stdout)[f"{kind}: trainer offload and onload"][1]
        )
    # every SKIP was announced, with its reason, before the first row ran
    announced = proc.stdout.split("[PASS]", 1)[0]
    for name, (status, detail) in table_details(proc.stdout).items():
        if status == "SKIP":
            assert f"  SKIP  {name}: {detail.rsplit(' (', 1)[0]}" in announced
    details = table_details(proc.stdout)
    for recipe in FP8_RECIPES:  # every recipe has its row; without TE each says why it did not run
        status, detail = details[f"fp8 {recipe} vs bf16: loss, logits, step time"]
        assert status == "SKIP" and "Transformer Engine, which is not installed" in detail
    status, detail = details["fused paths active"]
    assert status == "PASS" and "Adam torch.optim" in detail and "local_multi_tensor_applier" in detail
    assert "no apex" in detail and "WrappedTorchNorm (torch fallback)" in detail
    status, detail = details["planner: activations vs measured"]
    kept_ratio = float(re.search(r"kept [\d.]+ MiB \(planner ([\d.]+)x\)", detail).group(1))
    assert status == "PASS" and "local spec" in detail and abs(kept_ratio - 1) <= 0.05


@pytest.mark.slow  # imports every module the rows need (megatron-core, transformers): about 10 s
def test_a_missing_import_is_named_with_the_module_that_needs_it(monkeypatch):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(SCRIPT.parent))
    assert gpu_check.missing_module() is None  # this environment has every module the rows import
    monkeypatch.setattr(gpu_check, "NEEDED_MODULES", ("sapo_megatron.config", "tests.gpu_kit_absent_module"))
    monkeypatch.setitem(sys.modules, "tests.gpu_kit_absent_module", None)  # import raises ModuleNotFoundError
    line = gpu_check.missing_module()
    assert line.startswith(
        "gpu_check: cannot import tests.gpu_kit_absent_module (needed by tests.gpu_kit_absent_module)"
    )
    assert "tools/gpu_kit/kit.txt" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal shown where no GPU exists")
def test_refuses_without_gpu_unless_asked():
    proc = run_script()
    assert proc.returncode == 2
    assert "no CUDA device here" in proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_checks_pass_on_cuda():
    proc = run_script()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = table_rows(proc.stdout)
    assert rows["moe: logit parity vs HF, local spec"] == "PASS"
    assert rows["chunked log-probs: memory and values vs naive"] == "PASS"
    assert rows["planner: activations vs measured"] == "PASS"
    assert rows["fused paths active"] == "PASS"
    for kind in ("dense", "moe"):
        assert rows[f"{kind}: logit parity vs HF, local spec, bf16"] == "PASS"
        assert rows[f"{kind}: trainer offload and onload"] == "PASS"
    assert rows["process group of one: collectives"] == "PASS"
    assert rows["tensor transport to a second process"] == "PASS"
    for (
        recipe
    ) in FP8_RECIPES:  # SKIP only for a missing TE or a GPU without the recipe (mxfp8 before Blackwell)
        assert rows[f"fp8 {recipe} vs bf16: loss, logits, step time"] in ("PASS", "SKIP")
    if HAVE_TE:
        assert rows["fp8 tensorwise vs bf16: loss, logits, step time"] == "PASS"


def test_the_one_command_stops_without_a_kit_or_an_out_folder(tmp_path):
    run_sh = SCRIPT.parent / "gpu_kit" / "run.sh"
    env = {"PATH": os.environ["PATH"], "GPU_KIT_DIR": str(tmp_path / "no_kit"), "OUT": str(tmp_path / "out")}
    proc = subprocess.run(["bash", str(run_sh)], capture_output=True, text=True, env=env, check=False)
    assert proc.returncode == 3
    assert f"no wheels in {tmp_path / 'no_kit'}: run tools/gpu_kit.sh and carry" in proc.stdout
    assert "no wheels in" in (tmp_path / "out" / "gpu_check.log").read_text()
    del env["OUT"]
    proc = subprocess.run(["bash", str(run_sh)], capture_output=True, text=True, env=env, check=False)
    assert proc.returncode != 0 and "set OUT to the folder for the table and the log" in proc.stderr
