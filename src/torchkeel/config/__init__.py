"""Typed configuration: the dataclasses, loading from YAML with overrides, and plug-in imports."""

from torchkeel.config.imports import build_target, resolve_target
from torchkeel.config.load import from_dict, load_config, parse_override, read_yaml, to_dict
from torchkeel.config.schema import (
    DataConfig,
    KeelConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    ScheduleConfig,
    TrainConfig,
)

__all__ = [
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
