"""``torch.compile`` that explains itself: graph breaks named with the user's line, the compile
time reported once, and a clean fall-back to eager when compilation fails (or an error, with
``fullgraph``)."""

from __future__ import annotations

import re
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from torchkeel.checkpoint.state import leaving_no_trace
from torchkeel.errors import KeelError
from torchkeel.introspect.sites import display_path, is_user_file

# What a compile event is handed to: (kind, message, details) — the Trainer records incidents.
Reporter = Callable[[str, str, dict[str, Any]], None]


class CompileError(KeelError):
    """``compile.fullgraph`` is on and the model's graph breaks (the message names where)."""

    exit_code = 1


def explain_breaks(module: torch.nn.Module, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
    """Where ``torch.compile`` would break the graph of ``module(*args)``: reason, user file:line.

    Runs ``torch._dynamo.explain`` once and leaves no trace: RNG states and buffers (batch-norm
    statistics) are restored, and dynamo's caches are reset afterwards.
    """
    breaks: list[dict[str, Any]] = []
    try:
        with leaving_no_trace(module), torch.no_grad():
            report = torch._dynamo.explain(module)(*args, **kwargs)
        for reason in report.break_reasons:
            frames = [f for f in (reason.user_stack or []) if is_user_file(f.filename)]
            breaks.append(
                {
                    "reason": _first_reason(str(reason.reason)),
                    "file": display_path(frames[-1].filename) if frames else None,
                    "line": frames[-1].lineno if frames else None,
                }
            )
    except Exception as exc:  # noqa: BLE001 - a model dynamo cannot trace at all
        breaks.append({"reason": f"{type(exc).__name__}: {_message(exc)}", "file": None, "line": None})
    finally:
        torch._dynamo.reset()
    return breaks


class CompiledOrEager(torch.nn.Module):
    """Runs ``module`` through ``torch.compile``; on a compilation failure, reports once and stays eager.

    Before the first compiled call, the graph breaks of that call are found with
    ``explain_breaks`` and reported (``graph_break``, one per break, with the user's file:line);
    the first call's duration is reported as the compile time (``compile``). With ``fullgraph``
    a break raises ``CompileError`` naming it instead. The eager retry after a failure runs the
    same inputs: an error that is the model's own is raised again by the eager call and reaches
    the user unchanged. Out-of-memory errors are never retried here.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        backend: Any = "inductor",
        *,
        mode: str | None = None,
        fullgraph: bool = False,
        dynamic: bool | None = None,
        report: Reporter | None = None,
    ) -> None:
        super().__init__()
        self.module = module
        self.mode = None if mode in (None, "default") else mode
        self.fullgraph = fullgraph
        self.report = report
        self.compiled: Any = torch.compile(
            module.forward, backend=backend, mode=self.mode, fullgraph=fullgraph, dynamic=dynamic
        )
        self.is_compiled = True
        self.compile_s: float | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.is_compiled:
            first = self.compile_s is None
            if first and (self.report is not None or self.fullgraph):
                self._check_breaks(args, kwargs)
            start = time.perf_counter()
            try:
                out = self.compiled(*args, **kwargs)
            except torch.OutOfMemoryError:
                raise
            except Exception as exc:  # noqa: BLE001 - any compiler failure means: run eager
                self.is_compiled = False
                message = (
                    f"torch.compile failed ({type(exc).__name__}: {_message(exc)}); continuing in eager "
                    "mode. Set compile.enabled=false to skip compilation."
                )
                if self.report is not None:
                    self.report("compile", message, {"fallback": "eager", "error": type(exc).__name__})
                else:
                    warnings.warn(message, RuntimeWarning, stacklevel=2)
            else:
                if first:
                    self.compile_s = time.perf_counter() - start
                    if self.report is not None:
                        self.report(
                            "compile",
                            f"compiled in {self.compile_s:.1f} s (mode {self.mode or 'default'})",
                            {"compile_s": round(self.compile_s, 3), "mode": self.mode or "default"},
                        )
                return out
        return self.module(*args, **kwargs)

    def _check_breaks(self, args: tuple, kwargs: dict) -> None:
        breaks = explain_breaks(self.module, *args, **kwargs)
        if breaks and self.fullgraph:
            b = breaks[0]
            where = f" at {b['file']}:{b['line']}" if b.get("file") else ""
            raise CompileError(
                f"compile.fullgraph is on and the graph breaks{where}: {b['reason']}; remove the "
                "break (no .item()/print/data-dependent Python branch in forward) or set "
                "compile.fullgraph=false"
            )
        for b in breaks:
            where = f" at {b['file']}:{b['line']}" if b.get("file") else ""
            if self.report is not None:
                self.report("graph_break", f"torch.compile breaks the graph{where}: {b['reason']}", dict(b))


def break_reason(lines: list[str]) -> str:
    """The specific reason of a graph break, from the lines of its reason text: dynamo puts a
    generic ``Encountered graph break`` header first and the specific reason after it."""
    lines = [line.strip() for line in lines if line.strip()]
    if len(lines) > 1 and lines[0].startswith("Encountered graph break"):
        return lines[1][:300]
    return (lines[0] if lines else "")[:300]


def _first_reason(text: str) -> str:
    return break_reason(text.splitlines()) or text[:300]


def _message(exc: BaseException) -> str:
    # Dynamo wraps the backend's error: its first line names the backend, the second the cause.
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return re.sub(r"\s+", " ", " ".join(lines[:2]))[:300] or type(exc).__name__
