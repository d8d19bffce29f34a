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


def test_training_logs_tokens_per_s_of_the_batches_token_positions(tiny_config, tmp_path):
    root, _ = corpus(tmp_path / "corpus")
    trainer = tk.Trainer(text_config(tiny_config, f"{root}/*.txt", "train.max_steps=4"), progress=False)
    trainer.fit()
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r.get("kind") == "train"]
    assert train and all(r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * 16) for r in train)  # block 16
    assert trainer.counters.tokens == trainer.counters.samples * 16
    from torchkeel.report.build import build_report

    report = build_report(trainer.run_dir)
    assert "tokens" in report.drawn and (trainer.run_dir / "tokens.png").is_file()


BERT = (
    "{model_type: bert, num_hidden_layers: 1, num_attention_heads: 2, hidden_size: 16, intermediate_size: 32, "
    "max_position_embeddings: 16, vocab_size: 258}"
)


def test_a_masked_lm_pretrains_from_text_files_with_bert_masking(tiny_config, tmp_path):
    root, _ = corpus(tmp_path / "corpus")
    config = text_config(
        tiny_config,
        f"{root}/*.txt",
        f"data.val={root}/*.txt",
        f"model.hf.config={BERT}",
        "model.hf.task=masked-lm",
        "data.mlm_probability=0.15",
        "train.max_steps=3",
    )
    trainer = tk.Trainer(config, progress=False)
    assert trainer.fit()["status"] == "completed"
    assert type(trainer.model).__name__ == "BertForMaskedLM"
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    (val,) = [r for r in rows if r.get("kind") == "val"]
    assert val["val_perplexity"] == pytest.approx(math.exp(val["val_loss"]), rel=1e-9)


def test_masking_chooses_a_share_80_10_10_never_a_special_token_and_repeats_for_a_sample():
    import numpy as np

    from torchkeel.data.sources.masking import Masking
    from torchkeel.data.sources.tokenizer import ByteTokenizer

    masking = Masking.of(0.15, ByteTokenizer())
    ids = np.random.default_rng(0).integers(0, 256, size=(4000, 64))
    ids[:, ::8] = 256  # end-of-text tokens: never chosen
    inputs, labels = masking.apply(ids, np.arange(4000), seed=11)
    chosen = labels != -100
    assert not chosen[:, ::8].any()
    assert chosen.sum() / (4000 * 56) == pytest.approx(0.15, abs=0.005)
    assert (labels[chosen] == ids[chosen]).all() and (inputs[~chosen] == ids[~chosen]).all()
    masked, same = (inputs[chosen] == 257).mean(), (inputs[chosen] == ids[chosen]).mean()
    assert masked == pytest.approx(0.8, abs=0.02) and same == pytest.approx(0.1 + 0.1 / 258, abs=0.02)
    again, _ = masking.apply(ids[1000:1010], np.arange(1000, 1010), seed=11)  # the same rows read alone
    assert (again == inputs[1000:1010]).all()
    other, _ = masking.apply(ids[:10], np.arange(10), seed=12)  # another epoch's seed
    assert (other != inputs[:10]).any()


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["model.hf.task=masked-lm"], "set data.mlm_probability"),
        (["model.hf.task=masked-lm", "data.mlm_probability=1.5"], r"data.mlm_probability must be in \(0, 1\)"),
    ],
)
def test_masked_lm_mistakes_name_the_key(tiny_config, tmp_path, overrides, says):
    root, _ = corpus(tmp_path / "corpus")
    with pytest.raises(tk.ConfigError, match=says):
        tk.Trainer(text_config(tiny_config, f"{root}/*.txt", f"model.hf.config={BERT}", *overrides), progress=False)
