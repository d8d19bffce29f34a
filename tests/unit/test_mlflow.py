"""``logging.mlflow``, read back with MLflow's own client from a local file store: every
metrics.jsonl scalar at its step, the config as params, incidents as tags, and the MLflow run
ended as the torchkeel run ended — completed, preempted (then resumed into the same run), failed."""

from __future__ import annotations

import signal
import sys

import pytest

mlflow = pytest.importorskip("mlflow")  # in the dev extra, which make setup installs
from mlflow import MlflowClient  # noqa: E402
from test_loggers import BUSY, rows_of  # noqa: E402
from test_trainer_checkpoints import SignalAt  # noqa: E402

import torchkeel as tk  # noqa: E402
from torchkeel.errors import ConfigError, MissingExtraError  # noqa: E402
from torchkeel.train.hooks import TrainerHooks  # noqa: E402
from torchkeel.train.tracking import MlflowLogger  # noqa: E402


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store for local use
    return f"file:{tmp_path / 'mlruns'}"


def the_run(store, trainer):
    run_id = (trainer.run_dir / "mlflow_run_id").read_text()
    return MlflowClient(tracking_uri=store), run_id


def test_every_scalar_the_config_and_the_incidents_reach_mlflow(tiny_config, store):
    trainer = tk.Trainer(tiny_config(f"logging.mlflow.tracking_uri={store}", *BUSY), progress=False)
    trainer.fit()
    client, run_id = the_run(store, trainer)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "tiny"
    assert client.get_experiment(run.info.experiment_id).name == "tiny"  # the run's name by default
    every = ("loss", "lr", "epoch", "wall_s")
    for kind, key in [("train", k) for k in every] + [("val", "val_loss"), ("val", "epoch"), ("memory", "rss_bytes")]:
        expected = [(r["step"], r[key]) for r in rows_of(trainer.run_dir, kind)]
        got = sorted((m.step, m.value) for m in client.get_metric_history(run_id, f"{kind}/{key}"))
        assert [s for s, _ in got] == [s for s, _ in expected] and expected, key
        assert all(v == pytest.approx(w, rel=1e-9) for (_, v), (_, w) in zip(got, expected)), key
    params = run.data.params
    assert params["optim.lr"] == str(trainer.config.optim.lr) and params["train.max_epochs"] == "2"
    incidents = (trainer.run_dir / "incidents.jsonl").read_text().splitlines()
    tags = {k: v for k, v in run.data.tags.items() if k.startswith("torchkeel.incident.")}
    assert len(tags) == len(incidents) > 0 and run.data.tags["torchkeel.incidents"] == str(len(incidents))
    assert tags["torchkeel.incident.0001"].startswith("step 5 memory: ")


def test_a_preempted_run_is_killed_then_resumed_into_the_same_mlflow_run(tiny_config, store):
    options = (f"logging.mlflow.tracking_uri={store}", "logging.mlflow.experiment=team")
    first = tk.Trainer(tiny_config(*options), model=SignalAt(9, signal.SIGTERM), progress=False)
    assert first.fit()["status"] == "preempted"
    client, run_id = the_run(store, first)
    assert client.get_run(run_id).info.status == "KILLED"
    second = tk.Trainer(tiny_config(*options), model=SignalAt(0, signal.SIGTERM), resume="auto", progress=False)
    assert second.fit()["status"] == "completed"
    assert the_run(store, second)[1] == run_id and client.get_run(run_id).info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(run_id, "train/loss")]
    assert max(steps) == max(r["step"] for r in rows_of(second.run_dir, "train"))
    # The run's seconds run on across the resume, to the whole run's wall_s.
    walls = [m.value for m in sorted(client.get_metric_history(run_id, "train/wall_s"), key=lambda m: m.step)]
    assert len(walls) == len(steps) and walls == sorted(walls)
    assert walls[-1] <= second.files.summary["wall_s"] and walls[-1] > first.files.summary["wall_s"]
    assert len(client.search_runs([client.get_experiment_by_name("team").experiment_id])) == 1


