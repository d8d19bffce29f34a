"""``keel diagnose --compile``: graph breaks and recompilations of ``torch.compile``.

When the script compiles, dynamo's own ``graph_breaks`` and ``recompiles`` logs are captured
(they carry the reason and the user's file:line). When it does not, the first model the script
calls is run once through ``torch._dynamo.explain`` (RNG, buffers and gradients restored, so
the script computes what it would have) to say what compiling it would break on.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch

from torchkeel.diagnose.findings import Finding
from torchkeel.introspect.sites import display_path, is_user_file
from torchkeel.train.compile import break_reason, explain_breaks


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.breaks: list[dict[str, Any]] = []
        self.recompiles: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.name.endswith("__graph_breaks"):
            self.breaks.append(_parse_break(text))
        elif record.name.endswith("__recompiles"):
            head = re.search(r"Recompiling function (\S+) in (.+):(\d+)", text)
            reasons = [line.strip("- ").strip() for line in text.splitlines()[2:] if line.strip()]
            user = bool(head) and is_user_file(head.group(2))
            self.recompiles.append(
                {
                    "function": head.group(1) if head else None,
                    "file": display_path(head.group(2)) if user else None,
                    "line": int(head.group(3)) if user else None,
                    "reasons": reasons[:5],
                }
            )


def _parse_break(text: str) -> dict[str, Any]:
    """Reason, hint and user file:line of one dynamo ``graph_breaks`` log record."""
    lines = [line.strip() for line in text.splitlines()]
    at = next((i for i, line in enumerate(lines) if line.startswith("Graph Break Reason:")), None)
    reason = lines[0] if at is None else break_reason([lines[at].split(":", 1)[1], *lines[at + 1 :]])
    hint = next((line[len("Hint:") :].strip() for line in lines if line.startswith("Hint:")), None)
    sites = [(p, int(n)) for p, n in re.findall(r"in user code at (.+?):(\d+)", text) if is_user_file(p)]
    if not sites:
        sites = [(p, int(n)) for p, n in re.findall(r'File "([^"]+)", line (\d+)', text) if is_user_file(p)][-1:]
    file, line = sites[0] if sites else (None, None)
    return {"reason": reason[:300], "hint": hint, "file": display_path(file) if file else None, "line": line}


class CompileWatch:
    """Context manager around the script run; ``findings()`` afterwards."""

    def __init__(self, *, force: bool) -> None:
        self.force = force
        self.capture = _Capture()
        self.explained: list[dict[str, Any]] = []
        self.depth = 0
        self.done = False
        self.handles: list[Any] = []

    def __enter__(self) -> CompileWatch:
        torch._logging.set_logs(graph_breaks=True, recompiles=True)
        # torch's log setup stops propagation at its registered loggers: listen where dynamo logs.
        logging.getLogger("torch._dynamo").addHandler(self.capture)
        if self.force:
            mod = torch.nn.modules.module
            self.handles = [
                mod.register_module_forward_pre_hook(self._pre),
                mod.register_module_forward_hook(self._post, always_call=True),
            ]
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()
        logging.getLogger("torch._dynamo").removeHandler(self.capture)
        torch._logging.set_logs()

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        self.depth += 1
        if self.depth == 1 and not self.done and next(module.parameters(), None) is not None:
            self.done = True
            if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
                for handle in self.handles:  # the script compiles: dynamo's own logs tell the story
                    handle.remove()
            else:
                self._explain(module, args)

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.depth = max(0, self.depth - 1)

    def _explain(self, module: torch.nn.Module, args: Any) -> None:

        for handle in self.handles:  # dynamo would trace into these hooks
            handle.remove()
        self.explained = explain_breaks(module, *args)

    def findings(self) -> list[Finding]:
        out: list[Finding] = []
        breaks = self.capture.breaks or self.explained
        if breaks:
            first = breaks[0]
            where = f" at {first['file']}:{first['line']}" if first.get("file") else ""
            out.append(
                Finding(
                    "graph-break",
                    "warning",
                    f"torch.compile breaks the graph {len(breaks)} time(s); first{where}: {first['reason']}",
                    {
                        "count": len(breaks),
                        "breaks": breaks[:20],
                        "compiled_by_script": bool(self.capture.breaks),
                        **{k: first[k] for k in ("file", "line") if first.get(k) is not None},
                    },
                    "Move the break out of the compiled region: no print/.item()/.tolist()/numpy or "
                    "data-dependent Python control flow inside forward (torch._dynamo.explain shows each).",
                )
            )
        if self.capture.recompiles:
            first = self.capture.recompiles[0]
            out.append(
                Finding(
                    "recompile",
                    "warning",
                    f"torch.compile recompiled {first['function']} {len(self.capture.recompiles)} time(s): "
                    f"{first['reasons'][0] if first['reasons'] else 'guard failure'}",
                    {
                        "count": len(self.capture.recompiles),
                        "recompiles": self.capture.recompiles[:20],
                        **{k: first[k] for k in ("file", "line") if first.get(k) is not None},
                    },
                    "Keep shapes, dtypes and Python values that the guards check stable (pad to fixed shapes, "
                    "mark dynamic dims with torch._dynamo.mark_dynamic, or compile with dynamic=True).",
                )
            )
        return out
