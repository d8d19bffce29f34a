"""A real transformers model (a GPT-2 built from a config: nothing is downloaded) through the
journey: padded token batches as ``model(**batch).loss``, accumulation weighted by the labels
its causal-LM loss divides by (``loss.shift_labels`` decided from the model), export and parity."""

from __future__ import annotations

import transformers  # noqa: F401 - the hf extra, which make setup installs: no transformers, no pass

import torchkeel as tk
from torchkeel.export import export_run


def train(out, name, *overrides):
    config = tk.load_config(
        None,
        [
            f"out_dir={out}",
            f"name={name}",
            "model.target=tokens:tiny_gpt2",
            "data.target=tokens:make_data",
            "data.args={num_train: 128, num_val: 32}",
            "data.collate=pad",
            "data.num_workers=0",
            "loss.count_key=labels",
            "train.max_epochs=1",
            "train.clip_grad_norm=null",
            "optim.lr=1e-2",
            *overrides,
        ],
    )
    trainer = tk.Trainer(config, progress=False)
    summary = trainer.fit()
    return trainer, summary


def test_a_tiny_gpt2_accumulates_by_its_labels_and_exports(tmp_path):
    small, summary = train(tmp_path, "small", "train.batch_size=16", "train.accumulate=4")
    big, _ = train(tmp_path, "big", "train.batch_size=64", "train.accumulate=1")
    assert summary["status"] == "completed" and summary["steps"] == 2 and small.objective.shift_labels
    difference = max(
        (a - b).abs().max().item() for a, b in zip(small.model.state_dict().values(), big.model.state_dict().values())
    )
    assert difference < 1e-5  # weighted by samples instead, the updates would differ by ~1e-2
    for fmt in ("onnx", "torch-export"):
        meta = export_run(tmp_path / "small", fmt, tmp_path / fmt)
        assert meta["parity"]["passed"] and [i["name"] for i in meta["inputs"]] == ["input_ids", "attention_mask"]
        assert meta["outputs"][0]["name"] == "logits" and meta["inputs"][0]["range"] == [0, 31]
