"""Rules inside ``nn.Module.forward`` and around how models are called, evaluated and fed to losses."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator

from torchkeel.lint.engine import Source, call_name, dotted, keyword, last

# .cpu() is left out: torch.compile traces it, and RPC/pipeline code moves outputs on purpose.
_HOST_SYNC = {"item", "numpy", "tolist"}
_FACTORIES = {"zeros", "ones", "empty", "full", "rand", "randn", "randint", "arange", "linspace", "eye", "tensor"}
# Ops whose backward needs their own output: modifying that output in place breaks backward.
_SAVES_OUTPUT = {"sigmoid", "tanh", "exp", "softmax", "log_softmax", "relu", "elu", "selu", "sqrt", "rsqrt", "pow"}
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


def _in_forward(source: Source, node: ast.AST) -> bool:
    fn = source.function_of(node)
    return fn is not None and fn.name == "forward" and isinstance(source.parents.get(fn), ast.ClassDef)


def host_sync_in_forward(source: Source) -> Iterator[tuple[ast.AST, str]]:
    for call in source.calls():
        method = last(call_name(call))
        if (
            method in _HOST_SYNC
            and isinstance(call.func, ast.Attribute)
            and not call.args
            and _in_forward(source, call)
        ):
            yield (
                call,
                (
                    f".{method}() inside forward() copies to the host every call: a GPU sync, and a graph "
                    "break under torch.compile"
                ),
            )


def factory_without_device(source: Source) -> Iterator[tuple[ast.AST, str]]:
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
        ):
            yield (
                call,
                (
                    f"{name}() inside forward() without device= creates the tensor on the CPU, whatever device "
                    "the model runs on"
                ),
            )


def _index_or_metadata(source: Source, call: ast.Call) -> bool:
    """An index on the host (``x[torch.arange(n), idx]``: a CUDA tensor takes CPU indices) or a
    tensor of the inputs' shapes (``torch.tensor([t.shape[-1] for t in x])``): host data on purpose."""
    node, parent = call, source.parents.get(call)
    while isinstance(parent, (ast.Attribute, ast.Call)) and parent is not None:
        if isinstance(parent, ast.Call) and parent.func is not node:
            break
        node, parent = parent, source.parents.get(parent)
    while isinstance(parent, (ast.Tuple, ast.List)):
        node, parent = parent, source.parents.get(parent)
    if isinstance(parent, ast.Subscript) and parent.slice is node:
        return True
    if last(call_name(call)) != "tensor" or not call.args:
        return False
    data = call.args[0]
    scalar = not isinstance(data, (ast.List, ast.Tuple, ast.ListComp, ast.GeneratorExp))  # 0-dim: any device takes it
    return scalar or any(isinstance(n, ast.Attribute) and n.attr == "shape" for n in ast.walk(data))


def _moved_after(source: Source, call: ast.Call) -> bool:
    """``torch.zeros(...).to(x.device)`` / ``.cuda()`` / ``.type_as(x)``: created, then moved at once."""
    parent = source.parents.get(call)
    return isinstance(parent, ast.Attribute) and parent.attr in {"to", "cuda", "type_as"}


def inplace_on_activation(source: Source) -> Iterator[tuple[ast.AST, str]]:
    for fn in ast.walk(source.tree):
        if not (isinstance(fn, ast.FunctionDef) and fn.name == "forward"):
            continue
        saved: dict[str, str] = {}
        for node in sorted((n for n in ast.walk(fn) if hasattr(n, "lineno")), key=lambda n: (n.lineno, n.col_offset)):
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Call)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
            ):
                op = last(call_name(node.value))
                if op in _SAVES_OUTPUT:
                    saved[node.targets[0].id] = op
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
            if target in saved:
                yield (
                    node,
                    (
                        f"'{target}' holds the output of {saved[target]}(), which its backward needs; modifying "
                        "it in place makes backward() fail"
                    ),
                )
                saved.pop(target)


_HOOKS = {"register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook", "register_backward_hook"}


def forward_called_directly(source: Source) -> Iterator[tuple[ast.AST, str]]:
    hooks = any(last(call_name(c)) in _HOOKS for c in source.calls())
    wrappers = any(last(call_name(c)) in _WRAPPERS for c in source.calls())
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
            yield (
                call,
                (
                    f"{dotted(call.func)}(...) skips the module's hooks (and torch.compile, DDP and FSDP wrappers); "
                    f"call {dotted(receiver)}(...)"
                ),
            )


