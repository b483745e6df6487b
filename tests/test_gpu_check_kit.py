"""The GPU kit's CPU proof (docs/gpu.md): tools/gpu_kit.sh builds the kit, and tools/gpu_check.py runs from a
virtualenv that holds only what the GPU machine has (tools/gpu_kit/target.txt less absent.txt; the CPU build of
torch for the CUDA one) plus the kit installed the way that machine installs it (--no-index --no-deps --target).

The GPU machine runs Python 3.12; this machine's CPU torch is a Python 3.11 build (PyPI has no CPU torch for 3.12
on x86-64, only CUDA builds of several GB), so the full run uses the kit for 3.11 built by the same script from
the same pins, and the 3.12 kit is checked for what does not need torch: its wheels install for CPython 3.12 on
manylinux x86-64, and under a Python 3.12 where one exists here, pydantic's compiled core imports from it.

Needs the package index (pip download). The virtualenv lives outside the clone, like the SGLang tier's
($SAPO_GPU_KIT_VENV, default /opt/sapo-gpu-kit-venv), kept while its lists and Python are unchanged: building it
takes 1-3 minutes, reusing it about a second. Kits and outputs go to .gpu_kit_proof/ (git-ignored)."""

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


def python_312() -> str | None:
    """A CPython 3.12 on this machine (pyenv's, or python3.12 on PATH), or None."""
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    for candidate in [*sorted(glob.glob(f"{root}/versions/3.12*/bin/python3")), shutil.which("python3.12")]:
        if (
            candidate
            and sh(candidate, "-c", "import sys; assert sys.version_info[:2] == (3, 12)").returncode == 0
        ):
            return candidate
    return None


@pytest.fixture(scope="module")
def venv() -> Path:
    """The stand-in for the GPU machine's Python (kept between runs while its lists are unchanged)."""
    path = Path(os.environ.get("SAPO_GPU_KIT_VENV", "/opt/sapo-gpu-kit-venv"))
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
    python312 = python_312()
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


def test_the_one_command_runs_gpu_check_from_the_machines_packages_and_the_kit(venv):
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

    def one_command(kit_dir: Path, out: Path) -> subprocess.CompletedProcess:
        shutil.rmtree(out, ignore_errors=True)
        env = {"PYTHON": str(python), "GPU_KIT_DIR": str(kit_dir), "OUT": str(out), "PYTHONPATH": ""}
        return sh("bash", ROOT / "tools/gpu_kit/run.sh", "--allow-cpu", env=env, timeout=900)

    # without one wheel of the kit, the check stops at once naming the missing import
    short = PROOF / "kit_short"
    shutil.rmtree(short, ignore_errors=True)
    shutil.copytree(kit, short, ignore=shutil.ignore_patterns("annotated_types-*"))
    proc = one_command(short, PROOF / "out_short")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "cannot import annotated_types (needed by sapo_megatron.config)" in proc.stdout
    assert "cannot import annotated_types" in (PROOF / "out_short" / "gpu_check.log").read_text()

    out = PROOF / "out"
    proc = one_command(kit, out)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert {p.name for p in out.iterdir()} == {
        "environment.txt", "pip_install.log", "gpu_check.log", "gpu_check_table.md", "gpu_check.json",
    }  # fmt: skip
    assert "commit " in (out / "environment.txt").read_text()
    announced = [line for line in proc.stdout.splitlines() if line.startswith("  SKIP  ")]
    rows = {}
    for line in (out / "gpu_check_table.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) >= 3 and cells[1] in ("PASS", "FAIL", "SKIP"):
            rows[cells[0]] = cells[1]
    skipped = [name for name, status in rows.items() if status == "SKIP"]
    assert len(announced) == len(skipped) and all(
        any(line.startswith(f"  SKIP  {name}: ") for line in announced) for name in skipped
    )
    assert "FAIL" not in rows.values() and list(rows.values()).count("PASS") >= 20
    assert rows["process group of one: collectives"] == "PASS"
    assert rows["tensor transport to a second process"] == "PASS"
