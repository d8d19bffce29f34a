"""Typed configuration: the dataclasses, loading from YAML with overrides, and plug-in imports."""

from torchkeel.config.imports import build_target, resolve_target
from torchkeel.config.load import (
    config_hash,
    from_dict,
    load_config,
    parse_override,
    read_yaml,
    to_dict,
)
from torchkeel.config.schema import (
    CheckpointConfig,
    DataConfig,
    KeelConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    ScheduleConfig,
    TrainConfig,
)

__all__ = [
    "CheckpointConfig",
    "config_hash",
    "DataConfig",
    "KeelConfig",
    "LossConfig",
    "ModelConfig",
    "OptimConfig",
    "ScheduleConfig",
    "TrainConfig",
    "build_target",
    "from_dict",
    "load_config",
    "parse_override",
    "read_yaml",
    "resolve_target",
    "to_dict",
]
