"""Rules about checkpoints on disk: what is loaded (pickles), what is saved, and where."""

from __future__ import annotations

import ast
import functools
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

from torchkeel.lint.engine import Source, _sibling, call_name, dotted, keyword, last, torch_version

# torch.load's default became weights_only=True in torch 2.6.
_SAFE_LOAD_SINCE = (2, 6)
_NOT_A_MODULE = {"state", "dict", "sd", "config", "cfg", "path", "dir", "file", "name", "args", "params", "weights"}
_NOT_A_MODULE |= {"ckpt", "checkpoint", "snapshot", "opt", "optim", "optimizer", "kwargs", "type", "id", "url"}
_MODULE_WORDS = {"model", "net", "network", "module"}
_VARIES_PER_CALL = {"time", "time_ns", "ctime", "now", "utcnow", "strftime", "uuid4", "getpid", "mkdtemp", "mkstemp"}
_STEP_WORDS = ("epoch", "step", "iter", "batch", "it")
_RUN_COUNTS = ("epoch", "step", "iter")  # what a caller passes to name a new file per save


_DOWNLOADS = {"urlretrieve", "urlopen", "download_url", "download_url_to_file", "hf_hub_download", "cached_download"}
_DOWNLOADS |= {"cached_path", "download", "download_file", "gdown", "snapshot_download", "get_file"}


def unsafe_load(source: Source) -> Iterator[tuple[ast.AST, str]]:
    """A pickle-enabled ``torch.load`` of a file from elsewhere: its path is a URL or what a
    download returned, or the project (this file and the files next to it) never writes a file
    with ``torch.save``, so what it loads is someone else's (pretrained weights, a checkpoint to
    convert). A project that saves its own checkpoints and loads them back trusts what it wrote."""
    version = torch_version()
    default_safe = version is not None and version >= _SAFE_LOAD_SINCE
    writes_own: bool | None = None  # read the project only when the file loads something
    for call in source.calls():
        if call_name(call) != "torch.load" or not call.args:
            continue
        if writes_own is None:
            writes_own = source.project_matches(r"\btorch\.save\s*\(", levels=0)
        if writes_own and not source.reaches(call.args[0], _downloaded):
            continue
        value = keyword(call, "weights_only")
        if value is None and not default_safe and not _inside_safe_globals(source, call):
            yield (
                call,
                (
                    "torch.load without weights_only=True: torch before 2.6 (installed: "
                    f"{'none' if version is None else '%d.%d' % version}) unpickles arbitrary code from the file"
                ),
            )
        elif isinstance(value, ast.Constant) and value.value is False:
            yield call, "torch.load(weights_only=False) runs whatever pickled code the file holds"


