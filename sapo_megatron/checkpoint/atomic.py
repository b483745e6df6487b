"""Crash-safe checkpoint directories: write under a temporary sibling name, fsync, rename; a completion marker.

The rules every writer in this project follows:

- A checkpoint is written into ``.<name>.partial`` next to its final path and renamed into place only after
  every file is fsync'd. A crash mid-save leaves at worst a ``.partial`` directory, never a half-written
  directory under the final name.
- The last file written before the rename is the completion marker :data:`MARKER` (JSON). Readers refuse a
  directory without it (:func:`read_marker`), naming the directory.
- A run's ``latest`` pointer (a one-line file holding the checkpoint's directory name) is replaced with
  ``os.replace``, so it names either the previous or the new checkpoint, never a torn one.

Pure standard library: no torch, no megatron.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from sapo_megatron import jsonio
from sapo_megatron.errors import UserError

MARKER = "sapo_checkpoint.json"
"""Completion marker, written last; its JSON says what the directory holds (``kind``) and how it was made."""

HF_CONFIG = "hf_config.json"
"""The HF ``config.json`` of the model, stored inside Megatron checkpoints so they can be exported alone."""

LATEST = "latest"
"""Pointer file in a checkpoint's parent directory: the name of the newest complete checkpoint."""

FORMAT = "sapo_megatron/v1"


class IncompleteCheckpointError(UserError, FileNotFoundError):
    """A directory that is not a complete checkpoint (interrupted save, or not written by this project)."""


def partial_path(final: Path) -> Path:
    """The temporary sibling a save of ``final`` writes into."""
    return final.parent / f".{final.name}.partial"


def fsync_path(path: Path) -> None:
    """fsync one file or directory (directories: so that renames and new entries are durable)."""
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (``root`` included)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath))


def write_json_durably(path: Path, data: dict[str, Any]) -> None:
    """Write JSON to ``path`` through a temporary file + fsync + ``os.replace``."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as handle:
        handle.write(jsonio.dumps(data, indent=2, sort_keys=True))
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def write_marker(directory: Path, kind: str, **info: Any) -> dict[str, Any]:
    """Write the completion marker into ``directory`` (call after everything else is written). It lists every
    file's size, so that :func:`read_marker` tells a truncated or missing file from a complete checkpoint."""
    files = {
        str(path.relative_to(directory)): path.stat().st_size
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != MARKER
    }
    marker = {
        "format": FORMAT,
        "kind": kind,
        "complete": True,
        "created_unix": time.time(),
        "files": files,
        **info,
    }
    write_json_durably(directory / MARKER, marker)
    return marker


def read_marker(directory: str | Path) -> dict[str, Any]:
    """The completion marker of a checkpoint directory; :class:`IncompleteCheckpointError` naming the
    directory when there is none (a save that was interrupted, or a directory this project did not write)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise IncompleteCheckpointError(f"checkpoint directory {directory} does not exist")
    path = directory / MARKER
    if not path.is_file():
        hint = (
            " (a temporary directory of an interrupted save)" if directory.name.endswith(".partial") else ""
        )
        raise IncompleteCheckpointError(
            f"{directory} is not a complete checkpoint{hint}: its completion marker {MARKER} is missing. "
            "The save that wrote it did not finish, or it was not written by sapo-megatron; "
            "load the previous checkpoint (see the 'latest' pointer) instead"
        )
    try:
        marker = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise IncompleteCheckpointError(
            f"{path} is not valid JSON ({err}); the checkpoint is damaged"
        ) from err
    if not marker.get("complete"):
        raise IncompleteCheckpointError(f"{path} does not mark {directory} as complete")
    _check_files(directory, marker.get("files"))
    return marker


def _check_files(directory: Path, files: Any) -> None:
    """Every file the marker lists is there with the size it was written with (markers of older releases list
    none: nothing to check)."""
    if not isinstance(files, dict):
        return
    for name, size in files.items():
        path = directory / name
        try:
            actual = path.stat().st_size
        except OSError:
            raise IncompleteCheckpointError(
                f"{path} is missing from the checkpoint (its marker lists it); the checkpoint is damaged"
            ) from None
        if actual != size:
            raise IncompleteCheckpointError(
                f"{path} has {actual} bytes, the save wrote {size}: the file is truncated or damaged"
            )


RUN_CHECKPOINTS = "checkpoints"
"""The folder of a training run (``output_dir``) that holds its training states and their ``latest`` pointer."""


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from the directory itself, a folder holding a ``latest`` pointer, or a run folder
    (``output_dir``, whose ``checkpoints/latest`` names the newest training state)."""
    path = Path(path)
    if (path / MARKER).exists():
        return path
    for folder in (path, path / RUN_CHECKPOINTS):
        pointer = folder / LATEST
        if pointer.is_file():
            name = pointer.read_text().strip()
            if not name or "/" in name or name.startswith("."):
                raise IncompleteCheckpointError(f"{pointer} holds {name!r}, not a checkpoint directory name")
            return folder / name
    return path


