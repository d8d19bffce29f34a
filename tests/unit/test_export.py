"""Export: three formats with parity at batch 1 and 8, model.json, a batch-hard-coded trace
rejected, and the Triton repository config parsed into Triton's ModelConfig."""

from __future__ import annotations

import json

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
