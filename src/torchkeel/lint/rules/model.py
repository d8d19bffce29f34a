"""Rules around how models are called, evaluated and fed to losses (what ``forward()`` itself does: forward.py)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from torchkeel.lint.engine import Source, call_name, dotted, grad_free, last


def _in_forward(source: Source, node: ast.AST) -> bool:
    fn = source.function_of(node)
    return fn is not None and fn.name == "forward" and isinstance(source.parents.get(fn), ast.ClassDef)


_HOOKS = {"register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook", "register_backward_hook"}


def forward_called_directly(source: Source) -> Iterator[tuple[ast.AST, str]]:
    hooks = any(last(call_name(c)) in _HOOKS and not _on_leaf_layers(source, c) for c in source.calls())
    wrappers = any(last(call_name(c)) in _WRAPPERS for c in source.calls())
    sharded = any(last(call_name(c)) in _SHARDING for c in source.calls())  # FSDP wraps the children too
    for call in source.calls():
        if isinstance(call.func, ast.Attribute) and call.func.attr == "forward":
            receiver = call.func.value
            if isinstance(receiver, ast.Call) or _remote(source, receiver):
                continue  # super().forward, and RPC proxies: rref.remote().forward, RemoteModule.forward
            if isinstance(receiver, ast.Name) and receiver.id == "self" and not hooks:
                continue  # a module calling its own forward skips no hook this file registers
            if isinstance(receiver, ast.Name) and receiver.id == "self" and source.method_name(call) == "__init__":
                continue  # a dry run in __init__ to create lazy parameters: no hook is registered yet
            if not hooks and not wrappers:
                continue  # no hook registered here and no DDP / FSDP / compile: forward(x) is model(x)
            if not hooks and not sharded and (_in_forward(source, call) or _ddp_wrapped(source, receiver)):
                continue  # children run inside the wrapped module's own call; DDP's forward is DDP's
            yield (
                call,
                (
                    f"{dotted(call.func)}(...) skips the module's hooks (and torch.compile, DDP and FSDP wrappers); "
                    f"call {dotted(receiver)}(...)"
                ),
            )


def _on_leaf_layers(source: Source, hook: ast.Call) -> bool:
    """A hook registered on chosen layers inside a model (``for module in self.train_modules:
    module.register_forward_hook(...)``, or under ``isinstance(m, nn.Linear)`` in a walk of
    ``modules()``): ``model.forward(x)`` runs those layers' ``__call__``, so their hooks run too."""
    if not isinstance(hook.func, ast.Attribute) or not isinstance(hook.func.value, ast.Name):
        return False
    var = hook.func.value.id
    loop = source.enclosing(hook, ast.For)
    while loop is not None and not (isinstance(loop.target, ast.Name) and loop.target.id == var):
        loop = source.enclosing(loop, ast.For)
    if loop is None:
        return False
    if last(call_name(loop.iter)) not in {"modules", "named_modules", "children", "named_children"}:
        return not isinstance(loop.iter, ast.Call)  # a list of layers kept by name: not the model itself
    tests = [n.test for n in _ancestors(source, hook, loop) if isinstance(n, ast.If)]
    return any(last(call_name(t)) == "isinstance" for test in tests for t in ast.walk(test) if isinstance(t, ast.Call))


def _ancestors(source: Source, node: ast.AST, stop: ast.AST) -> Iterator[ast.AST]:
    parent = source.parents.get(node)
    while parent is not None and parent is not stop:
        yield parent
        parent = source.parents.get(parent)


# Wrappers that work through the module's __call__ or hooks (FSDP2's fully_shard registers hooks).
_WRAPPERS = {"DistributedDataParallel", "DDP", "FullyShardedDataParallel", "FSDP", "fully_shard", "compile"}


_SHARDING = {"FullyShardedDataParallel", "FSDP", "fully_shard"}


def _ddp_wrapped(source: Source, receiver: ast.expr) -> bool:
    """``model = DistributedDataParallel(model)``: ``model.forward(x)`` runs DDP's own forward."""
    return source.assigned_from(
        dotted(receiver), lambda v: isinstance(v, ast.Call) and last(call_name(v)) in {"DistributedDataParallel", "DDP"}
    )


def _remote(source: Source, receiver: ast.expr) -> bool:
    name = dotted(receiver)
    return (
        "rref" in name.lower()
        or "remote" in name.lower()
        or source.assigned_from(name, lambda v: isinstance(v, ast.Call) and "remote" in call_name(v).lower())
    )


def bare_mode_switch(source: Source) -> Iterator[tuple[ast.AST, str]]:
    for node in source.nodes:
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr in {"eval", "train"}
        ):
            yield node, f"{dotted(node.value)} is not called: the module stays in its current mode"


def _disables_grad(item: ast.withitem) -> bool:
    """``with torch.no_grad():``, ``torch.inference_mode()`` or ``torch.set_grad_enabled(False)``."""
    expr = item.context_expr
    name = last(call_name(expr))
    if name == "set_grad_enabled":
        return isinstance(expr, ast.Call) and bool(expr.args) and ast.unparse(expr.args[0]) == "False"
    return name in {"no_grad", "inference_mode"}


