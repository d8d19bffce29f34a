"""``model.hf``: a transformers model from a config or a local ``save_pretrained`` directory, through
``keel train`` and ``keel export``; its mistakes as one-line errors naming the key."""

from __future__ import annotations

import sys

import pytest
import torch
import transformers  # noqa: F401 - the hf extra, which make setup installs: no transformers, no pass
import yaml

import torchkeel as tk
from torchkeel.cli.main import main
from torchkeel.errors import ConfigError, MissingExtraError
from torchkeel.export import export_run
from torchkeel.export.export import trained_model
from torchkeel.train.build import build_model
from torchkeel.train.hf import build_hf_model

GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 32, "n_positions": 64}


def hf(**values):
    return tk.load_config(None, [f"model.hf={yaml.safe_dump(values, default_flow_style=True).strip()}"]).model


def test_a_gpt2_from_a_config_trains_through_keel_train_and_exports_with_parity(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing may be downloaded
    config = {
        "name": "lm",
        "out_dir": str(tmp_path),
        "seed": 0,
        "model": {"hf": {"config": {**GPT2, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1}}},
        "data": {"target": "tokens:make_data", "args": {"num_train": 64, "num_val": 16}, "collate": "pad"},
        "loss": {"count_key": "labels"},
        "optim": {"lr": 1e-2},
        "train": {"max_epochs": 2, "batch_size": 16},
    }
    path = tmp_path / "lm.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["train", str(path)]) == 0
    rows = [r for r in tk.read_metrics(tmp_path / "lm" / "metrics.jsonl") if r["kind"] == "val"]
    assert len(rows) == 2 and rows[-1]["val_loss"] < rows[0]["val_loss"] < 3.6  # ln(32) = 3.47 is a guess
    meta = export_run(tmp_path / "lm", "onnx", tmp_path / "onnx")
    assert meta["parity"]["passed"] and meta["outputs"][0]["name"] == "logits"
    assert [i["name"] for i in meta["inputs"]] == ["input_ids", "attention_mask"]


def test_a_save_pretrained_directory_loads_the_same_weights(tmp_path):
    torch.manual_seed(0)
    built = build_hf_model(hf(config=GPT2).hf)
    built.save_pretrained(tmp_path / "saved")
    loaded = build_model(hf(path=str(tmp_path / "saved")))
    assert type(loaded).__name__ == "GPT2LMHeadModel"
    assert built.state_dict().keys() == loaded.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(built.state_dict().values(), loaded.state_dict().values()))
    built.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")  # transformers 5 would load it as bf16
    assert {p.dtype for p in build_model(hf(path=str(tmp_path / "bf16"))).parameters()} == {torch.float32}


def test_a_directory_with_pickle_weights_is_refused_naming_the_file(tmp_path):
    model = build_hf_model(hf(config=GPT2).hf)
    model.save_pretrained(tmp_path / "both")
    torch.save(model.state_dict(), tmp_path / "both" / "pytorch_model.bin")
    with pytest.raises(ConfigError, match=r"holds weights stored with pickle \(pytorch_model\.bin\)"):
        build_model(hf(path=str(tmp_path / "both")))
    (tmp_path / "none").mkdir()
    with pytest.raises(ConfigError, match="not a directory written by save_pretrained"):
        build_model(hf(path=str(tmp_path / "none")))


def test_the_task_picks_the_head():
    config = {**GPT2, "num_labels": 3, "pad_token_id": 0}
    classifier = build_hf_model(hf(config=config, task="sequence-classification").hf)
    assert type(classifier).__name__ == "GPT2ForSequenceClassification"
    out = classifier(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([2]))
    assert out.logits.shape == (1, 3) and out.loss.ndim == 0
    tagger = build_hf_model(hf(config=config, task="token-classification").hf)
    assert tagger(input_ids=torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 3)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"config": GPT2, "path": "somewhere"}, "model.hf needs exactly one of config"),
        ({}, "model.hf needs exactly one of config"),
        ({"config": {"n_layer": 2}}, "model.hf.config needs model_type"),
        ({"config": {"model_type": "gpt-two"}}, "model.hf.config.model_type='gpt-two'"),
        (
            {"config": {"model_type": "vit"}, "task": "causal-lm"},
            "model.hf.task='causal-lm' does not fit model_type 'vit'",
        ),
    ],
)
def test_model_hf_mistakes_name_the_key(values, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        build_model(hf(**values))


def test_a_misspelt_task_and_a_target_beside_hf_are_refused_when_the_config_loads():
    with pytest.raises(ConfigError, match="model.hf.task must be one of .*did you mean 'causal-lm'"):
        hf(config=GPT2, task="causal_lm")
    with pytest.raises(ConfigError, match="model.target='mymodels:Net' and model.hf are both set"):
        tk.load_config(None, ["model.target=mymodels:Net", "model.hf.config.model_type=gpt2"])


def test_keel_train_with_a_bad_model_hf_exits_2_with_one_line(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    config = {
        "out_dir": str(tmp_path),
        "model": {"hf": {"path": str(tmp_path / "nope")}},
        "data": {"target": "tokens:make_data"},
    }
    path.write_text(yaml.safe_dump(config))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.hf.path=" in err[0] and "save_pretrained" in err[0]


def test_without_transformers_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    with pytest.raises(
        MissingExtraError, match=r"model.hf needs the 'transformers' package: pip install 'torchkeel\[hf\]'"
    ):
        build_model(hf(config=GPT2))


def test_keel_export_hf_writes_the_trained_weights_back_as_a_save_pretrained_directory(tmp_path, capsys):
    config = {
        "name": "lm",
        "out_dir": str(tmp_path),
        "model": {"hf": {"config": {**GPT2, "pad_token_id": 0}}},
        "data": {"target": "tokens:make_data", "args": {"num_train": 32, "num_val": 16}, "collate": "pad"},
        "train": {"batch_size": 16},
    }
    (tmp_path / "lm.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", str(tmp_path / "lm.yaml")]) == 0
    assert main(["export", str(tmp_path / "lm"), "--format", "hf"]) == 0
    assert "save_pretrained directory" in capsys.readouterr().out
    out = tmp_path / "lm" / "export-hf"
    assert (out / "config.json").is_file() and list(out.glob("*.safetensors")) and not list(out.glob("*.bin"))
    reference, *_ = trained_model(tmp_path / "lm")  # the checkpoint's weights
    loaded = build_model(hf(path=str(out)))  # back through model.hf.path
    assert reference.state_dict().keys() == loaded.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(reference.state_dict().values(), loaded.state_dict().values()))


def test_keel_export_hf_of_a_model_that_is_not_transformers_is_refused(tmp_path, capsys):
    from conftest import train_tiny

    train_tiny(tmp_path, 4)
    capsys.readouterr()  # the run's own lines (its num_workers choice)
    assert main(["export", str(tmp_path / "tiny"), "--format", "hf"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--format hf writes a transformers model with save_pretrained" in err[0]
