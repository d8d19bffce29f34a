"""Rules about data loading: DataLoader workers, what ``__getitem__`` does, sampling order."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from torchkeel.lint.engine import Source, call_name, dotted, keyword, last

_PY_RANDOM = {
    "random",
    "randint",
    "uniform",
    "gauss",
    "choice",
    "choices",
    "shuffle",
    "sample",
    "normalvariate",
    "randrange",
    "betavariate",
    "expovariate",
}


_SEEDS_TORCH = {"manual_seed", "seed_everything", "set_seed", "seed_all"}
# The project's own seeding helper (``init_seeds`` in a file next to this one) seeds these too.
_SEED_CALLS = {"random": r"(?<![\w.])random\.seed\s*\(", "np.random": r"\b(?:np|numpy)\.random\.seed\s*\("}
_SAME_GENERATOR = {"np.random": ("numpy.random",)}


def _workers(call: ast.Call) -> ast.expr | None:
    value = keyword(call, "num_workers")
    if isinstance(value, ast.Constant) and value.value == 0:
        return None
    return value


def workers_without_main_guard(source: Source) -> Iterator[tuple[ast.AST, str]]:
    """Once per file (one missing guard is one cause, however many loaders it has)."""
    loaders = [
        call
        for call in source.calls()
        if last(call_name(call)) == "DataLoader"
        and _workers(call) is not None
        and source.function_of(call) is None
        and not source.in_main_guard(call)
    ]
    if loaders and not _iterated_at_module_level(source, loaders):
        return  # built at import, iterated only in functions run under the guard: a worker builds, never starts, them
    if loaders:
        also = f" (and {len(loaders) - 1} more loader(s) at lines {', '.join(str(c.lineno) for c in loaders[1:])})"
        yield (
            loaders[0],
            (
                'DataLoader(num_workers>0) at module level outside `if __name__ == "__main__":`'
                + (also if len(loaders) > 1 else "")
                + ": with the spawn start method (Windows, macOS) every worker re-runs this file"
            ),
        )


def _iterated_at_module_level(source: Source, loaders: list[ast.Call]) -> bool:
    """Whether importing this file may start the loaders' workers: module-level code outside the
    ``__main__`` guard uses a loader (``for x, y in train_loader:``) or calls a function of this
    file, or the file has no guard at all (its loop runs on import)."""
    assigns = [source.parents.get(c) for c in loaders]
    names = {dotted(t) for a in assigns if isinstance(a, ast.Assign) for t in a.targets}
    if len(names) < len(loaders) or not any(source.in_main_guard(c) for c in source.calls()):
        return True  # a loader not kept in a name, or no guarded entry point: cannot tell
    for node in source.nodes:
        if source.function_of(node) is not None or source.in_main_guard(node):
            continue
        if isinstance(node, ast.Name) and node.id in names and isinstance(node.ctx, ast.Load):
            return True
        if isinstance(node, ast.Call) and last(call_name(node)) in source.functions:
            return True
    return False


def lambda_in_loader(source: Source) -> Iterator[tuple[ast.AST, str]]:
    for call in source.calls():
        if last(call_name(call)) == "DataLoader" and _workers(call) is not None:
            for key in ("collate_fn", "worker_init_fn"):
                if isinstance(keyword(call, key), ast.Lambda):
                    yield call, (f"{key}=lambda cannot be pickled into worker processes under the spawn start method")


def _in_getitem(source: Source, node: ast.AST) -> bool:
    return source.method_name(node) == "__getitem__"


def random_in_getitem(source: Source) -> Iterator[tuple[ast.AST, str]]:
    """Once per ``__getitem__``, for a global generator that neither this file nor its package
    seeds, in a project that seeds torch (so expects repeatable runs). The DataLoader
    reseeds ``random`` and numpy in each worker from torch's seed; with ``num_workers=0`` the draws
    come from the process's own generator, so results change with the number of workers."""
    if not source.folder_calls(_SEEDS_TORCH):
        return  # nothing is seeded: the whole run differs each time, not these draws alone
    seeded = {call_name(c).rsplit(".", 1)[0] for c in source.calls() if last(call_name(c)) == "seed"}
    for module, pattern in _SEED_CALLS.items():
        if module not in seeded and source.package_matches(pattern):
            seeded |= {module, *_SAME_GENERATOR.get(module, ())}
    reported: set[ast.AST] = set()
    for call in source.calls():
        name = call_name(call)
        if not _in_getitem(source, call):
            continue
        module = "random" if name.startswith("random.") and last(name) in _PY_RANDOM else None
        if name.startswith(("np.random.", "numpy.random.")) and last(name) != "default_rng":
            module = name.rsplit(".", 1)[0]
        fn = source.function_of(call)
        if module is None or module in seeded or fn in reported:
            continue
        reported.add(fn)
        yield (
            call,
            (
                f"{name}() in __getitem__ draws from {module}'s global generator, which neither this file nor its package seeds: "
                "with num_workers=0 every run draws differently, and the draws change with num_workers "
                "(each worker is reseeded from torch's seed)"
            ),
        )


