"""``torch.compile`` with a clean fall-back to eager when compilation fails."""

from __future__ import annotations

import warnings
from typing import Any

import torch


class CompiledOrEager(torch.nn.Module):
    """Runs ``module`` through ``torch.compile``; on a compilation failure, warns once and stays eager.

    Compilation happens at the first call (and at recompiles), so the failure surfaces there.
    The eager retry runs the same inputs: an error that is the model's own (a shape mismatch,
    say) is raised again by the eager call and reaches the user unchanged. Out-of-memory
    errors are never retried here.
    """

    def __init__(self, module: torch.nn.Module, backend: Any = "inductor") -> None:
        super().__init__()
        self.module = module
        self.compiled: Any = torch.compile(module.forward, backend=backend)
        self.is_compiled = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.is_compiled:
            try:
                return self.compiled(*args, **kwargs)
            except torch.OutOfMemoryError:
                raise
            except Exception as exc:  # noqa: BLE001 - any compiler failure means: run eager
                self.is_compiled = False
                warnings.warn(
                    f"torch.compile failed ({type(exc).__name__}: {_message(exc)}); "
                    "continuing in eager mode. Set compile=false to skip compilation.",
                    RuntimeWarning,
                    stacklevel=2,
                )
        return self.module(*args, **kwargs)


def _message(exc: BaseException) -> str:
    # Dynamo wraps the backend's error: its first line names the backend, the second the cause.
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return " ".join(lines[:2])[:300] or type(exc).__name__
