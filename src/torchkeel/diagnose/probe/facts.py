"""What the probe hands the detectors: ``Facts``, plain data; and how it ends a script early."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar, overload

from torchkeel.diagnose.events import NAMES

E = TypeVar("E")


class StopScript(BaseException):
    """Raised into the script to end it after ``--steps`` steps or ``--timeout`` seconds.

    A BaseException, so that the script's own ``except Exception`` does not swallow it."""


@dataclasses.dataclass
class Facts:
    """Everything observed, as plain data. Module and parameter names are qualified by the
    variable the script holds the model in (``model.encoder.0.weight``). ``events`` maps a kind
    of ``diagnose.events.KINDS`` to its first few events."""

    steps: int = 0
    backward_calls: int = 0
    losses: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # {"step", "value"}
    events: dict[str, list[dict[str, Any]]] = dataclasses.field(default_factory=dict)
    optimizers: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    grad_norms: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # {"step", "total", "layers"}
    layer_order: list[str] = dataclasses.field(default_factory=list)
    censuses: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    data: dict[str, Any] = dataclasses.field(default_factory=dict)
    seeds: dict[str, Any] = dataclasses.field(default_factory=dict)
    zero_grad_calls: int = 0
    closure_backward_calls: int = 0  # backward calls inside optimizer.step (an LBFGS closure)
    closure_zero_grad_calls: int = 0
    frozen: dict[str, Any] = dataclasses.field(default_factory=dict)  # frozen parameters handed to optimizers
    invariants: dict[str, Any] = dataclasses.field(default_factory=dict)  # each invariant family's own data
    wall_s: float = 0.0

    @overload
    def first(self, kind: type[E]) -> E | None: ...

    @overload
    def first(self, kind: str) -> dict[str, Any] | None: ...

    def first(self, kind: Any) -> Any:
        """The first event of ``kind``: a definition of ``diagnose.events`` (typed) or its name."""
        found = self.events.get(kind if isinstance(kind, str) else NAMES[kind])
        return found[0] if found else None
