"""Turn the config's import paths into the objects the Trainer composes, checking what comes back."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torchkeel.checkpoint import load_model_weights, load_weights
from torchkeel.config.imports import build_target, resolve_target
from torchkeel.config.schema import CarryConfig, KeelConfig, LossConfig, ModelConfig
from torchkeel.data.build import Loaders, build_loaders
from torchkeel.distributed.job import TrainingJob
from torchkeel.distributed.rank import RankInfo
from torchkeel.errors import ConfigError
from torchkeel.rng import seed_everything
from torchkeel.train.accumulate import total_steps
from torchkeel.train.carry import CarriedState, refuse_state
from torchkeel.train.compile import CompiledOrEager, Reporter
from torchkeel.train.ema import WeightAverage
from torchkeel.train.hf import build_hf_model, check_tokens_fit
from torchkeel.train.hooks import TrainerHooks
from torchkeel.train.metricset import MetricSet
from torchkeel.train.objective import Objective
from torchkeel.train.optim import optimizer_over, param_groups
from torchkeel.train.precision import Precision
from torchkeel.train.profiling import StepProfiler
from torchkeel.train.recompute import checkpoint_activations
from torchkeel.train.schedule import build_schedule
from torchkeel.train.step import StepSettings


@dataclass
class Training:
    """What a run trains with, built in the one order a hand-written loop can follow."""

    data: Loaders
    model: torch.nn.Module
    """The plain module (its weights are what checkpoints and exports hold)."""
    forward_model: torch.nn.Module
    """What the step calls: the model wrapped for the job (DDP, FSDP2) and compiled if asked."""
    objective: Objective
    val_scores: MetricSet | None
    train_scores: MetricSet | None
    params: list[torch.nn.Parameter]
    ema: WeightAverage | None
    optimizer: torch.optim.Optimizer
    total_steps: int
    scheduler: Any
    profiler: StepProfiler
    carry: CarriedState | None = None
    """The state carried across batches (``train.carry``), which checkpoints hold."""
    param_groups: list[dict[str, Any]] = field(default_factory=list)
    """The optimizer's groups as built (``ParamGroup.row``): reported once at the run's start."""


def build_training(
    cfg: KeelConfig,
    job: TrainingJob,
    model: torch.nn.Module | None = None,
    train_data: Any = None,
    val_data: Any = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    *,
    report: Reporter | None = None,
) -> Training:
    """Seed, data, model, loss, optimizer, schedule — in this order (a hand loop that follows it
    draws the same random numbers). Objects given take the place of the config's import paths;
    ``report`` hears of graph breaks and compile times."""
    seed_everything(cfg.seed, cfg.deterministic)
    rank, device = job.rank, job.device
    data = build_loaders(
        cfg.data,
        batch_size=cfg.train.batch_size,
        seed=cfg.seed,
        device=device,
        train_data=train_data,
        val_data=val_data,
        rank=rank.rank,
        world_size=rank.world_size,
        val_batch_size=cfg.val.batch_size,
    )
    model = _model(cfg, model, data, device)
    forward_model = _forward_model(cfg, job, model, report)
    objective = build_objective(cfg.loss, loss_fn, model, carry=cfg.train.carry)
    val_scores = MetricSet.from_config(cfg.metrics, device)
    train_scores = MetricSet.from_config(cfg.metrics, device, on="train")
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]  # FSDP2's DTensors by name
    params = [p for _, p in named]
    ema = WeightAverage(model, cfg.train.ema.decay, cfg.train.ema.start_step) if cfg.train.ema.decay else None
    groups = param_groups(cfg.optim, named, model)
    optimizer = optimizer_over(cfg.optim, groups)
    # The schedule's length: exact when no sample is bad (every epoch's plan is known); the
    # loop itself ends with the data, and the last step's learning rate is the floor.
    steps = total_steps(data.train.num_batches, cfg.train.accumulate, cfg.train.max_epochs, cfg.train.max_steps)
    peak = cfg.optim.lr if cfg.optim.target is None else None  # min_lr's reference (None: group 0's lr)
    has_val = data.val is not None
    scheduler = build_schedule(cfg.schedule, optimizer, total_steps=steps, peak_lr=peak, has_validation=has_val)
    profiler = StepProfiler(cfg.profile, Path(cfg.out_dir) / cfg.name / "profile", model, rank.rank)
    return Training(
        data,
        model,
        forward_model,
        objective,
        val_scores,
        train_scores,
        params,
        ema,
        optimizer,
        steps,
        scheduler,
        profiler,
        carry=objective.step_fn if isinstance(objective.step_fn, CarriedState) else None,
        param_groups=[g.row() for g in groups],
    )


def _model(cfg: KeelConfig, model: torch.nn.Module | None, data: Loaders, device: torch.device) -> torch.nn.Module:
    """The run's model on ``device``: given or built, checked against the data's tokens, with
    ``model.init_from``'s weights and ``train.activation_checkpointing``."""
    model = (model if model is not None else build_model(cfg.model)).to(device)
    check_tokens_fit(model, getattr(data.train, "source", None))
    if cfg.model.init_from:
        path = cfg.model.init_from
        skipped = load_model_weights(
            model, load_weights(path), strict=cfg.model.init_strict, source=f"weights in '{path}'"
        )
        if skipped:
            print(f"keel: warning: model.init_from '{path}': not loaded: {', '.join(skipped)}", file=sys.stderr)
    checkpoint_activations(model, cfg.train.activation_checkpointing)
    return model


