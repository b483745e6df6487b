"""Planning a comparison: which arms run, and the exact run config of each (no training happens here).

An arm is one (policy loss, routing replay, mismatch correction, seed) combination. Every arm's config is the
same base config (the user's CONFIG, or the embedded tiny MoE demo with an fp8 rollout) plus the arm's own
overrides, so arms differ only in what the arm names:

- the loss with its paper settings (:data:`LOSSES`; shared loss keys such as ``kl_coef`` keep the base value),
- ``algorithm.correction`` (:data:`CORRECTIONS`), ``algorithm.routing_replay``,
- ``seed`` = the seed index (data order, sampling and held-out set follow it, identically in every arm),
- for a MoE model, ``rollout.routed_experts: true`` in every arm (R3 needs the engine's routes; the other arms
  request them too so that each one logs the live routing agreement).

When the base config has an SFT phase it runs once, as a warm start (``trainer.steps: 0`` into
``<output_dir>/warm_start``, exporting HF weights); every arm then starts from those weights with
``model.init: hf`` and ``sft.steps: 0``.

Config arms (:func:`build_config_plan`, ``compare --arms a.yaml,b.yaml``): each arm is one YAML run config
(named after its file: ``a-s0``), for comparisons that are not losses × replay × corrections, such as the
distillation fusion modes. Teacher configs (``--teachers``) are trained first into ``<output_dir>/teachers/<name>``
and every arm's teacher of that name is pointed at the teacher's HF export.
"""

from __future__ import annotations

import difflib
import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import yaml

from sapo_megatron.config import AlgorithmConfig, RunConfig, load_config
from sapo_megatron.errors import UserError

LOSSES: dict[str, dict[str, Any]] = {
    # SAPO paper (arXiv:2511.20347): τ_pos 1.0, τ_neg 1.05, sequence-mean of token means.
    "sapo": {"name": "sapo", "tau_pos": 1.0, "tau_neg": 1.05, "level": "token", "agg": "seq-mean-token-mean"},
    # GSPO paper (arXiv:2507.18071): sequence-level ratio, ε 3e-4 / 4e-4; needs sequence-level advantages,
    # which the group advantages are.
    "gspo": {"name": "gspo", "eps_low": 3e-4, "eps_high": 4e-4, "agg": "seq-mean-token-mean"},
    # DAPO (arXiv:2503.14476) clip-higher ε 0.2 / 0.28 with token-mean aggregation. Dynamic sampling is left to
    # the base config: it would change which prompts each arm trains on.
    "grpo": {"name": "grpo", "eps_low": 0.2, "eps_high": 0.28, "dual_clip": None, "agg": "token-mean"},
    # CISPO (MiniMax-M1, arXiv:2506.13585) as TRL ships it: weight min(r, 5) (ScaleRL's ε_max), token-mean.
    "cispo": {"name": "cispo", "max_ratio": 5.0, "min_ratio": None, "agg": "token-mean"},
    # GMPO (arXiv:2507.20673): log-ratio clip (e^-0.4, e^0.4), geometric mean per sequence.
    "gmpo": {"name": "gmpo", "clip_low": 0.4, "clip_high": 0.4, "agg": "seq-mean-token-mean"},
    # DPPO (arXiv:2602.04879, verl docs/algo/dppo.md): binary TV 0.15 / binary KL 0.05, no ratio cap. The
    # authors train with seq-mean-token-sum-norm, which needs max_len; token-mean keeps the arm config-free.
    "dppo_tv": {
        "name": "dppo_tv",
        "delta_low": 0.15,
        "delta_high": 0.15,
        "ratio_cap": None,
        "agg": "token-mean",
    },
    "dppo_kl": {
        "name": "dppo_kl",
        "delta_low": 0.05,
        "delta_high": 0.05,
        "ratio_cap": None,
        "agg": "token-mean",
    },
    # M2PO (arXiv:2510.01161, AReaL gsm8k_m2po.yaml): second-moment mask at 0.04, unclipped ratio, token-mean.
    "m2po": {"name": "m2po", "m2_threshold": 0.04, "agg": "token-mean"},
}
"""Loss name on the command line → ``algorithm.loss`` settings of its arms."""

