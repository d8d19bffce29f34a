"""What the probe's listeners share while the script runs, written down in one object.

Each listener owns its own state; what one writes and another reads lives here (``ProbeState``),
and what one has to tell the others goes through ``Probe.emit`` as an event (``EVENTS``): a
listener never calls another listener's methods.
"""

from __future__ import annotations

import collections
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

EVENTS = {
    "zero_grad": "zero_grad() was called on an optimizer or a module (owner)",
    "step_begins": "an optimizer's step() is about to run (its pre-hook)",
    "optimizer_step": "the step's inspection found its parameters (optimizer), inside the observation",
    "step_ends": "an optimizer's step() ran (its post-hook)",
    "backward_counted": "a backward pass ran (counted even in a light run)",
    "backward_done": "a backward pass ran, with its roots (the loss tensors)",
    "loss_nonfinite": "backward() is about to run on a non-finite loss",
    "fetched": "a DataLoader handed out a batch",
    "model_called": "a model was called from outside any module (module, args)",
    "leaf_forward": "a module without children runs forward, the call's first layer not yet looked at (module, args)",
    "loss_targets": "a classification loss was given its targets (target)",
}
"""Every event ``Probe.emit`` dispatches, and what it means. A listener handles one by a method
``on_<event>``; the probe calls them in the listeners' install order."""


@dataclass
class ProbeState:
    """The mutable facts of where the script is, read or written by more than one listener."""

    busy: bool = False
    """Inside an observation: the probe's own torch calls are not observed."""
    in_step: bool = False
    """Inside ``optimizer.step()``."""
    in_fetch: bool = False
    """Inside a DataLoader's ``next()``."""
    watch_ops: bool = True
    """Look at ops outside modules (off once the loss went non-finite)."""
    step_nonfinite_op: dict[str, Any] | None = None
    """This step's first op that went non-finite."""
    roots: dict[int, tuple[torch.nn.Module, str]] = field(default_factory=dict)
    """The models the script called, by their variable names."""
    used: set[int] = field(default_factory=set)
    """Modules called at least once."""
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    tracked: list[weakref.ref] = field(default_factory=list)
    """Tensors with a graph the probe saw made (for censuses)."""
    last_census: list[weakref.ref] = field(default_factory=list)
    overhead_s: float = 0.0
    """Time the probe itself spent in the loop (censuses), not the script's."""
    module_stack: list[torch.nn.Module] = field(default_factory=list)
    """The modules whose forward is running, outermost first."""
    leaf_order: dict[int, torch.nn.Module] = field(default_factory=dict)
    """Modules with parameters of their own, in the order they first ran."""
    first_layer_seen: bool = False
    """Within the current model call, the first layer with parameters was looked at."""
    recent_roots: collections.deque = field(default_factory=lambda: collections.deque(maxlen=32))
    """``(grad_fn, step)`` of the latest backward passes' roots."""
    trained: set[int] = field(default_factory=set)
    """Parameters some optimizer stepped with a gradient (they were trained)."""
    last_loader: dict[str, Any] | None = None
    """What is known of the loader the last batch came from."""

    def current_loader(self) -> dict[str, Any] | None:
        """The loader the last batch came from (for events that name the data)."""
        if self.last_loader is None:
            return None
        keys = ("dataset_class", "dataset_size", "batch_size", "drop_last", "shuffle")
        return {k: self.last_loader[k] for k in keys}
