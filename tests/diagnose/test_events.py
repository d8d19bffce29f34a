"""Every event the probe records is of a kind ``diagnose.events`` defines, with only the keys its
definition declares: the probe and the detectors read one description of each event."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from torchkeel.diagnose.events import KINDS
from torchkeel.diagnose.probe import Probe
from torchkeel.diagnose.runner import run_script

CORPUS = Path(__file__).parent / "corpus"
# Scripts that between them record most kinds (labels, in-place, double steps, non-finite forward,
# gradients and inputs, batch norm, eval in train mode, carried state, a loss without a graph).
SCRIPTS = [
    "label_oor_bce.py",
    "inplace_sigmoid.py",
    "double_step_accum.py",
    "nonfinite_forward_log.py",
    "nonfinite_grad_distance.py",
    "bn_batch_one.py",
    "eval_train_mode.py",
    "leaked_graph_hidden.py",
    "grad_none_no_grad_forward.py",
    "nonfinite_input_dataset.py",
    "repeated_backward.py",
    "dropout_always_on.py",
    "unshuffled_sorted_labels.py",
    "inplace_gan_step.py",
    "nonfinite_loss_then_crash.py",
]


def test_every_recorded_event_matches_its_definition(monkeypatch):
    monkeypatch.chdir(CORPUS)
    recorded: set[str] = set()
    for script in SCRIPTS:
        probe = Probe(max_steps=30)
        run_script(os.fspath(CORPUS / script), [], probe, timeout_s=60)
        for kind, events in probe.facts.events.items():
            assert kind in KINDS, f"{script}: kind {kind!r} has no definition in diagnose.events"
            declared = KINDS[kind].__required_keys__ | KINDS[kind].__optional_keys__
            for event in events:
                assert set(event) <= declared, f"{script}: {kind} has undeclared keys {set(event) - declared}"
                assert KINDS[kind].__required_keys__ <= set(event), f"{script}: {kind} lacks required keys"
            recorded |= {kind} if events else set()
    assert len(recorded) >= 9, f"the scripts recorded too few kinds to check the definitions: {sorted(recorded)}"


def test_facts_first_takes_a_definition_or_its_name():
    from torchkeel.diagnose.events import LabelOutOfRange
    from torchkeel.diagnose.probe import Facts

    facts = Facts(events={"label-out-of-range": [{"step": 1, "loss": "nll_loss"}]})
    assert facts.first(LabelOutOfRange) == facts.first("label-out-of-range") == {"step": 1, "loss": "nll_loss"}
    with pytest.raises(KeyError):
        facts.first(dict)
