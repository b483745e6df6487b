"""The ``eval`` config section: a list of evaluation datasets over shared ``defaults`` (slime's ``--eval-config``
shape), evaluated before RL (``before_training``), every ``every`` RL steps and after the last one.

A dataset's unset field takes ``eval.defaults``' value, and an unset default the training run's (``max_new_tokens``
from ``rollout``, ``reward`` from ``algorithm``, and the dataset keys – ``format``, ``prompt_key``, ``label_key``,
``source_key``, the chat template, ``prompt_template``, the length policy – from ``data``, so that an eval prompt
is rendered as the training prompts are). :func:`resolve_datasets` gives
the settings each dataset is evaluated with. The section replaces ``data.heldout`` / ``data.heldout_size`` /
``trainer.eval_every``: a config that still has them is refused with the equivalent ``eval`` section
(:func:`refuse_old_eval_keys`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from sapo_megatron.data.datasets import DatasetKeys

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
"""Eval dataset names appear in metric names (``eval/<name>/avg@8``): no slashes or spaces."""
SYNTHETIC_SIZE = 200
"""Prompts of a ``synthetic:`` eval dataset without ``size`` (the old ``data.heldout_size`` default)."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


KEY_FIELDS = tuple(DatasetKeys.model_fields)
"""The dataset keys (docs/data.md) an eval dataset may set; unset, they are ``data``'s."""


def _common_fields() -> tuple[Any, Any, Any]:
    """``max_new_tokens``, ``reward`` and ``size``: the same in ``eval.defaults`` and in each dataset."""
    return (
        Field(default=None, ge=1, description="default: rollout.max_new_tokens"),
        Field(default=None, description="reward name; default: algorithm.reward"),
        Field(
            default=None,
            ge=1,
            description=f"prompts used: a synthetic task draws this many (default {SYNTHETIC_SIZE}), a file's "
            "first `size` rows (default: all)",
        ),
    )


_MAX_NEW_TOKENS, _REWARD, _SIZE = _common_fields()
_DATASET_MAX_NEW_TOKENS, _DATASET_REWARD, _DATASET_SIZE = _common_fields()