CORRECTIONS: dict[str, dict[str, Any]] = {
    "none": {"name": "none"},
    "tis": {"name": "tis", "cap": 2.0},
    "icepop": {"name": "icepop", "low": 0.5, "high": 2.0},
    # verl's rollout-correction presets (docs/algo/rollout_corr.md): decoupled_token_is, decoupled_seq_is
    # (threshold 2.0) and decoupled_geo_rs (geometric rejection, seq_mean_k1 within 0.999_1.001).
    # verl's presets leave rollout_is_batch_normalize at its default, false.
    "token_is": {
        "name": "rollout_corr",
        "is_level": "token",
        "is_threshold": 2.0,
        "is_batch_normalize": False,
        "reject": [],
    },
    "seq_is": {
        "name": "rollout_corr",
        "is_level": "sequence",
        "is_threshold": 2.0,
        "is_batch_normalize": False,
        "reject": [],
    },
    "geo_rs": {
        "name": "rollout_corr",
        "is_level": None,
        "is_threshold": 2.0,  # unused without an IS weight; spelled out so that the arm's config reads whole
        "is_batch_normalize": False,
        "reject": [{"stat": "seq_mean_k1", "lower": 0.999, "upper": 1.001}],
    },
}
"""Correction name on the command line → ``algorithm.correction`` of its arms."""

REPLAYS: tuple[str, ...] = get_args(AlgorithmConfig.model_fields["routing_replay"].annotation)
"""``algorithm.routing_replay`` values (``none``, ``r2``, ``r3``)."""

SHARED_LOSS_KEYS = ("kl_coef", "entropy_coef", "max_len")
"""``algorithm.loss`` keys a ``--set`` may give every arm (the others belong to each arm's loss)."""

WARM_START_DIR = "warm_start"
ARM_CONFIG_FILE = "compare.yaml"
"""The config compare wrote for a run (its own resolved copy is ``config.yaml``)."""
ARM_NAME = re.compile(
    r"^(?P<loss>[a-z0-9_]+)-(?P<replay>[a-z0-9]+)-(?P<correction>[a-z_]+)(?P<grid>(-[a-z0-9_.]+)*)-s(?P<seed>\d+)$"
)
CONFIG_ARM_NAME = re.compile(r"^(?P<label>[a-z0-9_]+)(?P<grid>(-[a-z0-9_.]+)*)-s(?P<seed>\d+)$")
"""Run directories of config arms: ``<config file stem>[-<grid point>]-s<seed>``."""
GridPoint = tuple[tuple[str, Any], ...]
"""One point of ``--grid``: (dotted config key, value) pairs in the order the options were given."""
GridAxis = tuple[tuple[str, ...], list[tuple[Any, ...]]]
"""One ``--grid`` option: its keys (one, or several linked with ``+``) and the value tuples it takes."""
TEACHERS_DIR = "teachers"
"""Where ``--teachers`` runs go: ``<output_dir>/teachers/<teacher config name>``."""
DEMO_MISMATCH = {"rollout.precision": "fp8"}
"""The demo's default source of training–inference mismatch (a ``--set`` may change it)."""


class CompareError(UserError):
    """Bad input to ``sapo-megatron compare`` (names, step counts, ``--set`` keys, the output directory)."""

    exit_code = 2


@dataclass(frozen=True)
class Arm:
    """One run of a comparison."""

    loss: str
    replay: str
    correction: str
    seed: int
    label: str | None = None
    """A config arm's name (its config file's stem); None for a (loss, replay, correction) arm."""
    grid: GridPoint = ()
    """The ``--grid`` overrides of this arm (applied after the arm's own), empty without ``--grid``."""

    @property
    def name(self) -> str:
        """``sapo-r2-none-s0`` (or ``<label>-s0``): the arm's run directory under the compare's output directory."""
        return f"{self.configuration}-s{self.seed}"

    @property
    def configuration(self) -> str:
        """``sapo-r2-none`` (or ``<label>``): the arm's name without its seed; the seeds of one configuration
        share it."""
        base = self.label if self.label is not None else f"{self.loss}-{self.replay}-{self.correction}"
        return base + "".join(f"-{_grid_part(key, value)}" for key, value in self.grid)

    @property
    def colour_key(self) -> tuple[str, ...]:
        """What the plots colour by: the config arm's label, else (loss, correction); and the grid point."""
        base = (self.label,) if self.label is not None else (self.loss, self.correction)
        return base + tuple(_grid_part(key, value) for key, value in self.grid)

    def overrides(self) -> dict[str, Any]:
        """Dotted config overrides of this arm, in the order they must be applied (the loss's ``name`` first:
        switching the variant drops the other variant's keys and keeps the shared ones). A config arm sets only
        its seed: the rest is its config."""
        if self.label is not None:
            return {"seed": self.seed, **dict(self.grid)}
        loss = LOSSES[self.loss]
        out: dict[str, Any] = {"algorithm.loss.name": loss["name"]}
        out.update({f"algorithm.loss.{key}": value for key, value in loss.items() if key != "name"})
        out["algorithm.correction"] = dict(CORRECTIONS[self.correction])
        out["algorithm.routing_replay"] = self.replay
        out["seed"] = self.seed
        out.update(self.grid)  # after the loss's paper settings: a grid over tau_pos replaces the paper's
        return out


