"""Invariants: randomness (see ``diagnose.invariants``).

What every healthy run's random state satisfies, whatever its fault: draws do not repeat.

- A global generator (torch's CPU generator, CUDA's, NumPy's, Python's) never comes back to a state
  it was in at an earlier step after it was drawn from, within one training (the same optimizers):
  the same dropout masks, noise and shuffles would repeat (a ``torch.manual_seed(0)`` inside the
  loop). Each generator's state is fingerprinted (a hash of its bytes, a few microseconds) at the
  start of sampled optimizer steps (the first ``_SAMPLED_FIRST``, then every ``_SAMPLE_EVERY``-th).
  A state seen again counts as a repeat when the generator was drawn from in between: the state
  changed between the two, or a seed call reset it there and draws moved it on from the seeded
  state (its fingerprint is not the freshly seeded one).
- A generator is not made again and again with one constant seed during training (a
  ``np.random.default_rng(0)`` or ``random.Random(0)`` per ``__getitem__``, a seed call per step):
  every sample, or every step, would get the same draws. The seed functions (``torch.manual_seed``,
  ``np.random.seed``/``default_rng``, ``random.seed``, ``random.Random(seed)``) are wrapped over
  the seed listener's wrappers; the calls made after the first step while training (not under
  ``no_grad`` or with every model in eval: a fixed evaluation crop is deliberate) are counted per
  line: one constant value, at least ``_MIN_RESEEDS`` times and at least once every other step.
  Calls inside DataLoader workers (other processes) are not seen.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from torchkeel.diagnose.findings import Finding, site_fields
from torchkeel.introspect.sites import site_text, user_frame, user_site

if TYPE_CHECKING:
    from torchkeel.diagnose.probe.core import Probe

FAMILY = "randomness"

_SAMPLED_FIRST = 64
_SAMPLE_EVERY = 4
_MAX_STATES = 10_000  # fingerprints kept per generator
_GLOBAL = ("torch.manual_seed", "numpy.random.seed", "random.seed")  # seed calls that reset a global generator
_MIN_REPEATS = 2  # a state seen three times, or two states seen again
_MIN_RESEEDS = 16
_RESEEDS_PER_STEP = 0.5
# The seed call that resets each global generator.
_SEEDERS = {
    "torch": ("torch.manual_seed",),
    "cuda": ("torch.manual_seed",),
    "numpy": ("numpy.random.seed",),
    "random": ("random.seed",),
}


def _fingerprints() -> dict[str, int]:
    """A hash of each global generator's state."""
    state = np.random.get_state()
    found = {
        "torch": hash(torch.random.get_rng_state().numpy().tobytes()),
        "numpy": hash((state[1].tobytes(), *state[2:])),
        "random": hash(random.getstate()),
    }
    if torch.cuda.is_initialized():
        found["cuda"] = hash(torch.cuda.get_rng_state().numpy().tobytes())
    return found


def _seeded(generator: str, value: Any) -> int | None:
    """The fingerprint of ``generator`` right after seeding it with ``value`` (None: unknown)."""
    try:
        if generator == "torch":
            return hash(torch.Generator().manual_seed(int(value)).get_state().numpy().tobytes())
        if generator == "cuda":  # a CUDA generator's state: its seed, then its offset (0 when seeded)
            return hash((int(value) % 2**64).to_bytes(8, "little") + bytes(8))
        if generator == "numpy":
            state = np.random.RandomState(value).get_state()
            return hash((state[1].tobytes(), *state[2:]))
        if generator == "random":
            return hash(random.Random(value).getstate())
    except (TypeError, ValueError, OverflowError):
        return None
    return None


