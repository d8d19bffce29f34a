"""The typed configuration: one dataclass per component and one root, ``KeelConfig``.

Every key is documented in ``docs/config.md``; ``validate()`` checks values and combinations and
names the key to change. Loading from YAML and overrides lives in ``torchkeel.config.load``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from torchkeel.config.data import DataConfig as DataConfig  # the data section has a module of its own
from torchkeel.config.data import PreprocessConfig as PreprocessConfig
from torchkeel.config.data import TokenizerConfig as TokenizerConfig
from torchkeel.config.validate import check_config

Device = Literal["auto", "cpu", "cuda", "mps"]
PrecisionName = Literal["fp32", "bf16", "fp16"]
Decay = Literal["cosine", "linear", "constant"]
DecayFilter = Literal["all", "matrices", "transformers"]
ScheduleStyle = Literal["torchkeel", "nanogpt", "transformers"]


@dataclass
class HFModelConfig:
    config: Optional[dict[str, Any]] = None
    """A transformers config to build the model from (random weights, nothing downloaded):
    ``model_type`` (``gpt2``, ``llama``, ``bert``...) and that model's settings (``n_layer: 2``)."""
    path: Optional[str] = None
    """Instead of ``config``: a local directory written by ``save_pretrained`` (its
    ``.safetensors`` weights; a directory holding pickle weights is refused)."""
    task: Literal["causal-lm", "masked-lm", "sequence-classification", "token-classification"] = "causal-lm"
    """The head: a language model, or a classifier of sequences or of tokens (``num_labels`` in
    ``config``)."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for transformers' ``from_config`` / ``from_pretrained``
    (``attn_implementation: eager``...)."""


@dataclass
class ModelConfig:
    target: Optional[str] = None
    """``module:callable`` that returns the ``torch.nn.Module`` to train."""
    hf: Optional[HFModelConfig] = None
    """Instead of ``target``: a transformers model (``pip install 'torchkeel[hf]'``)."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for ``target``."""
    init_from: Optional[str] = None
    """Load weights only (fine-tuning) from a torchkeel checkpoint, ``.safetensors`` or ``.pt``/``.pth``."""
    init_strict: bool = True
    """With ``init_from``: every key must match; false loads the matching weights and reports the rest."""


@dataclass
class LossConfig:
    target: str = "torch.nn:CrossEntropyLoss"
    """``module:callable`` that returns the loss function ``loss(output, target) -> scalar``.

    The loss must be a mean over the batch: accumulation weights it by micro-batch size."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for ``target``."""
    step_fn: Optional[str] = None
    """``module:callable`` ``(model, batch)`` returning a scalar ``loss``, ``(loss, {name: value})``
    or a ``torchkeel.StepOutput`` (``StepOutput(loss_sum, count=n)``: a sum over ``n`` elements);
    replaces ``loss(model(input), target)`` in training and validation (several inputs, a loss of
    your own). Without one, a dict batch is ``model(**batch)`` and its ``loss`` (a transformers-style model)."""
    count_key: Optional[str] = None
    """A batch key that counts the elements the loss is a mean over; accumulation weighs
    micro-batches by it instead of by samples. A key named ``labels`` (or ending in ``labels``)
    counts its elements other than ``ignore_index`` — what a transformers model's token-mean loss
    divides by; any other key is summed (``lengths``, a 0/1 ``attention_mask``, a count)."""
    ignore_index: int = -100
    """With a label ``count_key``: the label value that is not counted (cross-entropy's ``ignore_index``)."""
    shift_labels: Optional[bool] = None
    """With a label ``count_key``: the model predicts the next token, so each row's first label is
    not counted. ``null``: true for a transformers model whose loss is its causal-LM loss
    (``*ForCausalLM``, ``*LMHeadModel``), false otherwise."""
    output: Union[int, str, None] = None
    """Where the loss is in what the model returns: an index into a tuple, list or transformers
    ``ModelOutput`` (``1`` for nanoGPT's ``(logits, loss)``), or a key or attribute (``loss``).
    The model computes its loss: an ``(input, target)`` batch runs as ``model(input, target)``, a
    dict batch as ``model(**batch)``. ``null``: ``loss.target`` on the model's output (a dict
    batch: the ``loss`` the model returns)."""
    logits: Union[int, str, None] = None
    """Where the predictions are in what the model returns, for ``metrics`` (and for
    ``loss.target`` without ``loss.output``): an index or a key. ``null``: ``logits`` of a dict or
    ``ModelOutput``; none for a tuple."""