def _downloaded(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.startswith(("http://", "https://", "s3://", "gs://", "ftp://"))
    name = call_name(node)
    return bool(name) and (last(name) in _DOWNLOADS or name.endswith("requests.get"))


def _inside_safe_globals(source: Source, node: ast.AST) -> bool:
    parent = source.parents.get(node)
    while parent is not None:
        if isinstance(parent, ast.With) and any(
            last(call_name(i.context_expr)) == "safe_globals" for i in parent.items
        ):
            return True
        parent = source.parents.get(parent)
    return False


def _modelish_name(name: str) -> bool:
    """``model``, ``netG``, ``generator_net`` — not ``model_state_dict`` or ``network_config``."""
    words = [w.lower() for w in re.findall(r"[A-Za-z][a-z0-9]*|[A-Z]+(?![a-z])", last(name))]
    return bool(words) and not _NOT_A_MODULE & set(words) and bool(_MODULE_WORDS & set(words))


def _builds_module(source: Source, value: ast.expr) -> bool | None:
    """Whether ``value`` constructs an nn.Module: True, False, or None when it cannot tell."""
    call, where, node = source.constructed(value)
    if call is None:
        return False
    name = call_name(call)
    if name.startswith(("nn.", "torch.nn.", "models.", "torchvision.models.", "timm.create_model")):
        return True
    if where is not None:
        return where.is_module_class(node.name)
    return None if last(name)[:1].isupper() else False


def save_whole_module(source: Source) -> Iterator[tuple[ast.AST, str]]:
    for call in source.calls():
        if call_name(call) != "torch.save" or not call.args:
            continue
        obj = call.args[0]
        if not isinstance(obj, (ast.Name, ast.Attribute)):
            continue
        name = dotted(obj)
        kinds = {_builds_module(source, v) for v in source.assigned.get(name, [])}
        if True in kinds or (_modelish_name(name) and (not kinds or None in kinds)):
            yield (
                call,
                (
                    f"torch.save({name}) pickles the whole module: loading needs the same code at the same import "
                    "path, and torch.load's default weights_only=True (torch 2.6+) refuses it"
                ),
            )


def _write_target(source: Source, call: ast.Call) -> ast.expr:
    """The path a torch.save writes to: its second argument, or the path of the enclosing
    ``with open(PATH, "wb") as f``."""
    target = call.args[1]
    if isinstance(target, ast.Name):
        node = source.enclosing(call, ast.With)
        while node is not None:
            for item in node.items:
                if (
                    isinstance(item.optional_vars, ast.Name)
                    and item.optional_vars.id == target.id
                    and last(call_name(item.context_expr)) == "open"  # open, pathmgr.open, fs.open
                    and item.context_expr.args
                ):
                    return item.context_expr.args[0]
            node = source.enclosing(node, ast.With)
    if isinstance(target, ast.Call) and last(call_name(target)) == "open" and target.args:
        return target.args[0]
    return target


def _in_memory(source: Source, target: ast.expr) -> bool:
    def buffer(value: ast.AST) -> bool:
        return isinstance(value, ast.Call) and last(call_name(value)) == "BytesIO"

    return buffer(target) or (
        isinstance(target, ast.Name) and any(buffer(v) for v in source.assigned.get(target.id, []))
    )


def _new_path_each_time(source: Source, call: ast.Call, path: ast.expr) -> bool:
    """The path names the loop's variable (a file per epoch), a step-like parameter, the clock, or
    — formatted into it — a count or score of the run (``engine.state.epoch``, ``iteration + 1``,
    ``accu``), also through a function of this file given a count (``get_checkpoint(epoch + 1)``):
    a new file per save."""
    loop = source.loop_names(call)
    fn = source.function_of(call)
    params = {a.arg for a in fn.args.args + fn.args.kwonlyargs} if fn else set()

    def varies(node: ast.AST) -> bool:
        if isinstance(node, ast.Name):
            if node.id in loop:
                return True
            if node.id in params:
                return any(w in node.id.lower() for w in _STEP_WORDS) or _varies_at_every_call(source, fn, node.id)
            return False
        if isinstance(node, ast.Call) and last(call_name(node)) in source.functions:
            return any(_names_a_count(n, _RUN_COUNTS) for a in node.args for n in ast.walk(a))
        return isinstance(node, ast.Call) and last(call_name(node)) in _VARIES_PER_CALL

    return source.reaches(path, varies) or source.reaches(path, lambda n: _formats_a_count(source, n, params))


def _varies_at_every_call(source: Source, fn: ast.FunctionDef | ast.AsyncFunctionDef, param: str) -> bool:
    """Every call of ``fn`` that may run many times passes ``param`` a count of the run
    (``self.save(milestone)`` with ``milestone = self.step // every``, ``filename="ckpt_{}.pt".format(epoch)``);
    a call that runs once (``save_checkpoint("model.pkl")`` after the loop) rewrites nothing while
    training. One repeated call that passes a constant (``self.save("latest")``) or leaves the
    default keeps the path fixed. Where this file never calls ``fn``, the calls in the files next to
    it and in the three folders above are judged (``utils.save_checkpoint(..., "G_{}.pth".format(step))``)."""
    calls = [(source, c) for c in source.calls_of(fn)] or _calls_elsewhere(source, fn)
    for where, call in calls:
        arg = _argument(call, fn, param)
        loop = where.loop_names(call)
        if not (
            (arg is not None and _formats_a_count(where, arg))
            or (arg is not None and where.reaches(arg, lambda n: _names_a_count(n, _RUN_COUNTS) or dotted(n) in loop))
            or not _runs_repeatedly(where, call)
        ):
            return False
    return bool(calls)


def _argument(call: ast.Call, fn: ast.FunctionDef | ast.AsyncFunctionDef, param: str) -> ast.expr | None:
    """What ``call`` passes to ``fn``'s parameter ``param`` (None: the default, or unknown)."""
    method = bool(fn.args.args) and fn.args.args[0].arg in {"self", "cls"}
    positional = [a.arg for a in fn.args.args][1 if method else 0 :]
    arg = keyword(call, param)
    index = positional.index(param) if param in positional else len(call.args)
    if arg is None and index < len(call.args) and not any(isinstance(a, ast.Starred) for a in call.args):
        arg = call.args[index]
    return arg


def _calls_elsewhere(source: Source, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[tuple[Source, ast.Call]]:
    """Calls of the function ``fn`` (not a method) by name in the files next to this one and in the
    three folders above (``utils.save_checkpoint(...)`` in ``train.py``)."""
    if isinstance(source.parents.get(fn), ast.ClassDef):
        return []
    here = Path(source.path).resolve()
    found = []
    for folder in list(here.parents)[:4]:  # lib/model/utils/net_utils.py is called from the root's train script
        if folder in _OUTSIDE_ANY_PROJECT():
            break  # scratch files in /tmp or the home folder are not this project's callers
        for path in sorted(folder.glob("*.py"))[:50]:
            where = _sibling(str(folder), path.stem) if path != here else None
            if where is not None and fn.name in where.text:
                found += [(where, c) for c in where.calls() if last(call_name(c)) == fn.name]
        if any((folder / marker).exists() for marker in _PROJECT_ROOTS):
            break  # the repository's root: nothing above it calls into it
    return found


_PROJECT_ROOTS = (".git", "pyproject.toml", "setup.py", "setup.cfg")


@functools.cache
def _OUTSIDE_ANY_PROJECT() -> frozenset[Path]:  # noqa: N802 - a constant, computed once
    return frozenset({Path(tempfile.gettempdir()).resolve(), Path.home().resolve(), Path("/")})


_COUNTS = ("epoch", "step", "iter", "accu", "acc", "score", "loss", "count")


def _names_a_count(node: ast.AST, words: tuple[str, ...] = _COUNTS) -> bool:
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
    return any(w in name.lower() for w in words)


def _formats_a_count(source: Source, node: ast.AST, params: set[str] | frozenset[str] = frozenset()) -> bool:
    """An f-string, ``.format(...)`` or ``%`` whose values name a count or score of the run, directly
    or through what is assigned to them (``f"model-{milestone}.pt"``, ``milestone = step // k``).
    A parameter in ``params`` is judged by its callers instead (its name's assignments elsewhere in
    the file are other variables)."""
    if isinstance(node, ast.JoinedStr):
        values = [v.value for v in node.values if isinstance(v, ast.FormattedValue)]
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format":
        values = [*node.args, *(k.value for k in node.keywords)]
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) and isinstance(node.left, ast.Constant):
        values = [node.right]
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        # "ckpt_" + repr(train_step) + ".pth", "model.pth.tar-" + str(epoch)
        values = [v for v in (node.left, node.right) if last(call_name(v)) in {"str", "repr"}]
    else:
        return False
    names = [n for v in values for n in ast.walk(v) if isinstance(n, (ast.Name, ast.Attribute))]
    return any(
        _names_a_count(n) or (isinstance(n, ast.Name) and n.id not in params and source.reaches(n, _names_a_count, 2))
        for n in names
    )


_TEMPORARY = ("tempfile", "TemporaryDirectory", "NamedTemporaryFile", "mkdtemp", "mkstemp", "gettempdir")


def _temporary(source: Source, path: ast.expr) -> bool:
    """A scratch path: made by ``tempfile`` (or named ``tmp...``), nobody's last good checkpoint."""

    def scratch(node: ast.AST) -> bool:
        if isinstance(node, ast.Name) and node.id.lower().startswith(("tmp", "temp")):
            return True
        if isinstance(node, ast.Attribute) and node.attr.lower().startswith(("tmp", "temp")):
            return True
        return isinstance(node, ast.Call) and any(t in call_name(node) for t in _TEMPORARY)

    if source.reaches(path, scratch):
        return True
    with_block = source.enclosing(path, ast.With)
    while with_block is not None:  # with tempfile.TemporaryDirectory() as d: ... d / "x.pt"
        for item in with_block.items:
            if any(t in ast.unparse(item.context_expr) for t in _TEMPORARY) and item.optional_vars is not None:
                bound = dotted(item.optional_vars)
                if bound and any(dotted(n) == bound for n in ast.walk(path)):
                    return True
        with_block = source.enclosing(with_block, ast.With)
    return False


_ONE_OFF = ("prepare", "convert", "merge", "export", "download", "preprocess")


def _one_off(source: Source, call: ast.Call) -> bool:
    """A save in a data-preparation or conversion function (or script): it runs once per use."""
    fn = source.function_of(call)
    name = (fn.name if fn else "") + " " + Path(source.path).stem
    return any(word in name.lower() for word in _ONE_OFF) and not _in_loop(source, call)


def _deleted_after(source: Source, call: ast.Call, path: ast.expr) -> bool:
    """A scratch file: the same path is removed later in the same function (save-then-delete)."""
    text = ast.unparse(path)
    for other in source.calls(source.function_of(call) or source.tree):
        if (
            last(call_name(other)) in {"remove", "unlink", "rmtree"}
            and other.lineno > call.lineno
            and (
                any(ast.unparse(a) == text for a in other.args)
                or (isinstance(other.func, ast.Attribute) and ast.unparse(other.func.value) == text)
            )
        ):
            return True
    return False


_EXISTS = {"exists", "isfile", "isdir", "is_file", "is_dir"}


def _only_when_missing(source: Source, call: ast.Call) -> bool:
    """The save runs only when a file or folder does not exist yet (``if not os.path.exists(path):``,
    a cache written once): there is no last good file for a kill to spoil."""
    node = source.parents.get(call)
    while node is not None and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        parent = source.parents.get(node)
        if isinstance(parent, ast.If):
            test = parent.test
            negated = isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)
            checked = test.operand if negated else test  # type: ignore[attr-defined]
            if last(call_name(checked)) in _EXISTS and node in (parent.body if negated else parent.orelse):
                return True  # if not exists(p): save / if exists(p): load ... else: save
        node = parent
    return False


