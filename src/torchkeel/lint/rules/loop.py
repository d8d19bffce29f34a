"""Rules over the training loop: what one iteration of a loop that steps an optimizer does, in
source order (calls to functions defined in the same file are followed one level deep)."""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator

from torchkeel.lint.engine import Source, call_name, dotted, grad_free, last

_OPTIMIZERS = (
    "SGD",
    "Adam",
    "AdamW",
    "RMSprop",
    "Adagrad",
    "Adadelta",
    "Adamax",
    "NAdam",
    "RAdam",
    "LBFGS",
    "SparseAdam",
    "ASGD",
    "Rprop",
    "Adafactor",
    "Muon",
)


@dataclasses.dataclass
class Event:
    kind: str  # backward | step | zero_grad | sched
    target: str  # the optimizer / scheduler name ("" when unknown)
    node: ast.AST
    depth: int  # 0 in the loop's own body, 1+ inside a nested loop
    has_closure: bool = False
    site: ast.AST | None = None
    """The call in the loop that runs ``node`` when it lies in a function of this file, else None."""

    @property
    def order(self) -> tuple[int, int, int, int]:
        """Where it runs in the iteration: its call site's position first, then its own."""
        at = self.site or self.node
        return (at.lineno, at.col_offset, self.node.lineno, self.node.col_offset)


def is_optimizer(source: Source, name: str) -> bool:
    if not name:
        return False
    short = last(name).lower()
    if "sched" in short or "scaler" in short:
        return False
    if source.assigned_from(name, lambda v: isinstance(v, ast.Call) and last(call_name(v)) in _OPTIMIZERS):
        return True
    return "opt" in short


def is_scheduler(source: Source, name: str) -> bool:
    short = last(name).lower()
    return "sched" in short or source.assigned_from(
        name, lambda v: isinstance(v, ast.Call) and "lr_scheduler" in call_name(v)
    )


def loop_events(source: Source, body: list[ast.stmt], depth: int = 0, inlined: int = 0) -> list[Event]:
    """The backward / step / zero_grad / scheduler calls of ``body`` in execution-like order."""
    events: list[Event] = []
    for stmt in body:
        for node in _walk_in_order(stmt):
            if isinstance(node, (ast.For, ast.While, ast.AsyncFor)) and node is not stmt:
                continue
            if not isinstance(node, ast.Call):
                continue
            name = call_name(node)
            method, receiver = last(name), name.rsplit(".", 1)[0] if "." in name else ""
            d = depth + _loop_depth(source, node, stmt)
            if method == "backward" or name.endswith("autograd.backward"):
                events.append(Event("backward", receiver, node, d))
            elif method == "step" and last(receiver).lower().endswith("scaler") and node.args:
                events.append(Event("step", dotted(node.args[0]), node, d))
            elif method == "step" and is_scheduler(source, receiver):
                events.append(Event("sched", receiver, node, d))
            elif method == "step" and is_optimizer(source, receiver):
                events.append(Event("step", receiver, node, d, has_closure=bool(node.args or node.keywords)))
            elif method == "zero_grad":
                events.append(Event("zero_grad", receiver, node, d))
            elif inlined < 1 and last(name) in source.functions:
                fn = source.functions[last(name)]
                if fn.name not in {"__init__", "forward"}:
                    inner = loop_events(source, fn.body, d, inlined + 1)
                    events += [dataclasses.replace(e, site=e.site or node) for e in inner]
    for node in ast.walk(ast.Module(body=body, type_ignores=[])):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Attribute) and t.attr == "grad" for t in node.targets
        ):
            events.append(Event("zero_grad", "", node, depth))
        elif _zeroes_by_hand(node):
            events.append(Event("zero_grad", "", node, depth))
    return events


