"""tools/gpu_check.py: the GPU validation script. On CPU its checks run with --allow-cpu (contract test);
on a CUDA machine the real run must pass every check it does not skip."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "gpu_check.py"
HAVE_TE = importlib.util.find_spec("transformer_engine") is not None


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600, check=False
    )


def table_rows(stdout: str) -> dict[str, str]:
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[1] in ("PASS", "FAIL", "SKIP"):
            rows[cells[0]] = cells[1]
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
        assert rows[f"{kind}: SFT + SAPO steps, bf16"] == "PASS"
        expected_te = "PASS" if HAVE_TE else "SKIP"
        assert rows[f"{kind}: logit parity vs HF, TE spec"] == expected_te
    assert "SKIP" in rows["chunked log-probs: memory and values vs naive"]


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