def _in_loop(source: Source, node: ast.AST) -> bool:
    parent = source.parents.get(node)
    while parent is not None and not isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)):
        if isinstance(parent, (ast.For, ast.AsyncFor, ast.While)):
            return True
        parent = source.parents.get(parent)
    return False


def _runs_repeatedly(source: Source, node: ast.AST, depth: int = 3) -> bool:
    """``node`` may run many times in one process: it sits in a loop, or in a function that is
    called from a loop, handed over as a callback, or never called here (its caller is elsewhere).
    A save at module level, or in ``main()`` called once, runs once."""
    if _in_loop(source, node):
        return True
    fn = source.function_of(node)
    if fn is None or depth == 0:
        return False
    method = isinstance(source.parents.get(fn), ast.ClassDef)
    uses = [
        n
        for n in source.nodes
        if (isinstance(n, ast.Name) and n.id == fn.name and not method)
        or (isinstance(n, ast.Attribute) and n.attr == fn.name and method)
    ]
    calls = [n for n in uses if isinstance(source.parents.get(n), ast.Call) and source.parents[n].func is n]
    if not calls or len(calls) < len(uses):
        return True  # called from elsewhere, or passed on as a callback
    return any(_runs_repeatedly(source, source.parents[c], depth - 1) for c in calls)


def save_to_final_path(source: Source) -> Iterator[tuple[ast.AST, str]]:
    for call in source.calls():
        if call_name(call) != "torch.save" or len(call.args) < 2:
            continue
        path = _write_target(source, call)
        if (
            _in_memory(source, path)
            or _temporary(source, path)
            or _new_path_each_time(source, call, path)
            or _deleted_after(source, call, path)
            or _one_off(source, call)
            or _only_when_missing(source, call)
            or not _runs_repeatedly(source, call)
        ):
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
                    f"torch.save writes straight onto {ast.unparse(path)}: a kill during the write leaves a "
                    "truncated file where the last good one was"
                ),
            )
