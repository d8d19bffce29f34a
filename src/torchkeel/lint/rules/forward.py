"""Rules on what ``forward()`` itself does: host syncs, tensors made on the wrong device, in-place
writes to outputs that backward needs."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from torchkeel.lint.engine import Source, call_name, dotted, grad_free, keyword, last
from torchkeel.lint.rules.model import _in_forward

# .cpu() is left out: torch.compile traces it, and RPC/pipeline code moves outputs on purpose.
_HOST_SYNC = {"item", "numpy", "tolist"}
_FACTORIES = {"zeros", "ones", "empty", "full", "rand", "randn", "randint", "arange", "linspace", "eye", "tensor"}
# Ops whose backward needs their own output: modifying that output in place breaks backward
# (pow, elu and selu save their input instead).
_SAVES_OUTPUT = {"sigmoid", "tanh", "exp", "softmax", "log_softmax", "relu", "sqrt", "rsqrt"}
_INPLACE_METHODS = {
    "add_",
    "sub_",
    "mul_",
    "div_",
    "clamp_",
    "relu_",
    "sigmoid_",
    "tanh_",
    "exp_",
    "fill_",
    "zero_",
    "masked_fill_",
    "copy_",
    "pow_",
    "neg_",
    "abs_",
}


def host_sync_in_forward(source: Source) -> Iterator[tuple[ast.AST, str]]:
    for call in source.calls():
        method = last(call_name(call))
        if (
            method in _HOST_SYNC
            and isinstance(call.func, ast.Attribute)
            and not call.args
            and _in_forward(source, call)
            and not _moved_on_purpose(call)
            and not _on_host(source, call.func.value)
            and not _never_trained(source, source.function_of(call))
        ):
            yield (
                call,
                (
                    f".{method}() inside forward() copies to the host every call: a GPU sync, and a graph "
                    "break under torch.compile"
                ),
            )


def _moved_on_purpose(call: ast.Call) -> bool:
    """``x.cpu().numpy()``: the explicit ``.cpu()`` is the copy (left alone, as above); ``.numpy()``
    of a CPU tensor adds none (a forward that hands the input to ONNX Runtime or OpenCV)."""
    receiver = call.func.value if isinstance(call.func, ast.Attribute) else None
    return last(call_name(call)) == "numpy" and isinstance(receiver, ast.Call) and last(call_name(receiver)) == "cpu"


_CPU_FACTORIES = {"tensor", "LongTensor", "IntTensor", "FloatTensor", "DoubleTensor", "BoolTensor", "Tensor"}


def _on_host(source: Source, expr: ast.expr, depth: int = 2) -> bool:
    """``expr`` holds a host value whatever device the model is on, so reading it copies nothing:
    a numpy array (``lengths = np.array(...)``), a tensor made without ``device=`` from values
    (``torch.tensor(x.shape[1:])``: a CPU tensor of sizes), a torch function or method of one
    (``torch.prod(...)``), or something already copied (``x.cpu().data``)."""
    while isinstance(expr, ast.Attribute) and expr.attr == "data":
        expr = expr.value
    if isinstance(expr, ast.Name):
        values = source.assigned.get(expr.id, [])
        return depth > 0 and bool(values) and all(_on_host(source, v, depth - 1) for v in values)
    if not isinstance(expr, ast.Call):
        return False
    name = call_name(expr)
    if name.split(".")[0] in {"np", "numpy"} or last(name) == "cpu":
        return True
    if name.startswith("torch.") and last(name) in _CPU_FACTORIES:
        return keyword(expr, "device") is None
    if name.startswith("torch.") and name.count(".") == 1 and expr.args:
        return _on_host(source, expr.args[0], depth)  # torch.prod(torch.tensor(shape))
    return (
        isinstance(expr.func, ast.Attribute)
        and last(name) in {"detach", "sum", "prod", "max", "min"}
        and (_on_host(source, expr.func.value, depth))
    )


def _never_trained(source: Source, forward: ast.FunctionDef | ast.AsyncFunctionDef | None) -> bool:
    """A forward that no gradient passes through: decorated with ``torch.no_grad()`` or
    ``torch.inference_mode()``, or of a post-processor (``PostProcess``, DETR's naming), which turns
    outputs into boxes and lists for the caller: host values are its result, not a stall."""
    if forward is None:
        return False
    cls = source.parents.get(forward)
    return grad_free(forward) or (isinstance(cls, ast.ClassDef) and "postprocess" in cls.name.lower())


def factory_without_device(source: Source) -> Iterator[tuple[ast.AST, str]]:
    """A factory in ``forward`` that makes its tensor on the default device (the CPU), in a
    project that runs models elsewhere and never changes that default. Quiet where the file, or
    one next to it or up to two folders above, calls ``torch.set_default_device`` (or
    ``set_default_tensor_type``), under ``with torch.device(...)``, and where neither this folder
    nor its parent names a device (``cuda``, ``device``, ``mps``): the model runs on the CPU."""
    default_kept: bool | None = None  # read the project only once a candidate is found
    for call in source.calls():
        name = call_name(call)
        if (
            name.startswith("torch.")
            and last(name) in _FACTORIES
            and name.count(".") == 1
            and keyword(call, "device") is None
            and _in_forward(source, call)
            and not _moved_after(source, call)
            and not _index_or_metadata(source, call)
            and not _kept_as_host_index(source, call)
            and not _under_device_block(source, call)
        ):
            if default_kept is None:
                default_kept = not source.project_matches(_SETS_DEFAULT_DEVICE) and source.project_matches(
                    _NAMES_A_DEVICE, levels=1
                )
            if not default_kept:
                return
            yield (
                call,
                (
                    f"{name}() inside forward() without device= creates the tensor on the CPU, whatever device "
                    "the model runs on"
                ),
            )


_SETS_DEFAULT_DEVICE = r"\bset_default_(?:device|tensor_type)\s*\("
_NAMES_A_DEVICE = r"cuda|device|\bmps\b"


def _under_device_block(source: Source, node: ast.AST) -> bool:
    """Inside ``with torch.device(...):``: factories create their tensors on that device."""
    block = source.enclosing(node, ast.With)
    while block is not None:
        if any(call_name(i.context_expr) in {"torch.device", "device"} for i in block.items):
            return True
        block = source.enclosing(block, ast.With)
    return False


def _index_or_metadata(source: Source, call: ast.Call) -> bool:
    """An index on the host (``x[torch.arange(n), idx]``: a CUDA tensor takes CPU indices) or a
    tensor of the inputs' shapes (``torch.tensor([t.shape[-1] for t in x])``): host data on purpose."""
    node, parent = call, source.parents.get(call)
    while isinstance(parent, (ast.Attribute, ast.Call)) and parent is not None:
        if isinstance(parent, ast.Call) and parent.func is not node:
            break
        node, parent = parent, source.parents.get(parent)
    while isinstance(parent, (ast.Tuple, ast.List, ast.Compare, ast.BinOp, ast.UnaryOp)):  # x[:, arange(n) != k]
        node, parent = parent, source.parents.get(parent)
    if isinstance(parent, ast.Subscript) and parent.slice is node:
        return True
    if last(call_name(call)) != "tensor" or not call.args:
        return False
    data = call.args[0]
    scalar = not isinstance(data, (ast.List, ast.Tuple, ast.ListComp, ast.GeneratorExp))  # 0-dim: any device takes it
    return scalar or any(isinstance(n, ast.Attribute) and n.attr == "shape" for n in ast.walk(data))


def _kept_as_host_index(source: Source, call: ast.Call) -> bool:
    """``pos = torch.arange(n); start = off[:, None] + pos; x[rows, start]``: assigned to a name
    that, directly or through one more assignment, is only ever used to index a tensor."""
    stmt = source.enclosing(call, ast.Assign, ast.stmt)
    fn = source.function_of(call)
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        return False
    return fn is not None and _only_indexes(source, fn, stmt.targets[0].id, depth=1)


def _only_indexes(source: Source, fn: ast.AST, name: str, depth: int) -> bool:
    uses = [n for n in ast.walk(fn) if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)]
    for use in uses:
        node, parent = use, source.parents.get(use)
        while not isinstance(parent, (ast.stmt, ast.Subscript)) and parent is not None:
            node, parent = parent, source.parents.get(parent)
        if isinstance(parent, ast.Subscript) and parent.slice is node:
            continue
        while parent is not None and not isinstance(parent, ast.stmt):
            parent = source.parents.get(parent)
        target = parent.targets[0] if isinstance(parent, ast.Assign) and len(parent.targets) == 1 else None
        if isinstance(target, ast.Name) and target.id == name:
            continue  # idx = idx[..., None]: its later uses are judged too
        if (
            depth
            and isinstance(target, ast.Name)
            and target.id != name
            and _only_indexes(source, fn, target.id, depth - 1)
        ):
            continue
        return False
    return bool(uses)