@dataclass
class ParamGroupConfig:
    params: Union[str, list[str]] = ""
    """Shell-style pattern(s) (``fnmatch``: ``*`` matches any characters, dots included) matched
    against each parameter's dotted name in ``model.named_parameters()`` (``lm_head.*``, ``*.bias``)."""
    lr: Optional[float] = None
    """Learning rate of the group (``null``: ``optim.lr``); the schedule scales it like the others."""
    weight_decay: Optional[float] = None
    """Weight decay of the group (``null``: ``optim.weight_decay``); ``optim.decay_filter`` still
    takes it off the parameters it excludes."""


@dataclass
class OptimConfig:
    name: str = "adamw"
    """Any optimizer class of ``torch.optim`` by name, case-insensitive (``adamw``, ``Adadelta``,
    ``RMSprop``, ``nadam``...); ignored when ``target`` is set."""
    target: Optional[str] = None
    """``module:callable`` called as ``target(params, lr=..., weight_decay=..., **args)``; ``params``
    are param-group dicts when ``groups`` or ``decay_filter`` split them."""
    args: dict[str, Any] = field(default_factory=dict)
    """Further keyword arguments of the optimizer (``betas``, ``momentum``, ``rho``...)."""
    lr: float = 1e-3
    """Peak learning rate, reached at the end of warmup."""
    weight_decay: float = 0.0
    """Weight decay, on the parameters ``decay_filter`` keeps (not passed to an optimizer that
    takes none while it is 0)."""
    decay_filter: DecayFilter = "all"
    """Which parameters get weight decay: ``all``; ``matrices`` (tensors of 2 or more dimensions,
    as nanoGPT); ``transformers`` (all but biases and norm weights, transformers' Trainer's rule)."""
    groups: list[ParamGroupConfig] = field(default_factory=list)
    """Parameter groups with their own ``lr`` / ``weight_decay``: each parameter joins the first
    group whose ``params`` pattern matches its name; the rest keep ``lr`` and ``weight_decay``."""


@dataclass
class ScheduleConfig:
    warmup_steps: int = 0
    """Optimizer steps of linear warmup to ``lr`` (the formula: ``style``); before ``target`` too."""
    decay: Decay = "cosine"
    """Shape of the built-in decay from ``lr`` to ``min_lr`` over the remaining steps."""
    min_lr: float = 0.0
    """Learning rate where the built-in decay ends (cosine and linear decay)."""
    style: ScheduleStyle = "torchkeel"
    """Warmup formula and default decay end: ``torchkeel`` (lr·(s+1)/W, ends at the last step),
    ``nanogpt`` (lr·(s+1)/(W+1), ends at the last step), ``transformers`` (lr·s/W, ends one step
    past the last, as ``get_cosine_schedule_with_warmup``); see docs/config.md."""
    decay_steps: Optional[int] = None
    """Optimizer step (0-based) where the built-in decay reaches ``min_lr`` and stays (nanoGPT's
    ``lr_decay_iters``; ``null``: as ``style`` says)."""
    target: Optional[str] = None
    """Instead of the built-in decay: ``module:callable`` of a scheduler class or factory, called
    as ``target(optimizer, **args)`` (``torch.optim.lr_scheduler:StepLR``)."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for ``target`` (``step_size: 1``, ``gamma: 0.7``)."""
    interval: Literal["step", "epoch"] = "step"
    """When ``target`` steps: after each optimizer step, or at each epoch's end."""
    monitor: Optional[str] = None
    """A validation metric (``val_loss``): ``target`` steps after each validation with its value
    (``ReduceLROnPlateau``), whatever ``interval`` says; ``train_loss``: at each epoch's end with
    the mean of its steps' training losses."""
    mode: Optional[Literal["min", "max"]] = None
    """With ``monitor``: passed as the target's ``mode`` (``null``: the target's own default)."""


@dataclass
class EarlyStopConfig:
    patience: int = 0
    """Stop after this many validations in a row without improvement (0: off)."""
    monitor: Optional[str] = None
    """The validation metric to watch (``null``: ``checkpoint.monitor``)."""
    mode: Optional[Literal["min", "max"]] = None
    """Whether lower or higher is better (``null``: ``checkpoint.mode``)."""
    min_delta: float = 0.0
    """An improvement must beat the best by more than this."""