def _grad_disabled(source: Source, node: ast.AST, callers: int = 0) -> bool:
    """Whether ``node`` runs with gradients off: under a disabling ``with`` or decorator or, with
    ``callers`` > 0, in a function of this file whose every call here runs so (a caller's
    ``with torch.no_grad():``), followed that many calls up."""
    parent = source.parents.get(node)
    while parent is not None:
        if isinstance(parent, ast.With) and any(_disables_grad(i) for i in parent.items):
            return True
        if isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if grad_free(parent):
                return True
            calls = source.calls_of(parent) if callers > 0 else []
            if calls:
                return all(_grad_disabled(source, c, callers - 1) for c in calls)
        parent = source.parents.get(parent)
    return False


def _model_calls(source: Source, root: ast.AST) -> list[ast.Call]:
    out = []
    for call in source.calls(root):
        name = call_name(call)
        if (
            isinstance(call.func, (ast.Name, ast.Attribute))
            and any(k in last(name).lower() for k in ("model", "net", "encoder", "classifier"))
            and "." not in name.replace("self.", "")
            and name not in source.functions  # validate_network(...): a function of this file, not a model
            and not _own_method(source, call)  # self.model_predictions(...): a method, not a module
            and not (name not in source.assigned and source.imported_from(name))  # convert_model: imported, a function
        ):
            out.append(call)
    return out


def _own_method(source: Source, call: ast.Call) -> bool:
    """``self.NAME(...)`` where NAME is a method of the class the call is written in."""
    func = call.func
    if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self"):
        return False
    cls = source.enclosing(call, ast.ClassDef)
    return cls is not None and any(
        isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == func.attr for n in cls.body
    )


def eval_without_eval(source: Source) -> Iterator[tuple[ast.AST, str]]:
    """Evaluation (a model called under no_grad/inference_mode) in a file that never calls .eval()."""
    if any(last(call_name(c)) == "eval" for c in source.calls()) or not any(
        last(call_name(c)) == "backward" for c in source.calls()
    ):
        return
    for call in _model_calls(source, source.tree):
        if _grad_disabled(source, call) and _has_mode_layers(source, call_name(call)) is not False:
            yield (
                call,
                (
                    f"{call_name(call)}(...) is evaluated under no_grad/inference_mode but the file never calls "
                    ".eval(): dropout and batch-norm stay in training mode"
                ),
            )
            return


_MODE_LAYERS = ("Dropout", "BatchNorm", "dropout", "batch_norm", "SyncBatchNorm", "Transformer")
# nn.Transformer and its layers hold dropout; a class of one's own named TransformerNet need not.
_MODE_LAYER = re.compile(r"Dropout|BatchNorm|dropout|batch_norm|\bTransformer(Encoder|Decoder)?(Layer)?\(")


def _has_mode_layers(source: Source, model: str) -> bool | None:
    """Whether the module that ``model`` names holds layers that act differently in train and eval
    mode (dropout, batch norm): False only when every class it is built from is read here or in
    a sibling file and none has one; None when that cannot be told (an installed model)."""
    values = [v for v in source.assigned.get(model, []) if not _moved_self(v, model)]
    if not values:
        return None
    answers = {_class_has_mode_layers(source, v, depth=3) for v in values}
    return True if True in answers else (None if None in answers else False)


def _moved_self(value: ast.AST, model: str) -> bool:
    """``model = model.cuda()`` (or ``.to(device)``): the same module moved, not another one."""
    while isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr in {"to", "cuda"}:
        value = value.func.value
    return dotted(value) == model


def _torch_value_class(source: Source, call: ast.Call) -> bool:
    """A class of torch outside ``torch.nn`` (``Normal(mu, std)``, ``torch.Generator()``): a value,
    never a module with dropout or batch norm."""
    name = call_name(call)
    module = name.rsplit(".", 1)[0] if "." in name else (source.imported_from(name) or "")
    return last(name)[:1].isupper() and module.split(".")[0] == "torch" and ".nn" not in f".{module}"


def _class_has_mode_layers(source: Source, value: ast.AST, depth: int) -> bool | None:
    call, where, node = source.constructed(value)
    if call is None:
        return None
    if _MODE_LAYER.search(ast.unparse(call)):
        return True  # nn.Dropout(...), nn.Sequential(..., nn.BatchNorm1d(...)), nn.LSTM(..., dropout=0.2)
    if call_name(call).startswith(("nn.", "torch.nn.")) or _torch_value_class(source, call):
        return False
    if node is None or depth == 0:
        return None
    if _MODE_LAYER.search(ast.unparse(node)):
        return True
    inner = {_class_has_mode_layers(where, c, depth - 1) for c in where.calls(node) if last(call_name(c))[:1].isupper()}
    return True if True in inner else (None if None in inner else False)