def cuda_in_getitem(source: Source) -> Iterator[tuple[ast.AST, str]]:
    """CUDA in ``__getitem__``, unless every DataLoader of this file reads in the main process
    (``num_workers`` unset or 0: the dataset then runs where CUDA works, as in small LM scripts
    that return batches already on the GPU)."""
    loaders = [c for c in source.calls() if last(call_name(c)) == "DataLoader"]
    in_process = [_workers(c) is None and len(c.args) < 6 and all(k.arg for k in c.keywords) for c in loaders]
    if loaders and all(in_process):
        return
    for call in source.calls():
        if not _in_getitem(source, call):
            continue
        name, text = call_name(call), ast.unparse(call)
        if (
            last(name) == "cuda"
            or (last(name) == "to" and "cuda" in text)
            or ("cuda" in ast.unparse(keyword(call, "device")) if keyword(call, "device") is not None else False)
        ):
            yield (
                call,
                (
                    "CUDA in __getitem__: DataLoader workers cannot use CUDA (forked processes fail to "
                    "initialise it); return CPU tensors and move the batch in the training loop"
                ),
            )


def _set_names(source: Source, scope: ast.AST) -> set[str]:
    """Names that every assignment in ``scope`` (not nested functions) binds to a set, or to a
    list or tuple made from one (``vocab = list(set(words))``: the set's order, kept)."""
    values: dict[str, list[ast.expr]] = {}
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign) and (source.function_of(node) or source.tree) is scope:
            for target in node.targets:
                if isinstance(target, ast.Name):
                    values.setdefault(target.id, []).append(node.value)
    for node in ast.walk(scope):  # vocab.sort(): put in order after all
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "sort":
            values.pop(dotted(node.func.value), None)
    names: set[str] = set()
    while True:
        more = {name for name, vs in values.items() if all(_set_ordered(v, names) for v in vs)}
        if more <= names:
            return names
        names |= more


def _set_ordered(node: ast.AST, sets: set[str]) -> bool:
    """A set, a name of one, or ``list(...)`` / ``tuple(...)`` of one: items in the set's order."""
    if isinstance(node, ast.Call) and call_name(node) in {"list", "tuple"} and len(node.args) == 1:
        node = node.args[0]
    return _is_set(node) or (isinstance(node, ast.Name) and node.id in sets)


# A run meant to repeat (something is seeded), or a result that outlives the process (saved).
_KEEPS_OR_REPEATS = (
    r"\b(?:manual_seed|seed_everything|set_seed|seed_all|random\.seed|torch\.save|save_pretrained|"
    r"pickle\.dump|json\.dump|np\.save)\s*\("
)