@dataclass
class EmaConfig:
    decay: float = 0.0
    """Keep an exponential moving average of the weights with this decay (``0``: off; e.g. 0.999)."""
    start_step: int = 0
    """Start averaging at this optimizer step (the first update copies the weights)."""


@dataclass
class CarryConfig:
    enabled: bool = False
    """Carry a state across batches (an RNN's hidden state: truncated backpropagation through
    time): ``loss.step_fn`` is ``(model, batch, state)`` and returns ``StepOutput(loss,
    state=new_state)``; the state is detached after each micro-batch and saved in checkpoints
    (each rank its own). Turns ``oom.auto_split`` off (a split batch would split the state's rows)."""
    reset: Literal["epoch", "never"] = "epoch"
    """When the training state starts again from ``None``: at each epoch's start, or never."""
    eval: bool = True
    """Validation carries its own state across its batches, from ``None`` at each validation
    (false: each validation batch gets ``None``)."""


@dataclass
class TrainConfig:
    max_epochs: Optional[int] = 1
    """Stop after this many epochs (``null``: no epoch limit; then ``max_steps`` is required)."""
    max_steps: Optional[int] = None
    """Stop after this many optimizer steps, whichever limit comes first."""
    batch_size: int = 32
    """Samples per micro-batch (per forward/backward) of the whole job: under torchrun each of
    N ranks takes batch_size / N of every batch, so the math does not depend on N."""
    accumulate: int = 1
    """Micro-batches per optimizer step; the update equals one step on the concatenated batch."""
    clip_grad_norm: Optional[float] = 1.0
    """Clip the global gradient norm to this value (``null``: no clipping; the norm is still logged)."""
    activation_checkpointing: Union[bool, list[str]] = False
    """Recompute activations in the backward pass instead of keeping them (less memory for a
    longer sequence or a bigger batch, about a third more compute, the same losses): ``true``
    for every transformer block, found by structure (a transformers model does its own), or a
    list of class names. ``dist.activation_checkpointing`` is its old name."""
    val_every: int = 0
    """The old name of ``val.every_steps``; setting both is an error."""
    log_every: int = 10
    """Write a metrics row (and a progress line) every N optimizer steps."""
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)
    """End training when the validation metric stops improving."""
    ema: EmaConfig = field(default_factory=EmaConfig)
    """An exponential moving average of the weights, used for validation and export."""
    carry: CarryConfig = field(default_factory=CarryConfig)
    """A state carried from each batch to the next (truncated backpropagation through time)."""


@dataclass
class ValConfig:
    at_start: bool = False
    """Validate once before the first step, logged at step 0 (the untrained model; not again on a resume)."""
    batch_size: Optional[int] = None
    """The validation loader's batch, of the whole job like ``train.batch_size`` (``null``: ``train.batch_size``)."""
    max_batches: Optional[int] = None
    """Validate on the first N batches only, the same ones each time (``null``: the whole set);
    under torchrun, each rank's first N."""
    every_steps: int = 0
    """Validate every N optimizer steps instead of at each epoch's end (0: at each epoch's end).
    The run always ends with a validation. ``train.val_every`` is its old name."""


@dataclass
class CheckpointConfig:
    enabled: bool = True
    """Save checkpoints: at ``every_steps``, the end of training, a stop signal, and as the
    cadence allows (epoch ends, ``every_s``; see ``max_overhead``)."""
    every_steps: int = 0
    """Also save every N optimizer steps, always (0: off)."""
    every_s: float = 600.0
    """Save once this many seconds of training passed since the last save (0: off), within ``max_overhead``."""
    max_overhead: float = 0.02
    """Epoch-end and ``every_s`` saves wait until the training time since the last save is the
    last save's cost / this share: saving never takes more of the run than this."""
    keep_last: int = 2
    """Keep this many newest checkpoints (at least 1), so a corrupt newest one has a fallback."""
    save_top_k: int = 1
    """Also keep the best K checkpoints by ``monitor``."""
    monitor: str = "val_loss"
    """Metric that ranks checkpoints for ``save_top_k`` (the latest validation's value)."""
    mode: Literal["min", "max"] = "min"
    """Whether a lower or a higher ``monitor`` value is better."""
    async_save: bool = field(default=False, metadata={"key": "async"})
    """YAML key ``async``: copy the state to CPU memory and write it on a background thread."""


