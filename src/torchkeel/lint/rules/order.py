"""Rules for the statically visible forms of a loop's wrong order and of losses fed the wrong
thing: clipping before backward, a graph backpropagated twice, micro-batches summed without
dividing, ``train()`` never restored after an ``eval()`` in the epoch loop, an LBFGS closure
that never zeroes, functional dropout without ``training=``, softmax into NLL, and cross entropy
over a one-unit output."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from torchkeel.lint.engine import Source, call_name, dotted, keyword, last
from torchkeel.lint.rules.loop import Event, is_optimizer, training_loops
from torchkeel.lint.rules.model import _has_mode_layers, _in_forward, _is_softmax

_CLIPS = {"clip_grad_norm_", "clip_grad_value_"}
_DROPOUTS = {"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout"}


def _ordered(events: list[Event]) -> list[Event]:
    return sorted(events, key=lambda e: e.order)


def _clips(source: Source, loop: ast.AST) -> list[ast.Call]:
    return [
        c
        for c in source.calls(loop)
        if last(call_name(c)) in _CLIPS and source.enclosing(c, ast.For, ast.While) is loop
    ]


def clip_before_backward(source: Source) -> Iterator[tuple[ast.AST, str]]:
    """A clip of the gradients that comes, in the iteration, before every backward and is not
    followed by another clip before the step. A backward inside a function of this file counts
    where that function is called (``self.backward_step(loss)`` before the clip)."""
    for loop, events in training_loops(source):
        backwards = [e for e in events if e.kind == "backward" and e.depth == 0]
        steps = [e for e in events if e.kind == "step" and e.depth == 0 and not e.has_closure]
        clips = _clips(source, loop)
        if not backwards or not steps or not clips:
            continue
        first = min(backwards, key=lambda e: e.order)  # a backward in a function of this file: where it is called
        if all((c.lineno, c.col_offset) < first.order[:2] for c in clips):
            yield (
                clips[0],
                (
                    f"{call_name(clips[0])}() runs before backward() (line {first.order[0]}) in the "
                    "iteration: it clips the previous step's gradients, and the ones step() uses are never clipped"
                ),
            )


def repeated_backward(source: Source) -> Iterator[tuple[ast.AST, str]]:
    """``loss.backward(retain_graph=True)`` then ``loss.backward()`` of the same tensor before a step."""
    for _, events in training_loops(source):
        ordered = _ordered([e for e in events if e.depth == 0 and e.kind in ("backward", "step", "zero_grad")])
        kept: dict[str, Event] = {}
        for e in ordered:
            if e.kind != "backward":
                kept.clear()
                continue
            if e.target in kept and e.target:
                yield (
                    e.node,
                    (
                        f"{e.target}.backward() runs again (line {kept[e.target].node.lineno} kept the graph with "
                        "retain_graph=True) before step(): every gradient is added twice"
                    ),
                )
                break
            retain = keyword(e.node, "retain_graph")
            if isinstance(retain, ast.Constant) and retain.value is True:
                kept[e.target] = e


def accumulation_not_divided(source: Source) -> Iterator[tuple[ast.AST, str]]:
    """A loop that steps an SGD optimizer under ``if (i + 1) % k == 0`` and backpropagates, every
    iteration, a loss never divided. Gradients add up only when the backward runs more often than the step and no
    zero_grad clears them in between: a backward under the step's own condition (an RL update every
    ``train_frequency`` steps), or a zero_grad that runs whenever the backward does, is no accumulation."""
    for loop, events in training_loops(source):
        steps = [e for e in events if e.kind == "step" and e.depth == 0 and not e.has_closure]
        backwards = [e for e in events if e.kind == "backward" and e.depth == 0]
        if not steps or len(backwards) != 1 or not isinstance(backwards[0].node.func, ast.Attribute):
            continue
        if backwards[0].node.args:
            continue  # accelerator.backward(loss) divides by its accumulation steps itself
        backward, loss = backwards[0].node, backwards[0].node.func.value
        guard = source.enclosing(steps[0].node, ast.If)
        if not isinstance(loss, ast.Name) or guard is None or not _is_modulo_test(guard.test):
            continue
        if source.enclosing(guard, ast.For, ast.While) is not loop or _divided(source, loop, loss.id):
            continue
        every = source.guards(backward, loop)
        if source.guards(steps[0].node, loop) <= every:
            continue  # the backward runs only when the step does: one backward per step
        if any(e.kind == "zero_grad" and source.guards(e.node, loop) <= every for e in events if e.depth == 0):
            continue  # cleared whenever the backward runs: the gradients never add up
        if not _scale_sensitive(source, steps[0].target):
            continue  # Adam and its kin divide the scale out: k summed gradients step like their mean
        yield (
            backward,
            (
                f"{loss.id}.backward() runs every iteration and step() only every k-th (line {guard.lineno}): "
                f"{loss.id} is never divided by k, so the step is k times what the learning rate says"
            ),
        )


_SCALED_BY_GRADIENT = {"SGD", "LBFGS", "ASGD", "Rprop"}


def _scale_sensitive(source: Source, optimizer: str) -> bool:
    """The optimizer is built in this file with an update proportional to the gradient (SGD):
    summing k gradients makes its step k times larger. Adam, AdamW, RMSprop, Adagrad normalise
    the gradient, and an optimizer built elsewhere cannot be told."""
    return source.assigned_from(
        optimizer, lambda v: isinstance(v, ast.Call) and last(call_name(v)) in _SCALED_BY_GRADIENT
    )


def _is_modulo_test(test: ast.expr) -> bool:
    return any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod) for n in ast.walk(test))


def _divided(source: Source, loop: ast.AST, name: str) -> bool:
    """Some assignment to ``name`` in the loop divides (or multiplies: a scale), or ``name /= k``."""
    for node in ast.walk(loop):
        if isinstance(node, ast.AugAssign) and dotted(node.target) == name and isinstance(node.op, (ast.Div, ast.Mult)):
            return True
        if isinstance(node, ast.Assign) and any(dotted(t) == name for t in node.targets):
            if any(isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Div, ast.Mult)) for n in ast.walk(node.value)):
                return True
            if isinstance(node.value, ast.Call) and not _is_loss_call(node.value):
                return True  # the model or a helper of the script's: it may divide inside
    return False


def _is_loss_call(call: ast.Call) -> bool:
    callee = last(call_name(call))
    return callee in {"criterion", "cross_entropy", "mse_loss", "nll_loss", "l1_loss"} or "loss" in callee.lower()


def train_not_restored(source: Source) -> Iterator[tuple[ast.AST, str]]:
    """``model.eval()`` in an epoch loop whose inner loop trains ``model``, and no ``model.train()``
    anywhere in the file: every epoch after the first trains in eval mode."""
    restored = {
        dotted(c.func.value) for c in source.calls() if isinstance(c.func, ast.Attribute) and c.func.attr == "train"
    }
    for loop, _ in training_loops(source):
        outer = source.enclosing(loop, ast.For, ast.While)
        if outer is None:
            continue
        inner_models = {dotted(c.func) for c in source.calls(loop) if isinstance(c.func, ast.Name | ast.Attribute)}
        for call in _outer_calls(source, outer, loop):
            if isinstance(call.func, ast.Attribute) and call.func.attr == "eval" and not call.args:
                model = dotted(call.func.value)
                if (
                    model
                    and model in inner_models
                    and model not in restored
                    and _has_mode_layers(source, model)
                    is not False  # no dropout, no batch norm: eval() changes nothing
                ):
                    yield (
                        call,
                        (
                            f"{model}.eval() runs in the epoch loop and {model}.train() nowhere: from the second "
                            "epoch on the model trains in eval mode (dropout off, batch norm frozen)"
                        ),
                    )
                    return


def _outer_calls(source: Source, outer: ast.AST, inner: ast.AST) -> Iterator[ast.Call]:
    """The calls of ``outer``'s body outside ``inner``, and those of functions of this file it calls."""
    for call in source.calls(outer):
        if source.enclosing(call, ast.For, ast.While) is inner:
            continue
        yield call
        fn = source.functions.get(last(call_name(call)))
        if fn is not None and fn.name not in {"__init__", "forward"}:
            yield from (c for c in source.calls(fn))


