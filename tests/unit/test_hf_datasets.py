"""``data.format: datasets``: Hugging Face datasets on disk (``save_to_disk`` directories, the
``.arrow`` files ``datasets`` writes) train a transformers-shaped model map-style, a null named as
a bad sample; Parquet written by ``datasets`` reads as ``data.format: parquet``."""

from __future__ import annotations

import json

import pytest
import tokens

datasets = pytest.importorskip("datasets")  # in the dev extra, which make setup installs

import torchkeel as tk  # noqa: E402
from torchkeel.config import load_config  # noqa: E402
from torchkeel.errors import ConfigError  # noqa: E402

NULL_ROW = 5


def write(root, num: int = 256, seed: int = 1, null: bool = False):
    """A tokenized dataset as ``datasets`` users have one: ragged ``input_ids`` and ``labels`` and
    an extra column the model does not take; with ``null``, row 5's input_ids missing."""
    rows = [s.astype("int64").tolist() for s in tokens.sequences(num, seed)]
    ids = [None if null and i == NULL_ROW else r for i, r in enumerate(rows)]
    ds = datasets.Dataset.from_dict({"input_ids": ids, "labels": rows, "source": ["synthetic"] * num})
    ds.save_to_disk(str(root))
    return ds


def config(tmp_path, train, val, *extra):
    return load_config(
        None,
        [
            f"out_dir={tmp_path / 'runs'}",
            "name=ds",
            "model.target=tokens:TinyLM",
            "data.format=datasets",
            f"data.train={train}",
            f"data.val={val}",
            "data.columns=[input_ids, labels]",
            "data.collate=pad",
            "data.num_workers=0",
            "data.max_bad_fraction=0.01",
            "loss.count_key=labels",
            "loss.shift_labels=true",
            "train.max_epochs=2",
            "optim.lr=1e-2",
            "train.batch_size=32",
            *extra,
        ],
    )


def test_a_save_to_disk_directory_trains_and_a_null_row_is_named(tmp_path):
    write(tmp_path / "train", null=True)
    write(tmp_path / "val", num=64, seed=2)
    trainer = tk.Trainer(config(tmp_path, tmp_path / "train", tmp_path / "val"), progress=False)
    summary = trainer.fit()
    assert summary["status"] == "completed" and summary["samples"] == 2 * 255
    assert summary["val_loss"] < 3.0  # from ln(32) = 3.47: it learnt from these rows
    incidents = [json.loads(x) for x in (trainer.run_dir / "incidents.jsonl").read_text().splitlines()]
    bad = [r["where"] for r in incidents if r["kind"] == "bad_sample"]
    assert len(bad) == 2 and all(f"index {NULL_ROW}" in w for w in bad), bad
    messages = [r["message"] for r in incidents if r["kind"] == "bad_sample"]
    assert all("a null value in column 'input_ids'" in m for m in messages), messages


def test_the_arrow_files_datasets_wrote_read_as_the_same_samples(tmp_path):
    from torchkeel.data.sources.hfdatasets import HFDiskDataset

    write(tmp_path / "train")
    whole = HFDiskDataset(tmp_path / "train", ["input_ids", "labels"])
    files = HFDiskDataset(str(tmp_path / "train" / "*.arrow"), ["input_ids", "labels"])
    assert len(files) == len(whole) == 256
    assert all((files[i]["input_ids"] == whole[i]["input_ids"]).all() for i in (0, 17, 255))
    assert set(whole[3]) == {"input_ids", "labels"}  # only the columns asked for


def test_parquet_written_by_datasets_is_plain_parquet(tmp_path):
    ds = write(tmp_path / "disk")
    ds.to_parquet(str(tmp_path / "train.parquet"))
    trainer = tk.Trainer(
        config(
            tmp_path,
            tmp_path / "train.parquet",
            tmp_path / "train.parquet",
            "data.format=parquet",
            "train.max_epochs=1",
        ),
        progress=False,
    )
    assert trainer.fit()["samples"] == 256


def test_a_dataset_dict_root_or_a_missing_column_is_a_one_line_error(tmp_path):
    from torchkeel.data.sources.hfdatasets import HFDiskDataset

    rows = {"input_ids": [[1, 2], [3]], "labels": [[1, 2], [3]]}
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict(rows), "test": datasets.Dataset.from_dict(rows)}
    ).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ConfigError, match=r"holds the splits test, train; name one, e.g. '.*dd/test'"):
        HFDiskDataset(tmp_path / "dd", ["input_ids"])
    with pytest.raises(ConfigError, match=r"data.columns: 'attention' not in '.*train' \(columns: input_ids, labels\)"):
        HFDiskDataset(tmp_path / "dd" / "train", ["input_ids", "attention"])
    with pytest.raises(ConfigError, match=r"data.format=datasets needs data.columns"):
        load_config(None, ["data.format=datasets", "data.train=x", "model.target=m:f", "train.max_steps=1"])


def test_a_causal_lm_of_blocks_of_one_length_exports_for_any_length(tmp_path):
    """``group_texts``-style datasets hold rows of one length; the export still takes a 3-token prompt."""
    import numpy as np

    from torchkeel.export import export_run
    from torchkeel.export.formats import load_exported

    rows = [(np.arange(16) * (i % 5 + 1) % 32).tolist() for i in range(96)]
    for split in ("train", "val"):
        datasets.Dataset.from_dict({"input_ids": rows, "labels": rows}).save_to_disk(str(tmp_path / split))
    gpt2 = "{model_type: gpt2, n_layer: 1, n_head: 2, n_embd: 16, n_positions: 32, vocab_size: 32}"
    overrides = ["model.target=null", f"model.hf.config={gpt2}", "train.max_epochs=1", "data.collate=default"]
    trainer = tk.Trainer(config(tmp_path, tmp_path / "train", tmp_path / "val", *overrides), progress=False)
    trainer.fit()
    meta = export_run(trainer.run_dir, "onnx")
    assert meta["inputs"][0]["shape"] == [-1, -1] and meta["inputs"][0]["max_shape"] == [-1, 32]
    assert any(r.get("shapes", {}).get("input_ids", [0, 16])[1] == 8 for r in meta["parity"]["results"])
    run = load_exported("onnx", trainer.run_dir / "export-onnx" / meta["file"], ["input_ids"], "logits")
    assert np.asarray(run({"input_ids": np.array([[1, 2, 3]])})).shape == (1, 3, 32)