def _forward_model(
    cfg: KeelConfig, job: TrainingJob, model: torch.nn.Module, report: Reporter | None
) -> torch.nn.Module:
    """What the step calls: ``model`` wrapped for the job, then each rank seeded, then compiled if asked."""
    wrapped = job.wrap(model, precision=cfg.precision, batch_size=cfg.train.batch_size, accumulate=cfg.train.accumulate)
    job.seed_rank(cfg.seed)
    c = cfg.compile
    if not c.enabled:
        return wrapped
    return CompiledOrEager(wrapped, c.backend, mode=c.mode, fullgraph=c.fullgraph, dynamic=c.dynamic, report=report)


def step_settings(
    cfg: KeelConfig,
    training: Training,
    precision: Precision,
    job: TrainingJob,
    *,
    agree: Callable[[], Sequence[bool]] | None = None,
    hooks: TrainerHooks | None = None,
) -> StepSettings:
    """What every step of the run shares: the config's settings, ``agree`` and ``hooks``."""
    scores = training.train_scores
    return StepSettings(
        params=training.params,
        precision=precision,
        device=job.device,
        scheduler=training.scheduler,
        clip_grad_norm_max=cfg.train.clip_grad_norm,
        check_finite=cfg.guard.enabled,
        split_on_oom=cfg.oom.auto_split and not cfg.train.carry.enabled,  # a split would split the state
        sync=job.sync,
        on_outputs=scores.update if scores is not None else None,
        agree=agree,
        hooks=hooks,
    )


def resolve_device(name: str, rank: RankInfo | None = None) -> torch.device:
    """``auto`` → cuda, then mps, then cpu. Under torchrun each rank takes GPU ``LOCAL_RANK``.

    Raises:
        ConfigError: the named device is not available in this torch build or machine.
    """
    local_rank = (rank or RankInfo()).local_rank
    if name == "auto":
        if torch.cuda.is_available():
            name = "cuda"
        elif torch.backends.mps.is_available():
            name = "mps"
        else:
            name = "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise ConfigError(
                f"device=cuda but no CUDA device is usable (torch {torch.__version__}, {build}); "
                "use device=auto or device=cpu, or run `keel doctor`"
            )
        # Before anything else touches CUDA, or every rank lands on GPU 0.
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if name == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("device=mps but MPS is not available here; use device=auto or device=cpu")
    return torch.device(name)


def build_model(cfg: ModelConfig) -> torch.nn.Module:
    """Call ``model.target(**model.args)`` (it must return an ``nn.Module``), or build ``model.hf``."""
    if cfg.hf is not None:
        return build_hf_model(cfg.hf)
    if cfg.target is None:
        raise ConfigError(
            "model.target is not set; give a 'module:callable' that returns an nn.Module, or model.hf "
            "for a transformers model"
        )
    model = build_target(cfg.target, cfg.args, "model")
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"model.target={cfg.target!r} returned {type(model).__name__}; it must return a torch.nn.Module"
        )
    return model


def build_objective(
    cfg: LossConfig,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    model: torch.nn.Module | None = None,
    *,
    carry: CarryConfig | None = None,
) -> Objective:
    """The ``Objective``: ``loss.step_fn`` if set (carrying a state across batches with
    ``carry.enabled``), else ``loss_fn`` (or ``loss.target``), with ``loss.count_key``;
    ``model`` decides ``loss.shift_labels: null``."""
    shift = cfg.shift_labels if cfg.shift_labels is not None else model is not None and predicts_next_token(model)
    counting = dict(
        count_key=cfg.count_key,
        ignore_index=cfg.ignore_index,
        shift_labels=shift,
        token_loss=shift or (model is not None and _predicts_masked_token(model)),
    )
    if cfg.step_fn is not None and (cfg.output is not None or cfg.logits is not None):
        key = "loss.output" if cfg.output is not None else "loss.logits"
        raise ConfigError(
            f"{key} names part of what the model returns, and loss.step_fn calls the model itself; unset "
            f"{key} and return torchkeel.StepOutput(loss, logits=..., targets=...) from the step function"
        )
    if cfg.step_fn is not None:
        step_fn = resolve_target(cfg.step_fn, "loss.step_fn")
        if carry is not None and carry.enabled:
            return Objective(step_fn=CarriedState(step_fn, reset=carry.reset, eval=carry.eval), **counting)
        return Objective(step_fn=refuse_state(step_fn), **counting)
    loss = loss_fn if loss_fn is not None else build_loss(cfg)
    return Objective(loss, output=cfg.output, logits=cfg.logits, **counting)


def build_loss(cfg: LossConfig) -> Callable[[Any, Any], torch.Tensor]:
    """Call ``loss.target(**loss.args)``; it must return a callable ``loss(output, target)``."""
    loss_fn = build_target(cfg.target, cfg.args, "loss")
    if not callable(loss_fn):
        raise ConfigError(
            f"loss.target={cfg.target!r} returned {type(loss_fn).__name__}; "
            "it must return a callable loss(output, target) (e.g. torch.nn:CrossEntropyLoss)"
        )
    return loss_fn


def _predicts_masked_token(model: torch.nn.Module) -> bool:
    """A transformers masked LM (``…ForMaskedLM``): its loss is a mean over the masked tokens."""
    kind = type(model)
    return kind.__module__.startswith("transformers.") and kind.__name__.endswith("ForMaskedLM")


def predicts_next_token(model: torch.nn.Module) -> bool:
    """A transformers model whose loss shifts the labels by one (its causal-LM loss)."""
    try:
        loss = getattr(model, "loss_function", None)
    except Exception:  # noqa: BLE001 - a property of someone else's class: no answer is "no"
        return False
    if getattr(loss, "__name__", "") == "ForCausalLMLoss":
        return True
    kind = type(model)
    return kind.__module__.startswith("transformers.") and kind.__name__.endswith(("ForCausalLM", "LMHeadModel"))
