"""The example configs of examples/streaming train as they are documented (one short epoch each)."""

from __future__ import annotations

import json
import sys

import pytest
from keelproc import ROOT, run_keel

from torchkeel.config import load_config

EXAMPLES = ROOT / "examples" / "streaming"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("examples")
    sys.path.insert(0, str(EXAMPLES))
    try:
        import make_data
    finally:
        sys.path.remove(str(EXAMPLES))
    make_data.main(str(root / "data"))
    return root


@pytest.mark.parametrize("name", ["parquet", "webdataset", "sequences"])
def test_example_config_trains(data_dir, name):
    result = run_keel(
        "train",
        str(EXAMPLES / f"{name}.yaml"),
        "--no-progress",
        "train.max_epochs=1",
        f"out_dir={data_dir / 'runs'}",
        cwd=data_dir,
        PYTHONPATH=str(EXAMPLES),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads(next((data_dir / "runs").glob(f"{name}-example/summary.json")).read_text())
    assert summary["status"] == "completed" and summary["samples"] == 4096
    if name != "sequences":
        assert summary["val_accuracy"] > 0.8


def test_data_bench_prints_the_worker_table(data_dir):
    result = run_keel(
        "data-bench",
        str(EXAMPLES / "parquet.yaml"),
        "--trial-s",
        "0.2",
        "--max-workers",
        "1",
        cwd=data_dir,
        PYTHONPATH=str(EXAMPLES),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["workers", "samples/s", "RSS", "MiB", "startup", "s", "vs", "best"]
    rows = [line.split() for line in lines[1:3]]
    assert [r[0] for r in rows] == ["0", "1"] and all(float(r[1]) > 0 for r in rows)
    assert any(r[-1] == "chosen" for r in rows) and lines[-1].startswith("best: num_workers=")


TOKENS = ROOT / "examples" / "tokens"


@pytest.mark.parametrize(
    "name",
    [
        "tokens",
        pytest.param("tokens-parquet", marks=pytest.mark.slow),  # the Parquet × dict journey runs in the default suite
        # model.hf: a transformers GPT-2 from its config, on the Parquet files; keel train and the
        # ONNX export of such a GPT-2 run in the default suite in tests/unit/test_hf_models.py and
        # tests/journeys/test_text_journey.py
        pytest.param("gpt2", marks=pytest.mark.slow),
    ],
)
def test_the_tokens_example_trains_exports_and_learns(tmp_path, monkeypatch, name):
    """A strict transformers-shaped model on padded dict batches, from map-style data and from
    Parquet list columns (data.columns), as documented in docs/data.md."""
    sys.path.insert(0, str(TOKENS))
    try:
        import tokens
    finally:
        sys.path.remove(str(TOKENS))
    tokens.write_parquet(tmp_path / "data")
    result = run_keel(
        "train",
        str(TOKENS / f"{name}.yaml"),
        "--no-progress",
        "train.max_epochs=2",
        f"out_dir={tmp_path / 'runs'}",
        cwd=tmp_path,
        PYTHONPATH=str(TOKENS),
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    run = tmp_path / "runs" / f"{name}-example"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["samples"] == 2 * 1024
    assert summary["val_loss"] < 1.0  # from ln(32) = 3.5: it learnt to count on
    from torchkeel.export import export_run

    monkeypatch.chdir(tmp_path)  # the config's data paths are relative to where keel train ran
    sys.path.insert(0, str(TOKENS))  # what keel export imports from the working directory
    try:
        meta = export_run(run, "onnx")
    finally:
        sys.path.remove(str(TOKENS))
    assert [i["name"] for i in meta["inputs"]] == ["input_ids", "attention_mask"] and meta["parity"]["passed"]


TEXT = ROOT / "examples" / "text"


def test_the_text_example_config_is_valid():
    config = load_config(str(TEXT / "gpt2-bytes.yaml"))
    assert config.data.format == "text" and config.model.hf.config["vocab_size"] == 257


@pytest.mark.slow  # the text journey (tests/journeys/test_text_journey.py) takes the same path in the default suite
def test_the_text_example_learns_from_the_standard_librarys_documentation(tmp_path):
    sys.path.insert(0, str(TEXT))
    try:
        import corpus
    finally:
        sys.path.remove(str(TEXT))
    corpus.write(tmp_path / "data", limit=40)
    result = run_keel(
        "train",
        str(TEXT / "gpt2-bytes.yaml"),
        "--no-progress",
        "train.max_steps=150",
        f"out_dir={tmp_path / 'runs'}",
        cwd=tmp_path,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "runs" / "gpt2-bytes" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["val_loss"] < 2.6  # from ln(257) = 5.55
