"""The ``val`` section and ``clip_frac`` under real torchrun (gloo): two ranks validate at the
same steps, on the same batches, to the same numbers as one process."""

from __future__ import annotations

import pytest
from distrun import train, write_config

from torchkeel.train.runlog import read_metrics

VAL = ("val.at_start=true", "val.batch_size=30", "val.max_batches=2", "val.every_steps=10")


def test_two_ranks_validate_the_same_capped_batches_and_count_clipping_as_one_process(tmp_path):
    write_config(tmp_path)
    rows = {}
    for nproc in (1, 2):
        result = train(tmp_path, nproc, f"name=ranks-{nproc}", *VAL)
        assert result.returncode == 0, result.stderr[-3000:]
        rows[nproc] = read_metrics(tmp_path / "runs" / f"ranks-{nproc}" / "metrics.jsonl")
    val = {n: [r for r in rows[n] if r["kind"] == "val"] for n in rows}
    assert [r["step"] for r in val[1]] == [r["step"] for r in val[2]] == [0, 10, 20]
    for one, two in zip(val[1], val[2]):  # 2 global batches of 30: each rank 15 samples of each
        assert two["val_loss"] == pytest.approx(one["val_loss"], abs=1e-6)
        assert two["val_accuracy"] == one["val_accuracy"]
    clip = {n: [r["clip_frac"] for r in rows[n] if r["kind"] == "train"] for n in rows}
    assert clip[1] == clip[2] and len(clip[1]) == 4


def test_a_val_batch_size_that_does_not_divide_among_the_ranks_names_the_key(tmp_path):
    write_config(tmp_path)
    result = train(tmp_path, 2, "name=odd", "val.batch_size=31")
    assert result.returncode != 0
    assert "val.batch_size 31 does not divide by the world size 2" in result.stderr
