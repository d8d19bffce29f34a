"""``data.format: text``: text files tokenized (bytes, or a tokenizer saved by transformers) and
packed into blocks, read exactly once per epoch in a resumable order, bad lines named."""

from __future__ import annotations

import json
import os
from collections import Counter

import numpy as np
import pytest
import torch

from torchkeel.config import load_config
from torchkeel.data import PadCollate, StreamLoader
from torchkeel.data.sources import text as textmod
from torchkeel.data.sources.text import TextSource
from torchkeel.errors import ConfigError, DataError

PROSE = "".join(f"Line {i}: the quick brown fox jumps over the lazy dog {i * 7 % 13}.\n" for i in range(300))


def corpus(root, bad: bool = False):
    """Two text files and a JSON-lines file; with ``bad``, a Latin-1 line, a broken JSON line and a
    line without text. Returns the folder and the documents' texts by file."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "a.txt").write_text(PROSE, encoding="utf-8")
    (root / "b.txt").write_text("Ünïcödé text — with “quotes” and 汉字.\n" * 40, encoding="utf-8")
    docs = [f"document {i} " * (1 + i % 5) for i in range(60)]
    lines = [json.dumps({"text": d, "id": i}) for i, d in enumerate(docs)]
    if bad:
        lines.insert(3, '{"text": "cut sho')
        lines.insert(7, json.dumps({"body": "no text key"}))
        (root / "c.txt").write_bytes(b"fine line\n" * 5 + b"caf\xe9\n" + b"after\n" * 5)
    (root / "d.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root, docs


def blocks_of(source: TextSource) -> list[bytes]:
    """Every block of every unit, in file order, read straight from the source."""
    out = []
    for unit in range(len(source.units())):
        for event in source.read(unit, 0, None, as_samples=False):
            if isinstance(event, textmod.Rows):
                out += [row.numpy().tobytes() for row in event.data["input_ids"]]
    return out


def test_byte_blocks_are_the_files_bytes_with_end_of_text_after_each_document(tmp_path):
    root, docs = corpus(tmp_path / "c")
    source = TextSource(root, block_size=32, chunk_bytes=1 << 20, cache_dir=tmp_path / "cache")
    # One chunk per file: each file's tokens, cut into full blocks, the rest left out.
    expected = []
    for stream in (
        [*PROSE.encode(), 256],
        [*("Ünïcödé text — with “quotes” and 汉字.\n" * 40).encode(), 256],
        [t for d in docs for t in [*d.encode(), 256]],
    ):
        n = len(stream) // 32
        expected += [np.asarray(stream[i * 32 : (i + 1) * 32], dtype=np.int64).tobytes() for i in range(n)]
    assert blocks_of(source) == expected
    assert sum(u.num_samples for u in source.units()) == len(expected)
    batch = next(iter(StreamLoader(source, 4, seed=0).epoch(0)))
    assert set(batch) == {"input_ids", "labels"} and batch["input_ids"].dtype == torch.int64
    assert torch.equal(batch["input_ids"], batch["labels"]) and batch["input_ids"].shape == (4, 32)


def test_chunks_cut_at_line_ends_and_cover_each_file_once(tmp_path):
    root, _ = corpus(tmp_path / "c")
    source = TextSource(root, block_size=16, chunk_bytes=500, cache_dir=tmp_path / "cache")
    chunks = source._chunks
    assert len(chunks) > 10
    for path in {c.path for c in chunks}:
        mine = [c for c in chunks if c.path == path]
        data = open(path, "rb").read()
        assert mine[0].start == 0 and mine[-1].stop == len(data) and mine[-1].last
        assert all(a.stop == b.start for a, b in zip(mine, mine[1:]))
        assert all(data[c.start - 1 : c.start] == b"\n" for c in mine[1:])


def test_every_block_once_per_epoch_over_2_ranks_x_2_workers_and_a_new_order_each_epoch(tmp_path):
    root, _ = corpus(tmp_path / "c")
    source = TextSource(root, block_size=16, chunk_bytes=400, cache_dir=tmp_path / "cache")
    everything = Counter(blocks_of(source))
    epochs = []
    for epoch in (0, 1):
        seen: list[bytes] = []
        for rank in (0, 1):
            loader = StreamLoader(source, 8, seed=3, num_workers=2, streams=3, rank=rank, world_size=2)
            seen += [row.numpy().tobytes() for batch in loader.epoch(epoch) for row in batch["input_ids"]]
        assert Counter(seen) == everything
        epochs.append(seen)
    assert epochs[0] != epochs[1]


def test_a_resume_mid_epoch_continues_with_the_very_next_batches(tmp_path):
    root, _ = corpus(tmp_path / "c", bad=True)
    source = TextSource(root, block_size=16, chunk_bytes=400, cache_dir=tmp_path / "cache")

    def loader(workers):
        return StreamLoader(source, 8, seed=5, num_workers=workers, streams=4, max_bad_fraction=0.1)

    whole = [b["input_ids"] for b in loader(2).epoch(1)]
    first = loader(2)
    batches = first.epoch(1)
    head = [next(batches)["input_ids"] for _ in range(7)]
    state = first.state_dict()
    first.close()
    again = loader(1)
    again.load_state_dict(state)
    rest = [b["input_ids"] for b in again.epoch(1, start_batch=7)]
    assert len(head) + len(rest) == len(whole)
    assert all(torch.equal(a, b) for a, b in zip(head + rest, whole))
    assert again.bad.count == 3  # the bad lines of the first pass are counted once, not again


def test_bad_lines_are_named_by_file_and_line_and_left_out(tmp_path):
    root, _ = corpus(tmp_path / "c", bad=True)
    source = TextSource(root, block_size=16, chunk_bytes=1 << 20, cache_dir=tmp_path / "cache")
    loader = StreamLoader(source, 8, seed=0, max_bad_fraction=0.1)
    trained = b"".join(row.numpy().astype(np.uint8).tobytes() for b in loader.epoch(0) for row in b["input_ids"] % 256)
    bad = dict(loader.bad.listed)
    assert set(bad) == {f"{root / 'c.txt'} line 6", f"{root / 'd.jsonl'} line 4", f"{root / 'd.jsonl'} line 8"}
    assert "not UTF-8" in bad[f"{root / 'c.txt'} line 6"]
    assert "not a JSON line" in bad[f"{root / 'd.jsonl'} line 4"]
    assert "no 'text' key (it has: body)" in bad[f"{root / 'd.jsonl'} line 8"]
    assert b"caf\xe9" not in trained and b"cut sho" not in trained and b"after" in trained


def test_too_many_bad_lines_stop_the_epoch_with_them_listed(tmp_path):
    root, _ = corpus(tmp_path / "c", bad=True)
    source = TextSource(root, block_size=16, cache_dir=tmp_path / "cache")
    with pytest.raises(
        DataError, match=r"3 bad samples .*d\.jsonl line 4: not a JSON line \(JSONDecodeError: Unterminated string"
    ):
        list(StreamLoader(source, 8, seed=0, max_bad_fraction=0.001).epoch(0))


def test_without_packing_each_document_is_a_sample_padded_in_its_batch(tmp_path):
    root, docs = corpus(tmp_path / "c")
    (root / "a.txt").unlink()
    (root / "b.txt").unlink()
    source = TextSource(root, block_size=64, pack=False, cache_dir=tmp_path / "cache")
    assert sum(u.num_samples for u in source.units()) == sum(-(-(len(d) + 1) // 64) for d in docs)
    loader = StreamLoader(source, 8, seed=0, collate_fn=PadCollate(), shuffle=False)
    batch = next(iter(loader.epoch(0)))
    first = bytes(batch["input_ids"][0][batch["attention_mask"][0].bool()][:-1].tolist())
    assert first == docs[0].encode() and batch["labels"][0][-1] in (256, -100)
    assert set(batch) == {"input_ids", "labels", "attention_mask"}


def test_block_counts_are_cached_and_counted_again_when_a_file_changes(tmp_path, monkeypatch):
    root, _ = corpus(tmp_path / "c")
    cache = tmp_path / "cache"
    before = sum(u.num_samples for u in TextSource(root, block_size=16, cache_dir=cache).units())

    def no_counting(job):
        raise AssertionError("counted again")

    monkeypatch.setattr(textmod, "count_chunk", no_counting)
    assert sum(u.num_samples for u in TextSource(root, block_size=16, cache_dir=cache).units()) == before
    monkeypatch.undo()
    with open(root / "a.txt", "a", encoding="utf-8") as f:
        f.write("x" * 64 + "\n")
    os.utime(root / "a.txt", (1, 1))  # another modification time, whatever the clock's resolution
    assert sum(u.num_samples for u in TextSource(root, block_size=16, cache_dir=cache).units()) == before + 4


def test_a_file_changed_during_the_run_is_an_error_not_other_blocks(tmp_path):
    root, _ = corpus(tmp_path / "c")
    source = TextSource(root, block_size=16, cache_dir=tmp_path / "cache")
    (root / "a.txt").write_text(PROSE[:100], encoding="utf-8")
    with pytest.raises(DataError, match=r"a.txt changed since its blocks were counted"):
        list(StreamLoader(source, 8, seed=0).epoch(0))


def saved_tokenizer(path):
    """A byte-level BPE trained here and saved as transformers saves one (tokenizer.json and
    tokenizer_config.json naming the end-of-text token)."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([PROSE, "document " * 50], trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(str(path))
    return fast


