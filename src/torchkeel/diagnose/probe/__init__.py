"""Instrumentation of an unmodified script: what its modules, optimizers, backward passes and
data loaders did, collected once as plain data (``Facts``) for the detectors to judge.

This is the one place in torchkeel that patches torch, and only while a script runs under
``keel diagnose``. Everything here observes: values are read (host syncs are fine, this is a
diagnosis) but never changed, every original function is still called with the same
arguments, and the script's own exceptions pass through untouched. One listener per concern,
each owning its state. ``core.Probe`` installs them; what several of them read or write is one
``state.ProbeState``, and what one tells the others is an event the probe dispatches
(``Probe.emit``, ``state.EVENTS``: a step begins or ends, a backward pass ran, a batch was
fetched...), so that no listener calls another's methods:

- ``modules``: global module forward pre/post hooks (names, call order, non-finite outputs,
  inputs of the top-level call, BatchNorm batch sizes, no_grad calls in train mode), and a
  ``TorchFunctionMode`` that looks at cross-entropy/NLL arguments and, outside modules, at the
  ops of the loss computation (the first op that turns finite values non-finite);
- ``backward``: a wrapper of ``torch.autograd.backward`` (losses, non-finite gradients and the
  backward op that made them, in-place errors, graphs used twice);
- ``optim``: global optimizer step pre/post hooks (steps per backward, parameters without
  gradients, per-layer gradient norms, whether the weights moved, censuses of live autograd
  graphs, gradients left over from the previous step) and the ``zero_grad`` count;
- ``data``: the DataLoader iterator (time waiting on data);
- ``seeds``: the seed functions, and whether the global RNGs were drawn from;
- ``habits``: functional dropout left on in eval mode, the class order of training batches,
  and which modules had weights loaded (frozen parameters that were never loaded).

Autograd anomaly mode (without its NaN check, which would raise where the script does not)
records the forward stack of every op during the first ``anomaly_steps`` steps, so an in-place
error or a bad gradient there can be traced to the user's line.
"""

from torchkeel.diagnose.probe.core import Probe
from torchkeel.diagnose.probe.facts import Facts, StopScript

__all__ = ["Facts", "Probe", "StopScript"]
