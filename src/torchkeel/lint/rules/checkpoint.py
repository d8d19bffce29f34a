"""Rules about checkpoints on disk: what is loaded (pickles), what is saved, and where."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from torchkeel.lint.engine import Source, call_name, dotted, keyword, last


def unsafe_load(source: Source) -> Iterator[tuple[ast.AST, str]]:
    for call in source.calls():
        if call_name(call) == "torch.load":
            value = keyword(call, "weights_only")
            if value is None:
                yield (
                    call,
                    (
                        "torch.load without weights_only=True: older torch versions unpickle arbitrary code from "
                        "the file"
                    ),
                )
            elif isinstance(value, ast.Constant) and value.value is False:
                yield call, "torch.load(weights_only=False) runs whatever pickled code the file holds"


def save_whole_module(source: Source) -> Iterator[tuple[ast.AST, str]]:
    for call in source.calls():
        if call_name(call) != "torch.save" or not call.args:
            continue
        obj = call.args[0]
        if not isinstance(obj, (ast.Name, ast.Attribute)):
            continue
        name = dotted(obj)
        modelish = any(k in last(name).lower() for k in ("model", "net")) or source.assigned_from(
            name,
            lambda v: (
                isinstance(v, ast.Call)
                and (call_name(v).startswith(("nn.", "torch.nn.")) or source.is_module_class(last(call_name(v))))
            ),
        )
        if modelish:
            yield (
                call,
                (
                    f"torch.save({name}) pickles the whole module: loading needs the same code at the same import "
                    "path and runs pickled code"
                ),
            )


def save_to_final_path(source: Source) -> Iterator[tuple[ast.AST, str]]:
    for call in source.calls():
        if call_name(call) != "torch.save" or len(call.args) < 2:
            continue
        scope = source.function_of(call) or source.tree
        renames = [
            c
            for c in source.calls(scope)
            if last(call_name(c)) in {"replace", "rename"}
            and (call_name(c).startswith("os.") or isinstance(c.func, ast.Attribute))
            and c.lineno >= call.lineno
        ]
        if not renames:
            yield (
                call,
                (
                    "torch.save writes straight to the final path: a kill during the write leaves a truncated "
                    "file where the last good checkpoint was"
                ),
            )
