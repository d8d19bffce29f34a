"""Export: three formats with parity at batch 1 and 8, model.json, a batch-hard-coded trace
rejected, and the Triton repository config parsed into Triton's ModelConfig."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

import torchkeel as tk
from conftest import train_tiny
from torchkeel.errors import ConfigError, ParityError
from torchkeel.export import export_run, read_model_json
from torchkeel.export.formats import load_exported
from torchkeel.export.parity import check_parity, describe
from torchkeel.export.triton import parse_model_config, write_triton_repo


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("export")
    train_tiny(out, 20)
    return out / "tiny"


@pytest.mark.parametrize("fmt", ["torchscript", "torch-export", "onnx"])
def test_export_formats_pass_parity_at_1_and_8(run_dir, tmp_path, fmt):
    meta = export_run(run_dir, fmt, tmp_path, batch_sizes=(1, 8))
    assert meta["parity"]["passed"] and [r["batch_size"] for r in meta["parity"]["results"]] == [1, 8]
    assert all(r["max_abs_error"] <= 1e-5 for r in meta["parity"]["results"])
    assert meta == json.loads((tmp_path / "model.json").read_text())
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 32]}]
    assert meta["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, 4]}]
    reference = meta["reference"]
    assert reference["layout"] == "flat" and len(reference["features"]) == 32
    feature = reference["features"][0]
    assert sum(feature["bin_counts"]) == reference["num_samples"] == 480
    assert len(feature["bin_edges"]) == 11 and feature["min"] <= feature["mean"] <= feature["max"]
    run = load_exported(fmt, tmp_path / meta["file"])
    assert run(np.zeros((5, 32), dtype=np.float32)).shape == (5, 4)  # any batch size


def test_export_from_a_checkpoint_directory(run_dir, tmp_path):
    checkpoint = tk.CheckpointStore(run_dir / "checkpoints").latest_valid()[0].path
    meta = export_run(checkpoint, "torchscript", tmp_path)
    assert meta["checkpoint"] == str(checkpoint) and meta["step"] == 20


def test_a_trace_that_hard_codes_the_batch_size_is_rejected(tmp_path):
    config = tk.load_config(
        None,
        [
            f"out_dir={tmp_path}",
            "name=hard",
            "model.target=models:HardcodedBatch",
            "data.target=hand_written_loop:make_data",
            "train.max_epochs=null",
            "train.max_steps=2",
        ],
    )
    tk.Trainer(config, progress=False).fit()
    with pytest.raises(ParityError, match="parity FAILED on output 'output' at batch size 1"):
        export_run(tmp_path / "hard", "torchscript", tmp_path / "out")
    meta = read_model_json(tmp_path / "out")
    assert meta["parity"]["passed"] is False
    with pytest.raises(ConfigError, match="failed its parity check"):
        write_triton_repo(tmp_path / "out", tmp_path / "repo")


@pytest.mark.parametrize(
    ("fmt", "platform", "names"),
    [
        ("onnx", "onnxruntime_onnx", ("input", "output")),
        ("torchscript", "pytorch_libtorch", ("input__0", "output__0")),
    ],
)
def test_triton_repository_parses_into_model_config(run_dir, tmp_path, fmt, platform, names):
    export_run(run_dir, fmt, tmp_path / "export")
    model_dir = write_triton_repo(tmp_path / "export", tmp_path / "repo", max_batch_size=32)
    config = parse_model_config((model_dir / "config.pbtxt").read_text())
    assert config.name == "tiny" and config.platform == platform and config.max_batch_size == 32
    assert (config.input[0].name, config.output[0].name) == names
    assert list(config.input[0].dims) == [32] and list(config.output[0].dims) == [4]
    assert config.dynamic_batching.max_queue_delay_microseconds == 2000
    assert config.instance_group[0].count == 1
    assert (model_dir / "1" / ("model.onnx" if fmt == "onnx" else "model.pt")).is_file()


def test_torch_export_is_not_a_triton_format(run_dir, tmp_path):
    export_run(run_dir, "torch-export", tmp_path)
    with pytest.raises(ConfigError, match="export with --format onnx"):
        write_triton_repo(tmp_path, tmp_path / "repo")


def test_a_bad_config_text_is_a_config_error():
    with pytest.raises(ConfigError, match="not a valid Triton ModelConfig"):
        parse_model_config('name: "x"\nmax_batch_size: "eight"\n')


@pytest.fixture(scope="module")
def stream_runs(tmp_path_factory):
    """A Parquet run and a WebDataset run, trained with the streaming sources' defaults."""
    import streamdata

    out = tmp_path_factory.mktemp("stream-export")
    runs = {}
    for fmt, data in (
        (
            "parquet",
            [
                "data.format=parquet",
                f"data.train={streamdata.write_parquet(out / 'pq')}",
                "data.input=[id, f0, f1, f2, f3, f4, f5, f6, f7]",
                "data.target=label",
            ],
        ),
        (
            "webdataset",
            [
                "data.format=webdataset",
                f"data.train={streamdata.write_shards(out / 'wds')}",
                "data.input=npy",
                "data.target=cls",
            ],
        ),
    ):
        config = tk.load_config(
            None,
            [
                f"out_dir={out}",
                f"name={fmt}",
                "model.target=streamdata:make_model",
                "data.num_workers=0",
                "train.max_epochs=1",
                *data,
            ],
        )
        tk.Trainer(config, progress=False).fit()
        runs[fmt] = out / fmt
    return runs


