"""``logging.wandb`` in offline mode, read back from the run's own ``.wandb`` file (the records
W&B would send): every metrics.jsonl scalar at its step, the config, incidents as tags, and the
run ended as the torchkeel run ended — completed, preempted (then resumed into the same run), failed."""

from __future__ import annotations

import json
import signal
import struct
import sys
from pathlib import Path

import pytest

wandb = pytest.importorskip("wandb")  # in the dev extra, which make setup installs
from test_loggers import BUSY, rows_of  # noqa: E402
from test_trainer_checkpoints import SignalAt  # noqa: E402
from wandb.proto import wandb_internal_pb2  # noqa: E402

import torchkeel as tk  # noqa: E402
from torchkeel.errors import MissingExtraError  # noqa: E402
from torchkeel.train.tracking import WandbLogger  # noqa: E402

BLOCK, HEADER = 32768, 7


def records(path: Path) -> list:
    """The protobuf records of a ``.wandb`` file: a 7-byte file header (``:W&B``, magic, version),
    then LevelDB log blocks of 32 KiB, each record in pieces with a 7-byte header (CRC, length,
    type 1 full / 2 first / 3 middle / 4 last)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    out, pos, pieces = [], HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if kind == 0 and length == 0:  # the zeros at a block's end
            pos += left
            continue
        pieces += data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            out.append(record)
            pieces = b""
    return out


class Offline:
    """What a run directory's W&B offline runs hold (each start of the run writes one)."""

    def __init__(self, run_dir: Path) -> None:
        files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
        assert files, "no offline W&B run written"
        self.files = files
        self.runs = [records(f) for f in files]

    def of(self, kind: str, index: int = -1) -> list:
        return [getattr(r, kind) for r in self.runs[index] if r.WhichOneof("record_type") == kind]

    def history(self, key: str) -> list[tuple[int, float]]:
        rows = []
        for run in self.runs:
            for r in run:
                if r.WhichOneof("record_type") == "history":
                    items = {i.key or "/".join(i.nested_key): i.value_json for i in r.history.item}
                    if key in items:
                        rows.append((int(items["step"]), float(items[key])))
        return rows

    def summary(self) -> dict[str, str]:
        values: dict[str, str] = {}
        for s in self.of("summary"):
            values.update({i.key or "/".join(i.nested_key): i.value_json for i in s.update})
        return values


@pytest.fixture(autouse=True)
def _no_wandb_account(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))  # anything W&B writes outside the run directory
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def test_every_scalar_the_config_and_the_incidents_reach_wandb(tiny_config):
    trainer = tk.Trainer(tiny_config("logging.wandb.project=team", *BUSY), progress=False)
    trainer.fit()
    offline = Offline(trainer.run_dir)
    run = offline.of("run")[0]  # later run records carry what changed (the tags)
    assert run.project == "team" and run.display_name == "tiny"
    assert run.run_id == (trainer.run_dir / "wandb_run_id").read_text()
    for kind, key in (("train", "loss"), ("train", "lr"), ("val", "val_loss"), ("memory", "rss_bytes")):
        expected = [(r["step"], r[key]) for r in rows_of(trainer.run_dir, kind)]
        got = offline.history(f"{kind}/{key}")
        assert [s for s, _ in got] == [s for s, _ in expected] and expected, key
        assert all(v == pytest.approx(w, rel=1e-9) for (_, v), (_, w) in zip(got, expected)), key
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["optim"]["lr"] == trainer.config.optim.lr and config["train"]["max_epochs"] == 2
    incidents = (trainer.run_dir / "incidents.jsonl").read_text().splitlines()
    tags = {t for r in offline.of("run") for t in r.tags}
    summary = offline.summary()
    assert tags == {"incident:memory"}
    assert summary["torchkeel.incidents"] == str(len(incidents)) and len(incidents) > 0
    assert summary["torchkeel.incident.0001"].startswith('"step 5 memory: ')
    (exit_record,) = offline.of("exit")
    assert exit_record.exit_code == 0


def test_a_preempted_run_is_marked_then_resumed_into_the_same_wandb_run(tiny_config):
    first = tk.Trainer(tiny_config("logging.wandb.mode=offline"), model=SignalAt(9, signal.SIGTERM), progress=False)
    assert first.fit()["status"] == "preempted"
    offline = Offline(first.run_dir)
    assert offline.of("preempting") and offline.of("exit")[0].exit_code == 143
    run_id = (first.run_dir / "wandb_run_id").read_text()
    second = tk.Trainer(
        tiny_config("logging.wandb.mode=offline"), model=SignalAt(0, signal.SIGTERM), resume="auto", progress=False
    )
    assert second.fit()["status"] == "completed"
    offline = Offline(second.run_dir)
    assert len(offline.files) == 2 and {r.run_id for i in (0, 1) for r in offline.of("run", i)} == {run_id}
    assert offline.of("exit")[0].exit_code == 0
    steps = [s for s, _ in offline.history("train/loss")]
    assert max(steps) == max(r["step"] for r in rows_of(second.run_dir, "train"))


def test_a_failed_run_fails_in_wandb(tiny_config):
    from test_mlflow import Exploding

    trainer = tk.Trainer(tiny_config("logging.wandb.mode=offline"), model=Exploding(), progress=False)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit()
    assert Offline(trainer.run_dir).of("exit")[0].exit_code == 1


def test_without_wandb_the_error_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(
        MissingExtraError, match=r"logging.wandb needs the 'wandb' package: pip install 'torchkeel\[wandb\]'"
    ):
        WandbLogger(tmp_path, {"name": "x"})
