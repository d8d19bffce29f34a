"""torchkeel: PyTorch training and serving that stay steady. The public API."""

from importlib.metadata import PackageNotFoundError, version

from torchkeel.checkpoint import (
    AsyncSaver,
    CheckpointStore,
    capture_training_state,
    load_weights,
    read_checkpoint,
    restore_training_state,
)
from torchkeel.config import KeelConfig, load_config
from torchkeel.data import (
    EpochLoader,
    PadCollate,
    ParquetSource,
    StreamLoader,
    WebDatasetSource,
    tune_workers,
)
from torchkeel.diagnose import Diagnosis, diagnose_script
from torchkeel.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    KeelError,
    RunDirError,
    SampleTooLarge,
    TrainingDiverged,
)
from torchkeel.lint import lint_paths
from torchkeel.train.accumulate import iter_groups, steps_per_epoch, total_steps
from torchkeel.train.clipping import clip_grad_norm
from torchkeel.train.compile import CompiledOrEager
from torchkeel.train.diagnose import diagnose_nonfinite
from torchkeel.train.early_stop import EarlyStopping
from torchkeel.train.ema import WeightAverage
from torchkeel.train.guards import Action, NonFiniteGuard, SpikeDetector
from torchkeel.train.incidents import IncidentLog
from torchkeel.train.inputbound import InputBoundDetector, TimedBatches
from torchkeel.train.memory import LeakDetector, MemoryMonitor
from torchkeel.train.metrics import MetricsWriter, read_metrics
from torchkeel.train.metricset import MetricSet
from torchkeel.train.objective import Objective
from torchkeel.train.oom import OomInjector
from torchkeel.train.precision import Precision, make_precision
from torchkeel.train.schedule import build_scheduler, lr_at
from torchkeel.train.seed import seed_everything
from torchkeel.train.step import StepResult, train_step
from torchkeel.train.trainer import Trainer
from torchkeel.train.validate import evaluate

try:
    __version__ = version("torchkeel")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"

__all__ = [
    "Diagnosis",
    "EarlyStopping",
    "MetricSet",
    "WeightAverage",
    "diagnose_script",
    "lint_paths",
    "Action",
    "IncidentLog",
    "LeakDetector",
    "MemoryMonitor",
    "NonFiniteGuard",
    "OomInjector",
    "SampleTooLarge",
    "SpikeDetector",
    "TrainingDiverged",
    "diagnose_nonfinite",
    "AsyncSaver",
    "CheckpointError",
    "CheckpointStore",
    "capture_training_state",
    "load_weights",
    "read_checkpoint",
    "restore_training_state",
    "CompiledOrEager",
    "ConfigError",
    "DataError",
    "EpochLoader",
    "InputBoundDetector",
    "Objective",
    "PadCollate",
    "ParquetSource",
    "StreamLoader",
    "TimedBatches",
    "WebDatasetSource",
    "tune_workers",
    "KeelConfig",
    "KeelError",
    "MetricsWriter",
    "Precision",
    "RunDirError",
    "StepResult",
    "Trainer",
    "__version__",
    "build_scheduler",
    "clip_grad_norm",
    "evaluate",
    "iter_groups",
    "load_config",
    "lr_at",
    "make_precision",
    "read_metrics",
    "seed_everything",
    "steps_per_epoch",
    "total_steps",
    "train_step",
]