def test_a_saved_tokenizer_counts_in_worker_processes_and_its_blocks_decode_to_the_text(tmp_path, monkeypatch):
    fast = saved_tokenizer(tmp_path / "tok")
    root, docs = corpus(tmp_path / "c")
    (root / "b.txt").unlink()
    calls = tmp_path / "encode-pids"
    real = textmod.FileTokenizer.encode

    def recorded(self, text):
        with open(calls, "a") as f:
            f.write(f"{os.getpid()}\n")
        return real(self, text)

    monkeypatch.setattr(textmod.FileTokenizer, "encode", recorded)  # forked workers inherit it
    source = TextSource(
        root, tokenizer=str(tmp_path / "tok"), block_size=24, chunk_bytes=1500, cache_dir=tmp_path / "cache"
    )
    assert source.eos_id == fast.convert_tokens_to_ids("<|endoftext|>") and source.vocab_size == len(fast)
    ids = torch.cat(
        [b["input_ids"].flatten() for b in StreamLoader(source, 4, seed=0, num_workers=2, shuffle=False).epoch(0)]
    )
    assert str(os.getpid()) not in calls.read_text().split()  # tokenized only in other processes
    text = fast.decode(ids.tolist())
    assert text.count("<|endoftext|>") >= 50 and "document 12 document 12 document 12" in text
    assert "Line 17: the quick brown fox" in text