def _grid_part(key: str, value: Any) -> str:
    """``algorithm.loss.tau_pos`` = 4 → ``tau_pos4``: the grid point's part of an arm name (a directory name)."""
    shown = "null" if value is None else str(value).lower()  # YAML's spelling of None / True / False
    text = f"{key.rsplit('.', 1)[-1]}{shown}".lower()
    return re.sub(r"[^a-z0-9_.]", "_", text)


def parse_grid(options: Sequence[str]) -> list[GridAxis]:
    """``["algorithm.loss.tau_pos=1,4,16"]`` → ``[(("algorithm.loss.tau_pos",), [(1,), (4,), (16,)])]``, each
    value read as YAML (``null`` switches a section off). Linked keys move together:
    ``algorithm.loss.tau_pos+algorithm.loss.tau_neg=1:1.05,4:4.2`` is one axis of two points. Raises
    :class:`CompareError` naming the option on a malformed one, a repeated key or value, or a key the arms set
    themselves (seed, steps, replay, correction, loss name)."""
    axes: list[GridAxis] = []
    seen: list[str] = []
    for option in options:
        text_keys, sep, text = option.partition("=")
        keys = tuple(key.strip() for key in text_keys.split("+"))
        parts = [part.strip() for part in text.split(",")]
        split = (
            [[item.strip() for item in part.split(":")] for part in parts]
            if len(keys) > 1
            else [[p] for p in parts]
        )
        if not sep or not all(keys) or not all(parts) or any(len(items) != len(keys) for items in split):
            raise CompareError(
                f"--grid {option!r}: expected KEY=V1,V2,... (or KEY1+KEY2=A1:B1,A2:B2), e.g. "
                "--grid algorithm.loss.tau_pos=1,4,16"
            )
        for key in keys:
            owner = _arm_owned(key) if not _is_grid_loss_key(key) else None
            if owner:
                raise CompareError(
                    f"--grid {key}: {owner}", hint="the arms set this key; grid over another one"
                )
            if key in seen:
                raise CompareError(
                    f"--grid {key}: given twice; list all its values in one --grid {key}=V1,V2"
                )
            seen.append(key)
        values = [tuple(yaml.safe_load(item) for item in items) for items in split]
        texts = [str(v) for v in values]
        if len(set(texts)) != len(texts):
            raise CompareError(f"--grid {option!r}: a value is listed twice")
        axes.append((keys, values))
    return axes


def grid_points(axes: Sequence[GridAxis]) -> list[GridPoint]:
    """The Cartesian product of the axes (the first axis varies slowest); ``[()]`` without any."""
    return [
        tuple(pair for (keys, _), value in zip(axes, choice) for pair in zip(keys, value))
        for choice in itertools.product(*[values for _, values in axes])
    ]


def _is_grid_loss_key(key: str) -> bool:
    """A loss setting (not the loss's name): --grid may sweep it; the arm's loss must have that field."""
    parts = key.split(".")
    return len(parts) == 3 and parts[:2] == ["algorithm", "loss"] and parts[2] != "name"


@dataclass(frozen=True)
class PlannedRun:
    """A run compare starts: its name, its validated config (``cfg.output_dir`` is the run directory) and the
    arm it is (``None`` for the warm start)."""

    name: str
    cfg: RunConfig
    arm: Arm | None = None

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.output_dir)


@dataclass(frozen=True)
class ComparePlan:
    """Everything a comparison runs, validated before the first run starts."""

    output_dir: Path
    base: RunConfig
    """The shared config (the user's CONFIG or the demo, with ``--set``), before any arm's overrides."""
    warm_start: PlannedRun | None
    """The shared SFT run; ``None`` when the base config has no SFT phase."""
    arms: tuple[PlannedRun, ...]
    steps: int
    source: str
    """Where the base config comes from, in words (a path, or the embedded demo)."""
    overrides: dict[str, Any]
    """The ``--set`` overrides every run got."""
    teachers: tuple[PlannedRun, ...] = ()
    """Teacher runs (``--teachers``), trained before the warm start; arms score with their HF exports."""
    grid: tuple[GridAxis, ...] = ()
    """The ``--grid`` axes the arms cross (:func:`parse_grid`)."""