class Listener:
    """Fingerprints the global generators at sampled step starts; notes each seed call's line and context."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.seen: dict[str, dict[int, dict[str, Any]]] = {}  # generator -> fingerprint -> where last seen
        self.last: dict[str, int] = {}  # generator -> its previous fingerprint
        self.changed_at: dict[str, int] = {}  # generator -> the observation its fingerprint last changed
        self.observations = 0
        self.repeats: dict[str, dict[str, Any]] = {}
        self.loop_started = False
        self.resets: list[dict[str, Any]] = []  # global seed calls, with whether a model was evaluating
        self.by_site: dict[tuple, dict[str, Any]] = {}  # seed calls during the loop, per line

    def install(self) -> None:
        patch = self.probe.patch
        # Wrapped over the seed listener's own wrappers: these note the context of each call.
        patch(torch, "manual_seed", self._noting("torch.manual_seed", torch.manual_seed))
        patch(torch.random, "manual_seed", self._noting("torch.manual_seed", torch.random.manual_seed))
        patch(np.random, "seed", self._noting("numpy.random.seed", np.random.seed))
        patch(random, "seed", self._noting("random.seed", random.seed))
        patch(np.random, "default_rng", self._noting("numpy.random.default_rng", np.random.default_rng))
        patch(random.Random, "seed", self._noting("random.Random", random.Random.seed, method=True))

    def _noting(self, label: str, original: Callable, method: bool = False) -> Callable:
        listener, probe = self, self.probe

        def seed(*args: Any, **kwargs: Any) -> Any:
            values = args[1:] if method else args
            value = values[0] if values else kwargs.get("a" if method else "seed")
            if not probe.state.busy and not (method and type(args[0]) is not random.Random):
                probe.safely(listener._record, label, value, sys._getframe(1))
            return original(*args, **kwargs)

        return seed

    def _record(self, label: str, value: Any, frame: Any) -> None:
        site = user_site(frame)
        if site is None:
            return
        models = [m for m, _ in self.probe.state.roots.values()]
        evaluating = not torch.is_grad_enabled() or bool(models and not any(m.training for m in models))
        if label in _GLOBAL and len(self.resets) < _MAX_STATES:
            self.resets.append(
                {
                    "function": label,
                    "value": _plain(value),
                    "site": site,
                    "called_from": _caller(frame),
                    "evaluating": evaluating,
                }
            )
        if self.loop_started and value is not None:
            key = (label, site["file"], site["line"])
            entry = self.by_site.setdefault(
                key, {"function": label, "calls": 0, "training_calls": 0, "values": [], **site_fields(site)}
            )
            entry["calls"] += 1
            entry["training_calls"] += not evaluating
            if len(entry["values"]) < 3 and _plain(value) not in entry["values"]:
                entry["values"].append(_plain(value))

    def on_step_begins(self) -> None:
        if not self.probe.light:
            self.probe.safely(self._step_begins)  # emitted outside an observation: a bug here must not reach the script

    def _step_begins(self) -> None:
        probe = self.probe
        self.loop_started = True
        step = probe.next_step
        if step > _SAMPLED_FIRST and step % _SAMPLE_EVERY:
            return
        here = {
            "step": step,
            "index": self.observations,
            "calls": len(self.resets),
            "optimizers": len(probe.state.optimizers),
        }
        for generator, fingerprint in _fingerprints().items():
            self._observe(generator, fingerprint, here, self.resets)
        self.observations += 1

    def _observe(self, generator: str, fingerprint: int, here: dict[str, Any], calls: list[dict[str, Any]]) -> None:
        if self.last.get(generator) != fingerprint:
            self.changed_at[generator] = here["index"]
            self.last[generator] = fingerprint
        seen = self.seen.setdefault(generator, {})
        before = seen.get(fingerprint)
        if before is not None and before["optimizers"] == here["optimizers"]:
            resets = [c for c in calls[before["calls"] : here["calls"]] if c["function"] in _SEEDERS[generator]]
            moved_on = any(_seeded(generator, c["value"]) not in (None, fingerprint) for c in resets)
            if self.changed_at[generator] > before["index"] or moved_on:
                self._note_repeat(generator, before, here, resets)
        if fingerprint in seen or len(seen) < _MAX_STATES:
            seen[fingerprint] = dict(here, first_step=before["first_step"] if before else here["step"])

    def _note_repeat(
        self, generator: str, before: dict[str, Any], here: dict[str, Any], resets: list[dict[str, Any]]
    ) -> None:
        repeat = self.repeats.setdefault(
            generator, {"generator": generator, "repeats": 0, "steps": [], "first_step": before["first_step"]}
        )
        repeat["repeats"] += 1
        if len(repeat["steps"]) < 5:
            repeat["steps"].append([before["step"], here["step"]])
        repeat["evaluating"] = repeat.get("evaluating", True) and bool(resets) and all(c["evaluating"] for c in resets)
        if resets and "seed" not in repeat:
            call = resets[-1]
            repeat["seed"] = {"function": call["function"], "value": call["value"], **site_fields(call["site"] or {})}
            if call["called_from"]:
                repeat["seed"]["called_from"] = site_text(call["called_from"])

    def finish(self) -> None:
        self.probe.facts.invariants[FAMILY] = {
            "repeats": list(self.repeats.values()),
            "reseeds": sorted(self.by_site.values(), key=lambda e: -e["calls"])[:10],
            "steps": self.probe.facts.steps,
        }


def _caller(frame: Any) -> dict[str, Any] | None:
    """The user frame that called the user function holding ``frame``'s seed call (a ``set_seed()`` helper's caller)."""
    inner = user_frame(frame)
    outer = user_frame(inner.f_back) if inner is not None and inner.f_back is not None else None
    return user_site(outer) if outer is not None else None


def _plain(value: Any) -> Any:
    return value if value is None or isinstance(value, (int, float, str)) else repr(value)[:80]


# ---------------------------------------------------------------- detectors
def rng_reset(facts: Any, outcome: object) -> list[Finding]:
    """A global generator came back to an earlier step's state after being drawn from."""
    found = []
    for rec in facts.invariants.get(FAMILY, {}).get("repeats", []):
        if rec["repeats"] < _MIN_REPEATS:
            continue
        first, again = rec["steps"][0]
        seed = rec.get("seed")
        cause = (
            f"{seed['function']}({seed['value']!r}) at {seed['file']}:{seed['line']}"
            + (f" (called from {seed['called_from']})" if seed.get("called_from") else "")
            + " resets it"
            if seed and seed.get("file")
            else "its state is set back"
        )
        # Reset only while evaluating (fixed samples to compare): the training draws after it repeat,
        # a suspicion rather than clear evidence.
        evaluating = rec.get("evaluating", False)
        message = (
            f"the {rec['generator']} random generator was in the same state at step {again} as at step {first} "
            f"after drawing in between ({rec['repeats']} repeats): {cause} inside the loop"
            + (
                " while evaluating, so the training draws that follow each evaluation repeat"
                if evaluating
                else ", so the same dropout masks, noise and shuffles repeat"
            )
        )
        evidence = {
            "generator": rec["generator"],
            "steps": rec["steps"],
            "repeats": rec["repeats"],
            "threshold": _MIN_REPEATS,
            "period": again - first,
            "while_evaluating": evaluating,
        }
        if seed:
            evidence.update(function=seed["function"], value=seed["value"], **site_fields(seed))
            if seed.get("called_from"):
                evidence["called_from"] = seed["called_from"]
        fix = "seed once, before the loop (a seed per run, not per step or epoch); to vary it, seed with the step or epoch"
        found.append(Finding("invariant-rng-reset", "info" if evaluating else "warning", message, evidence, fix))
    return found


