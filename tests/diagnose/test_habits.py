"""The detectors of training that runs and learns badly, on facts written by hand: where each
draws its line (a loss that spikes and recovers is no divergence, imbalanced but shuffled labels
are not ordered), and how ``judge`` puts a cause before the crash it led to."""

from __future__ import annotations

from torchkeel.diagnose.detectors import judge
from torchkeel.diagnose.habit_detectors import frozen_parameters, lr_divergence, unshuffled_ordered_labels
from torchkeel.diagnose.probe import Facts
from torchkeel.diagnose.runner import ScriptOutcome

OK = ScriptOutcome(path="train.py", argv=[])


def facts_with_losses(values: list[float], lr: float = 0.5) -> Facts:
    f = Facts(steps=len(values), backward_calls=len(values))
    f.losses = [{"step": i + 1, "value": v} for i, v in enumerate(values)]
    f.optimizers = [
        {
            "index": 0,
            "class": "SGD",
            "num_params": 2,
            "num_trainable": 2,
            "lrs": [lr],
            "num_model_params": 2,
            "grad_none": [],
            "grad_none_steps": 3,
            "moved": [True] * 5,
        }
    ]
    f.grad_norms = [
        {"step": i + 1, "lrs": [lr], "optimizer": 0, "total": 1.0, "layers": {}} for i in range(len(values))
    ]
    return f


def test_a_loss_that_climbs_by_orders_of_magnitude_is_divergence_from_where_it_began():
    (found,) = lr_divergence(facts_with_losses([2.3, 2.2, 9.0, 3e3, 2e7, 1.7e9, float("nan")], lr=3.0), OK)
    assert found.id == "lr-divergence" and found.severity == "error"
    assert found.evidence["began_step"] == 3 and found.evidence["peak_step"] == 6
    assert found.evidence["lrs"] == [3.0] and found.evidence["went_nonfinite"] is True


def test_a_spike_that_recovers_or_a_falling_loss_is_not_divergence():
    assert lr_divergence(facts_with_losses([2.3, 40.0, 5.0, 1.2, 0.9, 0.7]), OK) == []
    assert lr_divergence(facts_with_losses([2.3, 2.1, 9e3, 1.9, 1.7, 1.5]), OK) == []  # one bad batch
    # Two players' losses interleaved, one drifting far above the other's first value: no climb.
    wgan = [0.01, 0.5, 0.02, 40.0, 0.01, 12.0, 0.03, 35.0, 0.02, 20.0]
    assert lr_divergence(facts_with_losses(wgan), OK) == []
    assert lr_divergence(facts_with_losses([2.3, 1.9, 1.5, 1.2, 0.9]), OK) == []
    assert lr_divergence(facts_with_losses([2.3, float("nan")]), OK) == []


def labels(classes_per_batch: list[list[int]], shuffle: bool | None) -> Facts:
    f = Facts(steps=len(classes_per_batch))
    f.events["batch-labels"] = [
        {"step": i + 1, "classes": c, "num_classes": len(c), "size": 16} for i, c in enumerate(classes_per_batch)
    ]
    f.data = {"loaders": [{"dataset_class": "Folder", "batches": len(classes_per_batch), "shuffle": shuffle}]}
    return f


def test_batches_of_one_class_in_runs_from_an_unshuffled_loader_are_named():
    runs = [[0]] * 4 + [[1]] * 4 + [[2]] * 4
    (found,) = unshuffled_ordered_labels(labels(runs, shuffle=False), OK)
    assert found.severity == "error" and found.evidence["dataset_class"] == "Folder"
    assert found.evidence["class_order"][:5] == [0, 0, 0, 0, 1]


def test_sorted_data_whose_batches_straddle_two_classes_is_named_too():
    straddling = [[0, 1], [1, 2], [2], [2, 3], [3, 4], [4, 5], [5], [5, 6], [6, 7], [7, 8], [8, 9], [9]]
    (found,) = unshuffled_ordered_labels(labels(straddling, shuffle=False), OK)
    assert found.evidence["class_order"][:4] == [0, 1, 2, 2]


def test_imbalanced_shuffled_batches_and_mixed_batches_are_quiet():
    # 95 % negatives: most batches hold one class, but always the same one.
    assert unshuffled_ordered_labels(labels([[0]] * 10 + [[0, 1]] * 2, shuffle=True), OK) == []
    assert unshuffled_ordered_labels(labels([[0, 1, 2]] * 12, shuffle=False), OK) == []
    # Classes that alternate batch by batch are not runs of a sorted dataset.
    assert unshuffled_ordered_labels(labels([[0], [1]] * 6, shuffle=None), OK) == []


def test_frozen_parameters_need_an_optimizer_that_also_trains_something():
    f = Facts()
    f.frozen = {"parameters": [{"parameter": "model.fc.weight", "module": "model.fc"}], "trainable_in_optimizers": 1}
    (found,) = frozen_parameters(f, OK)
    assert found.severity == "warning" and found.evidence["modules"] == ["model.fc"]
    f.frozen["trainable_in_optimizers"] = 0  # nothing trains at all: params-not-updating says so
    assert frozen_parameters(f, OK) == []


def test_the_crash_comes_after_the_finding_that_explains_it():
    f = facts_with_losses([2.3, 2.2, 9.0, 3e3, 2e7, 1.7e9])
    crashed = ScriptOutcome(
        path="train.py",
        argv=[],
        exit_status=1,
        error={"type": "RuntimeError", "message": "probability tensor contains nan", "file": "train.py", "line": 9},
    )
    assert [x.id for x in judge(f, crashed)] == ["lr-divergence", "script-error"]
    assert [x.id for x in judge(facts_with_losses([2.3, 2.0, 1.8]), crashed)] == ["script-error"]