def set_iteration(source: Source) -> Iterator[tuple[ast.AST, str]]:
    """Indices or a list built in a set's order, in a project where that order matters: one that
    seeds (a run meant to repeat) or saves (a model or vocabulary read back by another process).
    A script that does neither changes everything on every run anyway."""
    matters: bool | None = None  # read the project only once a candidate is found
    scopes: dict[ast.AST, set[str]] = {}
    for node in source.nodes:
        if isinstance(node, (ast.For, ast.AsyncFor)):
            iters = [node.iter]
        elif isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            iters = [g.iter for g in node.generators]
        elif isinstance(node, ast.Call) and call_name(node) in {"zip", "enumerate"}:
            iters = [] if _iterated(source, node) else [node]  # dict(zip(vocab, range(len(vocab))))
        else:
            continue
        scope = source.function_of(node) or source.tree
        if scope not in scopes:
            scopes[scope] = _set_names(source, scope)
        sets = scopes[scope]
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)) and _order_free(source, node):
            continue
        if isinstance(node, ast.Call) and _order_free(source, node):
            continue
        if isinstance(node, (ast.For, ast.AsyncFor)) and not _builds_in_order(source, node):
            continue
        for it in iters:
            inner = it.args if isinstance(it, ast.Call) and call_name(it) in {"enumerate", "zip"} else [it]
            if any(_set_ordered(arg, sets) for arg in inner):
                if matters is None:
                    matters = source.project_matches(_KEEPS_OR_REPEATS, levels=1)
                if not matters:
                    return
                yield (
                    it,
                    (
                        "iterating over a set: the order of strings changes with every process (PYTHONHASHSEED), "
                        "so indices built from it differ between runs; iterate over sorted(...)"
                    ),
                )


def _iterated(source: Source, call: ast.Call) -> bool:
    """``call`` is what a ``for`` or a comprehension iterates (judged there)."""
    parent = source.parents.get(call)
    return (isinstance(parent, (ast.For, ast.AsyncFor)) and parent.iter is call) or (
        isinstance(parent, ast.comprehension) and parent.iter is call
    )


_ORDER_FREE = {"any", "all", "sum", "min", "max", "len", "set", "frozenset", "sorted"}
_ORDERED_WRITES = {"append", "extend", "insert", "write", "add_module", "register_buffer", "register_parameter"}


def _builds_in_order(source: Source, loop: ast.For | ast.AsyncFor) -> bool:
    """A ``for`` over a set whose body records the order it met the items: ``enumerate``, a list
    appended to, a counter or string grown, an item stored by key or position, a value yielded or
    returned, or kept past a ``break`` (the first match wins). A body that only acts on each item
    (``download(name)``, ``os.remove(path)``), or stops at the first item that fails a test
    (``if dims != dims_list[0]: same = False; break``, ``return False``), does not depend on the order."""
    if isinstance(loop.iter, ast.Call) and call_name(loop.iter) == "enumerate":
        return True
    items = {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)}
    for node in ast.walk(ast.Module(body=loop.body, type_ignores=[])):
        if isinstance(node, (ast.Yield, ast.YieldFrom, ast.AugAssign)):
            return True
        if isinstance(node, ast.Return) and node.value is not None and _names(node.value) & items:
            return True  # return name: the first match wins
        if isinstance(node, ast.Break) and _read_after(source, loop, items):
            return True
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _ORDERED_WRITES:
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Subscript) for t in node.targets):
            return True
    return False


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _read_after(source: Source, loop: ast.For | ast.AsyncFor, names: set[str]) -> bool:
    """A name the loop binds is read after the loop (the item it stopped at is used)."""
    end = loop.end_lineno or loop.lineno
    scope = source.function_of(loop) or source.tree
    return any(
        isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in names and n.lineno > end
        for n in ast.walk(scope)
    )


def _order_free(source: Source, comprehension: ast.AST) -> bool:
    """A comprehension whose result does not depend on order: ``any(p in x for p in a_set)``, a set."""
    parent = source.parents.get(comprehension)
    joined = isinstance(parent, ast.Call) and last(call_name(parent)) == "join"  # a message: ", ".join(...)
    return (
        isinstance(comprehension, ast.SetComp)
        or (isinstance(parent, ast.Call) and call_name(parent) in _ORDER_FREE)
        or joined
    )


