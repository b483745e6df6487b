"""Input files a run reads, checked before anything starts (``train --dry-run`` and ``train`` itself).

:func:`check_input_files` lists every missing path at once, each with the config field that names it. Not
checked: ``rollout.endpoints_file``, which another job (the rollout servers) writes while the trainer waits.
"""

from __future__ import annotations

import glob
from pathlib import Path

from sapo_megatron.config import ConfigError, RunConfig


def check_input_files(cfg: RunConfig) -> None:
    """Raise :class:`ConfigError` naming every input path of ``cfg`` that does not exist (or is of the wrong
    kind); relative paths are read from the current directory, as the run will read them."""
    problems = [problem for field, path, kind in _inputs(cfg) if (problem := _check(field, path, kind))]
    if problems:
        raise ConfigError("missing input files:\n" + "\n".join(f"  - {p}" for p in problems))


def _inputs(cfg: RunConfig) -> list[tuple[str, str, str]]:
    """``(config field, path, "file" | "dir" | "any")`` of every input the run reads."""
    data, model = cfg.data, cfg.model
    sources = [("data.train", data.train)]
    sources += [(f"eval.datasets[{i}].path", d.path) for i, d in enumerate(cfg.eval.datasets)]
    inputs = [
        (field, source, "data")
        for field, source in sources
        if source is not None and not source.startswith("synthetic:")
    ]
    if data.tokenizer not in ("char", "chat", "qwen3"):
        inputs.append(("data.tokenizer", data.tokenizer, "dir"))
    if isinstance(model.hf_config, str):
        inputs.append(("model.hf_config", model.hf_config, "any"))
    if model.init != "random" and model.init_path:
        inputs.append(("model.init_path", model.init_path, "dir"))
    for teacher in cfg.teachers:
        if teacher.engine == "cpu" and teacher.model_path is not None:  # TeacherConfig requires it for cpu
            inputs.append((f"teachers[{teacher.name}].model_path", teacher.model_path, "dir"))
        if teacher.tokenizer and teacher.tokenizer not in ("char", "chat", "qwen3"):
            inputs.append((f"teachers[{teacher.name}].tokenizer", teacher.tokenizer, "dir"))
    return inputs


def _check(field: str, path_text: str, kind: str) -> str | None:
    if kind == "data":
        return _check_data(field, path_text)
    path = Path(path_text)
    where = "" if path.is_absolute() else f" (relative to the current directory {Path.cwd()})"
    if not path.exists():
        return f"{field}: {path_text} does not exist{where}"
    if kind == "file" and not path.is_file():
        return f"{field}: {path_text} is not a file (a .jsonl or .parquet prompt file is expected)"
    if kind == "dir" and not path.is_dir():
        return f"{field}: {path_text} is not a directory"
    return None


def _check_data(field: str, path_text: str) -> str | None:
    """A prompt dataset: a .jsonl / .parquet file, a directory holding such files, or a glob matching some."""
    from sapo_megatron.data.datasets import SUFFIXES

    path = Path(path_text)
    where = "" if path.is_absolute() else f" (relative to the current directory {Path.cwd()})"
    if any(char in path_text for char in "*?["):
        return (
            None
            if any(Path(p).is_file() for p in glob.glob(path_text, recursive=True))
            else (f"{field}: {path_text} matches no file{where}")
        )
    if not path.exists():
        return f"{field}: {path_text} does not exist{where}"
    if path.is_dir() and not any(p.suffix.lower() in SUFFIXES for p in path.iterdir() if p.is_file()):
        return (
            f"{field}: {path_text} is not a file (a .jsonl or .parquet prompt file, or a directory of them)"
        )
    return None