@dataclass
class GuardConfig:
    enabled: bool = True
    """Check the loss and gradients for NaN/Inf before every optimizer step (one host sync a step)."""
    on_nonfinite: Literal["skip", "rollback", "raise"] = "skip"
    """``skip`` the step (escalating to rollback), ``rollback`` at once, or ``raise`` (stop)."""
    max_consecutive: int = 5
    """Skipped steps in a row before ``skip`` escalates to a rollback."""
    lr_backoff: float = 0.5
    """Multiply the learning rate by this at each rollback."""
    max_rollbacks: int = 3
    """Rollbacks before the run stops with status ``failed`` and a diagnosis."""
    snapshot_every: int = 200
    """Keep an in-memory copy of the last good state every N good steps (0: no rollback)."""
    diagnose: bool = True
    """Replay the first non-finite step with hooks to name the module where NaN/Inf appeared."""
    spike_factor: Optional[float] = None
    """Warn when the loss exceeds this multiple of its running average (``null``: off)."""


@dataclass
class OomConfig:
    auto_split: bool = True
    """On out-of-memory, redo the step in micro-batches of half the size (down to 1) and keep that size."""


@dataclass
class MemoryConfig:
    every_steps: int = 100
    """Write a memory row (RSS; CUDA allocated, reserved, peak, fragmentation) every N steps (0: off)."""
    warn_rss_gb: Optional[float] = None
    """Warn when the process RSS exceeds this many GiB."""
    warn_cuda_fraction: float = 0.9
    """Warn when CUDA reserved memory exceeds this fraction of the device's memory."""
    leak_check: bool = True
    """Look for memory that grows step after step (live tensors and autograd graphs; CUDA allocated)."""
    leak_every_steps: int = 200
    """Least steps between leak censuses."""
    leak_max_overhead: float = 0.01
    """Most of the training time the censuses may take; spaces them in time as well."""
    leak_warmup_steps: int = 20
    """Steps before the first census."""
    leak_window: int = 4
    """Censuses in a row that must each grow before a leak is reported."""


@dataclass
class DistConfig:
    strategy: Literal["auto", "ddp", "fsdp"] = "auto"
    """``auto``: DDP when the job has several ranks; ``fsdp``: FSDP2 ``fully_shard`` per block
    (sharded weights, gradients and optimizer state; sharded checkpoints)."""
    backend: Optional[str] = None
    """Process group backend (``null``: ``nccl`` on CUDA, ``gloo`` on CPU)."""
    init_timeout_s: float = 600.0
    """Rendezvous and the first step (compilation, first allocations) may take this long."""
    timeout_s: float = 300.0
    """After the first step, a collective that waits longer than this fails and names the rank
    that did not arrive (where the backend can tell)."""
    shard_modules: list[str] = field(default_factory=list)
    """FSDP: class names of the blocks to shard one by one (``[]``: the repeated blocks — every
    child of a ``ModuleList``/``Sequential`` — found in the model); the root is always sharded."""
    activation_checkpointing: list[str] = field(default_factory=list)
    """Class names whose activations are recomputed in the backward pass instead of kept
    (less memory, about a third more compute)."""
    find_unused_parameters: bool = False
    """DDP: allow parameters that get no gradient in a step (slower; only when the model needs it)."""
    sync_batchnorm: bool = False
    """With several ranks, ``BatchNorm*d`` layers normalize with the statistics of the job's whole
    micro-batch (``SyncBatchNorm``; DDP and FSDP2, CUDA and CPU) instead of each rank's share:
    the same math as one process, at one all-reduce per layer per forward and backward."""


@dataclass
class CompileConfig:
    enabled: bool = False
    """Train through ``torch.compile`` (``compile: true`` is short for ``compile: {enabled: true}``)."""
    mode: Literal["default", "reduce-overhead", "max-autotune"] = "default"
    """``reduce-overhead`` (CUDA graphs: fast start, less Python overhead), ``max-autotune``
    (searches kernels: minutes of compile time, fastest kernels)."""
    fullgraph: bool = False
    """A graph break is an error naming it, instead of an incident."""
    dynamic: Optional[bool] = None
    """Dynamic shapes: ``null`` lets torch decide after the first recompile, ``true``/``false`` force it."""
    backend: str = "inductor"
    """The ``torch.compile`` backend (``aot_eager``, ``eager`` to debug)."""