_CHECKPOINT_FILES = ("metadata.json", ".metadata", "common.pt", HF_CONFIG)
"""Files of a torch_dist checkpoint besides the marker: their presence means a save started here."""


def find_checkpoint(path: str | Path) -> Path:
    """:func:`resolve_checkpoint`, refusing with a message that lists what was looked for when ``path`` is
    neither a checkpoint (complete or not), a folder with a ``latest`` pointer nor a run folder."""
    path = Path(path)
    resolved = resolve_checkpoint(path)
    started_here = path.name.endswith(".partial") or any((path / name).exists() for name in _CHECKPOINT_FILES)
    if resolved != path or started_here:
        return resolved  # read_marker then tells a complete checkpoint from an interrupted save
    if not path.is_dir():
        raise IncompleteCheckpointError(f"checkpoint directory {path} does not exist")
    raise IncompleteCheckpointError(
        f"{path} is not a Megatron checkpoint: looked for {path / MARKER} (a checkpoint), {path / LATEST} (a "
        f"folder of checkpoints) and {path / RUN_CHECKPOINTS / LATEST} (a training run's output_dir)"
        + _run_folder_hint(path)
    )


def _run_folder_hint(path: Path) -> str:
    if (path / RUN_CHECKPOINTS).is_dir():
        return (
            f"; {path / RUN_CHECKPOINTS} has no '{LATEST}' pointer: no checkpoint of this run was completed"
        )
    if (path / "hf" / "config.json").is_file():
        return f"; this run's HF export is already in {path / 'hf'}"
    return ""


class PathConflictError(UserError, ValueError):
    """An output path that is, contains or lies inside an input path."""


def path_relation(output: str | Path, source: str | Path) -> str | None:
    """How ``output`` overlaps ``source`` ("is the same directory as", "lies inside", "contains"), or None;
    compared after resolving symbolic links."""
    out, src = Path(output).resolve(), Path(source).resolve()
    if out == src:
        return "is the same directory as"
    if out.is_relative_to(src):
        return "lies inside"
    if src.is_relative_to(out):
        return "contains"
    return None


def refuse_overlap(output: str | Path, inputs: dict[str, str | Path | None]) -> None:
    """:class:`PathConflictError` when ``output`` is one of ``inputs`` (``{description: path}``; None entries
    are skipped), lies inside one or contains one: writing it, even with ``--force``, would destroy an input."""
    for description, source in inputs.items():
        relation = None if source is None else path_relation(output, source)
        if relation is not None:
            raise PathConflictError(
                f"the output directory {output} {relation} the {description} {source}; writing it would "
                "overwrite the input (--force does not change that): choose an output directory outside it"
            )


def publish(tmp: Path, final: Path, *, replace: bool = True) -> None:
    """Atomically move the finished ``tmp`` directory to ``final`` (files must already be fsync'd).

    An existing ``final`` is replaced only when ``replace``: it is first renamed aside, so that at every
    instant the final name holds either the old or the new complete checkpoint, then deleted.
    """
    aside = None
    if final.exists():
        if not replace:
            raise FileExistsError(f"{final} exists; refusing to overwrite it")
        aside = final.parent / f".{final.name}.replaced-{os.getpid()}-{time.time_ns()}"
        os.rename(final, aside)
    os.rename(tmp, final)
    fsync_path(final.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def update_latest(final: Path) -> None:
    """Point ``final.parent/latest`` at ``final`` (atomic replace of a one-line file)."""
    pointer = final.parent / LATEST
    tmp = final.parent / f".{LATEST}.tmp"
    with open(tmp, "w") as handle:
        handle.write(final.name + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, pointer)
    fsync_path(final.parent)


def refuse_overwrite(out_dir: Path, *, force: bool) -> None:
    """:class:`FileExistsError` for an existing non-empty ``out_dir`` unless ``force``."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not force:
        raise FileExistsError(
            f"output directory {out_dir} exists and is not empty; choose another path or pass --force "
            "(the old content is replaced only once the new checkpoint is complete)"
        )


def prepare_output_dir(out_dir: Path, *, force: bool) -> Path:
    """Check ``out_dir`` may be written and return a fresh, empty temporary sibling to write into.

    Refuses a non-empty existing ``out_dir`` unless ``force`` (it is then replaced only when the new one is
    complete). A leftover temporary directory of an interrupted run is removed.
    """
    refuse_overwrite(out_dir, force=force)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_path(out_dir)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    return tmp