def test_the_end_of_text_token_is_named_or_found_or_asked_for(tmp_path):
    saved_tokenizer(tmp_path / "tok")
    root, _ = corpus(tmp_path / "c")
    cfg = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    cfg.pop("eos_token", None)
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(cfg))
    found = TextSource(root, tokenizer=str(tmp_path / "tok"), block_size=8, cache_dir=tmp_path / "cache")
    assert found.eos_id == textmod.FileTokenizer(textmod.TokenizerSpec(str(tmp_path / "tok"))).tokenizer.token_to_id(
        "<|endoftext|>"
    )
    with pytest.raises(ConfigError, match=r"data.tokenizer.eos='<eot>' is not a token"):
        TextSource(root, tokenizer={"path": str(tmp_path / "tok"), "eos": "<eot>"}, cache_dir=tmp_path / "cache")
    with pytest.raises(ConfigError, match=r"data.tokenizer: '.*nowhere' not found"):
        TextSource(root, tokenizer=str(tmp_path / "nowhere"), cache_dir=tmp_path / "cache")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.pack=false"], "data.pack=false makes a sample of each document"),
        (["data.input=x"], "data.input is not used by data.format=text"),
        (["data.block_size=0"], "data.block_size must be"),
        (["data.tokenizer={path: t, vocab: 3}"], "data.tokenizer.vocab"),
    ],
)
def test_text_config_mistakes_are_one_line_errors_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(
            None, ["data.format=text", "data.train=corpus", "model.target=m:f", "train.max_steps=1", *overrides]
        )