class EvalDefaults(DatasetKeys):
    """Settings of every eval dataset that does not set its own (and the dataset keys of ``data``, which unset
    keys take). Greedy (n 1, temperature 0) by default."""

    n: int = Field(
        default=1,
        ge=1,
        le=4096,
        description="samples per prompt (avg@n, pass@k for k up to n, maj@n); at most 4096",
    )
    temperature: float = Field(default=0.0, ge=0.0, description="0: greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, description="-1: the whole vocabulary")
    max_new_tokens: int | None = _MAX_NEW_TOKENS
    reward: str | None = _REWARD
    size: int | None = _SIZE


class EvalDatasetConfig(DatasetKeys):
    """One evaluation dataset: a name (used in metric names) and a path (jsonl / parquet, or ``synthetic:TASK``,
    whose held-out split is used). Every other field overrides ``eval.defaults`` for this dataset (unset: None).
    Its fields are ``eval.defaults``' in the same order, then ``name`` and ``path``."""

    n: int | None = Field(default=None, ge=1, le=4096)  # rollout.n_samples' bound: 1e9 would run for ever
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = None
    max_new_tokens: int | None = _DATASET_MAX_NEW_TOKENS
    reward: str | None = _DATASET_REWARD
    size: int | None = _DATASET_SIZE
    name: str = Field(pattern=NAME_PATTERN)
    path: str


class EvalConfig(_Section):
    """Evaluation suites: when to evaluate and on what (see docs/evaluation.md)."""

    every: int = Field(default=0, ge=0, description="evaluate every N RL steps (0: before and after RL only)")
    before_training: bool = Field(default=True, description="evaluate after SFT, before the first RL step")
    defaults: EvalDefaults = Field(default_factory=EvalDefaults)
    datasets: list[EvalDatasetConfig] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check_datasets(self) -> EvalConfig:
        names = [d.name for d in self.datasets]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(
                f"eval.datasets: the name {repeated[0]!r} is used twice; give each dataset its own"
            )
        for index, dataset in enumerate(self.datasets):
            n = dataset.n if dataset.n is not None else self.defaults.n
            temperature = (
                dataset.temperature if dataset.temperature is not None else self.defaults.temperature
            )
            if n > 1 and temperature == 0:
                raise ValueError(
                    f"eval.datasets[{index}] ({dataset.name}): n={n} at temperature 0 draws {n} identical greedy "
                    "samples; set n: 1 for greedy accuracy, or a temperature > 0 (the papers: n 32, temperature 1)"
                )
        return self


@dataclasses.dataclass(frozen=True)
class EvalDataset:
    """One eval dataset's resolved settings (nothing left unset)."""

    name: str
    path: str
    n: int
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    reward: str
    size: int | None
    keys: DatasetKeys
    """Where the fields are and how prompts become ids (data/datasets.py, data/render.py)."""


def resolve_datasets(cfg: Any) -> list[EvalDataset]:
    """The resolved eval datasets of a :class:`~sapo_megatron.config.RunConfig`."""
    defaults = cfg.eval.defaults
    fallback = {"max_new_tokens": cfg.rollout.max_new_tokens, "reward": cfg.algorithm.reward}

    def pick(dataset: EvalDatasetConfig, key: str) -> Any:
        for value in (getattr(dataset, key), getattr(defaults, key), fallback.get(key)):
            if value is not None:
                return value
        return None

    fields = [f.name for f in dataclasses.fields(EvalDataset) if f.name not in ("name", "path", "keys")]
    return [
        EvalDataset(name=d.name, path=d.path, keys=_keys(cfg, d, i), **{key: pick(d, key) for key in fields})
        for i, d in enumerate(cfg.eval.datasets)
    ]


def _keys(cfg: Any, dataset: EvalDatasetConfig, index: int) -> DatasetKeys:
    """The dataset's keys: its own where set, else ``eval.defaults``', else ``data``'s."""
    from sapo_megatron.errors import ConfigError

    def pick(key: str) -> Any:
        for source in (dataset, cfg.eval.defaults):
            if key in source.model_fields_set:
                return getattr(source, key)
        return getattr(cfg.data, key)

    try:
        return DatasetKeys(**{key: pick(key) for key in KEY_FIELDS})
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        raise ConfigError(f"eval.datasets[{index}] ({dataset.name}): {problems}") from None


def materialised_eval(section: EvalConfig) -> dict[str, Any]:
    """The ``eval`` section as ``config.yaml`` writes it: every setting, but the dataset keys (``format``, the
    chat template, ...) only where set, so that reading the file back still takes the unset ones from ``data``
    (spelling out their defaults would turn a run's chat template off for ``eval --model RUN``)."""
    out = section.model_dump(mode="json")
    for dumped, model in ((out["defaults"], section.defaults), *zip(out["datasets"], section.datasets)):
        for key in KEY_FIELDS:
            if key not in model.model_fields_set:
                dumped.pop(key, None)
    return out


OLD_KEYS = (("data", "heldout"), ("data", "heldout_size"), ("trainer", "eval_every"))


def refuse_old_eval_keys(raw: dict[str, Any]) -> None:
    """Raise :class:`~sapo_megatron.config.ConfigError` when the raw config still uses ``data.heldout``,
    ``data.heldout_size`` or ``trainer.eval_every``, giving the ``eval`` section that does the same."""
    from sapo_megatron.errors import ConfigError

    found = {
        f"{section}.{key}": raw[section][key]
        for section, key in OLD_KEYS
        if isinstance(raw.get(section), dict) and key in raw[section]
    }
    if not found:
        return
    has_eval = isinstance(raw.get("eval"), dict)  # e.g. the embedded demo's, with an old key --set over it
    replacement: dict[str, Any] = {}
    if "trainer.eval_every" in found or not has_eval:
        replacement["every"] = found.get("trainer.eval_every", 0)
    heldout = found.get("data.heldout", "synthetic:addition")
    if heldout is not None and (not has_eval or "data.heldout" in found or "data.heldout_size" in found):
        dataset: dict[str, Any] = {"name": "heldout", "path": heldout, "n": 1, "temperature": 0}
        if "data.heldout_size" in found:
            dataset["size"] = found["data.heldout_size"]
        replacement["datasets"] = [dataset]
    written = yaml.safe_dump({"eval": replacement}, default_flow_style=None, sort_keys=False).strip()
    raise ConfigError(
        f"{', '.join(found)}: replaced by the eval section (docs/evaluation.md); write instead:\n{written}",
        hint=" ".join(f"--set 'eval.{key}={json.dumps(value)}'" for key, value in replacement.items())
        + " does it on the command line",
    )