_MOVES = {"to", "cuda", "type_as"}


def _moved_after(source: Source, call: ast.Call) -> bool:
    """Created, then moved: ``torch.zeros(...).to(x.device)`` (also after reshapes:
    ``torch.arange(n).view(-1, 1).to(device)``), a name it is assigned to moved later in the
    function (``if x.is_cuda: grid = grid.cuda()``), or a host coin flip (``if torch.rand(1) < p:``)."""
    node, parent = call, source.parents.get(call)
    if keyword(call, "out") is not None:
        return True  # torch.eye(n, out=torch.empty_like(x)): made where ``out`` lives
    while True:  # up through methods, indexing and torch functions of it: torch.triu(torch.ones(n, n)).to(d)
        if isinstance(parent, ast.Attribute) and getattr(source.parents.get(parent), "func", None) is parent:
            if parent.attr in _MOVES or parent.attr in {"item", "tolist"}:
                return True  # moved, or read on the host on purpose (torch.rand(1).item() < p)
            node = source.parents[parent]
        elif isinstance(parent, ast.Subscript) and parent.value is node:
            node = parent
        elif isinstance(parent, ast.Call) and call_name(parent).startswith("torch.") and node in parent.args:
            node = parent
        else:
            break
        parent = source.parents.get(node)
    if isinstance(parent, ast.Attribute) and parent.attr in _MOVES:
        return True
    while isinstance(parent, (ast.Compare, ast.BoolOp, ast.UnaryOp)):  # if training and torch.rand(1) > p:
        node, parent = parent, source.parents.get(parent)
        if isinstance(parent, (ast.If, ast.While, ast.IfExp)) and parent.test is node:
            return True
    fn = source.function_of(call)
    if not (isinstance(parent, ast.Assign) and len(parent.targets) == 1 and fn is not None):
        return False
    name = dotted(parent.targets[0])
    return any(
        isinstance(c.func, ast.Attribute)
        and c.func.attr in _MOVES
        and dotted(c.func.value) == name
        and c.lineno > call.lineno
        for c in source.calls(fn)
    )