def parse_names(text: str, known: Sequence[str], option: str) -> list[str]:
    """``"sapo,grpo"`` → ``["sapo", "grpo"]``; raises :class:`CompareError` naming ``option`` on an empty list,
    an unknown name (with the closest known one) or a repeated one."""
    names = [part.strip() for part in text.split(",")]
    if not text.strip() or any(not name for name in names):
        raise CompareError(f"{option} {text!r}: expected comma-separated names from {', '.join(known)}")
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            suggestion = f" (did you mean {close[0]!r}?)" if close else ""
            raise CompareError(f"{option}: unknown name {name!r}{suggestion}; choose from {', '.join(known)}")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise CompareError(f"{option}: {', '.join(repeated)} given more than once")
    return names


Configuration = tuple[str, str, str]
"""(loss, replay, correction) of a set of arms, e.g. ``("sapo", "r2", "none")``."""


def parse_configurations(text: str, also_given: Sequence[str] = ()) -> list[Configuration]:
    """``"sapo-none-none,grpo-r3-token_is"`` → ``[("sapo", "none", "none"), ("grpo", "r3", "token_is")]``
    (``compare --configurations``: chosen arms instead of the whole product); raises :class:`CompareError` on a
    malformed entry, an unknown name (with the closest one), a repeated configuration, or ``also_given`` options
    (``--losses`` / ``--replay`` / ``--corrections``, which it replaces)."""
    if also_given:
        raise CompareError(
            f"--configurations names every arm's loss, replay and correction; drop {', '.join(also_given)}"
        )
    out: list[Configuration] = []
    for entry in [part.strip() for part in text.split(",")]:
        parts = entry.split("-")
        if len(parts) != 3:
            raise CompareError(
                f"--configurations {entry!r}: expected LOSS-REPLAY-CORRECTION, e.g. sapo-r2-none or grpo-none-tis"
            )
        known = (list(LOSSES), list(REPLAYS), list(CORRECTIONS))
        for name, names, option in zip(parts, known, ("loss", "replay", "correction")):
            parse_names(name, names, f"--configurations {entry!r}: {option}")
        if tuple(parts) in out:
            raise CompareError(f"--configurations: {entry} given more than once")
        out.append((parts[0], parts[1], parts[2]))
    return out


def plan_arms(
    losses: Sequence[str],
    replays: Sequence[str],
    corrections: Sequence[str],
    seeds: int,
    grid: Sequence[GridPoint] = ((),),
    configurations: Sequence[Configuration] | None = None,
) -> list[Arm]:
    """Every combination (or only ``configurations``, in their order), seed-major (all configurations of seed 0
    first, so an early stop leaves whole seeds), then in the order given on the command line, the grid points
    last."""
    if seeds < 1:
        raise CompareError(f"--seeds {seeds}: need at least one seed")
    if configurations is None:
        configurations = list(itertools.product(losses, replays, corrections))
    return [
        Arm(loss, replay, correction, seed, grid=point)
        for seed in range(seeds)
        for loss, replay, correction in configurations
        for point in grid
    ]


