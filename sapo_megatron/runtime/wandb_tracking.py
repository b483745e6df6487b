"""Weights & Biases beside TensorBoard (``tracking.wandb``), off by default: the run's resolved config, every
metric row, the samples as a table and, after training, the report's plots.

- Metrics: each row of ``metrics.jsonl`` is one ``wandb.log`` call; a metric is named ``<phase>/<name>`` (``rl/
  reward/mean``, ``sft/sft/nll``, ``eval/eval/heldout/avg@1``) and plotted against its phase's own step
  (``<phase>/step``, declared with ``define_metric``), so SFT, RL and evaluation steps never mix.
- Samples: the rows ``samples.jsonl`` gets, as a table ``rl/samples`` (step, prompt, response, reward, ...).
- Plots: ``report/*.png`` as images ``report/<name>`` once ``train`` has written them.
- Resume: the W&B run id is kept in ``RUN_DIR/wandb/run_id``; a resumed run (``--resume``) continues that W&B
  run (``resume="allow"``), a fresh start (or ``--overwrite``) begins a new one.
- ``mode: offline`` writes everything under ``RUN_DIR/wandb/`` without network (``wandb sync`` uploads it
  later); ``disabled`` turns W&B into no-ops. ``online`` (the default) needs an API key: ``WANDB_API_KEY``, or
  the ``~/.netrc`` entry ``wandb login`` writes; without one the run stops before the model loads, in one line.

Only the main rank logs. ``wandb`` is an optional dependency: a run that asks for it without the package stops
before training with the install command.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from sapo_megatron.errors import UserError

WANDB_DIR = "wandb"
RUN_ID_FILE = "run_id"
SAMPLE_COLUMNS = ("step", "source", "prompt", "response", "reward", "finish_reason", "response_tokens")


class WandbConfig(BaseModel):
    """``tracking.wandb``: where the run goes in W&B."""

    model_config = ConfigDict(extra="forbid")

    project: str = Field(min_length=1, description="W&B project (verl: trainer.project_name)")
    entity: str | None = Field(default=None, description="W&B team or user; default: your default entity")
    name: str | None = Field(default=None, description="the W&B run's name; default: the run's `name`")
    mode: Literal["online", "offline", "disabled"] = Field(
        default="online", description="offline: write under RUN_DIR/wandb, upload later with `wandb sync`"
    )


class TrackingConfig(BaseModel):
    """``tracking``: experiment trackers besides TensorBoard and ``metrics.jsonl`` (always written)."""

    model_config = ConfigDict(extra="forbid")

    wandb: WandbConfig | None = Field(default=None, description="Weights & Biases (off when unset)")


class WandbMissing(UserError):
    """``tracking.wandb`` is set but the ``wandb`` package is not installed."""


def import_wandb() -> Any:
    """The ``wandb`` module, or :class:`WandbMissing` with the install command."""
    try:
        import wandb
    except ImportError:
        raise WandbMissing(
            "tracking.wandb is set, but the wandb package is not installed",
            hint="pip install wandb (or remove tracking.wandb: TensorBoard and metrics.jsonl are always written)",
        ) from None
    return wandb


def check_trackers(cfg: Any) -> None:
    """Before training: :class:`WandbMissing` when ``tracking.wandb`` is set and ``wandb`` does not import, or
    is online without an API key."""
    if cfg.tracking.wandb is not None:
        import_wandb()
        check_wandb_key(cfg.tracking.wandb.mode)


def check_wandb_key(
    mode: str, environ: Mapping[str, str] | None = None, netrc_path: Path | None = None
) -> None:
    """:class:`WandbMissing` when W&B would run online (``mode`` online and ``WANDB_MODE`` not offline / disabled)
    without an API key: ``WANDB_API_KEY``, or a ``~/.netrc`` (``$NETRC``) entry for the W&B host."""
    import netrc
    import os
    from urllib.parse import urlparse

    env = os.environ if environ is None else environ
    if (
        mode != "online"
        or env.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun")
        or env.get("WANDB_API_KEY")
    ):
        return
    host = urlparse(env.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    path = netrc_path or Path(env.get("NETRC", Path.home() / ".netrc"))
    try:
        if netrc.netrc(str(path)).authenticators(host):
            return
    except (OSError, netrc.NetrcParseError):
        pass
    raise WandbMissing(
        f"tracking.wandb.mode is online, but no W&B API key is set (WANDB_API_KEY, or a {path} entry for {host} "
        "from `wandb login`)",
        hint="export WANDB_API_KEY=..., run `wandb login`, or set tracking.wandb.mode: offline",
    )


def run_id(run_dir: Path, *, resume: bool) -> str:
    """The W&B run id of ``run_dir``: the stored one when resuming, else a new one (stored)."""
    path = run_dir / WANDB_DIR / RUN_ID_FILE
    if resume and path.is_file():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    new = secrets.token_hex(4)
    path.write_text(new + "\n")
    return new


class WandbSink:
    """One W&B run of a training run; the :class:`~sapo_megatron.runtime.tracking.Tracker` feeds it."""

    def __init__(
        self, settings: WandbConfig, run_dir: Path, *, run_name: str, config: Mapping[str, Any], resume: bool
    ) -> None:
        self.wandb = import_wandb()
        self.run_dir = Path(run_dir)
        self.run = self.wandb.init(
            project=settings.project,
            entity=settings.entity,
            name=settings.name or run_name,
            mode=settings.mode,
            dir=str(self.run_dir),
            id=run_id(self.run_dir, resume=resume),
            resume="allow",
            config=dict(config),
            reinit="create_new",
        )
        self._phases: set[str] = set()

    def log(self, phase: str, step: int, values: Mapping[str, float | None]) -> None:
        """One metric row (``None`` values are left out: W&B has no null)."""
        if phase not in self._phases:
            self.run.define_metric(f"{phase}/step")
            self.run.define_metric(f"{phase}/*", step_metric=f"{phase}/step")
            self._phases.add(phase)
        row = {f"{phase}/{name}": value for name, value in values.items() if value is not None}
        self.run.log({f"{phase}/step": step, **row})

    def samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """The samples logged at RL ``step`` as a table."""
        table = self.wandb.Table(columns=list(SAMPLE_COLUMNS))
        for row in rows:
            table.add_data(*(_cell(row.get(column)) for column in SAMPLE_COLUMNS))
        self.run.log({"rl/step": step, "rl/samples": table})

    def images(self, paths: Sequence[Path]) -> None:
        self.run.log({f"report/{path.stem}": self.wandb.Image(str(path)) for path in paths})

    def finish(self) -> None:
        self.run.finish()


def _cell(value: Any) -> Any:
    return value if isinstance(value, (str, int, float, bool, type(None))) else json.dumps(value, default=str)


def build_wandb_sink(cfg: Any, run_dir: Path, *, resume: bool, enabled: bool) -> WandbSink | None:
    """The sink of ``cfg.tracking.wandb`` on the main rank (``enabled``), else None."""
    settings = cfg.tracking.wandb
    if settings is None or not enabled:
        return None
    return WandbSink(settings, run_dir, run_name=cfg.name, config=cfg.resolved_dict(), resume=resume)


def upload_report(cfg: Any, run_dir: Path, plots: Sequence[Path]) -> None:
    """Log the report's plots to the run's W&B run (continued by its stored id), when ``tracking.wandb`` is set."""
    settings = cfg.tracking.wandb
    if settings is None or not plots:
        return
    sink = WandbSink(settings, run_dir, run_name=cfg.name, config={}, resume=True)
    try:
        sink.images(plots)
    finally:
        sink.finish()
