"""``deterministic: true`` repeats a run bit for bit on any thread count: a GPT-2 trained twice
on 2 intra-op threads (the conftest's default is 1) ends with the same weights and losses."""

from __future__ import annotations

import json

import torch
from test_text_data import corpus, text_config

import torchkeel as tk
from torchkeel.checkpoint import CheckpointStore

GPT2 = "{model_type: gpt2, n_layer: 2, n_head: 2, n_embd: 64, n_positions: 64, vocab_size: 257}"


def trained(config) -> tuple[dict[str, torch.Tensor], list[float]]:
    trainer = tk.Trainer(config, progress=False)
    assert trainer.fit()["status"] == "completed"
    found, _ = CheckpointStore(trainer.run_dir / "checkpoints").latest_valid()
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    return found.state["model"], [r["loss"] for r in rows if r.get("kind") == "train"]


def test_two_gpt2_runs_on_2_threads_are_bitwise_the_same(tiny_config, tmp_path):
    root, _ = corpus(tmp_path / "corpus")
    torch.set_num_threads(2)  # the conftest puts it back
    runs = [
        trained(
            text_config(
                tiny_config,
                f"{root}/*.txt",
                f"name=run{i}",
                "deterministic=true",
                "train.max_epochs=2",
                f"model.hf.config={GPT2}",
                "data.block_size=64",
            )
        )
        for i in range(2)
    ]
    (first, first_losses), (second, second_losses) = runs
    assert len(first_losses) > 10 and first_losses == second_losses
    assert {k for k in first if not torch.equal(first[k], second[k])} == set()