def test_a_failed_run_fails_in_mlflow(tiny_config, store):
    trainer = tk.Trainer(tiny_config(f"logging.mlflow.tracking_uri={store}"), model=Exploding(), progress=False)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit()
    client, run_id = the_run(store, trainer)
    assert client.get_run(run_id).info.status == "FAILED"


def test_without_mlflow_the_error_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(
        MissingExtraError, match=r"logging.mlflow needs the 'mlflow-skinny' package: pip install 'torchkeel\[mlflow\]'"
    ):
        MlflowLogger(tmp_path, {"name": "x"})


class Exploding(SignalAt):
    def __init__(self):
        super().__init__(0, signal.SIGTERM)

    def forward(self, x):
        if self.calls == 3:
            raise RuntimeError("boom")
        return super().forward(x)


def test_metrics_are_sent_in_batches_not_one_request_per_logged_step(tmp_path, store):
    logger = MlflowLogger(tmp_path, {"name": "batched"}, tracking_uri=store)
    calls = []
    send = logger.client.log_batch
    logger.client.log_batch = lambda run_id, **kw: (calls.append(len(kw.get("metrics", []))), send(run_id, **kw))
    for step in range(1, 31):
        logger.log_metrics(step, {"train/loss": 1.0 / step, "train/lr": 0.1})
    assert calls == []  # held: 60 values in well under FLUSH_S
    logger.finish("completed")
    assert calls == [60]
    history = MlflowClient(tracking_uri=store).get_metric_history(logger.run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, 31))


@pytest.mark.parametrize("missing", ["sqlalchemy", "alembic"])
def test_a_database_store_mlflow_cannot_open_is_a_config_error_before_anything_is_written(
    tiny_config, tmp_path, monkeypatch, missing
):
    monkeypatch.setitem(sys.modules, missing, None)  # mlflow-skinny alone
    with pytest.raises(ConfigError, match=rf"logging.mlflow.tracking_uri 'sqlite:///mlflow.db' .* without {missing}"):
        tk.Trainer(tiny_config("logging.mlflow.tracking_uri=sqlite:///mlflow.db"), progress=False)
    assert not (tmp_path / "runs").exists()
    assert ConfigError.exit_code == 2


def test_mlflows_default_store_is_checked_too(tiny_config, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setitem(sys.modules, "sqlalchemy", None)
    with pytest.raises(ConfigError, match=r"tracking_uri \(null: MLflow's default\) 'sqlite:"):
        tiny_config("logging.mlflow.experiment=x").validate()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    tiny_config("logging.mlflow.experiment=x").validate()  # a server: nothing to check before the run


def test_a_file_store_without_mlflows_opt_in_is_a_config_error(tiny_config, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(ConfigError, match="MLFLOW_ALLOW_FILE_STORE=true"):
        tiny_config(f"logging.mlflow.tracking_uri=file:{tmp_path / 'mlruns'}").validate()
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    tiny_config(f"logging.mlflow.tracking_uri=file:{tmp_path / 'mlruns'}").validate()


def test_the_sqlite_store_the_docs_name_holds_every_row(tiny_config, tmp_path):
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    trainer = tk.Trainer(tiny_config(f"logging.mlflow.tracking_uri={store}", *BUSY), progress=False)
    assert trainer.fit()["status"] == "completed"
    client, run_id = the_run(store, trainer)
    expected = [(r["step"], r["loss"]) for r in rows_of(trainer.run_dir, "train")]
    assert sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train/loss")) == expected


def test_the_rows_are_in_mlflow_before_each_checkpoint_is_saved(tiny_config, store):
    seen = []
    trainer = tk.Trainer(
        tiny_config(f"logging.mlflow.tracking_uri={store}", "checkpoint.every_steps=5"),
        progress=False,
        hooks=TrainerHooks(
            checkpoint=lambda point: (
                seen.append(held_steps(store)) if point == "model.safetensors:before_temp" else None
            )
        ),
    )
    trainer.fit()
    assert seen and seen[0] == list(range(1, 6))  # at the first save: steps 1..5, nothing later


def held_steps(store):
    client = MlflowClient(tracking_uri=store)
    (run,) = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    return sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss"))
