"""The data invariants: the row hash, where each detector draws its line on facts written by
hand, and the listener inside a probe around a hand-written loop."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from torchkeel.diagnose.invariants import data
from torchkeel.diagnose.probe import Facts, Probe
from torchkeel.diagnose.runner import ScriptOutcome

OK = ScriptOutcome(path="train.py", argv=[])


def hashes(x: torch.Tensor) -> list[int]:
    return data.Listener(Probe()).row_hashes(x)


def test_equal_rows_hash_equal_and_different_rows_differ_for_every_dtype():
    base = torch.randn(6, 3, 5)
    x = torch.cat([base, base[:2]])
    for t in (x, x.half(), x.double(), (x * 100).long(), x > 0):
        h = hashes(t)
        assert h[6:] == h[:2]
    assert len(set(hashes(base))) == 6
    wide = torch.randn(4, 10_000)  # wider than the hashed part: still one hash per row, equal for equal rows
    assert len(set(hashes(torch.cat([wide, wide])))) == 4


def overlap(rows_in_training: int, names: list[str] | None = None) -> Facts:
    f = Facts()
    f.invariants["data"] = {
        "overlaps": [
            {
                "loader": (names or ["val_loader"])[-1],
                "names": names or ["val_loader"],
                "dataset_class": "Subset",
                "dataset_size": 200,
                "eval_rows": 600,
                "rows_compared": 200,
                "rows_in_training": rows_in_training,
                "train_loaders": [{"loader": "train_loader", "dataset_class": "Subset"}],
                "step": 21,
                "site": {"file": "train.py", "line": 9},
            }
        ]
    }
    return f


def test_evaluation_rows_that_are_training_rows_warn_from_half_on_unless_the_loader_is_named_for_training():
    (found,) = data.eval_overlaps_train(overlap(100), OK)
    assert found.severity == "warning"
    assert found.evidence["loader"] == "val_loader" and found.evidence["train_loaders"] == ["train_loader"]
    assert found.evidence["share"] == 0.5 and found.evidence["line"] == 9
    assert data.eval_overlaps_train(overlap(99), OK) == []
    assert data.eval_overlaps_train(overlap(200, ["loader", "train_eval_loader"]), OK) == []
    f = overlap(200, ["memory_loader"])
    held_out = dict(
        f.invariants["data"]["overlaps"][0], loader="test_loader", names=["test_loader"], rows_in_training=0
    )
    f.invariants["data"]["overlaps"].append(held_out)
    (suspicion,) = data.eval_overlaps_train(f, OK)  # with a held-out loader beside it: only a suspicion
    assert suspicion.severity == "info" and suspicion.evidence["held_out_loaders"] == ["test_loader"]


def test_labels_that_change_for_the_same_rows_warn_from_a_fifth_of_the_rows_seen_again():
    def facts(changed: int, compared: int = 100) -> Facts:
        f = Facts()
        rec = {"loader": "loader", "names": ["loader"], "dataset_class": "Digits", "dataset_size": 100}
        f.invariants["data"] = {"labels": [dict(rec, rows_compared=compared, rows_changed=changed)]}
        return f

    (found,) = data.labels_change(facts(20), OK)
    assert found.severity == "warning" and found.evidence["rows_changed"] == 20
    assert data.labels_change(facts(19), OK) == []
    assert data.labels_change(facts(40, compared=49), OK) == []  # too few rows seen again to tell


def test_one_class_and_identical_rows_need_enough_batches():
    f = Facts()
    classes = {"batches": 20, "targets": 640, "values": [0], "loader": {"loader": "loader", "dataset_class": "D"}}
    same = {"sampled": 10, "identical": 9, "steps": [1, 2], "module": "model", "shape": [32, 4], "site": None}
    f.invariants["data"] = {"classes": classes, "identical": dict(same, max_abs=0.0)}
    assert [x.id for x in data.one_class(f, OK)] == ["invariant-one-class"]
    assert [x.id for x in data.identical_inputs(f, OK)] == ["invariant-identical-inputs"]
    f.invariants["data"] = {"classes": dict(classes, batches=19), "identical": dict(same, identical=8, max_abs=0.0)}
    assert data.one_class(f, OK) == [] and data.identical_inputs(f, OK) == []
    f.invariants["data"] = {"classes": dict(classes, values=[0, 1]), "identical": dict(same, sampled=4, max_abs=0.0)}
    assert data.one_class(f, OK) == [] and data.identical_inputs(f, OK) == []


def train_and_evaluate(val_rows: slice, shuffled_labels: bool) -> dict:
    x = torch.randn(320, 6)
    y = (x[:, 0] > 0).long()
    train_loader = DataLoader(TensorDataset(x[:256], y[:256]), batch_size=32, shuffle=True)
    val_loader = DataLoader(TensorDataset(x[val_rows], y[val_rows]), batch_size=64)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Probe() as probe:
        for _ in range(2):
            for xb, yb in train_loader:
                if shuffled_labels:
                    yb = yb[torch.randperm(len(yb))]
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(xb), yb).backward()
                optimizer.step()
            with torch.no_grad():
                for xb, _ in val_loader:
                    model(xb)
    return probe.facts.invariants["data"]


def test_the_listener_finds_training_rows_in_evaluation_and_labels_shuffled_apart_from_their_rows():
    found = train_and_evaluate(slice(0, 128), shuffled_labels=True)
    (overlap_rec,) = found["overlaps"]
    assert (
        overlap_rec["loader"] == "val_loader" and overlap_rec["rows_in_training"] == overlap_rec["rows_compared"] == 128
    )
    (labels,) = found["labels"]
    assert labels["rows_compared"] == 256 and labels["rows_changed"] > 0.2 * 256
    healthy = train_and_evaluate(slice(256, 320), shuffled_labels=False)
    assert healthy["overlaps"][0]["rows_in_training"] == 0
    assert healthy["labels"][0]["rows_changed"] == 0 and healthy["classes"]["values"] == [0, 1]


class Scorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 2)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear(features)


def test_a_model_called_by_keyword_is_seen_through_the_loaders_batch():
    rows = [{"features": torch.randn(6), "label": i % 2} for i in range(96)]
    train_loader = DataLoader(rows, batch_size=16, shuffle=True)
    val_loader = DataLoader(rows[:48], batch_size=16)
    model = Scorer()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Probe() as probe:
        for batch in train_loader:
            label = batch.pop("label")
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(**batch), label).backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            for batch in val_loader:
                model(features=batch["features"])
    (rec,) = probe.facts.invariants["data"]["overlaps"]
    assert rec["loader"] == "val_loader" and rec["rows_in_training"] == rec["rows_compared"] == 48


def test_labels_at_chance_among_neighbours_are_uninformative_only_while_the_loss_does_not_learn():
    def facts(z: float, late: float) -> Facts:
        f = Facts()
        rec = {"rows": 512, "agreement": 0.26, "chance": 0.25, "entropy": 1.386, "z": z, "site": None}
        f.invariants["data"] = {"neighbours": dict(rec, loader="loader", dataset_class="TensorDataset")}
        f.losses = [{"step": i + 1, "value": 1.45 if i < 5 else late} for i in range(60)]
        return f

    (found,) = data.labels_uninformative(facts(z=0.5, late=1.40), OK)
    assert found.severity == "warning" and found.evidence["neighbour_agreement"] == 0.26
    assert data.labels_uninformative(facts(z=2.5, late=1.40), OK)  # a chance draw: mutual pairs count twice
    assert data.labels_uninformative(facts(z=5.0, late=1.40), OK) == []  # neighbours share labels
    assert data.labels_uninformative(facts(z=0.5, late=1.05), OK) == []  # the loss learns
    several = facts(z=0.5, late=1.40)
    several.optimizers = [{"class": "SGD"}, {"class": "SGD"}]
    assert data.labels_uninformative(several, OK) == []


def test_the_neighbour_agreement_is_high_for_clustered_labels_and_at_chance_for_shuffled_ones():
    centers = torch.randn(4, 16) * 3
    classes = torch.randint(0, 4, (512,))
    points = centers[classes] + torch.randn(512, 16)
    paired = data._neighbour_agreement({"rows": [points], "labels": classes.tolist(), "site": None, "loader": None})
    assert paired["agreement"] > 0.9 and paired["z"] > 10
    shuffled = classes[torch.randperm(512)].tolist()
    apart = data._neighbour_agreement({"rows": [points], "labels": shuffled, "site": None, "loader": None})
    assert abs(apart["agreement"] - apart["chance"]) < 0.1 and apart["z"] < 4