def build_plan(
    config: str | None,
    overrides: Mapping[str, Any],
    *,
    losses: Sequence[str],
    replays: Sequence[str],
    corrections: Sequence[str],
    seeds: int,
    steps: int,
    output_dir: str | Path,
    grid: Sequence[GridAxis] = (),
    configurations: Sequence[Configuration] | None = None,
) -> ComparePlan:
    """Validate the request and every arm's config; raises :class:`CompareError` (or ``ConfigError``) on bad
    input. ``config`` None: the embedded demo with :data:`DEMO_MISMATCH`. ``overrides``: the ``--set`` pairs;
    ``grid``: the ``--grid`` axes (:func:`parse_grid`), crossed with the losses, replays and corrections (or
    with ``configurations``, :func:`parse_configurations`, which then replace their product)."""
    if steps < 1:
        raise CompareError(f"--steps {steps}: each arm needs at least one RL step")
    check_overrides(overrides)
    _check_grid_against_set(grid, overrides)
    arms = plan_arms(losses, replays, corrections, seeds, grid_points(grid), configurations)
    if configurations is not None:
        replays = sorted({replay for _, replay, _ in configurations})
    root = Path(output_dir).resolve()
    shared = {**(DEMO_MISMATCH if config is None else {}), **overrides, "trainer.steps": steps}
    base = load_config(config, shared)
    _check_base(base, replays)
    warm_start = None
    if base.sft.steps > 0:
        warm_start = _warm_start(config, shared, root / WARM_START_DIR)
        shared.update({"model.init": "hf", "model.init_path": str(warm_start.run_dir / "hf"), "sft.steps": 0})
    if base.model.arch.is_moe:
        shared["rollout.routed_experts"] = True
    planned = tuple(
        PlannedRun(
            arm.name,
            load_config(
                config, {**shared, **arm.overrides(), "name": arm.name, "output_dir": str(root / arm.name)}
            ),
            arm,
        )
        for arm in arms
    )
    source = config or "the embedded tiny MoE demo (sapo_megatron/defaults.py)"
    return ComparePlan(root, base, warm_start, planned, steps, source, dict(overrides), grid=tuple(grid))


def _check_grid_against_set(grid: Sequence[GridAxis], overrides: Mapping[str, Any]) -> None:
    both = [key for keys, _ in grid for key in keys if key in overrides]
    if both:
        raise CompareError(f"--grid {both[0]} and --set {both[0]}: give the key one way (the grid's values)")


def _warm_start(config: str | None, shared: Mapping[str, Any], run_dir: Path) -> PlannedRun:
    """The base config's SFT alone (no RL step), exporting the HF weights every arm starts from."""
    overrides = {
        **shared,
        "name": WARM_START_DIR,
        "output_dir": str(run_dir),
        "trainer.steps": 0,
        "trainer.export_hf": True,
    }
    return PlannedRun(WARM_START_DIR, load_config(config, overrides))


def check_overrides(overrides: Mapping[str, Any]) -> None:
    """Refuse ``--set`` keys that each arm sets itself (they would be silently replaced)."""
    for key in overrides:
        owner = _arm_owned(key)
        if owner:
            raise CompareError(f"--set {key}: {owner}", hint="drop this --set; the arms set it")


def _arm_owned(key: str) -> str | None:
    if key in ("seed", "output_dir"):
        return "every arm gets its own (seed index i uses seed i; runs go under --output-dir)"
    if key == "trainer.steps":
        return "use --steps"
    if key == "algorithm.routing_replay":
        return "use --replay"
    if key == "algorithm.correction" or key.startswith("algorithm.correction."):
        return "use --corrections"
    if key == "algorithm.loss" or (
        key.startswith("algorithm.loss.") and key.split(".")[2] not in SHARED_LOSS_KEYS
    ):
        return (
            "each arm's loss comes with its paper settings (--losses); only "
            + ", ".join(f"algorithm.loss.{k}" for k in SHARED_LOSS_KEYS)
            + " may be set for every arm"
        )
    return None


def _check_base(base: RunConfig, replays: Sequence[str]) -> None:
    if base.launch.nodes > 1:
        raise CompareError(
            f"launch.nodes={base.launch.nodes}: compare runs its arms one after another on this machine",
            hint="run each arm as a SLURM job instead (launch/slurm_train.sbatch), or use launch.nodes: 1",
        )
    replayed = [replay for replay in replays if replay != "none"]
    if replayed and not base.model.arch.is_moe:
        raise CompareError(
            f"--replay {','.join(replayed)}: routing replay needs a MoE model, and model type "
            f"{base.model.arch.model_type} has no experts",
            hint="use --replay none",
        )


# --------------------------------------------------------------------------------------------------------
# Config arms (--arms) and teachers (--teachers)
# --------------------------------------------------------------------------------------------------------

SHARED_SECTIONS = ("model", "sft", "data")
"""Sections every config arm must have alike: they share one warm start and one prompt set."""