def eval_without_no_grad(source: Source) -> Iterator[tuple[ast.AST, str]]:
    """A function that switches a model to eval() and then calls it in a loop with gradients on."""
    for fn in source.nodes:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        evals = [c for c in source.calls(fn) if last(call_name(c)) == "eval" and not c.args]
        if not evals or any(last(call_name(c)) in {"backward", "grad"} for c in source.calls(fn)):
            continue  # gradients are the point (autograd.grad: an attack's input gradient, a Hessian product)
        for loop in (n for n in ast.walk(fn) if isinstance(n, (ast.For, ast.While))):
            calls = [c for c in _model_calls(source, loop) if not _grad_disabled(source, c, callers=2)]
            if calls and loop.lineno > evals[0].lineno:
                yield (
                    calls[0],
                    (
                        f"{call_name(calls[0])}(...) runs in an evaluation loop without torch.no_grad() or "
                        "torch.inference_mode(): every batch builds an autograd graph"
                    ),
                )
                break


def softmax_into_cross_entropy(source: Source) -> Iterator[tuple[ast.AST, str]]:
    criteria = {
        name
        for name, values in source.assigned.items()
        if any(isinstance(v, ast.Call) and last(call_name(v)) == "CrossEntropyLoss" for v in values)
    }
    uses_ce = bool(criteria) or any(last(call_name(c)) == "cross_entropy" for c in source.calls())
    for call in source.calls():
        name = call_name(call)
        if (
            last(name) == "cross_entropy"
            or name in criteria
            or (isinstance(call.func, ast.Call) and last(call_name(call.func)) == "CrossEntropyLoss")
        ) and call.args:
            arg = call.args[0]
            if _is_softmax(source, arg, call):
                yield (
                    call,
                    (
                        f"{name or 'CrossEntropyLoss()'}(...) gets softmax probabilities; it applies log_softmax "
                        "itself, so the loss is wrong and its gradients tiny"
                    ),
                )
        if (
            uses_ce
            and last(name) == "Softmax"
            and isinstance(source.parents.get(call), ast.Call)
            and last(call_name(source.parents[call])) == "Sequential"
            and source.parents[call].args[-1] is call
        ):
            yield call, ("the model ends in nn.Softmax and the file trains it with cross entropy, which expects logits")


_RESHAPES = {"view", "reshape", "flatten", "contiguous", "permute", "transpose", "squeeze", "unsqueeze", "float"}


def _is_softmax(source: Source, arg: ast.expr, at: ast.AST) -> bool:
    """``arg`` is a softmax output, also seen through ``.view(...)``/``.reshape(...)``/indexing."""
    while True:
        if isinstance(arg, ast.Subscript):
            arg = arg.value
        elif isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute) and arg.func.attr in _RESHAPES:
            arg = arg.func.value
        else:
            break
    if isinstance(arg, ast.Call):
        return last(call_name(arg)) == "softmax"
    if isinstance(arg, ast.Name):
        fn = source.function_of(at) or source.tree
        values = [
            n.value
            for n in ast.walk(fn)
            if isinstance(n, ast.Assign)
            and getattr(n, "lineno", 0) < at.lineno
            and any(isinstance(t, ast.Name) and t.id == arg.id for t in n.targets)
        ]
        return bool(values) and _is_softmax(source, values[-1], values[-1])
    return False


def backward_in_autocast(source: Source) -> Iterator[tuple[ast.AST, str]]:
    for node in source.nodes:
        if isinstance(node, ast.With) and any(last(call_name(i.context_expr)) == "autocast" for i in node.items):
            for call in source.calls(node):
                name = call_name(call)
                if last(name) == "backward" or (last(name) == "step" and "scaler" in name.lower()):
                    yield (
                        call,
                        (
                            f"{name}() runs inside autocast: only the forward pass and the loss belong there; "
                            "backward ops run in the dtype autocast chose for the forward"
                        ),
                    )


def clip_without_unscale(source: Source) -> Iterator[tuple[ast.AST, str]]:
    """A clip on a path that scales the loss with a GradScaler: in the same function, or in a
    function of this file that calls the clipping one (``clip(model)`` after ``scaler.scale``).
    A clip in a function with no scaler on its way (a compiled step built without one) is left alone."""
    for clip in source.calls():
        if last(call_name(clip)) not in {"clip_grad_norm_", "clip_grad_value_"}:
            continue
        own = source.function_of(clip)
        scopes = {own, *_callers(source, own)}
        calls = [c for c in source.calls() if source.function_of(c) in scopes]
        scales = [c for c in calls if last(call_name(c)) == "scale" and "scaler" in call_name(c).lower()]
        if all(source.exclusive(clip, scale) for scale in scales):
            continue  # no scaler on this path (none at all, or the `else:` branch of `if use_amp:`)
        if not any(
            last(call_name(c)) == "unscale_"
            and (source.function_of(c) is not own or (c.lineno, c.col_offset) < (clip.lineno, clip.col_offset))
            for c in calls
        ):
            yield (
                clip,
                f"{call_name(clip)}() clips the gradients while they are still multiplied by the GradScaler's scale",
            )


def _callers(source: Source, fn: ast.AST | None) -> set[ast.AST | None]:
    """The functions of this file (None: module level) that call ``fn``."""
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return set()
    return {source.function_of(c) for c in source.calls_of(fn)}