def test_a_model_too_small_for_the_tokens_is_a_config_error_before_the_first_step(tmp_path):
    transformers = pytest.importorskip("transformers")
    from torchkeel.train.hf import check_tokens_fit

    root, _ = corpus(tmp_path / "c")
    source = TextSource(root, block_size=64, cache_dir=tmp_path / "cache")

    def gpt2(**kw):
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, **kw))

    check_tokens_fit(gpt2(vocab_size=257, n_positions=64), source)  # fits: nothing said
    with pytest.raises(ConfigError, match=r"data.tokenizer has 257 token ids .* 256 rows; .*vocab_size >= 257"):
        check_tokens_fit(gpt2(vocab_size=256, n_positions=64), source)
    with pytest.raises(ConfigError, match=r"data.block_size=64 is longer than the model's 32 positions"):
        check_tokens_fit(gpt2(vocab_size=300, n_positions=32), source)


def test_num_workers_auto_never_tokenizes_in_the_training_process(tmp_path):
    from torchkeel.data.build import build_loaders

    root, _ = corpus(tmp_path / "c")
    config = load_config(
        None,
        ["data.format=text", f"data.train={root}", "data.block_size=16", "model.target=m:f", "train.max_steps=1"],
    )
    loaders = build_loaders(config.data, batch_size=8, seed=0, device=torch.device("cpu"))
    assert [t.num_workers for t in loaders.tuning.trials][0] == 1
    assert loaders.train.num_workers >= 1
    loaders.train.close()


def test_files_all_shorter_than_a_block_are_named_as_such(tmp_path):
    root = tmp_path / "short"
    root.mkdir()
    for i in range(40):
        (root / f"{i:02d}.txt").write_text(f"file {i:02d}: forty-one bytes in one line....\n")  # 41 bytes
    with pytest.raises(
        ConfigError,
        match=r"every one of the 40 files of data\.train \(1640 bytes in all\) is shorter "
        r"than data\.block_size=64 tokens",
    ):
        TextSource(str(root / "*.txt"), block_size=64)
    (root / "empty.txt").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"41 files of data\.val"):
        TextSource(str(root / "*.txt"), block_size=64, key="data.val")


GPT2 = "{model_type: gpt2, n_layer: 1, n_head: 2, n_embd: 16, n_positions: 16, vocab_size: 257}"


def text_config(tiny_config, train, *overrides):
    return tiny_config(
        "data.target=null",
        "data.format=text",
        f"data.train={train}",
        "data.block_size=16",
        "data.num_workers=0",
        "model.target=null",
        f"model.hf.config={GPT2}",
        "loss.count_key=labels",
        *overrides,
    )


def test_a_validation_folder_with_only_an_empty_file_names_data_val_and_exits_2(tiny_config, tmp_path):
    import torchkeel as tk

    root, _ = corpus(tmp_path / "train")
    (tmp_path / "val").mkdir()
    (tmp_path / "val" / "empty.txt").write_bytes(b"")
    config = text_config(tiny_config, f"{root}/*.txt", f"data.val={tmp_path}/val/*.txt")
    with pytest.raises(ConfigError, match=r"every one of the 1 file of data\.val is empty") as caught:
        tk.Trainer(config, progress=False)
    assert caught.value.exit_code == 2 and not (tmp_path / "runs").exists()


def test_an_empty_file_is_an_incident_and_left_out(tiny_config, tmp_path):
    import torchkeel as tk

    root, _ = corpus(tmp_path / "c")
    (root / "empty.txt").write_bytes(b"")
    trainer = tk.Trainer(
        text_config(tiny_config, f"{root}/*.txt", "train.max_epochs=null", "train.max_steps=2"), progress=False
    )
    summary = trainer.fit()
    assert summary["status"] == "completed" and summary["incidents"] == {"empty_file": 1}
    (row,) = [json.loads(line) for line in (trainer.run_dir / "incidents.jsonl").read_text().splitlines()]
    assert row["kind"] == "empty_file" and row["step"] == 0 and str(root / "empty.txt") in row["message"]