def closure_without_zero_grad(source: Source) -> Iterator[tuple[ast.AST, str]]:
    """A closure handed to ``optimizer.step(closure)`` that calls backward and never zero_grad."""
    for call in source.calls():
        if last(call_name(call)) != "step" or len(call.args) != 1 or not isinstance(call.args[0], ast.Name):
            continue
        receiver = call_name(call).rsplit(".", 1)[0]
        fn = source.functions.get(call.args[0].id)
        if fn is None or not is_optimizer(source, receiver):
            continue
        names = {last(call_name(c)) for c in source.calls(fn)}
        zeroes = "zero_grad" in names or any(
            isinstance(n, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == "grad" for t in n.targets)
            for n in ast.walk(fn)
        )
        if "backward" in names and not zeroes:
            yield (
                fn,
                (
                    f"the closure {fn.name}() passed to {receiver}.step() calls backward() and never zero_grad(): "
                    "LBFGS evaluates it several times per step, and each evaluation adds onto the last"
                ),
            )


def dropout_without_training(source: Source) -> Iterator[tuple[ast.AST, str]]:
    """``F.dropout(x, p)`` inside ``forward`` without ``training=``: it stays on in eval mode."""
    for call in source.calls():
        name = call_name(call)
        if last(name) not in _DROPOUTS or "." not in name or last(name.rsplit(".", 1)[0]) not in {"F", "functional"}:
            continue
        if not _in_forward(source, call) or keyword(call, "training") is not None or len(call.args) >= 3:
            continue
        if _under_training_test(source, call):
            continue  # `if self.training: x = F.dropout(x, p)`: on only while training
        yield (
            call,
            (
                f"{name}() in forward() without training=: it defaults to True, so dropout stays on when the model "
                "is in eval mode"
            ),
        )


