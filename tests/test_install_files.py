"""A fresh machine installs from the package registries only: no tracked install file (lock, requirements,
pyproject, Makefile, CI script) pins a ``file://`` URL or a path on the machine that wrote it. (Issue 30: the SGLang
tier's lock once named ``sglang @ file:///tmp/...whl``, and CI passed only because an old virtualenv outside the
clone was still there.)"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INSTALL_FILE = re.compile(
    r"(^|/)(requirements[^/]*\.(txt|in|lock)|[^/]*\.lock|constraints[^/]*\.txt|pyproject\.toml|setup\.(cfg|py)"
    r"|Makefile|[^/]*\.mk)$|^\.ci/"
)
# a package source that only exists on one machine: a file: URL, a direct reference or pip option naming an
# absolute or home path, or an archive given by an absolute path
LOCAL_PIN = re.compile(
    r"file:"
    r"|@\s*[/~]"
    r"|(^|\s)(-e|--editable|-f|--find-links|-i|--index-url|--extra-index-url|-c|--constraint|-r|--requirement)"
    r"(\s+|=)[\"']?[/~]"
    r"|(^|[\s\"'=])[/~][^\s\"']*\.(whl|tar\.gz|zip|tgz)\b"
    r"|(^|[\s\"'=])(/tmp|/var/tmp|/home|/root|/Users)/"
)


def local_pins(text: str) -> list[str]:
    """The lines of an install file that name a machine-local package source (comments included: a commented
    pin is one edit away from breaking a fresh machine)."""
    return [line.strip() for line in text.splitlines() if LOCAL_PIN.search(line)]


def _tracked_files() -> list[str]:
    done = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True, check=False, timeout=30
    )
    assert done.returncode == 0, f"this test reads the tracked files with git ls-files: {done.stderr.strip()}"
    return done.stdout.splitlines()


def test_no_tracked_install_file_pins_a_local_path():
    files = [name for name in _tracked_files() if INSTALL_FILE.search(name)]
    # the files this rule exists for: if one moves, the pattern above must follow it
    assert {"pyproject.toml", "Makefile", ".ci/run", "tools/sglang_cpu/requirements.lock"} <= set(files)
    found = {name: local_pins((ROOT / name).read_text()) for name in files if (ROOT / name).is_file()}
    assert {name: lines for name, lines in found.items() if lines} == {}


# line 84 of tools/sglang_cpu/requirements.lock before commit 2d3ee55, which this test must catch
OLD_LOCK_LINE = (
    "sglang @ file:///tmp/sgl/sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl"
    "#sha256=00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937"
)


@pytest.mark.parametrize(
    "line",
    [
        OLD_LOCK_LINE,
        "torch @ /opt/wheels/torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl",
        "--find-links /opt/wheels",
        "--extra-index-url=file:///opt/pypi/simple",
        "-e /home/me/sapo_megatron",
        "/root/dist/sglang-0.5.23.tar.gz",
        '"mypkg @ ~/src/mypkg"',
        "\tpip install --no-deps /tmp/build/thing.whl",
    ],
)
def test_a_local_pin_is_found(line):
    assert local_pins(f"aiohttp==3.14.5\n{line}\nzmq==0.0.0\n") == [line.strip()]


@pytest.mark.parametrize(
    "line",
    [
        "torch==2.13.0",
        "sglang @ https://files.pythonhosted.org/packages/sglang-0.5.23-py3-none-any.whl",
        "--extra-index-url https://download.pytorch.org/whl/cpu",
        '\t$(BIN)/pip install --quiet -e ".[test,math]"',
        "\tSAPO_REQUIRE_SGLANG=1 $(BIN)/pytest -q tests/sglang_real",
        "# outside the clone ($SAPO_SGLANG_VENV, default /opt/sapo-sglang-venv)",
        "  dpkg-query -W -f='${Status}' \"$package\" 2> /dev/null",
    ],
)
def test_registry_pins_and_ordinary_paths_pass(line):
    assert local_pins(line) == []


INSTALL = ROOT / "tools" / "sglang_cpu" / "install.sh"


def _fake_venv(path: Path, freeze: list[str]) -> Path:
    """A directory that looks like an installed SGLang virtualenv to install.sh: its stamp, and a ``python``
    whose ``-m pip freeze`` prints ``freeze``."""
    lock = (ROOT / "tools" / "sglang_cpu" / "requirements.lock").read_bytes()
    (path / "bin").mkdir(parents=True)
    (path / "freeze.txt").write_text("\n".join(freeze) + "\n")
    python = path / "bin" / "python"
    python.write_text('#!/bin/sh\ncat "$(dirname "$0")/../freeze.txt"\n')
    python.chmod(0o755)
    digest = hashlib.sha256(lock).hexdigest()[:16]
    (path / ".sapo-sglang-installed").write_text(f"sglang==0.5.23 torch==2.13.0 lock={digest}\n")
    return path


def _install(venv: Path) -> subprocess.CompletedProcess:
    # PYTHON=false: a rebuild would fail at its first step instead of downloading 2.4 GB
    env = {**os.environ, "PYTHON": "false"}
    return subprocess.run(
        ["bash", str(INSTALL), str(venv)], capture_output=True, text=True, env=env, timeout=60
    )


def test_install_keeps_a_virtualenv_only_when_pip_freeze_matches_the_lock(tmp_path):
    pins = [line for line in (INSTALL.parent / "requirements.lock").read_text().splitlines() if line.strip()]
    exact = _fake_venv(tmp_path / "exact", [*pins, "sglang==0.5.23", "torch==2.13.0+cpu"])
    done = _install(exact)
    assert done.returncode == 0 and "verified with pip freeze" in done.stdout and exact.exists()

    other = [*pins[1:], pins[0].replace("==", "==0.0.0+"), "sglang==0.5.23", "torch==2.13.0"]
    for name, freeze in {
        "other version": other,
        "extra package": [*pins, "sglang==0.5.23", "torch==2.13.0", "evil==1.0"],
        "missing sglang": [*pins, "torch==2.13.0"],
        "local wheel": [*pins, "sglang @ file:///tmp/sgl/sglang-0.5.23.whl", "torch==2.13.0"],
    }.items():
        venv = _fake_venv(tmp_path / name.replace(" ", "_"), freeze)
        done = _install(venv)
        assert "differs from the lock, rebuilding it" in done.stderr, name
        assert done.returncode != 0 and not venv.exists(), name  # removed, and the rebuild was attempted
