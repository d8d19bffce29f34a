"""One exception hierarchy. Every message names what is wrong and how to fix it, on one line.

The CLI maps each class to an exit code (``KeelError.exit_code``) and prints the message
without a traceback unless ``--debug`` is given.
"""

from __future__ import annotations


class KeelError(Exception):
    """Base class of every error torchkeel raises on purpose."""

    exit_code: int = 1


class ConfigError(KeelError):
    """A config key, override, config file or plugged-in callable is wrong (a usage error)."""

    exit_code = 2


class RunDirError(KeelError):
    """The run directory cannot be used as asked (it exists, or is not a torchkeel run)."""

    exit_code = 2


class CheckpointError(KeelError):
    """A checkpoint is missing, corrupt, unsafe to load, or does not fit the model."""

    exit_code = 3


class DataError(KeelError):
    """A dataset or batch is not what the trainer needs."""

    exit_code = 1


class TrainingDiverged(KeelError):
    """Training kept producing non-finite values; ``diagnosis`` says where they first appeared."""

    exit_code = 1

    def __init__(self, message: str, diagnosis: dict | None = None) -> None:
        super().__init__(message)
        self.diagnosis = diagnosis


class SampleTooLarge(KeelError):
    """A single sample does not fit in memory, even after splitting the batch down to one."""

    exit_code = 1


class ParityError(KeelError):
    """An exported model's outputs differ from the eager model's beyond the tolerance."""

    exit_code = 4


class MissingExtraError(KeelError):
    """An optional dependency group is not installed."""

    exit_code = 2

    def __init__(self, extra: str, package: str, feature: str) -> None:
        super().__init__(f"{feature} needs the '{package}' package: pip install 'torchkeel[{extra}]'")


def first_line(exc: BaseException, limit: int = 200) -> str:
    """The first non-empty line of an exception's message (library errors are often multi-line)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[0] if lines else type(exc).__name__)[:limit]
