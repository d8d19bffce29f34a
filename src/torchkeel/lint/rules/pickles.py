"""TK135: a checkpoint saved with pickled objects, loaded where torch 2.6+ refuses them."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from torchkeel.lint.engine import Source, call_name, keyword, last, torch_version
from torchkeel.lint.rules.checkpoint import _SAFE_LOAD_SINCE, _builds_module, _inside_safe_globals


def load_needs_pickle(source: Source) -> Iterator[tuple[ast.AST, str]]:
    """``torch.load(PATH)`` with torch's default ``weights_only=True`` (2.6+) of a file this file
    or one next to it saves with an object only pickle can hold: a whole module, a numpy array,
    an argparse namespace. The load raises ``UnpicklingError``."""
    version = torch_version()
    if version is not None and version < _SAFE_LOAD_SINCE:
        return
    loads = []
    for call in source.calls():
        if call_name(call) != "torch.load" or not call.args or _inside_safe_globals(source, call):
            continue
        value = keyword(call, "weights_only")
        if value is None or (isinstance(value, ast.Constant) and value.value is True):
            loads.append(call)
    if not any(_file_name(call.args[0]) for call in loads):
        return  # the files next to this one are read only for a load of a named file
    saved = _pickled_saves(source)
    for folder_file in _neighbours(source):
        saved.update(_pickled_saves(folder_file))
    for call in loads:
        name = _file_name(call.args[0])
        if name in saved:
            yield (
                call,
                (
                    f"torch.load('{name}') reads with weights_only=True (the default since torch 2.6), and "
                    f"{saved[name]} is saved there: the load raises UnpicklingError"
                ),
            )


def _file_name(node: ast.expr) -> str | None:
    """The file name of a path literal, also inside ``open('x.pt', 'rb')``."""
    if isinstance(node, ast.Call) and call_name(node) == "open" and node.args:
        node = node.args[0]
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return Path(node.value).name
    return None


def _pickled_saves(source: Source) -> dict[str, str]:
    """File name → what needing pickle is saved there (``a numpy array``, ``a whole module``...)."""
    found: dict[str, str] = {}
    for call in source.calls():
        if call_name(call) != "torch.save" or len(call.args) < 2:
            continue
        name = _file_name(call.args[1])
        what = _needs_pickle(source, call.args[0])
        if name and what:
            found[name] = f"{what} ({Path(source.path).name}:{call.lineno})"
    return found


def _needs_pickle(source: Source, obj: ast.expr) -> str | None:
    values = [obj] + (source.assigned.get(obj.id, []) if isinstance(obj, ast.Name) else [])
    for value in values:
        text = call_name(value) if isinstance(value, ast.Call) else ""
        if text.startswith(("np.", "numpy.")) or (
            isinstance(value, ast.Call) and last(text) == "astype" and "np." in ast.unparse(value)
        ):
            return "a numpy array"
        if last(text) == "parse_args":
            return "an argparse namespace"
        if isinstance(value, ast.Call) and _builds_module(source, value):
            return "a whole module"
    return None


def _neighbours(source: Source) -> list[Source]:
    folder = Path(source.path).parent
    found = []
    for path in sorted(folder.glob("*.py"))[:50]:
        if path.name != Path(source.path).name:
            try:
                found.append(Source(str(path), path.read_text(encoding="utf-8", errors="replace")))
            except (SyntaxError, ValueError, OSError):
                continue
    return found