def _under_training_test(source: Source, node: ast.AST) -> bool:
    parent = source.parents.get(node)
    while parent is not None and not isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)):
        if isinstance(parent, (ast.If, ast.IfExp)) and any(
            (isinstance(n, ast.Attribute) and n.attr == "training") or (isinstance(n, ast.Name) and n.id == "training")
            for n in ast.walk(parent.test)
        ):
            return True
        parent = source.parents.get(parent)
    return False


def softmax_into_nll(source: Source) -> Iterator[tuple[ast.AST, str]]:
    criteria = {
        name
        for name, values in source.assigned.items()
        if any(isinstance(v, ast.Call) and last(call_name(v)) == "NLLLoss" for v in values)
    }
    for call in source.calls():
        name = call_name(call)
        if (last(name) == "nll_loss" or name in criteria) and call.args and _is_softmax(source, call.args[0], call):
            yield (
                call,
                (
                    f"{name}(...) gets softmax probabilities; it expects log-probabilities, so the loss is "
                    "-p instead of -log p and training barely moves"
                ),
            )


def cross_entropy_one_output(source: Source) -> Iterator[tuple[ast.AST, str]]:
    """Cross entropy over a model that ends in ``nn.Linear(n, 1)`` (an ``nn.Sequential`` of this
    file): the log-softmax of one logit is 0, and so is the loss."""
    one_unit = {
        name
        for name, values in source.assigned.items()
        for v in values
        if isinstance(v, ast.Call) and last(call_name(v)) == "Sequential" and v.args and _one_output(v.args[-1])
    }
    criteria = {
        name
        for name, values in source.assigned.items()
        if any(isinstance(v, ast.Call) and last(call_name(v)) == "CrossEntropyLoss" for v in values)
    }
    if not one_unit:
        return
    for call in source.calls():
        name = call_name(call)
        if not (last(name) == "cross_entropy" or name in criteria) or not call.args:
            continue
        model = _called_model(source, call.args[0], call)
        if model in one_unit:
            yield (
                call,
                (
                    f"{name or 'cross_entropy'}(...) over {model}, whose last layer has one output: the loss is 0 "
                    "whatever the weights (use BCEWithLogitsLoss for one output, or C outputs for C classes)"
                ),
            )


def _one_output(node: ast.expr) -> bool:
    if not isinstance(node, ast.Call) or last(call_name(node)) != "Linear":
        return False
    out = node.args[1] if len(node.args) >= 2 else keyword(node, "out_features")
    return isinstance(out, ast.Constant) and out.value == 1


def _called_model(source: Source, arg: ast.expr, at: ast.AST) -> str | None:
    """``model`` for ``model(x)``, directly or through a name assigned from it before ``at``."""
    if isinstance(arg, ast.Call):
        return dotted(arg.func) or None
    if isinstance(arg, ast.Name):
        fn = source.function_of(at) or source.tree
        values = [
            n.value
            for n in ast.walk(fn)
            if isinstance(n, ast.Assign)
            and n.lineno < at.lineno
            and any(isinstance(t, ast.Name) and t.id == arg.id for t in n.targets)
        ]
        return _called_model(source, values[-1], values[-1]) if values and isinstance(values[-1], ast.Call) else None
    return None