def _is_set(node: ast.AST) -> bool:
    """A set whose order can change between runs: not one of numbers (``set(ids.tolist())``,
    ``{1, 2}``, ``set(range(n))``), which hash to themselves and iterate the same every run."""
    if isinstance(node, ast.Set):
        return not all(isinstance(e, ast.Constant) and isinstance(e.value, int) for e in node.elts)
    if isinstance(node, ast.Call) and call_name(node) in {"set", "frozenset"}:
        numbers = (n for arg in node.args for n in ast.walk(arg) if isinstance(n, ast.Call))
        return not any(last(call_name(n)) in {"tolist", "range"} for n in numbers)
    return isinstance(node, ast.SetComp)


def sampler_without_set_epoch(source: Source) -> Iterator[tuple[ast.AST, str]]:
    """A shuffling DistributedSampler in a file that trains (calls backward) and never calls
    ``set_epoch``. A sampler built with ``shuffle=False`` (or a shuffle its caller chooses), or in a
    file that only evaluates, reads the same order every epoch on purpose or runs one pass."""
    samplers = [
        c
        for c in source.calls()
        if last(call_name(c)) == "DistributedSampler" and _shuffles(c) and not _for_evaluation(source, c)
    ]
    if not samplers or any(last(call_name(c)) == "set_epoch" for c in source.calls()):
        return
    if not any(last(call_name(c)) == "backward" for c in source.calls()):
        return  # no training here: an evaluation's single pass, or a loader built for a script elsewhere
    if _handed_elsewhere(source, samplers[0]):
        return
    yield (
        samplers[0],
        ("DistributedSampler without sampler.set_epoch(epoch): every epoch shuffles the data in the same order"),
    )


def _shuffles(sampler: ast.Call) -> bool:
    """``shuffle`` left at its default (True) or set True: set_epoch changes its order."""
    value = keyword(sampler, "shuffle")
    return value is None or (isinstance(value, ast.Constant) and value.value is True)


def _for_evaluation(source: Source, sampler: ast.Call) -> bool:
    """``val_sampler = DistributedSampler(val_set)``: an evaluation's order does not matter."""
    parent = source.parents.get(sampler)
    names = [dotted(t) for t in parent.targets] if isinstance(parent, ast.Assign) else []
    names += [dotted(a) for a in sampler.args[:1]] + [dotted(keyword(sampler, "dataset"))]
    return any(w in n.lower() for n in names for w in ("val", "test", "eval"))


def _handed_elsewhere(source: Source, sampler: ast.Call) -> bool:
    """The sampler (or the loader or kwargs built on it) is passed to a function this file does not
    define, which may call set_epoch itself."""
    holders = {
        n for n, values in source.assigned.items() if any(sampler is v or sampler in ast.walk(v) for v in values)
    }
    for _ in range(2):  # the sampler, then what is built from it (a DataLoader, a kwargs dict)
        holders |= {
            n
            for n, values in source.assigned.items()
            for v in values
            if any(isinstance(x, ast.Name) and x.id in holders for x in ast.walk(v))
        }
    for call in source.calls():
        if last(call_name(call)) in source.functions or last(call_name(call)) in {"DataLoader", "dict"}:
            continue
        arguments = list(call.args) + [k.value for k in call.keywords]
        if any(isinstance(a, ast.Name) and a.id in holders for a in arguments):
            return True
    return _returned_to_another_file(source, sampler, holders)


def _returned_to_another_file(source: Source, sampler: ast.Call, holders: set[str]) -> bool:
    """``def build_loader(...): ... return loader`` that nothing in this file calls: the training
    script that does (``loader.sampler.set_epoch(epoch)``) is elsewhere."""
    fn = source.function_of(sampler)
    if fn is None or any(source.function_of(c) is not fn for c in source.calls_of(fn)):
        return False  # called here (a call from inside itself, super()._get_sampler(), aside)
    returns = [n for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value is not None]
    return any(
        sampler in ast.walk(r.value) or any(isinstance(x, ast.Name) and x.id in holders for x in ast.walk(r.value))
        for r in returns
    )