def rng_recreated(facts: Any, outcome: object) -> list[Finding]:
    """A generator made again and again during training with one constant seed."""
    data = facts.invariants.get(FAMILY, {})
    reset_sites = {(r["seed"].get("file"), r["seed"].get("line")) for r in data.get("repeats", []) if r.get("seed")}
    steps = max(data.get("steps", 0), 1)
    found = []
    for rec in data.get("reseeds", []):
        if len(rec["values"]) != 1 or rec["training_calls"] < max(_MIN_RESEEDS, _RESEEDS_PER_STEP * steps):
            continue
        if (rec["file"], rec["line"]) in reset_sites:
            continue  # already named as the reset of a global generator
        message = (
            f"{rec['function']}({rec['values'][0]!r}) at {rec['file']}:{rec['line']} ran {rec['training_calls']} times "
            f"while training in {steps} steps, always with the same seed: every generator it makes draws the same numbers, so each "
            "sample (or step) gets the same crops, noise or masks"
        )
        evidence = {
            "function": rec["function"],
            "value": rec["values"][0],
            "calls": rec["training_calls"],
            "steps": steps,
            "threshold_per_step": _RESEEDS_PER_STEP,
            **site_fields(rec),
        }
        fix = "make the generator once (or seed it from the sample index and epoch), not with a constant seed per use"
        found.append(Finding("invariant-rng-recreated", "warning", message, evidence, fix))
    return found[:2]


IDS: tuple[str, ...] = ("invariant-rng-reset", "invariant-rng-recreated")
DETECTORS: tuple = (rng_reset, rng_recreated)
EXPLAINED_BY: dict[str, set[str]] = {}