@dataclass
class ProfileConfig:
    steps: list[int] = field(default_factory=list)
    """``[start, end]``: write a ``torch.profiler`` trace of training steps start to end (counted
    from 1, both included) into ``<run_dir>/profile``, with a summary of where their time went
    (``[]``: no profiling)."""
    record_shapes: bool = False
    """Record each operator's input shapes (a larger trace)."""
    memory: bool = False
    """Record tensor allocations and frees (memory per operator, a larger trace)."""


@dataclass
class MlflowConfig:
    tracking_uri: Optional[str] = None
    """Where the runs go: a server (``http://mlflow:5000``), a database (``sqlite:///mlflow.db``)
    or a directory (``file:./mlruns``); ``null``: MLflow's default (``MLFLOW_TRACKING_URI``)."""
    experiment: Optional[str] = None
    """The MLflow experiment (``null``: the run's ``name``)."""


@dataclass
class WandbConfig:
    project: Optional[str] = None
    """The W&B project (``null``: the run's ``name``)."""
    mode: Optional[Literal["online", "offline", "disabled"]] = None
    """``offline`` writes under ``<run_dir>/wandb`` (send it later with ``wandb sync``); ``null``:
    W&B's default (``WANDB_MODE``, else online)."""


@dataclass
class LoggingConfig:
    tensorboard: bool = False
    """Write TensorBoard event files under ``<run_dir>/tensorboard`` (needs ``tensorboard``)."""
    mlflow: Optional[MlflowConfig] = None
    """Send the run to MLflow (``pip install 'torchkeel[mlflow]'``): every scalar at its step, the
    config as params, incidents as tags, the run ended with the run's status."""
    wandb: Optional[WandbConfig] = None
    """Send the run to Weights & Biases (``pip install 'torchkeel[wandb]'``): every scalar against
    the step, the config, incidents as tags, the run ended with the run's status."""
    loggers: list[str] = field(default_factory=list)
    """``module:callable`` per extra logger, called with ``(run_dir, config_dict)``; it returns an
    object with ``log_metrics(step, values)``, ``log_incident(row)`` and ``close()``."""


@dataclass
class MetricConfig:
    name: str = ""
    """The metric's name in the run files: logged as ``val_<name>``."""
    target: str = ""
    """``module:Class`` of the metric, e.g. ``torchmetrics.classification:MulticlassF1Score``."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for ``target`` (``num_classes: 10``)."""
    on: list[Literal["val", "train"]] = field(default_factory=lambda: ["val"])
    """Where to compute it: ``val`` (over each validation) and/or ``train`` (over the steps between
    two logged rows, as ``train_<name>``)."""


@dataclass
class KeelConfig:
    name: str = "run"
    """Run name; the run directory is ``<out_dir>/<name>``."""
    out_dir: str = "runs"
    """Directory that holds run directories."""
    seed: int = 0
    """Seed for python, numpy, torch (CPU and CUDA), data order and DataLoader workers."""
    deterministic: bool = False
    """Use deterministic algorithms (``torch.use_deterministic_algorithms``, cuDNN deterministic)."""
    device: Device = "auto"
    """``auto`` picks cuda, then mps, then cpu."""
    precision: PrecisionName = "fp32"
    """``bf16`` autocast (CPU, CUDA), ``fp16`` autocast with a GradScaler (CUDA only)."""
    compile: CompileConfig = field(default_factory=CompileConfig)
    """``torch.compile`` settings; graph breaks and fall-backs are incidents."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    val: ValConfig = field(default_factory=ValConfig)
    """When and on how much of the validation data the run validates."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    oom: OomConfig = field(default_factory=OomConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    metrics: list[MetricConfig] = field(default_factory=list)
    """Validation metrics (torchmetrics): a list of ``{name, target, args}``, each computed over the
    whole validation set and logged as ``val_<name>``; with none, classification gets ``val_accuracy``."""

    def validate(self) -> "KeelConfig":
        """Check values and combinations; raise ``ConfigError`` naming the key to change."""
        check_config(self)
        return self