@pytest.mark.parametrize("fmt", ["torchscript", "torch-export", "onnx"])
@pytest.mark.parametrize("source", ["parquet", "webdataset"])
def test_a_streaming_run_exports_from_its_own_data(stream_runs, tmp_path, source, fmt):
    meta = export_run(stream_runs[source], fmt, tmp_path)
    assert meta["parity"]["passed"] and meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 9]}]
    assert meta["reference"]["num_samples"] == 480 and meta["reference"]["input"] == "input"


@pytest.fixture(scope="module")
def token_run(tmp_path_factory):
    """The tokens example: a strict transformers-shaped model on padded dict batches."""
    from tokenrun import train_tokens

    return train_tokens(tmp_path_factory.mktemp("token-export"))


@pytest.mark.parametrize("fmt", ["torchscript", "torch-export", "onnx"])
def test_a_dict_batch_model_exports_with_named_inputs_and_dynamic_lengths(token_run, tmp_path, fmt):
    meta = export_run(token_run, fmt, tmp_path)
    ids, mask = meta["inputs"]
    assert ids == {
        "name": "input_ids",
        "datatype": "INT64",
        "shape": [-1, -1],
        "dims": ["batch", "length"],
        "range": [0, 31],
    }  # the embedding's rows
    assert mask == {"name": "attention_mask", "datatype": "INT64", "shape": [-1, -1], "dims": ["batch", "length"]}
    assert meta["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, -1, 32]}]
    lengths = {r["shapes"]["input_ids"][1] for r in meta["parity"]["results"] if "shapes" in r}
    assert meta["parity"]["passed"] and len(lengths) == 2  # also checked at two other lengths
    assert meta["reference"] is None  # no input of a fixed shape: drift is off
    run = load_exported(fmt, tmp_path / meta["file"], ["input_ids", "attention_mask"], "logits")
    feed = {"input_ids": np.ones((3, 11), dtype=np.int64), "attention_mask": np.ones((3, 11), dtype=np.int64)}
    assert run(feed).shape == (3, 11, 32)


class RecurrentLM(torch.nn.Module):
    """A GRU over the tokens: torch.export fixes the sequence length it was traced with."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.rnn, self.head = (
            torch.nn.Embedding(32, 8),
            torch.nn.GRU(8, 8, batch_first=True),
            torch.nn.Linear(8, 32),
        )

    def forward(self, input_ids, attention_mask, labels=None):
        logits = self.head(self.rnn(self.embed(input_ids) * attention_mask[..., None])[0])
        loss = None if labels is None else torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits}


def test_an_axis_the_model_fixes_fails_torch_export_by_name(tmp_path):
    from tokenrun import train_tokens

    train_tokens(tmp_path, "gru", "model.target=test_export:RecurrentLM", "loss.count_key=null")
    with pytest.raises(ParityError, match=r"torch.export fixed axis 1 of input 'input_ids' to \d+.*--format onnx"):
        export_run(tmp_path / "gru", "torch-export", tmp_path / "out")
    assert export_run(tmp_path / "gru", "torchscript", tmp_path / "ts")["parity"]["passed"]


def test_parity_allows_rounding_that_grows_with_the_output_and_nothing_more():
    # Logits of a language model are tens: float32 rounding through its layers grows with them.
    model = torch.nn.Linear(4, 3)
    samples = torch.randn(8, 4)

    def shifted(offset):
        def run(inputs):
            with torch.inference_mode():
                return model(torch.as_tensor(inputs)).numpy() + offset

        return run

    with torch.no_grad():  # outputs of about 100: allowed 1e-5 + 1.3e-6 * 100 = 1.4e-4
        model.weight.zero_()
        model.bias.fill_(100.0)
    passed = check_parity(model, shifted(1e-4), samples, [1, 8])
    assert passed["passed"] and 0.65 < passed["worst"]["max_share"] < 0.75
    failed = check_parity(model, shifted(2e-4), samples, [1, 8])
    assert not failed["passed"] and "what 1e-05 + 1.3e-06*|eager| allows" in describe(failed)
    with torch.no_grad():  # outputs of 0: the absolute 1e-5 alone
        model.bias.zero_()
    assert not check_parity(model, shifted(1.1e-5), samples, [1])["passed"]
    assert check_parity(model, shifted(0.9e-5), samples, [1])["passed"]


@pytest.fixture(scope="module")
def text_lms(tmp_path_factory):
    """GPT-2s trained on text with the byte tokenizer (end-of-text 256): one whose config sets
    its padding and beginning tokens, one that leaves them to the tokenizer, one whose config
    names another end-of-text."""
    pytest.importorskip("transformers")
    from textrun import GPT2_BYTES, train_text_lm

    out = tmp_path_factory.mktemp("text-lms")
    ids = train_text_lm(out, "ids", {**GPT2_BYTES, "pad_token_id": 1, "bos_token_id": 2})
    return ids, train_text_lm(out, "plain"), train_text_lm(out, "other-eos", {**GPT2_BYTES, "eos_token_id": 5})


def token_ids(where) -> dict[str, int]:
    return {k: where[k] for k in ("eos_token_id", "bos_token_id", "pad_token_id")}


@pytest.mark.parametrize("which, expected", [(0, (256, 2, 1)), (1, (256, 256, 256))])
def test_the_token_ids_the_model_config_sets_survive_every_export_and_its_tokenizer_agrees(
    text_lms, tmp_path, which, expected
):
    from transformers import AutoTokenizer

    from torchkeel.export.export import export_pretrained

    wanted = dict(zip(("eos_token_id", "bos_token_id", "pad_token_id"), expected))
    hf = export_pretrained(text_lms[which], tmp_path / "hf")
    assert token_ids(json.loads((hf / "config.json").read_text())) == wanted
    assert token_ids(json.loads((hf / "generation_config.json").read_text())) == wanted
    onnx = tmp_path / "onnx"
    recorded = export_run(text_lms[which], "onnx", onnx)["tokenizer"]
    for export in (hf, onnx):
        tokenizer = AutoTokenizer.from_pretrained(export)
        assert {k: getattr(tokenizer, k) for k in wanted} == wanted
        assert tokenizer("def f(x)")["input_ids"] == list(b"def f(x)")  # naming them adds no token
    for meta in (recorded, read_model_json(hf)["tokenizer"]):
        assert {k: meta[k.replace("_token_id", "_id")] for k in wanted} == wanted


def test_an_export_whose_config_and_tokenizer_would_disagree_exits_2_naming_the_key(text_lms, tmp_path, capsys):
    from torchkeel.cli.main import main

    for fmt in ("hf", "onnx"):
        capsys.readouterr()
        assert main(["export", str(text_lms[2]), "--format", fmt, "--out", str(tmp_path / fmt)]) == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert "model.hf.config sets eos_token_id=5" in line and "is id 256" in line, line


@pytest.mark.parametrize(
    "named, model_ids, expected",
    [
        ({}, {}, {"eos": 256, "bos": 256, "pad": 256}),
        ({}, {"pad_token_id": 1, "bos_token_id": 0}, {"eos": 256, "bos": 0, "pad": 1}),
        ({"pad": "!"}, {}, {"eos": 256, "bos": 256, "pad": 33}),
        ({"pad": "!"}, {"pad_token_id": 33}, {"eos": 256, "bos": 256, "pad": 33}),
        ({}, {"eos_token_id": [5, 256]}, {"eos": 256, "bos": 256, "pad": 256}),
        ({"pad": "!"}, {"pad_token_id": 1}, "pad_token_id=1, but the tokenizer's pad token '!' is id 33"),
        ({}, {"eos_token_id": 5}, "eos_token_id=5, but the tokenizer's eos token '<|endoftext|>' is id 256"),
        ({}, {"eos_token_id": [5, 6]}, "eos_token_id=[5, 6], but the tokenizer's eos token"),
        ({}, {"bos_token_id": 999}, "bos_token_id=999, which is not a token of the tokenizer (257 ids)"),
        ({}, {"pad_token_id": -1}, "pad_token_id=-1, which is not a token of the tokenizer (257 ids)"),
    ],
)
def test_special_tokens_keep_the_config_ids_and_name_a_disagreement(named, model_ids, expected):
    pytest.importorskip("tokenizers")
    from torchkeel.lm.tokenizer import byte_tokenizer_object, special_tokens

    def chosen():
        return {k: i for k, (_, i) in special_tokens(256, named, model_ids, byte_tokenizer_object(), "CFG").items()}

    if isinstance(expected, dict):
        assert chosen() == expected
    else:
        with pytest.raises(ConfigError, match=re.escape(f"CFG sets {expected}")):
            chosen()
