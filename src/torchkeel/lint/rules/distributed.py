"""Rules about process groups and devices under torchrun."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from torchkeel.lint.engine import Source, call_name, last

_SET_DEVICE = ("cuda.set_device", "accelerator.set_device_index", "xpu.set_device")
_COLLECTIVES = {"barrier", "all_reduce", "broadcast", "all_gather", "reduce_scatter", "DistributedDataParallel", "DDP"}


def set_device_after_init(source: Source) -> Iterator[tuple[ast.AST, str]]:
    """The device is chosen after the process group already used one: a collective (or DDP's
    construction) between ``init_process_group`` and ``set_device`` runs on GPU 0. NCCL creates its
    communicator lazily, so ``set_device`` right after init is fine."""
    for scope in source.nodes:
        if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
            continue
        body_calls = sorted(
            (c for c in source.calls(scope) if (source.function_of(c) or source.tree) is scope),
            key=lambda c: (c.lineno, c.col_offset),
        )
        inits = [c for c in body_calls if last(call_name(c)) == "init_process_group"]
        if not inits:
            continue
        init = inits[0]
        for call in body_calls:
            if not call_name(call).endswith(_SET_DEVICE) or call.lineno <= init.lineno:
                continue
            if any(call_name(c).endswith(_SET_DEVICE) and c.lineno < init.lineno for c in body_calls):
                break  # already chosen before init (a second set_device later is harmless)
            used = [
                c for c in body_calls if init.lineno < c.lineno < call.lineno and last(call_name(c)) in _COLLECTIVES
            ]
            if used:
                yield (
                    call,
                    (
                        f"{call_name(call)}() after {call_name(used[0])}(): the process group already used a "
                        "device, so the ranks share GPU 0 or hang"
                    ),
                )
            break