def _zeroes_by_hand(node: ast.AST) -> bool:
    """``w.grad.zero_()`` / ``p.grad.data.zero_()``: a tensor's gradient cleared without an optimizer."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "zero_"):
        return False
    holder = dotted(node.func.value)
    return holder.endswith((".grad", ".grad.data"))


def _walk_in_order(node: ast.AST) -> Iterator[ast.AST]:
    """Depth-first, children in source order (ast.walk is breadth-first), not into nested defs."""
    yield node
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        yield from _walk_in_order(child)


def _loop_depth(source: Source, node: ast.AST, stop: ast.AST) -> int:
    depth, parent = 0, source.parents.get(node)
    while parent is not None and parent is not stop:
        if isinstance(parent, (ast.For, ast.While, ast.AsyncFor)):
            depth += 1
        parent = source.parents.get(parent)
    return depth + (1 if isinstance(stop, (ast.For, ast.While, ast.AsyncFor)) else 0)


def training_loops(source: Source) -> list[tuple[ast.AST, list[Event]]]:
    """Loops whose own body (not a nested loop) steps an optimizer, with their events (found
    once per file: every loop rule asks)."""
    found = source.memo.get("training_loops")
    if found is None:
        found = source.memo["training_loops"] = [
            (loop, events)
            for loop in source.nodes
            if isinstance(loop, (ast.For, ast.While, ast.AsyncFor))
            for events in [loop_events(source, loop.body)]
            if any(e.kind == "step" and e.depth == 0 and not _over_optimizers(loop, e) for e in events)
        ]
    return found


def _over_optimizers(loop: ast.AST, step: Event) -> bool:
    """``for opt in optimizers: opt.step()``: a loop over optimizers (each stepped once), not over batches."""
    target = getattr(loop, "target", None)
    names = {n.id for n in ast.walk(target) if isinstance(n, ast.Name)} if target is not None else set()
    return step.target.split(".")[0] in names


def double_step(source: Source) -> Iterator[tuple[ast.AST, str]]:
    for _, events in training_loops(source):
        backwards = sum(e.kind == "backward" for e in events)
        for target in sorted({last(e.target) for e in events if e.kind == "step" and e.depth == 0}):
            steps = [e for e in events if e.kind == "step" and last(e.target) == target and e.depth == 0]
            if backwards and len(steps) > backwards and not any(e.has_closure for e in steps):
                lines = ", ".join(str(e.node.lineno) for e in steps)
                yield (
                    steps[1].node,
                    (
                        f"{target}.step() runs {len(steps)} times per iteration (lines {lines}) "
                        f"for {backwards} backward(): the optimizer steps twice"
                    ),
                )


def missing_zero_grad(source: Source) -> Iterator[tuple[ast.AST, str]]:
    for loop, events in training_loops(source):
        steps = [e for e in events if e.kind == "step" and e.depth == 0 and not e.has_closure]
        if not steps or not any(e.kind == "backward" for e in events):
            continue
        outer = source.enclosing(loop, ast.For, ast.While, ast.AsyncFor)
        zeros = [e for e in events if e.kind == "zero_grad"]
        if outer is not None:
            zeros += [e for e in loop_events(source, outer.body) if e.kind == "zero_grad"]
        # zero_grad on the model (or `.grad = None`) clears everything; on an optimizer only its own
        # parameters; on one this loop never steps (a loop variable, a helper's parameter): unknown.
        stepped = {last(e.target) for e in steps}
        if any(not e.target or not is_optimizer(source, e.target) or last(e.target) not in stepped for e in zeros):
            continue
        zeroed = {last(e.target) for e in zeros}
        for step in steps:
            if last(step.target) not in zeroed and not _built_in_loop(loop, step.target):
                also = f" (zero_grad() runs only on {', '.join(sorted(zeroed))})" if zeroed else ""
                yield (
                    step.node,
                    (
                        f"the loop calls backward() and {step.target}.step() but never "
                        f"{step.target}.zero_grad(){also}: gradients add up across steps"
                    ),
                )
                break


def _built_in_loop(loop: ast.AST, optimizer: str) -> bool:
    """The optimizer is made anew in each iteration (over a tensor made there too): nothing adds up."""
    return any(
        isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and any(dotted(t) == optimizer for t in n.targets)
        for n in ast.walk(loop)
    )


def zero_grad_between(source: Source) -> Iterator[tuple[ast.AST, str]]:
    for _, events in training_loops(source):
        ordered = sorted((e for e in events if e.depth == 0 or e.kind != "step"), key=lambda e: e.order)
        seen_backward = False
        for i, e in enumerate(ordered):
            if e.kind == "backward":
                seen_backward = True
            elif e.kind == "zero_grad" and seen_backward and not _some_gradients_cleared(source, e.node):
                rest = ordered[i + 1 :]
                nxt = next((x for x in rest if x.kind in ("step", "backward")), None)
                if nxt is not None and nxt.kind == "step":
                    yield (
                        e.node,
                        (
                            "zero_grad() runs after backward() and before step(): the optimizer steps "
                            "with zero gradients"
                        ),
                    )
                    break


def _some_gradients_cleared(source: Source, node: ast.AST) -> bool:
    """``if "prototypes" in name: p.grad = None`` in a loop over the parameters: a chosen few are
    frozen for this step on purpose, the others still step. Also a zero_grad that leaves the
    iteration (``zero_grad(); continue``: a step skipped on a non-finite gradient)."""
    if _leaves_after(source, node):
        return True
    if not isinstance(node, ast.Assign):
        return False
    branch = source.enclosing(node, ast.If, ast.For, ast.While)
    return isinstance(branch, ast.If) and isinstance(source.enclosing(branch, ast.For, ast.While), ast.For)


def _leaves_after(source: Source, node: ast.AST) -> bool:
    """The statements after ``node`` in its block end with continue, break, return or raise."""
    stmt = node if isinstance(node, ast.stmt) else source.enclosing(node, ast.stmt)
    block = source.parents.get(stmt) if stmt is not None else None
    for field in ("body", "orelse", "finalbody"):
        stmts = getattr(block, field, None)
        if isinstance(stmts, list) and any(s is stmt for s in stmts):
            after = stmts[[id(s) for s in stmts].index(id(stmt)) + 1 :]
            return any(isinstance(s, (ast.Continue, ast.Break, ast.Return, ast.Raise)) for s in after)
    return False


def _grads_assigned(scope: ast.AST) -> bool:
    """``p.grad = g`` (not None) or ``torch.autograd.grad(...)``: gradients made by hand, then stepped."""
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Attribute) and t.attr == "grad" for t in node.targets
        ):
            if not (isinstance(node.value, ast.Constant) and node.value.value is None):
                return True
        if isinstance(node, ast.Call) and call_name(node).endswith("autograd.grad"):
            return True
    return False


def step_without_backward(source: Source) -> Iterator[tuple[ast.AST, str]]:
    """A loop that computes a loss, never hands it on, and steps: no backward can have run. A loss
    handed to any call but printing or logging (``agent.learn(loss)``), or a call into this file's
    functions that reaches a backward (three calls deep), may run one: then it stays quiet."""
    for loop, events in training_loops(source):
        steps = [e for e in events if e.kind == "step" and e.depth == 0 and not e.has_closure]
        if not steps or any(e.kind == "backward" for e in events) or _grads_assigned(loop):
            continue
        if any("backward" in last(call_name(c)) for c in source.calls(loop)):
            continue  # model.forward_backward(batch), self.manual_backward(loss): backward inside a method
        outer = source.enclosing(loop, ast.For, ast.While, ast.AsyncFor)
        if outer is not None and any(e.kind == "backward" for e in loop_events(source, outer.body)):
            continue
        loss = _loss_left_alone(source, loop)
        if loss is None or _reaches_backward(source, loop, depth=3):
            continue
        yield (
            steps[0].node,
            (
                f"{steps[0].target}.step() runs in a loop that computes '{loss}' and never calls backward(): "
                "no parameter gets a gradient"
            ),
        )


_ONLY_READ = {
    "print",
    "str",
    "float",
    "format",
    "append",
    "add_scalar",
    "log",
    "info",
    "update",
    "write",
    "set_postfix",
}


def _loss_left_alone(source: Source, loop: ast.AST) -> str | None:
    """The name of a loss computed in the loop (``loss = criterion(...)``) that no call other than
    printing or logging receives, and no ``.backward`` method reads: None when there is none."""
    for node in ast.walk(loop):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        name = node.targets[0].id
        value = node.value.left if isinstance(node.value, ast.BinOp) else node.value
        if "loss" not in name.lower() or not (isinstance(value, ast.Call) and _loss_call(value)):
            continue
        handed = any(
            last(call_name(c)) not in _ONLY_READ
            and any(
                isinstance(a, ast.Name) and a.id == name
                for arg in [*c.args, *(k.value for k in c.keywords)]
                for a in ast.walk(arg)
            )
            for c in source.calls(loop)
        )
        if not handed:
            return name
    return None


def _loss_call(call: ast.Call) -> bool:
    callee = last(call_name(call)).lower()
    return "loss" in callee or callee in {"criterion", "cross_entropy", "mse_loss", "nll_loss", "l1_loss"}


def _reaches_backward(source: Source, root: ast.AST, depth: int) -> bool:
    """A call in ``root`` to a function of this file that calls backward, ``depth`` calls deep."""
    for call in source.calls(root):
        fn = source.functions.get(last(call_name(call)))
        if fn is None or fn is root or depth == 0:
            continue
        if any(last(call_name(c)) == "backward" for c in source.calls(fn)) or _reaches_backward(source, fn, depth - 1):
            return True
    return False


def loss_accumulated(source: Source) -> Iterator[tuple[ast.AST, str]]:
    """``total += loss`` or ``losses.append(loss)`` of a tensor that was backpropagated or made by a loss."""
    for node in source.nodes:
        value, what = None, None
        if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add):
            value, what = node.value, f"{dotted(node.target)} += {ast.unparse(node.value)}"
        elif isinstance(node, ast.Call) and last(call_name(node)) == "append" and len(node.args) == 1:
            value, what = node.args[0], f"{call_name(node)}({ast.unparse(node.args[0])})"
        if not isinstance(value, ast.Name) or source.enclosing(node, ast.For, ast.While) is None:
            continue
        scope = source.function_of(node) or source.tree
        if _no_graph(source, node) or _backpropagated_later(source, scope, node) or _built_and_returned(scope, node):
            continue
        if "torch" in source.text and _is_loss_tensor(source, scope, value.id):  # no torch: Python floats
            yield (
                node,
                (
                    f"{what} keeps the tensor '{value.id}' (and its autograd graph) alive across iterations: "
                    "memory grows every step"
                ),
            )


def _no_graph(source: Source, node: ast.AST) -> bool:
    """Under ``torch.no_grad()`` / ``inference_mode()`` (a block, or the function's decorator): no graph is kept."""
    parent = source.parents.get(node)
    while parent is not None:
        if isinstance(parent, ast.With) and any(
            last(call_name(i.context_expr)) in {"no_grad", "inference_mode"} for i in parent.items
        ):
            return True
        if isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return grad_free(parent)
        parent = source.parents.get(parent)
    return False


def _backpropagated_later(source: Source, scope: ast.AST, node: ast.AST) -> bool:
    """The list (or sum) is backpropagated after the loop: ``for l in losses: l.backward()`` or
    ``torch.stack(losses).sum().backward()``: kept on purpose, for one backward over all of them."""
    holder = dotted(node.target) if isinstance(node, ast.AugAssign) else dotted(node.func.value)  # type: ignore[attr-defined]
    if not holder:
        return False
    loop = source.enclosing(node, ast.For, ast.While)
    for call in source.calls(scope):
        if last(call_name(call)) not in {"backward", "grad"} or call.lineno <= node.lineno:
            continue
        if loop is not None and source.enclosing(call, ast.For, ast.While) is loop:
            continue  # a backward in the same loop: the usual per-step one
        around = source.enclosing(call, ast.For) or call  # for loss in losses: ... / loss = losses[i] ... backward
        if holder in {dotted(n) for n in ast.walk(around)}:
            return True
        if last(call_name(call)) == "grad" and source.reaches(call, lambda n: dotted(n) == holder, 2):
            return True  # autograd.grad(total_loss / n, params): the sum is differentiated on purpose
    return False


def _built_and_returned(scope: ast.AST, node: ast.AST) -> bool:
    """``l += nl`` in a function that returns ``l`` and backpropagates none of the terms: one loss
    built from its terms, for the caller to backpropagate (not a per-step graph kept alive)."""
    if not isinstance(node, ast.AugAssign) or not isinstance(node.value, ast.Name):
        return False
    holder, term = dotted(node.target), node.value.id
    returned = any(
        isinstance(n, ast.Return) and n.value is not None and holder in {dotted(m) for m in ast.walk(n.value)}
        for n in ast.walk(scope)
    )
    backward = any(isinstance(n, ast.Call) and call_name(n) == f"{term}.backward" for n in ast.walk(scope))
    return returned and not backward


def _is_loss_tensor(source: Source, scope: ast.AST, name: str) -> bool:
    for node in ast.walk(scope):
        if isinstance(node, ast.Call) and call_name(node) == f"{name}.backward":
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            if isinstance(node.value, ast.Call) and last(call_name(node.value)) in {"item", "tolist", "float"}:
                return False  # loss_ = loss.detach().item(): a Python number, no graph
            callee = call_name(node.value) if isinstance(node.value, ast.Call) else ""
            if isinstance(node.value, ast.BinOp) and isinstance(node.value.left, ast.Call):
                callee = call_name(node.value.left)
            if "loss" in callee.lower() or last(callee) in {
                "criterion",
                "cross_entropy",
                "mse_loss",
                "nll_loss",
                "l1_loss",
                "binary_cross_entropy",
                "binary_cross_entropy_with_logits",
            }:
                return True
    return False
