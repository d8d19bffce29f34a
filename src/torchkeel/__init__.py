"""torchkeel: PyTorch training and serving that stay steady. The public API.

Names are imported on first use (PEP 562): ``import torchkeel`` loads nothing but this table, so
``import torchkeel.serve.grpc`` pays for serving alone, and ``keel lint`` never loads torch.
"""

from __future__ import annotations

from torchkeel._lazy import lazy_exports
from torchkeel._version import __version__

# Public name → the module that defines it; ``__all__`` is this table's names.
_EXPORTS = {
    "AsyncSaver": "torchkeel.checkpoint",
    "CheckpointStore": "torchkeel.checkpoint",
    "capture_training_state": "torchkeel.checkpoint",
    "load_weights": "torchkeel.checkpoint",
    "read_checkpoint": "torchkeel.checkpoint",
    "restore_training_state": "torchkeel.checkpoint",
    "KeelConfig": "torchkeel.config",
    "load_config": "torchkeel.config",
    "EpochLoader": "torchkeel.data",
    "HFDiskDataset": "torchkeel.data",
    "PadCollate": "torchkeel.data",
    "ParquetSource": "torchkeel.data",
    "StreamLoader": "torchkeel.data",
    "TextSource": "torchkeel.data",
    "WebDatasetSource": "torchkeel.data",
    "tune_workers": "torchkeel.data",
    "BadSampleLedger": "torchkeel.data.bad",
    "Diagnosis": "torchkeel.diagnose",
    "diagnose_script": "torchkeel.diagnose",
    "CheckpointError": "torchkeel.errors",
    "ConfigError": "torchkeel.errors",
    "DataError": "torchkeel.errors",
    "KeelError": "torchkeel.errors",
    "RunDirError": "torchkeel.errors",
    "SampleTooLarge": "torchkeel.errors",
    "TrainingDiverged": "torchkeel.errors",
    "lint_paths": "torchkeel.lint",
    "Generation": "torchkeel.lm",
    "GenerationError": "torchkeel.lm",
    "generate": "torchkeel.lm",
    "open_language_model": "torchkeel.export.lm",
    "iter_groups": "torchkeel.train.accumulate",
    "steps_per_epoch": "torchkeel.train.accumulate",
    "total_steps": "torchkeel.train.accumulate",
    "clip_grad_norm": "torchkeel.train.clipping",
    "ClipRate": "torchkeel.train.clipping",
    "CompiledOrEager": "torchkeel.train.compile",
    "diagnose_nonfinite": "torchkeel.train.nonfinite",
    "EarlyStopping": "torchkeel.train.early_stop",
    "WeightAverage": "torchkeel.train.ema",
    "Action": "torchkeel.train.guards",
    "NonFiniteGuard": "torchkeel.train.guards",
    "Snapshot": "torchkeel.train.guards",
    "SpikeDetector": "torchkeel.train.guards",
    "Rollback": "torchkeel.train.rollback",
    "TrainingParts": "torchkeel.train.counters",
    "IncidentLog": "torchkeel.train.incidents",
    "InputBoundDetector": "torchkeel.train.inputbound",
    "TimedBatches": "torchkeel.train.inputbound",
    "LeakDetector": "torchkeel.train.memory",
    "MemoryMonitor": "torchkeel.train.memory",
    "MetricsWriter": "torchkeel.train.runlog",
    "read_metrics": "torchkeel.train.runlog",
    "MetricSet": "torchkeel.train.metricset",
    "Objective": "torchkeel.train.objective",
    "StepOutput": "torchkeel.train.objective",
    "CarriedState": "torchkeel.train.carry",
    "Precision": "torchkeel.train.precision",
    "make_precision": "torchkeel.train.precision",
    "build_scheduler": "torchkeel.train.schedule",
    "lr_at": "torchkeel.train.schedule",
    "TargetSchedule": "torchkeel.train.schedule",
    "seed_everything": "torchkeel.rng",
    "StepResult": "torchkeel.train.step",
    "StepSettings": "torchkeel.train.step",
    "train_step": "torchkeel.train.step",
    "Trainer": "torchkeel.train.trainer",
    "evaluate": "torchkeel.train.validate",
}

__all__ = ["__version__", *sorted(_EXPORTS)]  # one list: every name of the table, and the version


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
