"""What the probe records and the detectors read: one typed definition per event kind.

Events stay plain dicts at run time (``TypedDict``), so ``Facts`` is plain data that serializes as
it is; the types say which keys each kind carries, for the listener that records it and the
detector that judges it. ``Site`` keys (``file``, ``line``, ``function``) are the user's line, when
one was found. ``KINDS`` maps each kind's name to its definition.
"""

from __future__ import annotations

from typing import Any, TypedDict


class Site(TypedDict, total=False):
    file: str
    line: int
    function: str


class Layout(TypedDict, total=False):
    """Where a tensor holds NaN/Inf (``inspect.sites.nonfinite_layout``)."""

    shape: list[int]
    num_nonfinite: int
    has_nan: bool
    has_inf: bool
    samples: list[int]
    num_samples: int
    features: list[int]


class NonfiniteInput(Site, Layout, total=False):
    step: int
    module: str
    argument: int
    op: str


class NonfiniteForward(TypedDict, total=False):
    step: int
    module: str
    module_class: str
    params_nonfinite: list[str]
    training: bool
    output: Layout
    op: dict[str, Any] | None


class NonfiniteLoss(TypedDict, total=False):
    step: int
    op: dict[str, Any] | None
    site: Site | None
    before_backward: bool  # the script ended (crashed) before the backward of that step


class NonfiniteGrad(TypedDict):
    step: int
    parameters: list[str]
    num_parameters: int
    modules: list[str]
    backward_op: dict[str, Any] | None


class LabelOutOfRange(Site, total=False):
    step: int
    loss: str
    value: float
    num_classes: int
    num_bad_targets: int
    min_target: float
    max_target: float


class ProbabilitiesIntoCrossEntropy(Site, total=False):
    step: int
    loss: str
    rows: int
    num_classes: int
    max_row_sum_error: float | None
    produced_by: str | None
    loss_at: str  # the loss call; the Site is the line that made the probabilities, where known


class BatchnormBatchOne(Site, total=False):
    step: int
    module: str
    input_shape: list[int]
    values_per_channel: int
    loader: dict[str, Any] | None


class EvalInTrainMode(Site, total=False):
    step: int
    module: str
    train_mode_layers: list[str]
    inference_mode: bool


class CarriedState(Site, total=False):
    step: int
    module: str
    argument: int
    made_at_step: int
    variable: str | None


class LossWithoutGraph(Site, total=False):
    step: int
    grad_enabled: bool
    num_params: int
    num_trainable: int


class InplaceModified(Site, total=False):
    step: int
    error: str
    backward_op: str
    saved: str
    module: str | None
    tensor: str  # a parameter's name, or the shape autograd gave
    by_optimizer_step: bool


class GraphReused(Site, total=False):
    step: int
    holder: dict[str, Any] | None
    error: str


class DoubleStep(TypedDict):
    step: int
    steps_since_backward: int
    call_sites: list[str]
    sites: list[Site | None]


class ZeroGradCheck(TypedDict):
    step: int
    optimizer: str
    optimizer_index: int
    param: str | None


class RepeatedBackward(TypedDict):
    step: int
    call_sites: list[str]
    retain_graph: bool


class DropoutAlwaysOn(Site, total=False):
    step: int
    module: str
    call: str  # F.dropout, F.dropout2d, ...
    p: float


class BatchLabels(TypedDict):
    """The class targets of one training batch (the first steps only)."""

    step: int
    classes: list[int]  # its distinct classes, sorted (at most 8)
    num_classes: int
    size: int


class OneUnitCrossEntropy(Site, total=False):
    """Cross entropy over a one-unit output: the log-softmax of one logit is 0, and so is the loss."""

    step: int
    loss: str
    shape: list[int]


class SoftmaxOverBatch(Site, total=False):
    """A softmax over dim 0 of a ``(batch, classes)`` tensor: it normalizes across the samples."""

    step: int
    call: str
    shape: list[int]
    dim: int
    module: str | None


