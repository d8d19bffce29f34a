"""Rules about process groups and devices under torchrun."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from torchkeel.lint.engine import Source, call_name, last


def set_device_after_init(source: Source) -> Iterator[tuple[ast.AST, str]]:
    for scope in ast.walk(source.tree):
        if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
            continue
        body_calls = [c for c in source.calls(scope) if (source.function_of(c) or source.tree) is scope]
        inits = [c for c in body_calls if last(call_name(c)) == "init_process_group"]
        for call in body_calls:
            if call_name(call).endswith("cuda.set_device") and inits and call.lineno > inits[0].lineno:
                yield (
                    call,
                    ("torch.cuda.set_device() after init_process_group(): NCCL has already bound every rank to GPU 0"),
                )