def build_config_plan(
    arm_configs: Sequence[str],
    overrides: Mapping[str, Any],
    *,
    teacher_configs: Sequence[str] = (),
    seeds: int,
    steps: int,
    output_dir: str | Path,
    grid: Sequence[GridAxis] = (),
) -> ComparePlan:
    """A comparison whose arms are whole run configs (one per file, named after its stem) crossed with the
    ``grid`` points, plus teachers to train first. Raises :class:`CompareError` (or ``ConfigError``) on bad
    input; nothing runs."""
    if steps < 1:
        raise CompareError(f"--steps {steps}: each arm needs at least one RL step")
    if seeds < 1:
        raise CompareError(f"--seeds {seeds}: need at least one seed")
    check_overrides({k: v for k, v in overrides.items() if not k.startswith("algorithm.")})
    _check_grid_against_set(grid, overrides)
    points = grid_points(grid)
    root = Path(output_dir).resolve()
    labels = [_arm_label(path) for path in arm_configs]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise CompareError(
            f"--arms: {', '.join(repeated)} given more than once (arms are named by file stem)"
        )
    teachers = tuple(_teacher_run(path, root) for path in teacher_configs)
    shared = {**overrides, "trainer.steps": steps}
    bases = [load_config(path, shared) for path in arm_configs]
    base = bases[0]
    _check_base(base, ["none"])
    _check_alike(arm_configs, bases)
    made = {run.cfg.name: run.run_dir / "hf" for run in teachers}
    warm_start = None
    if base.sft.steps > 0:
        # The warm start loads the first arm's config, teachers included: they must point at what compare trains.
        pointed = {"teachers": _teachers_pointed_at(base, made)} if made and base.teachers else {}
        warm_start = _warm_start(arm_configs[0], {**shared, **pointed}, root / WARM_START_DIR)
        shared.update({"model.init": "hf", "model.init_path": str(warm_start.run_dir / "hf"), "sft.steps": 0})
    planned = []
    arm_configs_and_points = [
        (seed, path, label, cfg, point)
        for seed in range(seeds)
        for path, label, cfg in zip(arm_configs, labels, bases)
        for point in points
    ]
    for seed, path, label, cfg, point in arm_configs_and_points:
        loss, replay, correction = (
            cfg.algorithm.loss.name,
            cfg.algorithm.routing_replay,
            cfg.algorithm.correction.name,
        )
        arm = Arm(loss, replay, correction, seed, label, point)
        arm_overrides = {**shared, **arm.overrides(), "name": arm.name, "output_dir": str(root / arm.name)}
        if made and cfg.teachers:
            arm_overrides["teachers"] = _teachers_pointed_at(cfg, made)
        planned.append(PlannedRun(arm.name, load_config(path, arm_overrides), arm))
    source = "configs " + ", ".join(arm_configs)
    return ComparePlan(
        root, base, warm_start, tuple(planned), steps, source, dict(overrides), teachers, tuple(grid)
    )


def _arm_label(path: str) -> str:
    label = Path(path).stem
    if not re.fullmatch(r"[a-z0-9_]+", label):
        raise CompareError(
            f"--arms {path}: arms are named after their file's stem, which must be lower-case letters, digits "
            f"and '_' (got {label!r})",
            hint="rename the file, e.g. fixed_fusion.yaml",
        )
    return label


def _teacher_run(path: str, root: Path) -> PlannedRun:
    """A teacher config trained (SFT and/or RL, as it says) into ``root/teachers/<its name>``, exporting HF."""
    name = load_config(path).name
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        raise CompareError(f"--teachers {path}: its name {name!r} must be usable as a directory name")
    overrides = {"output_dir": str(root / TEACHERS_DIR / name), "trainer.export_hf": True}
    return PlannedRun(f"{TEACHERS_DIR}/{name}", load_config(path, overrides))


def _teachers_pointed_at(cfg: RunConfig, made: Mapping[str, Path]) -> list[dict[str, Any]]:
    """The arm's ``teachers`` with each teacher that compare trains (same name) reading that teacher's export."""
    out = []
    for teacher in cfg.teachers:
        entry = teacher.model_dump(mode="json")
        if teacher.name in made and teacher.engine != "sglang":
            entry["model_path"] = str(made[teacher.name])
        out.append(entry)
    return out


def _check_alike(paths: Sequence[str], configs: Sequence[RunConfig]) -> None:
    first = {section: getattr(configs[0], section).model_dump(mode="json") for section in SHARED_SECTIONS}
    for path, cfg in zip(paths[1:], configs[1:]):
        for section in SHARED_SECTIONS:
            if getattr(cfg, section).model_dump(mode="json") != first[section]:
                raise CompareError(
                    f"--arms: {path} has another {section} section than {paths[0]}; config arms share one warm "
                    f"start and one prompt set, so {', '.join(SHARED_SECTIONS)} must be the same in every arm"
                )