def inplace_on_activation(source: Source) -> Iterator[tuple[ast.AST, str]]:
    """An in-place write, in a module's ``forward``, to the output of an op whose backward reads
    that output. Left alone: a custom ``torch.autograd.Function`` (its forward runs without
    autograd and saves what its own backward needs), an output made under no_grad or from
    factories alone (nothing requires grad), a write in the other branch of an ``if``, and one on
    the evaluation path (``if not self.training:``)."""
    for fn in source.nodes:
        if not (isinstance(fn, ast.FunctionDef) and fn.name == "forward") or _autograd_function(source, fn):
            continue
        params = {a.arg for a in fn.args.args + fn.args.kwonlyargs} - {"self"}
        saved: dict[str, tuple[str, ast.AST]] = {}
        for node in sorted((n for n in ast.walk(fn) if hasattr(n, "lineno")), key=lambda n: (n.lineno, n.col_offset)):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                op = last(call_name(node.value)) if isinstance(node.value, ast.Call) else ""
                if op in _SAVES_OUTPUT and not _no_graph_here(source, node, fn) and _may_need_grad(node.value, params):
                    saved[node.targets[0].id] = (op, node)
                else:
                    saved.pop(node.targets[0].id, None)
            target = None
            if isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
                target = node.target.id
            elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript):
                target = dotted(node.targets[0].value)
            elif (
                isinstance(node, ast.Call)
                and last(call_name(node)) in _INPLACE_METHODS
                and isinstance(node.func, ast.Attribute)
            ):
                target = dotted(node.func.value)
            if target not in saved or source.exclusive(node, saved[target][1]):
                continue
            if ("self.training", False) in source.guards(node, fn):
                continue  # the evaluation path: nothing is backpropagated through it
            yield (
                node,
                (
                    f"'{target}' holds the output of {saved[target][0]}(), which its backward needs; modifying "
                    "it in place makes backward() fail"
                ),
            )
            saved.pop(target)


def _may_need_grad(value: ast.expr, params: set[str]) -> bool:
    """The op reads the forward's inputs or the module's state; ``torch.exp(-torch.arange(n) * c)``
    is made from factories and constants alone, and nothing of it requires grad."""
    names = {n.id for n in ast.walk(value) if isinstance(n, ast.Name)}
    own = any(isinstance(n, ast.Attribute) and dotted(n).startswith("self.") for n in ast.walk(value))
    made = any(isinstance(n, ast.Call) and last(call_name(n)) in _FACTORIES for n in ast.walk(value))
    return own or bool(names & params) or not made or bool(names - {"torch", "math", "F"} - params)


def _autograd_function(source: Source, fn: ast.FunctionDef) -> bool:
    """``forward`` of a class deriving from ``torch.autograd.Function`` (or ``Function`` imported
    from ``torch.autograd``)."""
    cls = source.parents.get(fn)
    if not isinstance(cls, ast.ClassDef):
        return False
    for base in map(dotted, cls.bases):
        if base.endswith(("autograd.Function", "autograd.function.Function", "InplaceFunction")):
            return True
        if base == "Function" and (source.imported_from("Function") or "").startswith("torch.autograd"):
            return True
    return False


def _no_graph_here(source: Source, node: ast.AST, fn: ast.FunctionDef) -> bool:
    """``node`` runs without autograd: ``fn`` is decorated with no_grad/inference_mode, or ``node``
    lies in such a ``with`` block."""
    if grad_free(fn):
        return True
    block = source.enclosing(node, ast.With)
    while block is not None and source.function_of(block) is fn:
        if any(last(call_name(i.context_expr)) in {"no_grad", "inference_mode"} for i in block.items):
            return True
        block = source.enclosing(block, ast.With)
    return False
