"""The GPU kit's CPU proof (docs/gpu.md): tools/gpu_kit.sh builds the kit, and tools/gpu_check.py runs from a
virtualenv that holds only what the GPU machine has (tools/gpu_kit/target.txt less absent.txt; the CPU build of
torch for the CUDA one) plus the kit installed the way that machine installs it (--no-index --no-deps --target).

The GPU machine runs Python 3.12; this machine's CPU torch is a Python 3.11 build (PyPI has no CPU torch for 3.12
on x86-64, only CUDA builds of several GB), so the full run uses the kit for 3.11 built by the same script from
the same pins, and the 3.12 kit is checked for what does not need torch: its wheels install for CPython 3.12 on
manylinux x86-64, and under a Python 3.12 where one exists here, pydantic's compiled core imports from it.

Needs the package index (pip download). The virtualenv is kept in .gpu_kit_proof/ (git-ignored) between runs;
building it takes about a minute."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PROOF = ROOT / ".gpu_kit_proof"
KIT_SH = ROOT / "tools" / "gpu_kit.sh"
PIN_COUNT = sum(
    1
    for line in (ROOT / "tools/gpu_kit/kit.txt").read_text().splitlines()
    if line and not line.startswith("#")
)
MANYLINUX = ["--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64"]


def sh(*args: str | Path, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(a) for a in args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
    )


def build_kit(name: str, python_version: str, **env: str) -> tuple[Path, subprocess.CompletedProcess]:
    kit = PROOF / name
    proc = sh(KIT_SH, env={"GPU_KIT_DIR": str(kit), "GPU_KIT_PYTHON": python_version, **env})
    return kit, proc


@pytest.fixture(scope="module")
def venv() -> Path:
    """The stand-in for the GPU machine's Python (kept between runs while its lists are unchanged)."""
    path = PROOF / "venv"
    proc = sh(ROOT / "tools/gpu_kit/proof_venv.sh", path, sys.executable, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return path


def test_the_kit_for_python_312_fits_and_installs_for_cpython_312_manylinux():
    kit, proc = build_kit("kit312", "3.12")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    size = float(re.search(rf"{PIN_COUNT} wheels for Python 3.12 in .*: ([\d.]+) MiB", proc.stdout).group(1))
    assert 1 < size <= 60
    wheels = sorted(p.name for p in kit.glob("*.whl"))
    assert len(wheels) == PIN_COUNT and any(w.startswith("pydantic_core-") and "cp312" in w for w in wheels)
    manifest = (kit / "manifest.txt").read_text()
    assert manifest.startswith("commit ") and all(w in manifest for w in wheels)
    target = PROOF / "site312"
    shutil.rmtree(target, ignore_errors=True)
    install = sh(
        sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--only-binary=:all:",
        "--target", target, "--python-version", "3.12", "--implementation", "cp", *MANYLINUX,
        *sorted(kit.glob("*.whl")),
    )  # fmt: skip
    assert install.returncode == 0, install.stderr
    assert (target / "megatron" / "core" / "__init__.py").is_file()
    python312 = shutil.which("python3.12") or next(
        iter(glob.glob("/root/.pyenv/versions/3.12*/bin/python")), None
    )
    if python312:  # the compiled core under a real CPython 3.12
        run = sh(python312, "-c", "import pydantic; print(pydantic.TypeAdapter(int).validate_python('7'))",
                 env={"PYTHONPATH": str(target)})  # fmt: skip
        assert run.returncode == 0 and run.stdout.strip() == "7", run.stderr


def test_the_kit_refuses_more_than_its_limit_and_an_unpinned_line(tmp_path):
    _, proc = build_kit("kit_limit", "3.12", GPU_KIT_LIMIT_MIB="1")
    assert proc.returncode == 1
    assert re.search(r"[\d.]+ MiB is over the 1 MiB limit", proc.stderr), proc.stderr
    pins = tmp_path / "kit.txt"
    pins.write_text("# a comment\nmegatron-core\n")
    _, proc = build_kit("kit_unpinned", "3.12", GPU_KIT_PINS=str(pins))
    assert proc.returncode == 2 and "'megatron-core' is not pinned (name==version)" in proc.stderr


def test_gpu_check_runs_from_the_machines_packages_and_the_kit(venv):
    python = venv / "bin" / "python"
    version = sh(python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])").stdout.strip()
    absent = sh(
        python,
        "-c",
        "import importlib.util as u; print([m for m in ('megatron', 'pydantic') if u.find_spec(m)])",
    )
    assert absent.stdout.strip() == "[]", "the stand-in must not have megatron-core or pydantic"
    kit, proc = build_kit(f"kit{version.replace('.', '')}", version)
    assert proc.returncode == 0, proc.stderr
    site = PROOF / "site"
    shutil.rmtree(site, ignore_errors=True)
    install = sh(python, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--target", site,
                 *sorted(kit.glob("*.whl")))  # fmt: skip
    assert install.returncode == 0, install.stderr

    # without one wheel of the kit, the check stops at once naming the missing import
    missing = PROOF / "site_missing"
    shutil.rmtree(missing, ignore_errors=True)
    shutil.copytree(site, missing)
    shutil.rmtree(missing / "annotated_types")
    proc = sh(
        python,
        ROOT / "tools/gpu_check.py",
        "--allow-cpu",
        env={"PYTHONPATH": f"{missing}:{ROOT}"},
        timeout=120,
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "cannot import annotated_types (needed by sapo_megatron.config)" in proc.stdout

    out = PROOF / "out"
    shutil.rmtree(out, ignore_errors=True)
    proc = sh(python, ROOT / "tools/gpu_check.py", "--allow-cpu", "--out", out, env={"PYTHONPATH": f"{site}:{ROOT}"}, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    announced = set(re.findall(r"^  SKIP  (.+?): ", proc.stdout, re.M))
    rows = {}
    for line in (out / "gpu_check_table.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) >= 3 and cells[1] in ("PASS", "FAIL", "SKIP"):
            rows[cells[0]] = cells[1]
    assert announced == {name for name, status in rows.items() if status == "SKIP"}
    assert "FAIL" not in rows.values() and list(rows.values()).count("PASS") >= 20
    assert rows["process group of one: collectives"] == "PASS"
    assert rows["tensor transport to a second process"] == "PASS"
