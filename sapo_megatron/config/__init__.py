"""Typed run configuration, loaded from YAML and validated once, before any process group or model exists.

Every error names the field and the fix. :func:`load_config` returns a :class:`RunConfig`;
:func:`validate_layout` checks the parallel layout against the model and the world size;
:meth:`RunConfig.save_resolved` writes the resolved config next to the run's outputs.

Each section lives beside the feature that reads it (``rollout/config.py``, ``model/config.py``,
``loop/config.py``, ``data/config.py``, ``algo/config.py``, ``runtime/config.py``, ``eval/config.py``,
``distill/config.py``); this package holds what ties them together:

- :mod:`.run`: :class:`RunConfig` (the sections and the checks across them);
- :mod:`.load`: file / embedded default + overrides → validated config;
- :mod:`.yaml_io`: YAML within limits, ``--set`` overrides; :mod:`.messages`: error texts;
- :mod:`.layout`: the parallel layout against the model and the world size;
- :mod:`.deprecated`: keys of the previous release, read under their new names with a warning.

Every name below stays importable from ``sapo_megatron.config``.
"""

from sapo_megatron.algo.config import AlgorithmConfig, RemoteRewardConfig, WeightedReward
from sapo_megatron.config.deprecated import DeprecatedConfigKey
from sapo_megatron.config.layout import data_parallel_size, sequence_length_multiple, validate_layout
from sapo_megatron.config.load import (
    TINY,
    apply_overrides,
    config_from_dict,
    fill_auto_sizes,
    load_config,
    resolve_relative_paths,
)
from sapo_megatron.config.run import MAX_SEQUENCES_PER_STEP, RunConfig
from sapo_megatron.config.yaml_io import (
    MAX_CONFIG_BYTES,
    MAX_YAML_ALIASES,
    MAX_YAML_DEPTH,
    MAX_YAML_VALUES,
    parse_overrides,
    parse_yaml,
    read_yaml,
)
from sapo_megatron.config_section import Section
from sapo_megatron.data.config import DataConfig
from sapo_megatron.errors import ConfigError  # ConfigError: also importable from here, as before
from sapo_megatron.loop.config import SFTConfig, TrainerConfig
from sapo_megatron.model.config import (
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    PrecisionConfig,
    RecomputeModule,
)
from sapo_megatron.rollout.config import (
    ColocateConfig,
    ColocationConfig,
    EngineKind,
    MultiTurnConfig,
    NotColocated,
    RolloutConfig,
    SplitColocation,
)
from sapo_megatron.runtime.config import LaunchConfig

__all__ = [
    "MAX_CONFIG_BYTES",
    "MAX_SEQUENCES_PER_STEP",
    "MAX_YAML_ALIASES",
    "MAX_YAML_DEPTH",
    "MAX_YAML_VALUES",
    "TINY",
    "AlgorithmConfig",
    "ColocateConfig",
    "ColocationConfig",
    "ConfigError",
    "DataConfig",
    "DeprecatedConfigKey",
    "EngineKind",
    "LaunchConfig",
    "ModelConfig",
    "MultiTurnConfig",
    "NotColocated",
    "OptimizerConfig",
    "ParallelConfig",
    "PrecisionConfig",
    "RecomputeModule",
    "RemoteRewardConfig",
    "RolloutConfig",
    "RunConfig",
    "SFTConfig",
    "Section",
    "SplitColocation",
    "TrainerConfig",
    "WeightedReward",
    "apply_overrides",
    "config_from_dict",
    "data_parallel_size",
    "fill_auto_sizes",
    "load_config",
    "parse_overrides",
    "parse_yaml",
    "read_yaml",
    "resolve_relative_paths",
    "sequence_length_multiple",
    "validate_layout",
]
