"""``keel diagnose`` on its corpus: each faulty script's root cause is named first with its
evidence, and the clean controls raise no alarm. The default suite runs one script per named
finding id, one per invariant family, and the controls closest to a fault; ``slow`` runs the whole
corpus with the reproducibility check everywhere."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from diagcorpus import EXPECTED, diagnose_all, verdict

from torchkeel.diagnose.findings import FINDING_IDS
from torchkeel.diagnose.invariants import FAMILIES

SCHEMA = json.loads((Path(__file__).resolve().parents[2] / "docs" / "diagnose.schema.json").read_text())
FAULTS = sorted(n for n, e in EXPECTED.items() if e is not None)
CONTROLS = sorted(n for n, e in EXPECTED.items() if e is None)
# One script per id (the first in name order) and the two controls closest to a fault (deliberate
# accumulation, a GAN's second backward): the default suite's short form.
SHORT_CONTROLS = ["clean_accumulation.py", "clean_gan.py"]
# The controls of the findings for training that runs and learns badly (each next to its fault).
HABIT_CONTROLS = [
    "clean_dropout_functional.py",
    "clean_mc_dropout.py",
    "clean_finetune_loaded.py",
    "clean_frozen_embedding.py",
    "clean_frozen_transformers.py",
    "clean_multitask.py",
    "clean_sorted_shuffled.py",
    "clean_epoch_item.py",
    "clean_gan_dcgan.py",
    "clean_two_stage.py",
    "clean_clip.py",
    "clean_scheduler_per_step.py",
    "clean_accumulation_divided.py",
    "clean_train_after_eval.py",
    "clean_attention_time.py",
    "clean_features_standardized.py",
    "clean_augmentation_train_only.py",
    "clean_eval_on_purpose.py",
    "clean_from_pretrained_train.py",
]
# Forms first missed on held-out public scripts, with their controls (an LSTM fed 0-255 pixel rows).
HELD_OUT_FORMS = ["input_scale_sequence.py", "clean_sequence_scaled.py"]
# Invariant findings: one script per family in the short form (the ranking across families, end to
# end); each invariant's own listener and detector are proved by tests/diagnose/test_invariants_*.py,
# and the slow run takes every script.
FIRST_OF_FAMILY = {family.IDS[0] for family in FAMILIES}
ONE_PER_ID = sorted({EXPECTED[n]["id"]: n for n in reversed(FAULTS)}.items())
SHORT = (
    [n for i, n in ONE_PER_ID if not i.startswith("invariant-") or i in FIRST_OF_FAMILY]
    + SHORT_CONTROLS
    + HABIT_CONTROLS
    + HELD_OUT_FORMS
)
NONDET = {n for n in FAULTS if EXPECTED[n]["id"] == "nondeterministic"}


def test_corpus_covers_every_runtime_id_and_enough_controls():
    covered = {EXPECTED[n]["id"] for n in FAULTS}
    runtime = set(FINDING_IDS) - {"graph-break", "recompile", "script-error"}
    assert runtime - covered == set()
    assert len(FAULTS) >= 30 and len(CONTROLS) >= 8


@pytest.fixture(scope="module")
def short_reports():
    return diagnose_all(SHORT, repro_for=NONDET | set(SHORT_CONTROLS))


@pytest.mark.timeout(900)  # the first test also runs the fixture: about 70 scripts, two at a time
@pytest.mark.parametrize("name", SHORT)
def test_short_corpus(name, short_reports):
    report, code, _ = short_reports[name]
    jsonschema.validate(report, SCHEMA)
    ok, why = verdict(name, report)
    assert ok, f"{name}: {why}"
    has_error = any(f["severity"] == "error" for f in report["findings"])
    assert code == (1 if has_error else 0)


@pytest.mark.slow
@pytest.mark.timeout(1200)  # about 120 scripts, two at a time, each with its reproducibility run
def test_whole_corpus_meets_the_goals():
    reports = diagnose_all(sorted(EXPECTED))
    failures = {}
    for name, (report, _, _) in reports.items():
        jsonschema.validate(report, SCHEMA)
        ok, why = verdict(name, report)
        if not ok:
            failures[name] = why
    named = sum(1 for n in FAULTS if n not in failures)
    alarms = sum(1 for n in CONTROLS if n in failures)
    print(f"faults named first with evidence: {named}/{len(FAULTS)}; false alarms: {alarms}/{len(CONTROLS)}")
    assert failures == {}