class InputScale(Site, total=False):
    """Data far from unit scale at a model call's first Linear/Conv layer."""

    step: int
    module: str
    layer: str
    min: float
    max: float
    images: bool  # integer values in 0..255 of a ≥ 3-D input: images not divided by 255
    column_rms_max: float
    columns: list[int]  # feature columns of magnitude ≥ 100 (root mean square over the batch)


class AugmentationInEvaluation(Site, total=False):
    """An evaluation loader whose sample 0 differs from one read to the next: random transforms."""

    dataset_class: str
    step: int


class GeneratorInWorkers(Site, total=False):
    """A dataset that holds its own random generator, read by several workers (each a copy of it)."""

    dataset_class: str
    num_workers: int
    generators: list[str]


class ZeroGradBeforeStep(Site, total=False):
    """``zero_grad()`` between a backward and the step of the optimizer whose gradients it cleared."""

    step: int
    optimizer: str
    backward_at: str
    step_at: str


class ClipBeforeBackward(Site, total=False):
    """A clip of the gradients before this step's backward: it clipped the previous step's (or none)."""

    step: int
    call: str  # clip_grad_norm_, clip_grad_value_
    backward_at: str
    step_at: str


class SchedulerCall(Site, total=False):
    """A learning-rate scheduler the script stepped: how often, in which order, how far the lr went."""

    scheduler: str
    calls: int
    calls_before_step: int  # calls made before its optimizer's first step, or after a backward before the step
    first_epoch_calls: int  # calls during the first epoch of the loader it was stepped with
    batches_per_epoch: int | None
    horizon: dict[str, Any]  # step_size / milestones / T_max / total_iters, as the script set it
    lr_set: float
    lr_first_epoch_min: float  # the lowest lr within that first epoch
    lr_reached: float


class StepGroup(TypedDict):
    """What came before one optimizer step: backwards, batches fetched, whether a loss was scaled."""

    step: int
    backwards: int
    batches: int
    calls: int  # model calls with gradients on (micro-batches drawn without a DataLoader)
    unscaled: bool  # no backward's loss was divided (or multiplied) right before it
    backward_at: str


class TrainedInEval(Site, total=False):
    """Optimizer steps on a model left in eval mode after it had trained in train mode."""

    step: int  # the first such step
    steps: int
    module: str
    layers: list[str]  # its Dropout / BatchNorm layers
    trained_until: int | None  # the last step it trained in train mode (None: eval() came in an evaluation first)
    by_library: bool  # a library put it in eval mode (from_pretrained) and it never trained in train mode


class ProbeError(TypedDict):
    error: str


KINDS: dict[str, type] = {
    "nonfinite-input": NonfiniteInput,
    "nonfinite-forward": NonfiniteForward,
    "nonfinite-loss": NonfiniteLoss,
    "nonfinite-grad": NonfiniteGrad,
    "label-out-of-range": LabelOutOfRange,
    "probabilities-into-cross-entropy": ProbabilitiesIntoCrossEntropy,
    "batchnorm-batch-one": BatchnormBatchOne,
    "eval-in-train-mode": EvalInTrainMode,
    "carried-state": CarriedState,
    "loss-without-graph": LossWithoutGraph,
    "inplace-modified": InplaceModified,
    "graph-reused": GraphReused,
    "double-step": DoubleStep,
    "zero-grad-checks": ZeroGradCheck,
    "repeated-backward": RepeatedBackward,
    "dropout-always-on": DropoutAlwaysOn,
    "batch-labels": BatchLabels,
    "one-unit-cross-entropy": OneUnitCrossEntropy,
    "softmax-over-batch": SoftmaxOverBatch,
    "input-scale": InputScale,
    "augmentation-in-evaluation": AugmentationInEvaluation,
    "generator-in-workers": GeneratorInWorkers,
    "zero-grad-before-step": ZeroGradBeforeStep,
    "clip-before-backward": ClipBeforeBackward,
    "scheduler-calls": SchedulerCall,
    "trained-in-eval": TrainedInEval,
    "step-groups": StepGroup,
    "probe-error": ProbeError,
}
NAMES: dict[type, str] = {definition: name for name, definition in KINDS.items()}