# Wrappers that work through the module's __call__ or hooks (FSDP2's fully_shard registers hooks).
_WRAPPERS = {"DistributedDataParallel", "DDP", "FullyShardedDataParallel", "FSDP", "fully_shard", "compile"}


def _remote(source: Source, receiver: ast.expr) -> bool:
    name = dotted(receiver)
    return (
        "rref" in name.lower()
        or "remote" in name.lower()
        or source.assigned_from(name, lambda v: isinstance(v, ast.Call) and "remote" in call_name(v).lower())
    )


def bare_mode_switch(source: Source) -> Iterator[tuple[ast.AST, str]]:
    for node in ast.walk(source.tree):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr in {"eval", "train"}
        ):
            yield node, f"{dotted(node.value)} is not called: the module stays in its current mode"


def _grad_disabled(source: Source, node: ast.AST) -> bool:
    parent = source.parents.get(node)
    while parent is not None:
        if isinstance(parent, ast.With) and any(
            last(call_name(i.context_expr)) in {"no_grad", "inference_mode"} for i in parent.items
        ):
            return True
        if isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
            "no_grad" in dotted(d) or "inference_mode" in dotted(d) for d in parent.decorator_list
        ):
            return True
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
            and not (name not in source.assigned and source.imported_from(name))  # convert_model: imported, a function
        ):
            out.append(call)
    return out


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
    values = source.assigned.get(model, [])
    if not values:
        return None
    answers = {_class_has_mode_layers(source, v, depth=3) for v in values}
    return True if True in answers else (None if None in answers else False)


def _class_has_mode_layers(source: Source, value: ast.AST, depth: int) -> bool | None:
    call, where, node = source.constructed(value)
    if call is None:
        return None
    if _MODE_LAYER.search(ast.unparse(call)):
        return True  # nn.Dropout(...), nn.Sequential(..., nn.BatchNorm1d(...)), nn.LSTM(..., dropout=0.2)
    if call_name(call).startswith(("nn.", "torch.nn.")):
        return False
    if node is None or depth == 0:
        return None
    if _MODE_LAYER.search(ast.unparse(node)):
        return True
    inner = {_class_has_mode_layers(where, c, depth - 1) for c in where.calls(node) if last(call_name(c))[:1].isupper()}
    return True if True in inner else (None if None in inner else False)


def eval_without_no_grad(source: Source) -> Iterator[tuple[ast.AST, str]]:
    """A function that switches a model to eval() and then calls it in a loop with gradients on."""
    for fn in ast.walk(source.tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        evals = [c for c in source.calls(fn) if last(call_name(c)) == "eval" and not c.args]
        if not evals or any(last(call_name(c)) == "backward" for c in source.calls(fn)):
            continue
        for loop in (n for n in ast.walk(fn) if isinstance(n, (ast.For, ast.While))):
            calls = [c for c in _model_calls(source, loop) if not _grad_disabled(source, c)]
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
    for node in ast.walk(source.tree):
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


def _exclusive(source: Source, a: ast.AST, b: ast.AST) -> bool:
    """``a`` and ``b`` lie in opposite branches of one ``if``: they never run in the same pass."""
    child, parent = a, source.parents.get(a)
    while parent is not None:
        if isinstance(parent, ast.If):
            inside = child in parent.body
            other = parent.orelse if inside else parent.body
            if child in parent.body or child in parent.orelse:
                return any(b is n for stmt in other for n in ast.walk(stmt))
        child, parent = parent, source.parents.get(parent)
    return False


def clip_without_unscale(source: Source) -> Iterator[tuple[ast.AST, str]]:
    for fn in ast.walk(source.tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
            continue
        calls = sorted(source.calls(fn), key=lambda c: (c.lineno, c.col_offset))
        scales = [c for c in calls if last(call_name(c)) == "scale" and "scaler" in call_name(c).lower()]
        for clip in (c for c in calls if last(call_name(c)) in {"clip_grad_norm_", "clip_grad_value_"}):
            if all(_exclusive(source, clip, scale) for scale in scales):
                continue  # no scaler on this path (the `else:` branch of `if use_amp:`)
            if not any(
                last(call_name(c)) == "unscale_" and (c.lineno, c.col_offset) < (clip.lineno, clip.col_offset)
                for c in calls
            ):
                yield (
                    clip,
                    (
                        f"{call_name(clip)}() clips the gradients while they are still multiplied by the "
                        "GradScaler's scale"
                    ),
                )
        if isinstance(fn, ast.Module):
            break
