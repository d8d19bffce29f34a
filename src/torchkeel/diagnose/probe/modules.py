"""Modules and the ops between them: global forward hooks and a ``TorchFunctionMode``.

Names the models by the variables the script holds them in, keeps this step's module calls
(checked only when the step goes non-finite: a healthy run pays one check per top-level call),
and looks at the arguments of classification losses and at the ops outside modules.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode

from torchkeel.checkpoint.state import leaving_no_trace
from torchkeel.diagnose.events import (
    BatchnormBatchOne,
    CarriedState,
    EvalInTrainMode,
    NonfiniteForward,
    NonfiniteInput,
)
from torchkeel.diagnose.tracing import (
    FirstNonfiniteOp,
    allocates_uninitialized,
    nonfinite_scalar,
    op_name,
)
from torchkeel.introspect.sites import (
    has_graph,
    is_nonfinite,
    nonfinite_layout,
    tensors_in,
    user_frame,
    user_site,
    variable_name,
)

if TYPE_CHECKING:
    from torchkeel.diagnose.probe.core import Probe

_BN = torch.nn.modules.batchnorm._BatchNorm
_DROPOUT = torch.nn.modules.dropout._DropoutNd


class _Mode(TorchFunctionMode):
    """Sees every torch function call; hands the interesting ones to the listener."""

    def __init__(self, listener: ModuleListener) -> None:
        super().__init__()
        self.listener, self.probe = listener, listener.probe

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        probe = self.probe
        if probe.state.busy:
            return func(*args, **kwargs)
        check = self.listener.loss_checks.get(func)
        if check is not None:
            probe.safely(check, func, args, kwargs)
        out = func(*args, **kwargs)
        if not self.listener.stack and not probe.state.in_step and not probe.state.in_fetch:
            if isinstance(out, (torch.Tensor, tuple)):
                probe.track(out)
            if probe.state.watch_ops:
                probe.safely(self.listener.check_op, func, args, kwargs, out)
        return out


class ModuleListener:
    """Forward hooks on every module and the function mode, while the script is not compiled."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.calls: list[tuple[torch.nn.Module, Any, Any]] = []  # this step's module calls, inner first
        self.stack = probe.state.module_stack
        self.leaf_order = probe.state.leaf_order
        # Outputs of top-level module calls → the step that made them: an input that is one of
        # them from an earlier step is state carried across steps with its graph (an RNN's hidden).
        self.root_outputs: dict[int, tuple[weakref.ref, int]] = {}
        self.loss_checks: dict[Callable, Callable] = {}  # function → check (the loss listener's, dropout's)
        self._mode: _Mode | None = None
        self._mode_on = True
        self._unsafe: list[Callable[[], None]] = []  # what torch.compile cannot trace through

    def install(self) -> None:
        mod = torch.nn.modules.module
        self._mode = _Mode(self)
        self._mode.__enter__()
        self._unsafe = [
            mod.register_module_forward_pre_hook(self._forward_pre).remove,
            mod.register_module_forward_hook(self._forward_post, always_call=True).remove,
            self.mode_off,
        ]

    def uninstall(self) -> None:
        while self._unsafe:
            try:
                self._unsafe.pop()()
            except Exception:  # noqa: BLE001 - a mode the script pushed on top of ours cannot be popped
                pass
        self.stack.clear()

    def on_step_begins(self) -> None:
        self.mode_off()

    def on_step_ends(self) -> None:
        self.calls.clear()
        if not self.probe.light:
            self.mode_back()

    def on_loss_nonfinite(self) -> None:
        self.scan_calls()

    def mode_off(self) -> None:
        """Pop the function mode if it is on top (the optimizer's many small ops need no looking at)."""
        if self._mode is not None and self._mode_on and _get_current_function_mode() is self._mode:
            self._mode.__exit__(None, None, None)
            self._mode_on = False

    def mode_back(self) -> None:
        if self._mode is not None and not self._mode_on and not self.probe.compiling:
            self._mode.__enter__()
            self._mode_on = True

    # ---------------------------------------------------------------- hooks
    def _forward_pre(self, module: torch.nn.Module, args: Any) -> None:
        probe = self.probe
        if probe.state.busy:
            return
        if not self.stack:
            probe.safely(self._root_call, module, args)
        if not probe.state.first_layer_seen and next(module.children(), None) is None:
            probe.safely(probe.emit, "leaf_forward", module, args)
        if isinstance(module, _BN) and module.training:
            probe.safely(self._batchnorm_input, module, args)
        probe.state.used.add(id(module))
        self.stack.append(module)

    def _forward_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        probe = self.probe
        if probe.state.busy:
            return
        if self.stack and self.stack[-1] is module:
            self.stack.pop()
        if (
            id(module) not in self.leaf_order
            and next(module.children(), None) is None
            and next(module.parameters(recurse=False), None) is not None
        ):
            self.leaf_order[id(module)] = module
        events = probe.facts.events
        if not events.get("nonfinite-forward"):
            if len(self.calls) > 20000:
                self.calls.clear()
            self.calls.append((module, args, output))
        probe.track(output)
        if not self.stack:
            if not events.get("nonfinite-forward") and any(is_nonfinite(t) for t in tensors_in(output)):
                probe.safely(self.scan_calls)
            if len(self.root_outputs) > 5000:
                self.root_outputs = {k: v for k, v in self.root_outputs.items() if v[0]() is not None}
            for t in tensors_in(output):
                if has_graph(t):
                    self.root_outputs[id(t)] = (weakref.ref(t), probe.next_step)

    def _root_label(self, module: torch.nn.Module) -> str:
        """The variable that holds a model; a layer of a model already seen, called from a method
        (``model.decode(z)`` runs ``self.fc4`` outside any forward), is named inside that model."""
        if any(sub is module for root, _ in self.probe.state.roots.values() for sub in root.modules()):
            return self.probe.name_of(module)
        return variable_name(module, user_frame()) or type(module).__name__

    def _root_call(self, module: torch.nn.Module, args: Any) -> None:
        probe = self.probe
        events, step = probe.facts.events, probe.next_step
        if id(module) not in probe.state.roots:
            probe.state.roots[id(module)] = (module, self._root_label(module))
        probe.emit("model_called", module, args)
        if not torch.is_grad_enabled() and module.training and len(events.get("eval-in-train-mode", [])) < 5:
            active = [
                probe.name_of(m)
                for m in module.modules()
                if m.training and ((isinstance(m, _DROPOUT) and m.p > 0) or isinstance(m, _BN))
            ]
            site = user_site()
            if active and site is not None:
                probe.record(
                    "eval-in-train-mode",
                    EvalInTrainMode(
                        module=probe.name_of(module),
                        step=step,
                        train_mode_layers=active[:10],
                        inference_mode=torch.is_inference_mode_enabled(),
                        **site,
                    ),
                )
        for i, t in enumerate(tensors_in(args)):
            ref, made = self.root_outputs.get(id(t), (None, None))
            if (
                ref is not None
                and ref() is t
                and t.grad_fn is not None
                and made <= probe.facts.steps
                and not events.get("carried-state")
            ):
                probe.record(
                    "carried-state",
                    CarriedState(
                        module=probe.name_of(module),
                        argument=i,
                        made_at_step=made,
                        step=step,
                        variable=variable_name(t, user_frame()),
                        **(user_site() or {}),
                    ),
                )
        if not events.get("nonfinite-input"):
            for i, t in enumerate(tensors_in(args)):
                if is_nonfinite(t) and t.grad_fn is None and not t.requires_grad:
                    probe.record(
                        "nonfinite-input",
                        NonfiniteInput(
                            module=probe.name_of(module),
                            argument=i,
                            step=step,
                            **nonfinite_layout(t),
                            **(user_site() or {}),
                        ),
                    )
                    break

    def _batchnorm_input(self, module: torch.nn.Module, args: Any) -> None:
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is None or x.dim() < 2 or x.shape[0] != 1:
            return
        probe = self.probe
        probe.record(
            "batchnorm-batch-one",
            BatchnormBatchOne(
                module=probe.name_of(module),
                step=probe.next_step,
                input_shape=list(x.shape),
                values_per_channel=x.numel() // max(x.shape[1], 1),
                loader=probe.state.current_loader(),
                **(user_site() or {}),
            ),
        )

    # ---------------------------------------------------------------- non-finite outputs
    def scan_calls(self) -> None:
        """The step went non-finite: find the first module call (inner modules finish first)
        whose output is non-finite while its inputs are finite. Outputs are checked only now, not
        on every call: a healthy run pays one check per top-level call."""
        calls, self.calls = self.calls, []
        for module, args, output in calls:
            if self.probe.facts.events.get("nonfinite-forward"):
                break
            self._check_output(module, args, output)

    def _check_output(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        outs = [t for t in tensors_in(output) if t.is_floating_point()]
        if not any(is_nonfinite(t) for t in outs):
            return
        if any(is_nonfinite(t) for t in tensors_in(args)):
            return  # not where it started: an earlier op or the batch made it non-finite
        probe = self.probe
        bad_params = [n for n, p in module.named_parameters() if is_nonfinite(p)]
        event = NonfiniteForward(
            module=probe.name_of(module),
            module_class=type(module).__name__,
            step=probe.next_step,
            params_nonfinite=bad_params[:10],
            training=module.training,
            output=nonfinite_layout(next(t for t in outs if is_nonfinite(t))),
        )
        if not bad_params:
            event["op"] = self._replay_for_op(module, args)
        probe.record("nonfinite-forward", event)

    def _replay_for_op(self, module: torch.nn.Module, args: Any) -> dict[str, Any] | None:
        """Run the module again on the same input under an op tracer, leaving no trace, to name the
        first op inside it whose output went non-finite from finite inputs."""
        tracer = FirstNonfiniteOp()
        try:
            with leaving_no_trace(module), torch.no_grad(), tracer:
                module(*args) if isinstance(args, tuple) else module(args)
        except Exception:  # noqa: BLE001 - a replay that fails names nothing
            pass
        return tracer.found

    def check_op(self, func: Callable, args: Any, kwargs: dict, out: Any) -> None:
        """An op outside modules (the loss computation): the first whose output goes non-finite."""
        probe = self.probe
        if probe.state.step_nonfinite_op is not None or allocates_uninitialized(func):
            return
        outs = [t for t in tensors_in(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if not outs or not any(is_nonfinite(t) for t in outs):
            return
        inputs = tensors_in(list(args) + list(kwargs.values()))
        if any(nonfinite_scalar(a) for a in list(args) + list(kwargs.values())):
            return  # deliberate: a mask filled with -inf, torch.full(..., nan)
        bad_inputs = [t for t in inputs if is_nonfinite(t)]
        site = user_site()
        if site is None:
            return
        step = probe.next_step
        if not bad_inputs:
            probe.state.step_nonfinite_op = {"op": op_name(func), "step": step, **site}
        elif all(t.grad_fn is None and not t.requires_grad for t in bad_inputs) and not probe.facts.events.get(
            "nonfinite-input"
        ):
            probe.state.step_nonfinite_op = {"op": op_name(func), "step": step, "from_data": True, **site}
            probe.record(
                "nonfinite-input",
                NonfiniteInput(op=op_name(func), step=step, **nonfinite_layout(bad_inputs[0]), **site),
            )

    def finish(self) -> None:
        """The order in which leaf layers with parameters first ran, by name."""
        self.probe.facts.layer_order = [self.probe.name_of(m) for m in self.leaf_order.values()]
