"""A resume checks the files its checkpoint planned over: text files edited, appended to, removed
or added, a tokenizer retrained in place, Parquet and WebDataset shards rewritten — each stops
``--resume`` with exit 2 naming the files, and ``--allow-data-change`` continues and says so."""

from __future__ import annotations

import time

import journeydata
import pytest
from test_text_data import corpus, saved_tokenizer, text_config

import torchkeel as tk
from torchkeel.data.inputs import file_identity, fingerprint_inputs, input_changes
from torchkeel.errors import ConfigError


def first_then_resume(config_of, change, **allow):
    """Train 2 steps, ``change()`` the files, resume to step 3; returns the resumed Trainer's summary."""
    tk.Trainer(config_of("train.max_steps=2"), progress=False).fit()
    change()
    return tk.Trainer(config_of("train.max_steps=3"), resume="auto", progress=False, **allow).fit()


def edit(path, text: str = "X") -> None:
    """Change one byte in the middle of ``path``, keeping its size (and a later mtime)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] = ord(text)
    time.sleep(0.01)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda root: edit(root / "a.txt"), "data.train: changed {root}/a.txt"),
        (lambda root: (root / "b.txt").open("a").write("one more line\n"), "data.train: changed {root}/b.txt"),
        (lambda root: (root / "b.txt").unlink(), "data.train: missing {root}/b.txt"),
        (lambda root: (root / "new.txt").write_text("a new file with some text in it\n" * 9), "added {root}/new.txt"),
    ],
    ids=["edited", "appended", "removed", "added"],
)
def test_a_changed_text_file_stops_the_resume_naming_it(tiny_config, tmp_path, change, named):
    root, _ = corpus(tmp_path / "corpus")
    with pytest.raises(ConfigError, match="--allow-data-change") as caught:
        first_then_resume(
            lambda *o: text_config(tiny_config, f"{root}/*.txt", "train.max_epochs=null", *o), lambda: change(root)
        )
    assert named.format(root=root) in str(caught.value) and caught.value.exit_code == 2


def test_allow_data_change_continues_over_the_new_files_and_says_so(tiny_config, tmp_path, capsys):
    root, _ = corpus(tmp_path / "corpus")
    summary = first_then_resume(
        lambda *o: text_config(tiny_config, f"{root}/*.txt", "train.max_epochs=null", *o),
        lambda: (root / "a.txt").open("a").write("appended\n" * 20),
        allow_data_change=True,
    )
    assert summary["status"] == "completed" and summary["steps"] == 3
    err = capsys.readouterr().err
    assert (
        f"data differs from the checkpoint's: data.train: changed {root}/a.txt (allowed by --allow-data-change" in err
    )


def test_an_unchanged_resume_says_nothing_of_the_data(tiny_config, tmp_path, capsys):
    root, _ = corpus(tmp_path / "corpus")
    summary = first_then_resume(
        lambda *o: text_config(tiny_config, f"{root}/*.txt", "train.max_epochs=null", *o), lambda: None
    )
    assert summary["status"] == "completed" and "data differs" not in capsys.readouterr().err


def test_a_tokenizer_retrained_in_place_stops_the_resume(tiny_config, tmp_path):
    root, _ = corpus(tmp_path / "corpus")
    tokenizer = tmp_path / "tok"
    saved_tokenizer(tokenizer)

    def config_of(*overrides):
        return text_config(
            tiny_config,
            f"{root}/*.txt",
            "train.max_epochs=null",
            f"data.tokenizer={tokenizer}",
            "model.hf.config.vocab_size=400",
            *overrides,
        )

    def retrain():
        text = (tokenizer / "tokenizer.json").read_text()
        time.sleep(0.01)
        (tokenizer / "tokenizer.json").write_text(text.replace('"dropout":null', '"dropout": null '))

    with pytest.raises(ConfigError, match=rf"data.train: changed {tokenizer}/tokenizer.json"):
        first_then_resume(config_of, retrain)


@pytest.mark.parametrize("source", ["parquet", "webdataset"])
def test_a_rewritten_shard_stops_the_resume(tiny_config, tmp_path, source):
    data, _ = journeydata.write(source, "pair", tmp_path / "data")
    shard = sorted((tmp_path / "data").rglob("*.parquet" if source == "parquet" else "train-000003.tar"))[-1]
    settings = [f"data.{k}={v}" for k, v in data.items()] + ["model.target=journeymodels:mlp"]

    def config_of(*overrides):
        return tiny_config(*settings, "train.max_epochs=null", "data.max_bad_fraction=0.01", *overrides)

    with pytest.raises(ConfigError, match=f"changed {shard}"):
        first_then_resume(config_of, lambda: edit(shard, "\x00"))


def test_fingerprints_see_edits_beyond_the_head_and_tail_through_mtime(tmp_path):
    path = tmp_path / "big.txt"
    path.write_bytes(b"x" * 100_000)
    source = type("Source", (), {"paths": [str(path)]})()
    before = fingerprint_inputs({"data.train": source})
    edit(path)
    after = fingerprint_inputs({"data.train": source}, known=before)
    assert before["data.train"][str(path)][2] == after["data.train"][str(path)][2]  # same head and tail
    assert input_changes(before, after) == {"data.train": {"changed": [str(path)]}}
    assert input_changes(before, {}) == {}  # data with no files (map-style) is not compared
    assert file_identity(str(path))[0] == 100_000


def test_a_resume_reads_no_file_whose_stat_is_unchanged(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("some text\n")
    size, mtime, _ = file_identity(str(path))
    assert file_identity(str(path), known=[size, mtime, "recorded"]) == [size, mtime, "recorded"]
    assert file_identity(str(path), known=[size, mtime - 1, "recorded"])[2] != "recorded"  # touched: read again


def test_the_same_files_copied_to_another_directory_resume_and_say_so(tiny_config, tmp_path, capsys):
    import shutil

    root, _ = corpus(tmp_path / "corpus")
    tk.Trainer(
        text_config(tiny_config, f"{root}/*.txt", "train.max_epochs=null", "train.max_steps=2"), progress=False
    ).fit()
    staged = tmp_path / "scratch" / "job-2"
    shutil.copytree(root, staged)  # as a job that stages its data to local disk: new paths, new mtimes
    summary = tk.Trainer(
        text_config(tiny_config, f"{staged}/*.txt", "train.max_epochs=null", "train.max_steps=3"),
        resume="auto",
        progress=False,
    ).fit()
    assert summary["status"] == "completed" and summary["steps"] == 3
    assert f"data moved since the checkpoint: data.train: moved {root} -> {staged}" in capsys.readouterr().err
    edit(staged / "a.txt")  # a copy that differs is a change, wherever it is
    with pytest.raises(ConfigError, match="changed"):
        tk.Trainer(
            text_config(tiny_config, f"{staged}/*.txt", "train.max_epochs=null", "train.max_steps=4"),
            resume="auto",
            progress=False,
        ).fit()
