"""A next-token model measured as LM people measure it: validation logs ``val_perplexity``, the
exponential of the token-mean validation loss, and a torchmetrics ``Perplexity`` configured as a
metric is given the logits and labels the loss pairs (position t with label t + 1), so it agrees."""

from __future__ import annotations

import json
import math

import pytest
from test_text_data import corpus, text_config

import torchkeel as tk

pytest.importorskip("torchmetrics")


def test_val_perplexity_and_a_configured_perplexity_are_the_exponential_of_the_loss(tiny_config, tmp_path):
    root, _ = corpus(tmp_path / "corpus")
    (tmp_path / "val").mkdir()
    (tmp_path / "val" / "held.txt").write_text((root / "a.txt").read_text()[::-1])
    config = text_config(
        tiny_config,
        f"{root}/*.txt",
        f"data.val={tmp_path}/val/*.txt",
        "train.max_epochs=1",
        "metrics=[{name: ppl, target: 'torchmetrics.text:Perplexity', args: {ignore_index: -100}}]",
    )
    trainer = tk.Trainer(config, progress=False)
    assert trainer.fit()["status"] == "completed"
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    (val,) = [r for r in rows if r.get("kind") == "val"]
    assert val["val_perplexity"] == pytest.approx(math.exp(val["val_loss"]), rel=1e-9)
    assert val["val_ppl"] == pytest.approx(math.exp(val["val_loss"]), rel=1e-4)


def test_a_classifier_gets_no_perplexity(tiny_config):
    trainer = tk.Trainer(tiny_config("train.max_epochs=1"), progress=False)
    trainer.fit()
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all("val_perplexity" not in r for r in rows if r.get("kind") == "val")
